"""Checking ``averaging`` configs before training: one validator per built-in policy.

Each is called as ``validate(options, world_size)`` by :func:`wagma.app.policies.validate_policy_config`
(after its generic checks: a known name, ``group_size`` dividing the world size, no negative
``*period``/``*_steps``) on every rank before anything is built, and raises one ``ValueError`` naming the
key, the value found and what was expected. They check unknown keys, ``progress_nice`` in [0, 19], group sizes that
do not divide the world size, periods, ``global_period`` a multiple of ``local_period``, momentum in [0, 1), the mode /
mixing / order / topology names, gossip's two ranks at least, and WAGMA's schedule (built here, so a schedule that
does not mix is refused).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from wagma.averaging.gossip import TOPOLOGIES
from wagma.averaging.wagma import MIXINGS
from wagma.averaging.wagma import ORDERS as WAGMA_ORDERS
from wagma.checks import check_bool, check_choice, check_int, check_number, fail
from wagma.engine import SYNCS, check_max_lead, check_progress_nice
from wagma.schedule import GroupSchedule, check_group_fits
from wagma.shm import TRANSPORTS
from wagma.wire import WIRE_DTYPES

__all__ = [
    "EAGER_MODES",
    "ORDERS",
    "WAGMA_MIXINGS",
    "WAGMA_SYNCS",
    "validate_allreduce",
    "validate_eager",
    "validate_gossip",
    "validate_hierarchical",
    "validate_hierarchical_momentum",
    "validate_local_sgd",
    "validate_wagma",
]

#: When a model-averaging policy averages within a step (docs/design.md §2.2).
ORDERS: tuple[str, ...] = WAGMA_ORDERS
#: Mixing rules of the WAGMA policy (``reference``: (w_i + Σ_{j∈G} ŵ_j) / (S + 1), docs/design.md §2.2; ``mean``;
#: ``conserve``: w_i + Σ_{j∈G} ŵ_j / S - ŵ_i, which keeps each group's sum of models); the averager's own.
WAGMA_MIXINGS: tuple[str, ...] = MIXINGS
#: How WAGMA's sync rounds run: ``barrier`` (blocking, fresh models: docs/design.md §2.2) or ``wait_avoiding``
#: (triggered by the first arrival like the group rounds; staleness bounded by ``max_lead``); the engine's own.
WAGMA_SYNCS: tuple[str, ...] = SYNCS
#: eager-SGD partial allreduce modes (docs/design.md §2.4).
EAGER_MODES: tuple[str, ...] = ("solo", "majority")
#: Keys every DDP-wrapping policy accepts.
_COMMON_KEYS = ("bucket_cap_mb", "timeout_s")


def _only_keys(policy: str, options: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise fail(f"averaging '{policy}' unknown keys", f"none (it takes {sorted(allowed)})", unknown)


def _int(options: Mapping[str, Any], key: str, minimum: int, *, required: bool = True) -> int | None:
    if key not in options:
        if required:
            raise ValueError(f"averaging.{key} is required (an integer >= {minimum})")
        return None
    return check_int(f"averaging.{key}", options[key], minimum)


def _max_lead(options: Mapping[str, Any], sync_period: int) -> None:
    max_lead = options.get("max_lead")
    if max_lead is not None:
        check_max_lead(max_lead, sync_period, "averaging.max_lead")


def _positive(options: Mapping[str, Any], key: str) -> None:
    check_number(f"averaging.{key}", options.get(key, 1.0), 0, above=True)


def _flag(options: Mapping[str, Any], key: str) -> None:
    if key in options:
        check_bool(f"averaging.{key}", options[key])


def _choice(options: Mapping[str, Any], key: str, choices: tuple[str, ...], default: str) -> str:
    return str(check_choice(f"averaging.{key}", options.get(key, default), choices))


def _divisor(options: Mapping[str, Any], key: str, world_size: int) -> None:
    value = _int(options, key, 1)
    assert value is not None
    check_group_fits(value, world_size, f"averaging.{key}")
    if world_size % value != 0:
        raise fail(
            f"averaging.{key}",
            f"a positive divisor of the world size {world_size}",
            value,
            "pick a group size that divides the number of ranks",
        )


def _progress_nice(options: Mapping[str, Any]) -> None:
    check_progress_nice(options.get("progress_nice", 0), "averaging.progress_nice")


def _transport(options: Mapping[str, Any]) -> None:
    check_choice("averaging.transport", options.get("transport", "default"), TRANSPORTS)


def _wire(options: Mapping[str, Any]) -> None:
    value = options.get("wire_dtype")
    if value is None:
        return
    if not isinstance(value, str) or value.lower() not in WIRE_DTYPES:
        raise fail("averaging.wire_dtype", f"null or one of {', '.join(map(repr, sorted(WIRE_DTYPES)))}", value)
    if WIRE_DTYPES[value.lower()] is not None and options.get("transport", "default") == "shm":
        raise ValueError(
            f"averaging.wire_dtype={value} needs averaging.transport=default: shared memory moves no bytes over a wire"
        )


def _common(options: Mapping[str, Any]) -> None:
    _positive(options, "bucket_cap_mb")
    _positive(options, "timeout_s")


_LOCAL_SGD_KEYS = ("period", "warmup_steps", "average_buffers", "wire_dtype", *_COMMON_KEYS)
_HIERARCHICAL_KEYS = (
    "local_group_size",
    "local_period",
    "global_period",
    "warmup_steps",
    "average_buffers",
    "wire_dtype",
    *_COMMON_KEYS,
)
_MOMENTUM_KEYS = (*_HIERARCHICAL_KEYS, "momentum", "lr", "nesterov", "apply_to")
_WAGMA_KEYS = (
    "group_size",
    "sync_period",
    "schedule",
    "mixing",
    "order",
    "average_buffers",
    "max_lead",
    "sync",
    "overlap",
    "progress_nice",
    "transport",
    "wire_dtype",
    "publish_after_step",
    *_COMMON_KEYS,
)
_GOSSIP_KEYS = ("warmup_steps", "average_buffers", *_COMMON_KEYS)
_DPSGD_KEYS = ("topology", *_GOSSIP_KEYS)
_EAGER_KEYS = (
    "mode",
    "sync_period",
    "warmup_iters",
    "seed",
    "max_lead",
    "overlap",
    "progress_nice",
    "transport",
    "wire_dtype",
    "late",
    "lookahead_rounds",
    *_COMMON_KEYS,
)


def validate_allreduce(options: Mapping[str, Any], world_size: int) -> None:
    """Check an ``allreduce`` config: only ``bucket_cap_mb`` (> 0), ``transport`` and ``wire_dtype``."""
    _only_keys("allreduce", options, ("bucket_cap_mb", "transport", "wire_dtype"))
    _positive(options, "bucket_cap_mb")
    _transport(options)
    _wire(options)


def validate_local_sgd(options: Mapping[str, Any], world_size: int) -> None:
    """Check a ``local_sgd`` config: ``period`` >= 1, ``warmup_steps`` >= 0."""
    _only_keys("local_sgd", options, _LOCAL_SGD_KEYS)
    _int(options, "period", 1)
    _int(options, "warmup_steps", 0, required=False)
    _flag(options, "average_buffers")
    _wire(options)
    _common(options)


def validate_hierarchical(options: Mapping[str, Any], world_size: int, *, momentum: bool = False) -> None:
    """Check a ``hierarchical`` (or, with ``momentum``, ``hierarchical_momentum``) config.

    ``local_group_size`` divides the world size; periods >= 1 with ``global_period`` a multiple of
    ``local_period``; with momentum: ``momentum`` in [0, 1), ``lr`` > 0, ``nesterov`` a bool, ``apply_to``
    ``global`` or ``all``.
    """
    name = "hierarchical_momentum" if momentum else "hierarchical"
    _only_keys(name, options, _MOMENTUM_KEYS if momentum else _HIERARCHICAL_KEYS)
    _divisor(options, "local_group_size", world_size)
    local, global_ = _int(options, "local_period", 1), _int(options, "global_period", 1)
    assert local is not None and global_ is not None
    if global_ % local != 0:
        raise fail(
            "averaging.global_period",
            f"a multiple of averaging.local_period={local}",
            global_,
            "a global mean replaces the local one on the steps where both fall",
        )
    _int(options, "warmup_steps", 0, required=False)
    _flag(options, "average_buffers")
    _wire(options)
    _common(options)
    if momentum:
        check_number("averaging.momentum", options.get("momentum"), 0.0, 1.0, below=True)
        _positive(options, "lr")
        _flag(options, "nesterov")
        _choice(options, "apply_to", ("global", "all"), "global")


def validate_hierarchical_momentum(options: Mapping[str, Any], world_size: int) -> None:
    """Check a ``hierarchical_momentum`` config (see :func:`validate_hierarchical`)."""
    validate_hierarchical(options, world_size, momentum=True)


def validate_wagma(options: Mapping[str, Any], world_size: int) -> None:
    """Check a ``wagma`` config: group size, periods, schedule, mixing, order, sync, overlap,
    ``max_lead`` <= ``sync_period``.

    The schedule is built (cheaply, without communication) so one that does not mix every rank with
    every other is refused here.
    """
    _only_keys("wagma", options, _WAGMA_KEYS)
    _divisor(options, "group_size", world_size)
    sync_period = _int(options, "sync_period", 0)
    assert sync_period is not None
    _max_lead(options, sync_period)
    _choice(options, "mixing", WAGMA_MIXINGS, "reference")
    _choice(options, "order", ORDERS, "average_then_step")
    _choice(options, "sync", WAGMA_SYNCS, "barrier")
    _flag(options, "average_buffers")
    _flag(options, "overlap")
    _flag(options, "publish_after_step")
    order, overlap = options.get("order", "average_then_step"), options.get("overlap", False)
    if options.get("publish_after_step") and (order != "average_then_step" or overlap):
        raise ValueError(  # the form of wagma.checks.fail, with two values found
            "averaging.publish_after_step=true: expected averaging.order=average_then_step and "
            f"averaging.overlap=false, found order={order!r}, overlap={overlap!r}"
        )
    _progress_nice(options)
    _transport(options)
    _wire(options)
    _common(options)
    schedule = options.get("schedule", "auto")
    try:
        if isinstance(schedule, str):
            built = GroupSchedule.create(schedule, world_size, int(options["group_size"]))
        else:
            built = GroupSchedule(schedule)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"averaging.schedule={schedule!r} cannot be used: {exc}") from exc
    if built.world_size != world_size:
        raise fail("averaging.schedule", f"a schedule of the job's {world_size} ranks", built)


def validate_gossip(policy: str, options: Mapping[str, Any], world_size: int) -> None:
    """Check a ``dpsgd`` / ``sgp`` / ``osgp`` / ``adpsgd`` config: at least 2 ranks (AD-PSGD: an even number),
    ``topology`` (D-PSGD), ``warmup_steps`` >= 0."""
    _only_keys(policy, options, _DPSGD_KEYS if policy == "dpsgd" else _GOSSIP_KEYS)
    if world_size < 2:
        raise ValueError(f"averaging={policy} gossips with peers: it needs at least 2 ranks, the job has {world_size}")
    if policy == "adpsgd" and world_size % 2:
        raise ValueError(
            f"averaging=adpsgd pairs even (active) ranks with odd (passive) ones: it needs an even number of ranks, "
            f"the job has {world_size}"
        )
    if policy == "dpsgd":
        _choice(options, "topology", TOPOLOGIES, "ring")
    _int(options, "warmup_steps", 0, required=False)
    _flag(options, "average_buffers")
    _common(options)


def validate_eager(policy: str, options: Mapping[str, Any], world_size: int) -> None:
    """Check an ``eager_solo`` / ``eager_majority`` config: ``mode`` matches the name, periods, seed."""
    _only_keys(policy, options, _EAGER_KEYS)
    expected = policy.removeprefix("eager_")
    mode = _choice(options, "mode", EAGER_MODES, expected)
    if mode != expected:
        raise fail(
            "averaging.mode",
            f"{expected!r} (averaging '{policy}' runs it)",
            mode,
            f"use averaging=reference/eager_{mode}",
        )
    sync_period = _int(options, "sync_period", 1, required=False)
    _int(options, "warmup_iters", 2, required=False)
    _max_lead(options, 32 if sync_period is None else sync_period)  # 32: EagerPolicy's default
    check_int("averaging.seed", options.get("seed", 0))
    _flag(options, "overlap")
    late = _choice(options, "late", ("apply", "lookahead", "lookahead_local"), "apply")
    _int(options, "lookahead_rounds", 1, required=False)
    if late == "lookahead_local" and not options.get("overlap", False):
        raise fail(
            "averaging.overlap",
            "true with averaging.late=lookahead_local (it estimates the round in flight)",
            options.get("overlap", False),
        )
    _progress_nice(options)
    _transport(options)
    _wire(options)
    _common(options)
