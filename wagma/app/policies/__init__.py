"""The averaging policies and their registry: the ``averaging`` config group's names, each bound to a policy.

=========================  ==========================================================================
``allreduce``              :class:`AllreducePolicy`: DDP's own bucketed gradient allreduce.
``local_sgd``              :class:`LocalSGDPolicy`: local steps, a global model mean every ``period``
                           steps (K-AVG; :class:`~wagma.averaging.PeriodicAverager`).
``hierarchical``           :class:`HierarchicalPolicy`: means inside fixed groups every ``local_period``
                           steps, over all ranks every ``global_period``
                           (:class:`~wagma.averaging.HierarchicalAverager`).
``hierarchical_momentum``  :class:`HierarchicalPolicy` with reduction momentum
                           (:class:`~wagma.averaging.ReductionMomentum` around the hierarchical averager).
``wagma``                  :class:`WagmaPolicy`: wait-avoiding group model averaging (WAGMA-SGD).
``eager_solo``,            :class:`EagerPolicy`: eager-SGD's partial gradient allreduce in a DDP comm
``eager_majority``         hook, solo or majority.
``dpsgd``, ``sgp``,        :class:`GossipPolicy`: the decentralized baselines, D-PSGD, SGP, OSGP and
``osgp``, ``adpsgd``       AD-PSGD (:mod:`wagma.averaging.gossip`, :mod:`wagma.averaging.adpsgd`).
=========================  ==========================================================================

This module is the registry (:func:`register_policy`, :func:`build_policy`, :func:`validate_policy_config`,
:func:`known_policies`); the interface the loop drives is :class:`Policy` (:mod:`.base`), the policies
live in :mod:`.averaging` and :mod:`.eager`, their config checks in :mod:`.options`. Those modules never
import this one, so there is no import circle: importing ``wagma.app.policies`` registers every built-in.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from wagma.app.policies.averaging import (
    GossipPolicy,
    HierarchicalPolicy,
    LocalSGDPolicy,
    ModelAveragingPolicy,
    WagmaPolicy,
    averager_stats,
)
from wagma.app.policies.base import AllreducePolicy, Policy
from wagma.app.policies.eager import EagerPolicy
from wagma.app.policies.hsdp import HSDP_POLICIES, validate_hsdp
from wagma.app.policies.options import (
    EAGER_MODES,
    validate_allreduce,
    validate_eager,
    validate_gossip,
    validate_hierarchical,
    validate_hierarchical_momentum,
    validate_local_sgd,
    validate_wagma,
)
from wagma.checks import check_bool, check_optional_number, fail, is_number

__all__ = [
    "AllreducePolicy",
    "EagerPolicy",
    "GossipPolicy",
    "HSDP_POLICIES",
    "HierarchicalPolicy",
    "LocalSGDPolicy",
    "ModelAveragingPolicy",
    "Policy",
    "PRESET_KEYS",
    "WagmaPolicy",
    "averager_stats",
    "build_policy",
    "known_policies",
    "policy_options",
    "register_policy",
    "validate_hsdp",
    "validate_policy_config",
]


@dataclasses.dataclass(frozen=True)
class _Entry:
    build: Callable[..., Policy]
    validate: Callable[[Mapping[str, Any], int], None] | None


_POLICIES: dict[str, _Entry] = {}


def register_policy(
    name: str,
    build: Callable[..., Policy],
    validate: Callable[[Mapping[str, Any], int], None] | None = None,
) -> None:
    """Make ``averaging.name == name`` build a policy.

    Args:
        name: the name used in ``configs/averaging/<file>.yaml``.
        build: called as ``build(rank=..., world_size=..., device=..., **options)`` with the config's other
            entries as ``options``; returns the policy.
        validate: called as ``validate(options, world_size)`` before training; raises ``ValueError``.
    """
    if name in _POLICIES:
        raise ValueError(f"a policy named {name!r} is already registered")
    _POLICIES[name] = _Entry(build, validate)


def known_policies() -> tuple[str, ...]:
    """Names of the registered policies, sorted."""
    return tuple(sorted(_POLICIES))


_NON_NEGATIVE_SUFFIXES = ("period", "_every", "_steps")
#: Keys of an ``averaging`` config that describe the preset rather than configure the policy: checked here, read
#: by the training loop, never passed to a policy. ``validated_staleness``: the largest mean staleness (rounds) at
#: which the preset held its accuracy in the committed grid; the run-time guard (:mod:`wagma.app.guard`) warns
#: above it (null: no check). ``baseline``: true for a published method shipped to be compared against (the
#: gossip baselines), run as published and reported as measured, not held to the presets' accuracy rule.
#: ``policy_module``: a module to import when no policy of that ``name`` is registered yet; importing it registers
#: the policy (:func:`register_policy`), so a policy of one's own is one module and one config file (see the docs'
#: "Write your own averaging policy").
PRESET_KEYS: tuple[str, ...] = ("validated_staleness", "baseline", "policy_module")


def policy_options(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """An ``averaging`` config without ``name`` and the :data:`PRESET_KEYS`: the options its policy takes."""
    return {k: v for k, v in dict(cfg).items() if k != "name" and k not in PRESET_KEYS}


def _import_policy_module(name: object, module: object) -> None:
    """Import ``module`` (an ``averaging.policy_module``) when no policy ``name`` is registered yet.

    Raises:
        ValueError: the module is not a dotted name, cannot be imported, or registers no policy ``name``.
    """
    if module is None or name in _POLICIES:
        return
    if not isinstance(module, str) or not all(part.isidentifier() for part in module.split(".")):
        raise ValueError(
            f"averaging.policy_module: expected a dotted module name such as 'my_policies.random_peers', "
            f"found {module!r}"
        )
    try:
        importlib.import_module(module)
    except ImportError as err:
        raise ValueError(
            f"averaging.policy_module: expected a module importable from here that registers policy "
            f"{name!r}, found {module!r}, which does not import ({err})"
        ) from err
    if name not in _POLICIES:
        raise ValueError(
            f"averaging.policy_module: {module!r} imported, but it registered no policy {name!r} "
            f"(expected it to call wagma.app.policies.register_policy({name!r}, ...))"
        )


def validate_policy_config(cfg: Mapping[str, Any], world_size: int) -> None:
    """Check an ``averaging`` config for ``world_size`` ranks without building anything.

    Checks that hold for every policy: the name is registered (after importing the config's ``policy_module``,
    if it has one); a ``group_size`` is positive and divides
    the world size; every integer whose key ends in ``period``, ``_every`` or ``_steps`` is >= 0. Then the
    policy's own validator runs.

    Raises:
        ValueError: naming the offending key, its value and what was expected.
    """
    name = dict(cfg).get("name")
    _import_policy_module(name, dict(cfg).get("policy_module"))
    options = policy_options(cfg)
    check_optional_number("averaging.validated_staleness", dict(cfg).get("validated_staleness"), 0)
    check_bool("averaging.baseline", dict(cfg).get("baseline", False))
    if name not in _POLICIES:
        raise ValueError(f"unknown averaging policy {name!r}; known policies: {', '.join(known_policies())}")
    group_size = options.get("group_size")
    if group_size is not None and (int(group_size) < 1 or world_size % int(group_size) != 0):
        raise fail(
            "averaging.group_size",
            f"a positive divisor of the world size {world_size}",
            group_size,
            "pick a group size that divides the number of ranks",
        )
    for key, value in options.items():
        if key.endswith(_NON_NEGATIVE_SUFFIXES) and is_number(value) and value < 0:
            raise fail(f"averaging.{key}", "a number >= 0", value)
    validator = _POLICIES[name].validate
    if validator is not None:
        validator(options, world_size)


def build_policy(
    cfg: Mapping[str, Any], *, rank: int, world_size: int, device: torch.device, mesh: Any = None
) -> Policy:
    """Build the policy ``cfg["name"]`` with the config's other entries as options (validated first).

    Args:
        mesh: under ``parallel=hsdp`` the job's ``("replicate", "shard")`` mesh, set as the policy's
            :attr:`~wagma.app.policies.base.Policy.mesh` (then ``rank`` and ``world_size`` are the replica's and
            the number of replicas, and the policy must be one of :data:`wagma.app.policies.hsdp.HSDP_POLICIES`).

    Raises:
        ValueError: for an unknown name or invalid options.
    """
    validate_policy_config(cfg, world_size)
    if mesh is not None:
        validate_hsdp(cfg)
    options = policy_options(cfg)
    policy = _POLICIES[str(cfg["name"])].build(rank=rank, world_size=world_size, device=device, **options)
    if mesh is not None:
        policy.mesh = mesh
    return policy


def _build_allreduce(*, rank: int, world_size: int, device: torch.device, **options: Any) -> Policy:
    return AllreducePolicy(device=device, **options)


def _build_local_sgd(*, rank: int, world_size: int, device: torch.device, **options: Any) -> Policy:
    return LocalSGDPolicy(device=device, **options)


def _build_hierarchical(*, rank: int, world_size: int, device: torch.device, **options: Any) -> Policy:
    return HierarchicalPolicy(device=device, **options)


def _build_wagma(*, rank: int, world_size: int, device: torch.device, **options: Any) -> Policy:
    return WagmaPolicy(device=device, **options)


def _gossip_builder(kind: str) -> Callable[..., Policy]:
    def build(*, rank: int, world_size: int, device: torch.device, **options: Any) -> Policy:
        return GossipPolicy(kind=kind, device=device, **options)

    return build


def _gossip_validator(kind: str) -> Callable[[Mapping[str, Any], int], None]:
    def validate(options: Mapping[str, Any], world_size: int) -> None:
        validate_gossip(kind, options, world_size)

    return validate


def _eager_builder(mode: str) -> Callable[..., Policy]:
    def build(*, rank: int, world_size: int, device: torch.device, **options: Any) -> Policy:
        return EagerPolicy(device=device, **({"mode": mode} | options))

    return build


def _eager_validator(mode: str) -> Callable[[Mapping[str, Any], int], None]:
    def validate(options: Mapping[str, Any], world_size: int) -> None:
        validate_eager(f"eager_{mode}", options, world_size)

    return validate


def _register() -> None:
    register_policy("allreduce", _build_allreduce, validate_allreduce)
    register_policy("local_sgd", _build_local_sgd, validate_local_sgd)
    register_policy("hierarchical", _build_hierarchical, validate_hierarchical)
    register_policy("hierarchical_momentum", _build_hierarchical, validate_hierarchical_momentum)
    register_policy("wagma", _build_wagma, validate_wagma)
    for mode in EAGER_MODES:
        register_policy(f"eager_{mode}", _eager_builder(mode), _eager_validator(mode))
    for kind in GossipPolicy.KINDS:
        register_policy(kind, _gossip_builder(kind), _gossip_validator(kind))


_register()
