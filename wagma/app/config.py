"""From a composed Hydra config to checked settings: :func:`validate_config` and the optimizer builder.

:func:`validate_config` runs on every rank before anything collective or expensive happens. It needs only
the config and the world size, so all ranks reach the same verdict without talking to each other, and a
bad config ends the run with one :class:`ConfigError` listing every problem, instead of a hang or a stack
of tracebacks halfway through training.
"""

from __future__ import annotations

import os

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from wagma.app.data import DATASET_INFO, DataInfo, dataset_info, train_split_size
from wagma.app.imbalance import build_imbalance
from wagma.app.quota import check_rank_cpus
from wagma.app.models import build_model
from wagma.app.parallel import check_parallel, replica_count
from wagma.app.policies import validate_hsdp, validate_policy_config

__all__ = [
    "ConfigError", "KNOWN_OPTIMIZERS", "build_optimizer", "group_options", "validate_config", "validate_launch",
]

KNOWN_OPTIMIZERS: tuple[str, ...] = ("adam", "sgd")
_GROUPS: tuple[str, ...] = ("data", "model", "optim", "imbalance", "averaging")
_TOP_LEVEL: tuple[str, ...] = (
    "steps", "batch_size", "seed", "device", "checkpoint_every", "resume", "eval_every", "log_every",
)


class ConfigError(ValueError):
    """The configuration cannot be run; the message lists every problem found, one per line.

    ``problems`` holds them as a list; :meth:`one_line` joins them for a terminal report.
    """

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = list(problems) if problems is not None else [message]

    def one_line(self) -> str:
        """``"invalid configuration: <problem>; <problem>"``."""
        return "invalid configuration: " + "; ".join(p.replace("\n", " ") for p in self.problems)


def group_options(cfg: DictConfig | Mapping[str, Any], group: str) -> dict[str, Any]:
    """The resolved entries of config group ``group`` as a plain dict (``name`` included)."""
    node = cfg[group]
    if isinstance(node, DictConfig):
        return dict(OmegaConf.to_container(node, resolve=True))  # type: ignore[arg-type]
    return dict(node)


def build_optimizer(cfg: Mapping[str, Any], params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """Build the optimizer ``cfg["name"]`` ("sgd" with optional momentum, or "adam") over ``params``.

    Raises:
        ValueError: for an unknown name or a bad value.
    """
    options = dict(cfg)
    name = options.pop("name", None)
    lr = float(options.pop("lr", -1.0))
    if lr <= 0:
        raise ValueError(f"optim.lr must be > 0, got {cfg.get('lr')}")
    if float(options.get("weight_decay", 0.0)) < 0:
        raise ValueError(f"optim.weight_decay must be >= 0, got {options['weight_decay']}")
    try:
        if name == "sgd":
            if float(options.get("momentum", 0.0)) < 0:
                raise ValueError(f"optim.momentum must be >= 0, got {options['momentum']}")
            return torch.optim.SGD(params, lr=lr, **options)
        if name == "adam":
            if "betas" in options:
                options["betas"] = tuple(options["betas"])
            return torch.optim.Adam(params, lr=lr, **options)
    except TypeError as exc:
        raise ValueError(f"bad arguments for optimizer {name!r}: {exc}") from exc
    raise ValueError(f"unknown optimizer {name!r}; known optimizers: {', '.join(KNOWN_OPTIMIZERS)}")


def _nonneg_int(cfg: Mapping[str, Any], key: str, minimum: int, problems: list[str]) -> None:
    value = cfg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        problems.append(f"{key} must be an integer >= {minimum}, got {value!r}")


def validate_config(cfg: DictConfig | Mapping[str, Any], world_size: int) -> None:
    """Check that ``cfg`` can train on ``world_size`` ranks; build nothing expensive, talk to no one.

    Checked: the top-level keys (``steps``, ``batch_size`` >= 1; ``checkpoint_every``, ``eval_every``,
    ``consensus_every`` >= 0; ``log_every`` >= 1; ``telemetry_interval_s`` >= 0; ``device`` in
    auto/cpu/cuda; ``resume`` a bool), the dataset and its split
    (every rank's shard holds at least one batch), the model (built once on the CPU, it is small), the
    optimizer (built over a dummy parameter), the imbalance injector (built for rank 0 of
    ``world_size``), ``parallel`` / ``shard_size`` (:func:`wagma.app.parallel.check_parallel`) and the averaging
    policy (:func:`wagma.app.policies.validate_policy_config`: known name, group sizes dividing the world size --
    under ``parallel=hsdp`` the number of replicas, and a policy with a sharded form --, periods, momentum,
    mode/mixing/order; see :mod:`wagma.app.policies.options`).

    Raises:
        ConfigError: listing every problem, one per line.
    """
    problems: list[str] = []
    plain: dict[str, Any]
    if isinstance(cfg, DictConfig):
        plain = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    else:
        plain = dict(cfg)
    missing = [k for k in (*_TOP_LEVEL, *_GROUPS) if k not in plain]
    if missing:
        message = f"the config lacks the keys {missing}; compose it from configs/config.yaml"
        raise ConfigError(message, [message])
    if world_size < 1:
        problems.append(f"world size must be >= 1, got {world_size}")
    _nonneg_int(plain, "steps", 1, problems)
    _nonneg_int(plain, "batch_size", 1, problems)
    _nonneg_int(plain, "checkpoint_every", 0, problems)
    _nonneg_int(plain, "eval_every", 0, problems)
    _nonneg_int(plain, "log_every", 1, problems)
    if "consensus_every" in plain:
        _nonneg_int(plain, "consensus_every", 0, problems)
    interval = plain.get("telemetry_interval_s", 0.0)
    if isinstance(interval, bool) or not isinstance(interval, (int, float)) or interval < 0:
        problems.append(f"telemetry_interval_s must be a number >= 0 (0: off), got {interval!r}")
    if plain["device"] not in ("auto", "cpu", "cuda"):
        problems.append(f"device must be 'auto', 'cpu' or 'cuda', got {plain['device']!r}")
    if not isinstance(plain["resume"], bool):
        problems.append(f"resume must be true or false, got {plain['resume']!r}")
    if not isinstance(plain.get("resume_policy_change", False), bool):
        problems.append(f"resume_policy_change must be true or false, got {plain['resume_policy_change']!r}")
    if world_size >= 1:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        quota_problem = check_rank_cpus(plain.get("rank_cpus"), min(local_ranks, world_size))
        if quota_problem is not None:
            problems.append(quota_problem)

    data = plain["data"]
    info: DataInfo | None = None
    try:
        info = dataset_info(data)
    except ValueError as exc:
        problems.append(str(exc))
    if info is not None:
        fraction = data.get("test_fraction", 0.2)
        if not 0.0 < float(fraction) < 1.0:
            problems.append(f"data.test_fraction must be in (0, 1), got {fraction}")
        elif isinstance(plain["batch_size"], int) and world_size >= 1:
            shard = train_split_size(data["name"], float(fraction), info.examples) // world_size
            if plain["batch_size"] > shard and data.get("batching", "samples") == "samples":
                problems.append(
                    f"batch_size={plain['batch_size']} exceeds the {shard} training examples each of "
                    f"{world_size} ranks holds of {data['name']!r}; use batch_size <= {shard}"
                )
    if info is None:  # the model is checked against some data all the same
        info = DataInfo(*DATASET_INFO["digits"])
    model = dict(plain["model"])
    try:
        build_model(str(model.pop("name", None)), info.in_shape, info.num_classes, **model,
                    **({} if info.vocab_size is None else {"vocab_size": info.vocab_size}))
    except ValueError as exc:
        problems.append(str(exc))

    optim = plain["optim"]
    try:
        build_optimizer(optim, [torch.nn.Parameter(torch.zeros(1))])
    except ValueError as exc:
        problems.append(str(exc))

    if world_size >= 1:
        try:
            build_imbalance(plain["imbalance"], 0, world_size)
        except ValueError as exc:
            problems.append(str(exc))
        _check_averaging(plain, world_size, problems)

    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems), problems)


def _check_averaging(plain: Mapping[str, Any], world_size: int, problems: list[str]) -> None:
    """Check ``parallel`` / ``shard_size`` and the averaging policy on the world it averages over.

    Under ``parallel=hsdp`` that world is the replicas (``world_size / shard_size``): every policy size is checked
    against their number, and a policy with no sharded form is refused (:func:`wagma.app.policies.validate_hsdp`).
    """
    layout = check_parallel(plain.get("parallel", "ddp"), plain.get("shard_size", 1), world_size)
    problems.extend(layout)
    if layout:
        return
    hsdp = plain.get("parallel", "ddp") == "hsdp"
    replicas = replica_count(plain, world_size)
    try:
        if hsdp:
            validate_hsdp(plain["averaging"])
        validate_policy_config(plain["averaging"], replicas)
    except ValueError as exc:
        where = (f" (parallel=hsdp: the policy averages over the {replicas} replicas = {world_size} ranks / "
                 f"shard_size {plain.get('shard_size')})") if hsdp and "parallel=hsdp" not in str(exc) else ""
        problems.append(f"{exc}{where}")


def validate_launch(cfg: DictConfig | Mapping[str, Any]) -> None:
    """Check the keys of a ``python train.py`` launch: ``nproc`` (local ranks, >= 1) and ``max_restarts`` (>= 0).

    They matter only when ``train.py`` starts the ranks itself (not under torchrun, whose flags decide).

    Raises:
        ConfigError: listing every problem.
    """
    problems: list[str] = []
    _nonneg_int(cfg, "nproc", 1, problems)
    _nonneg_int(cfg, "max_restarts", 0, problems)
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems), problems)
