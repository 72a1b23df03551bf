"""From a composed Hydra config to checked settings: :func:`validate_config` and the optimizer builder.

:func:`validate_config` runs on every rank before anything collective or expensive happens. It needs only
the config and the world size, so all ranks reach the same verdict without talking to each other, and a
bad config ends the run with one :class:`ConfigError` listing every problem, instead of a hang or a stack
of tracebacks halfway through training.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from wagma.app.data import DATASET_INFO, DataInfo, Dataset, dataset_info, load_dataset, train_split_size
from wagma.app.ft_options import check_ft, ft_enabled
from wagma.app.imbalance import build_imbalance
from wagma.app.models import build_model
from wagma.app.network import check_rank_net
from wagma.app.parallel import check_parallel, replica_count
from wagma.app.policies import validate_hsdp, validate_policy_config
from wagma.app.presets import CONFIGS_DIR
from wagma.app.quota import check_rank_cpus
from wagma.checks import check_bool, check_choice, check_int, check_number, is_number

__all__ = [
    "ConfigError",
    "KNOWN_OPTIMIZERS",
    "build_optimizer",
    "configured_dataset",
    "configured_model",
    "data_options",
    "group_options",
    "validate_config",
    "validate_launch",
]

KNOWN_OPTIMIZERS: tuple[str, ...] = ("adam", "sgd")
_GROUPS: tuple[str, ...] = ("data", "model", "optim", "imbalance", "averaging")
_TOP_LEVEL: tuple[str, ...] = (
    "steps",
    "batch_size",
    "seed",
    "device",
    "checkpoint_every",
    "resume",
    "eval_every",
    "log_every",
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


def data_options(cfg: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    """The data group's options for its loader and batches (all but ``name`` and ``test_fraction``)."""
    return {k: v for k, v in group_options(cfg, "data").items() if k not in ("name", "test_fraction")}


def configured_dataset(cfg: DictConfig | Mapping[str, Any]) -> Dataset:
    """The run's dataset as its config (``data`` group, ``seed``) names it: the same split on every rank."""
    data = group_options(cfg, "data")
    test_fraction = float(data.get("test_fraction", 0.2))
    return load_dataset(data["name"], seed=int(cfg["seed"]), test_fraction=test_fraction, **data_options(cfg))


def configured_model(cfg: DictConfig | Mapping[str, Any], dataset: Dataset) -> torch.nn.Module:
    """The run's model as its config (``model`` group) names it, shaped for ``dataset``; on the CPU, from the current
    random state."""
    model = group_options(cfg, "model")
    return build_model(model.pop("name"), dataset.in_shape, dataset.num_classes, **model, **dataset.model_options())


def build_optimizer(cfg: Mapping[str, Any], params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """Build the optimizer ``cfg["name"]`` ("sgd" with optional momentum, or "adam") over ``params``.

    Raises:
        ValueError: for an unknown name or a bad value.
    """
    options = dict(cfg)
    name = options.pop("name", None)
    lr = check_number("optim.lr", options.pop("lr", None), 0, above=True)
    check_number("optim.weight_decay", options.get("weight_decay", 0.0), 0)
    try:
        if name == "sgd":
            check_number("optim.momentum", options.get("momentum", 0.0), 0)
            return torch.optim.SGD(params, lr=lr, **options)
        if name == "adam":
            if "betas" in options:
                options["betas"] = tuple(options["betas"])
            return torch.optim.Adam(params, lr=lr, **options)
    except TypeError as exc:
        raise ValueError(f"bad arguments for optimizer {name!r}: {exc}") from exc
    raise ValueError(f"unknown optimizer {name!r}; known optimizers: {', '.join(KNOWN_OPTIMIZERS)}")


def _check_ints(cfg: Mapping[str, Any], minimums: Mapping[str, int], problems: list[str]) -> None:
    """Each ``cfg[key]`` an integer >= its minimum (:func:`wagma.checks.check_int`); the failures go to ``problems``."""
    for key, minimum in minimums.items():
        _attempt(problems, functools.partial(check_int, key, cfg.get(key), minimum))


def validate_config(cfg: DictConfig | Mapping[str, Any], world_size: int) -> None:
    """Check that ``cfg`` can train on ``world_size`` ranks; build nothing expensive, talk to no one.

    Checked: the top-level keys (``steps``, ``batch_size`` >= 1; ``checkpoint_every``, ``eval_every``,
    ``consensus_every`` >= 0; ``log_every`` >= 1; ``telemetry_interval_s`` >= 0; ``device`` in
    auto/cpu/cuda; ``resume`` a bool; ``stop_at_loss``, ``stop_at_accuracy``, ``stop_after_s`` null or positive,
    with ``eval_every`` >= 1), the dataset and its split
    (every rank's shard holds at least one batch), the model (built once on the CPU, it is small), the
    optimizer (built over a dummy parameter), the imbalance injector (built for rank 0 of
    ``world_size``), ``parallel`` / ``shard_size`` (:func:`wagma.app.parallel.check_parallel`) and the averaging
    policy (:func:`wagma.app.policies.validate_policy_config`: known name, group sizes dividing the world size --
    under ``parallel=hsdp`` the number of replicas, and a policy with a sharded form --, periods, momentum,
    mode/mixing/order; see :mod:`wagma.app.policies.options`), ``rank_cpus`` (:func:`wagma.app.quota.check_rank_cpus`)
    and ``rank_net`` (:func:`wagma.app.network.check_rank_net`: its rate, one host, and a trial bridge, namespace,
    veth and tbf, once per process), and the ``ft`` group with ``replicas`` (:func:`wagma.app.ft_options.check_ft`;
    under ``ft=torchft`` ``world_size`` is the number of replica groups and ``averaging`` is not used). A value of
    another type than the shipped configs give its key is named, whatever the check it failed said
    (``optim.lr: expected a float, found 'abc'``).

    Raises:
        ConfigError: listing every problem, one per line.
    """
    plain: dict[str, Any]
    if isinstance(cfg, DictConfig):
        plain = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    else:
        plain = dict(cfg)
    missing = [k for k in (*_TOP_LEVEL, *_GROUPS) if k not in plain]
    if missing:
        message = f"the config lacks the keys {missing}; compose it from configs/config.yaml"
        raise ConfigError(message, [message])
    # Each check's problems by the group it checked ("": the top-level keys), for _with_types.
    found: dict[str, list[str]] = {group: [] for group in ("", *_GROUPS)}
    _check_top_level(plain, world_size, found[""])
    found[""] += check_ft(plain)  # ft=torchft: world_size is the replica groups' number, not ranks
    _check_groups(plain, world_size, found)
    problems = _with_types(found, plain)
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems), problems)


def _check_top_level(plain: Mapping[str, Any], world_size: int, problems: list[str]) -> None:
    """The world size and the top-level keys: step counts and intervals, telemetry, device, resume, placement."""
    _attempt(problems, lambda: check_int("world size", world_size, 1))
    minimums = {"steps": 1, "batch_size": 1, "checkpoint_every": 0, "eval_every": 0, "log_every": 1}
    _check_ints(plain, minimums | ({"consensus_every": 0} if "consensus_every" in plain else {}), problems)
    interval = plain.get("telemetry_interval_s", 0.0)
    _attempt(problems, lambda: check_number("telemetry_interval_s", interval, 0), advice=" (0: off)")
    _attempt(problems, lambda: check_choice("device", plain["device"], ("auto", "cpu", "cuda")))
    _attempt(problems, lambda: check_bool("resume", plain["resume"]))
    _attempt(problems, lambda: check_bool("resume_policy_change", plain.get("resume_policy_change", False)))
    _check_stops(plain, problems)
    _attempt(problems, lambda: check_choice("eval_model", plain.get("eval_model", "local"), ("local", "mean")))
    if plain.get("eval_model") == "mean" and plain.get("parallel", "ddp") == "hsdp":
        problems.append("eval_model=mean: expected whole replicas (parallel=ddp), found parallel=hsdp")
    if world_size >= 1:
        _check_placement(plain, world_size, problems)


def _check_stops(plain: Mapping[str, Any], problems: list[str]) -> None:
    """``stop_at_loss`` (> 0), ``stop_at_accuracy`` (in (0, 1]) and ``stop_after_s`` (> 0), each null or a number;
    any of them needs ``eval_every`` >= 1: the run stops only after an evaluation."""
    bounds = {"stop_at_loss": (0, None), "stop_at_accuracy": (0, 1), "stop_after_s": (0, None)}
    set_keys = [key for key in bounds if plain.get(key) is not None]
    for key in set_keys:
        low, high = bounds[key]
        _attempt(
            problems, functools.partial(check_number, key, plain[key], low, high, above=True), advice=" (null: off)"
        )
    if set_keys and isinstance(plain.get("eval_every"), int) and plain["eval_every"] < 1:
        problems.append(
            f"{set_keys[0]}: needs eval_every >= 1 (the run stops only after an evaluation), found eval_every="
            f"{plain['eval_every']}"
        )


def _check_placement(plain: Mapping[str, Any], world_size: int, problems: list[str]) -> None:
    """``rank_cpus`` and ``rank_net`` for the ranks this host runs of ``world_size``."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    quota_problem = check_rank_cpus(plain.get("rank_cpus"), min(local_ranks, world_size))
    if quota_problem is not None:
        problems.append(quota_problem)
    if plain.get("rank_net") is not None:  # (null, the default, needs no look at the device)
        device = plain["device"] if plain["device"] != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        net_problem = check_rank_net(plain.get("rank_net"), min(local_ranks, world_size), world_size, device)
        if net_problem is not None:
            problems.append(net_problem)


def _check_groups(plain: Mapping[str, Any], world_size: int, found: dict[str, list[str]]) -> None:
    """The config groups: the data and its split, the model (against the data, or the digits when the data is
    unusable), the optimizer, the imbalance injector and the averaging policy; problems by group in ``found``."""
    data = plain["data"]
    info: DataInfo | None = _attempt(found["data"], lambda: dataset_info(data))
    if info is not None:
        known: DataInfo = info
        _attempt(found["data"], lambda: _check_split(plain, known, world_size, found))
    if info is None:  # the model is checked against some data all the same
        info = DataInfo(*DATASET_INFO["digits"])
    model = dict(plain["model"])
    _attempt(
        found["model"],
        lambda: build_model(
            str(model.pop("name", None)),
            info.in_shape,
            info.num_classes,
            **model,
            **({} if info.vocab_size is None else {"vocab_size": info.vocab_size}),
            **({"token_targets": True} if info.token_targets else {}),
        ),
    )
    _attempt(found["optim"], lambda: build_optimizer(plain["optim"], [torch.nn.Parameter(torch.zeros(1))]))
    if world_size >= 1:
        _attempt(found["imbalance"], lambda: build_imbalance(plain["imbalance"], 0, world_size))
        if not ft_enabled(plain):  # replica groups average with the ft group's keys (wagma.app.ft_options)
            _check_averaging(plain, world_size, found)


def _attempt(problems: list[str], check: Callable[[], Any], advice: str = "") -> Any:
    """``check()``; its ``ValueError`` or ``TypeError`` (a value of the wrong type) goes to ``problems`` (followed by
    ``advice``), as None."""
    try:
        return check()
    except (ValueError, TypeError) as exc:
        problems.append(f"{exc}{advice}")
        return None


def _check_split(plain: Mapping[str, Any], info: DataInfo, world_size: int, found: dict[str, list[str]]) -> None:
    """``data.test_fraction`` in (0, 1), and a batch that every rank's shard of the training split holds."""
    data = plain["data"]
    fraction = check_number("data.test_fraction", data.get("test_fraction", 0.2), 0, 1, above=True, below=True)
    if isinstance(plain["batch_size"], int) and world_size >= 1:
        shard = train_split_size(data["name"], fraction, info.examples) // world_size
        if plain["batch_size"] > shard and data.get("batching", "samples") == "samples":
            found[""].append(
                f"batch_size={plain['batch_size']} exceeds the {shard} training examples each of "
                f"{world_size} ranks holds of {data['name']!r}; use batch_size <= {shard}"
            )


def _check_averaging(plain: Mapping[str, Any], world_size: int, found: dict[str, list[str]]) -> None:
    """Check ``parallel`` / ``shard_size`` and the averaging policy on the world it averages over.

    Under ``parallel=hsdp`` that world is the replicas (``world_size / shard_size``): every policy size is checked
    against their number, and a policy with no sharded form is refused (:func:`wagma.app.policies.validate_hsdp`).
    """
    layout = check_parallel(plain.get("parallel", "ddp"), plain.get("shard_size", 1), world_size)
    found[""].extend(layout)
    if layout:
        return
    hsdp = plain.get("parallel", "ddp") == "hsdp"
    replicas = replica_count(plain, world_size)
    try:
        if hsdp:
            validate_hsdp(plain["averaging"])
        validate_policy_config(plain["averaging"], replicas)
    except (ValueError, TypeError) as exc:
        where = (
            (
                f" (parallel=hsdp: the policy averages over the {replicas} replicas = {world_size} ranks / "
                f"shard_size {plain.get('shard_size')})"
            )
            if hsdp and "parallel=hsdp" not in str(exc)
            else ""
        )
        found["averaging"].append(f"{exc}{where}")


# --- the type of every key: what the shipped configs give it ------------------------------------------------------

_INTERPOLATION = re.compile(r"\$\{(\w+)\}")


@functools.lru_cache(maxsize=4)
def _shipped_values(configs_dir: Path) -> dict[str, dict[Any, dict[str, list[Any]]]]:
    """Every value the configs of ``configs_dir`` give each key, ``{group: {name: {key: [values]}}}``.

    Group ``""`` holds the keys of ``config.yaml`` (under name None); a group's files are filed under their
    ``name`` (None: a file without one, which extends another). A ``${key}`` value is the root's value of ``key``.
    Empty when there is no ``config.yaml`` (an installed package without the repository's ``configs/``).
    """
    root_file = configs_dir / "config.yaml"
    if not root_file.is_file():
        return {}
    root = OmegaConf.to_container(OmegaConf.load(root_file), resolve=False)
    assert isinstance(root, dict)
    for key in ("defaults", "hydra"):
        root.pop(key, None)

    def resolved(value: Any) -> Any:
        match = _INTERPOLATION.fullmatch(value) if isinstance(value, str) else None
        return root.get(match.group(1)) if match else value

    values: dict[str, dict[Any, dict[str, list[Any]]]] = {"": {None: {str(k): [v] for k, v in root.items()}}}
    for group in _GROUPS:
        by_name = values.setdefault(group, {})
        for path in sorted((configs_dir / group).rglob("*.yaml")):
            own: Any = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
            if not isinstance(own, dict):
                continue
            own.pop("defaults", None)
            keys = by_name.setdefault(own.get("name"), {})
            for key, value in own.items():
                keys.setdefault(str(key), []).append(resolved(value))
    return values


def _kind(example: Any) -> tuple[Callable[[Any], bool], str] | None:
    """How to recognise a value of ``example``'s type, and its name; None for a string or null (any value)."""
    if isinstance(example, bool):
        return (lambda v: isinstance(v, bool)), "true or false"
    if isinstance(example, (int, float)):  # an integer key may take a float (rank_cpus=0.5): its check says
        return is_number, ("an integer" if isinstance(example, int) else "a float")
    if isinstance(example, list):
        item = next((k for k in map(_kind, example) if k is not None), None)
        if item is None:
            return (lambda v: isinstance(v, list)), "a list"
        plural = {"an integer": "integers", "a float": "floats", "true or false": "booleans"}.get(item[1], item[1])
        return (lambda v: isinstance(v, list) and all(x is None or item[0](x) for x in v)), f"a list of {plural}"
    if isinstance(example, dict):
        return (lambda v: isinstance(v, dict)), "a mapping"
    return None


def _type_problems(plain: Mapping[str, Any], configs_dir: Path) -> dict[str, dict[str, tuple[str, bool]]]:
    """The keys whose value is not of the type the shipped configs give them, by group (``""``: the top level).

    ``{group: {path: (problem, null)}}`` with ``problem`` ``"optim.lr: expected a float, found 'abc'"``; ``null``
    marks a null value, which many keys take (a check that knows says) and so only explains a failed check.
    A key is checked against the files of its group with the same ``name`` (or, where none has the key, all
    of them); a value of the type of any of them passes, and a string or null in a config lets anything pass.
    """
    shipped = _shipped_values(configs_dir)
    result: dict[str, dict[str, tuple[str, bool]]] = {}
    for group, by_name in shipped.items():
        options = plain.get(group) if group else plain
        if not isinstance(options, Mapping):
            continue
        named = by_name.get(options.get("name")) if group else by_name[None]
        for key, value in options.items():
            examples = (named or {}).get(str(key)) or [v for keys in by_name.values() for v in keys.get(str(key), [])]
            kinds = [_kind(example) for example in examples]
            if not kinds or any(k is None or k[0](value) for k in kinds) or (group and key == "name"):
                continue
            expected = kinds[0][1]  # type: ignore[index]  # no kind is None here (the line above)
            path = f"{group}.{key}" if group else str(key)
            result.setdefault(group, {})[path] = (f"{path}: expected {expected}, found {value!r}", value is None)
    return result


def _names(problem: str, key: str) -> bool:
    """Whether ``problem`` names ``key`` (a whole word or dotted path)."""
    return re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", problem) is not None


def _with_types(found: dict[str, list[str]], plain: Mapping[str, Any]) -> list[str]:
    """The problems of every check (``found``, by group) with the keys of the wrong type named.

    A value of the wrong type makes a check fail with Python's own words (``could not convert string to float:
    'abc'``) or pass by accident; the one problem that names the key (:func:`_type_problems`) replaces every
    problem of its group that names none of the group's keys, and is added where no problem names it.
    """
    typed = _type_problems(plain, CONFIGS_DIR)
    problems: list[str] = []
    for group, messages in found.items():
        wrong = typed.get(group, {})
        if group and wrong:
            keys = [f"{group}.{k}" for k in plain[group]] + [str(k) for k in plain[group] if k != "name"]
            keyless = [m for m in messages if not any(_names(m, k) for k in keys)]
            if keyless:
                messages = [m for m in messages if m not in keyless] + [text for text, _ in wrong.values()]
        problems += messages
        for path, (text, null) in wrong.items():
            if (
                not null
                and text not in problems
                and not any(_names(m, path) or _names(m, path.split(".")[-1]) for m in messages)
            ):
                problems.append(text)
    return problems


def validate_launch(cfg: DictConfig | Mapping[str, Any]) -> None:
    """Check the keys of a ``python train.py`` launch: ``nproc`` (local ranks, >= 1) and ``max_restarts`` (>= 0).

    They matter only when ``train.py`` starts the ranks itself (not under torchrun, whose flags decide).

    Raises:
        ConfigError: listing every problem.
    """
    problems: list[str] = []
    _check_ints(cfg, {"nproc": 1, "max_restarts": 0}, problems)
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems), problems)
