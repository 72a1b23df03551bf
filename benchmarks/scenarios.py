"""The imbalance scenarios and the averaging policies the benchmark compares, and how each becomes a config.

A scenario is one of :mod:`wagma.app.imbalance`'s injectors with its parameters expressed in units of a
delay ``d``, by default the measured step time ``T`` (the mean per-rank step time of synchronous SGD
without injected delay), so the same scenario means the same thing on a fast and a slow machine:

- ``none``: no injected delay.
- ``random_k1`` / ``random_k2``: each step, 1 (2) of the P ranks, drawn with a seed shared by all ranks,
  sleep ``d`` (the papers' method: "about one step time"; ``d = T`` unless chosen otherwise).
- ``persistent``: rank P-1 sleeps ``d`` before every step, so its steps take about 2T (2x slower).
- ``heavy_tail``: every rank sleeps a lognormal draw each step (median ``d / 4``, sigma 1, capped at ``4 d``).

A policy is named by its file in ``configs/averaging/`` (``averaging=<policy>``), in
``configs/averaging/reference/`` for the published algorithms that are not shipped presets
(``eager_solo`` is ``averaging=reference/eager_solo``: :func:`benchmarks.presets.averaging_option`), or in
``configs/averaging/candidate/`` for variants not yet measured on the accuracy grid a preset needs.
:func:`resolve_policy` says whether it can run now: the config must exist and its ``name`` must be registered with
:func:`wagma.app.policies.register_policy`; otherwise the benchmark reports it as skipped, with the reason,
and picks it up without changes once it is registered.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig, OmegaConf

from benchmarks.presets import averaging_option
from wagma.app.config import ConfigError, group_options, validate_config
from wagma.app.imbalance import build_imbalance
from wagma.app.policies import known_policies

__all__ = [
    "BASELINE",
    "POLICIES",
    "SCENARIOS",
    "SCENARIO_TABLE",
    "Scenario",
    "describe",
    "expected_delays",
    "resolve_policy",
]

POLICIES: tuple[str, ...] = (
    "allreduce",
    "local_sgd",
    "hierarchical",
    "hierarchical_momentum",
    "wagma",
    "eager_solo",
    "eager_majority",
    "dpsgd",
    "sgp",
    "osgp",
    "adpsgd",
)
"""The policies compared and the decentralized baselines (D-PSGD, SGP, OSGP, AD-PSGD), in the order tables and plots
show them; ``allreduce`` is plain DDP."""

BASELINE = "allreduce"
"""The policy every ratio is taken against (synchronous SGD, DDP's allreduce)."""


@dataclasses.dataclass(frozen=True)
class Scenario:
    """An imbalance injector with parameters scaled to the delay unit ``d``.

    ``overrides(d, P)`` returns the Hydra overrides of the ``imbalance`` group for a world of P ranks.
    """

    name: str
    description: str
    overrides: Callable[[float, int], list[str]]


def _random_k(k: int) -> Callable[[float, int], list[str]]:
    return lambda d, p: ["imbalance=random_k", f"imbalance.k={k}", f"imbalance.delay_s={d:.6f}"]


def _persistent(d: float, p: int) -> list[str]:
    return ["imbalance=persistent", f"imbalance.ranks=[{p - 1}]", "imbalance.factor=2.0", f"imbalance.base_s={d:.6f}"]


def _heavy_tail(d: float, p: int) -> list[str]:
    return [
        "imbalance=heavy_tail",
        "imbalance.distribution=lognormal",
        f"imbalance.scale_s={0.25 * d:.6f}",
        "imbalance.shape=1.0",
        f"imbalance.max_s={4 * d:.6f}",
    ]


SCENARIO_TABLE: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("none", "no injected delay", lambda d, p: ["imbalance=none"]),
        Scenario("random_k1", "each step 1 of P ranks (shared seed) sleeps d", _random_k(1)),
        Scenario("random_k2", "each step 2 of P ranks (shared seed) sleep d", _random_k(2)),
        Scenario("persistent", "rank P-1 sleeps d before every step (2x slower when d = T)", _persistent),
        Scenario("heavy_tail", "every rank sleeps a lognormal draw: median d/4, sigma 1, cap 4 d", _heavy_tail),
    )
}
"""Every scenario by name."""

SCENARIOS: tuple[str, ...] = tuple(SCENARIO_TABLE)
"""Scenario names, in the order tables and plots show them."""


def expected_delays(cfg: DictConfig, world_size: int, compute_s: float) -> tuple[float, float]:
    """(mean, max) expected injected delay per step of ``cfg``'s imbalance, from :mod:`wagma.app.imbalance`.

    The mean is what a perfectly wait-avoiding method pays per step (``k d / P`` for random_k); the max
    is what synchronous SGD pays (``d``).
    """
    injector = build_imbalance(group_options(cfg, "imbalance"), 0, world_size)
    return injector.expected_mean_delay_s(compute_s), injector.expected_max_delay_s(compute_s)


def resolve_policy(
    policy: str, compose: Callable[[list[str]], DictConfig], configs_dir: Path, world_size: int, base: list[str]
) -> tuple[DictConfig | None, str | None]:
    """The config to train ``policy`` with, or ``(None, reason)`` when it cannot run in this checkout.

    Args:
        policy: a file stem of ``configs/averaging/``.
        compose: composes the root config with the given overrides.
        configs_dir: the repository's ``configs/``.
        world_size: ranks the run will have (for validation).
        base: the other overrides (scenario, steps, ...).
    """
    option = averaging_option(policy, configs_dir)
    try:
        if not (configs_dir / "averaging" / f"{option}.yaml").exists():
            if policy in known_policies():
                # Registered without a config file: build it with its defaults.
                cfg = compose(base)
                cfg.averaging = OmegaConf.create({"name": policy})
            else:
                return None, f"no configs/averaging/{policy}.yaml and no registered policy named {policy!r}"
        else:
            cfg = compose([*base, f"averaging={option}"])
    except ConfigCompositionException as exc:
        # e.g. a --set averaging.KEY=... for a key this policy does not have: this policy fails, the others run.
        return None, f"the overrides {base} do not compose with averaging={policy}: {exc}"
    try:  # an unregistered name is refused here too, after its config's policy_module (if any) is imported
        validate_config(cfg, world_size)
    except ConfigError as exc:
        return None, "config rejected: " + " ".join(
            line.strip(" -") for line in str(exc).splitlines()[1:] or [str(exc)]
        )
    return cfg, None


def describe(cfg: DictConfig) -> dict[str, Any]:
    """The averaging options a record keeps, as plain values."""
    return group_options(cfg, "averaging")
