"""The seam where an averaging policy plugs into the training loop, and the plain-DDP policy.

A :class:`Policy` decides how the ranks' replicas are kept in agreement: by averaging gradients in a
DDP comm hook (eager-SGD, plain allreduce), by averaging models after optimizer steps (WAGMA-SGD, K-AVG,
hierarchical averaging), or both. The loop in :mod:`wagma.app.train` knows nothing else about it.

Policies are registered by name (:func:`register_policy`) and built from the ``averaging`` config group
by :func:`build_policy`; :func:`validate_policy_config` checks a config before any rank starts training.
``allreduce`` (:class:`AllreducePolicy`, DDP's own bucketed allreduce) is defined here; the others live in
:mod:`wagma.app.policies` and are registered when this module is imported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "AllreducePolicy", "known_policies", "Policy", "build_policy", "register_policy", "validate_policy_config",
]


class Policy:
    """How replicas are kept in agreement. The loop drives it in this order:

    1. ``model = policy.wrap(model)`` once, after the initial model was broadcast from rank 0 and before
       the optimizer is built (the optimizer gets the *unwrapped* module's parameters, which a wrapper
       shares). Return a DDP wrapper with or without a comm hook, or the module itself.
    2. ``policy.load_state_dict(state)`` when resuming, with what :meth:`state_dict` returned at the
       checkpoint.
    3. Every step ``step`` (0-based, counting optimizer steps of the whole run), after ``loss.backward()``
       on the wrapped model: ``policy.before_step(optimizer, step)``, ``optimizer.step()``,
       ``policy.after_step(optimizer, step)``. Model averaging goes in one of the two ("average then
       step" or "step then average"); gradient averaging lives in the comm hook installed by ``wrap``.
    4. ``policy.stats()`` whenever the loop logs: JSON-able numbers. The loop records ``global_reductions``
       (cumulative count of global averaging rounds) and ``staleness`` (rounds by which the latest
       contributions were old; 0 when synchronous) when present, and every other key as is.
    5. At the end: a checkpoint (with :meth:`state_dict`), then ``policy.finalize(model, optimizer)``
       (a final global average, or flushing outstanding rounds) before the test evaluation and the final
       model are taken, then ``policy.close()``. ``close`` is also called when training fails; it must
       stop any thread the policy started and be safe to call twice.

    Every rank builds its policy in the same order, so a policy may create process groups in its
    constructor (all ranks, same order); it must never create them lazily.
    """

    name: str = ""

    def wrap(self, model: nn.Module) -> nn.Module:
        """Wrap the (broadcast) model for training; default: no wrapper."""
        return model

    def before_step(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Called after backward, before ``optimizer.step()``; default: nothing."""

    def after_step(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Called after ``optimizer.step()``; default: nothing."""

    def finalize(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Bring the replicas to the model to evaluate and keep; default: nothing."""

    def state_dict(self) -> dict[str, Any]:
        """Opaque state to checkpoint (counters, residuals, schedule position); default: empty.

        Plain containers, numbers, strings and tensors only: checkpoints load with ``weights_only=True``.
        """
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; default: nothing."""

    def stats(self) -> dict[str, Any]:
        """Counters for the metrics (see the class docstring); default: empty."""
        return {}

    def close(self) -> None:
        """Release threads and resources (idempotent); default: nothing."""


class AllreducePolicy(Policy):
    """Synchronous data parallelism: DDP's bucketed gradient allreduce, one global reduction per step."""

    name = "allreduce"

    def __init__(self, *, device: torch.device, bucket_cap_mb: float = 25.0) -> None:
        """
        Args:
            device: where the model lives; a CUDA device is passed to DDP as its only device.
            bucket_cap_mb: DDP's gradient bucket size.
        """
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        self.device = device
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.global_reductions = 0

    def wrap(self, model: nn.Module) -> nn.Module:
        device_ids = [self.device] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=self.bucket_cap_mb)

    def after_step(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        self.global_reductions += 1  # the gradients of this step were allreduced inside backward()

    def state_dict(self) -> dict[str, Any]:
        return {"global_reductions": self.global_reductions}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.global_reductions = int(state["global_reductions"])

    def stats(self) -> dict[str, Any]:
        return {"global_reductions": self.global_reductions, "staleness": 0}


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


def _build_allreduce(*, rank: int, world_size: int, device: torch.device, **options: Any) -> Policy:
    return AllreducePolicy(device=device, **options)


def _validate_allreduce(options: Mapping[str, Any], world_size: int) -> None:
    unknown = set(options) - {"bucket_cap_mb"}
    if unknown:
        raise ValueError(f"averaging 'allreduce' takes only bucket_cap_mb, got {sorted(unknown)}")
    if float(options.get("bucket_cap_mb", 25.0)) <= 0:
        raise ValueError(f"averaging.bucket_cap_mb must be > 0, got {options['bucket_cap_mb']}")


register_policy("allreduce", _build_allreduce, _validate_allreduce)


def known_policies() -> tuple[str, ...]:
    """Names of the registered policies, sorted."""
    return tuple(sorted(_POLICIES))


_NON_NEGATIVE_SUFFIXES = ("period", "_every", "_steps")


def validate_policy_config(cfg: Mapping[str, Any], world_size: int) -> None:
    """Check an ``averaging`` config for ``world_size`` ranks without building anything.

    Checks that hold for every policy: the name is registered; a ``group_size`` is positive and divides
    the world size; every integer whose key ends in ``period``, ``_every`` or ``_steps`` is >= 0. Then the
    policy's own validator runs.

    Raises:
        ValueError: naming the offending key, its value and what was expected.
    """
    options = dict(cfg)
    name = options.pop("name", None)
    if name not in _POLICIES:
        raise ValueError(f"unknown averaging policy {name!r}; known policies: {', '.join(known_policies())}")
    group_size = options.get("group_size")
    if group_size is not None and (int(group_size) < 1 or world_size % int(group_size) != 0):
        raise ValueError(
            f"averaging.group_size={group_size} must be a positive divisor of the world size {world_size}; "
            "pick a group size that divides the number of ranks"
        )
    for key, value in options.items():
        if key.endswith(_NON_NEGATIVE_SUFFIXES) and isinstance(value, (int, float)) and value < 0:
            raise ValueError(f"averaging.{key} must be >= 0, got {value}")
    validator = _POLICIES[name].validate
    if validator is not None:
        validator(options, world_size)


def build_policy(cfg: Mapping[str, Any], *, rank: int, world_size: int, device: torch.device) -> Policy:
    """Build the policy ``cfg["name"]`` with the config's other entries as options (validated first).

    Raises:
        ValueError: for an unknown name or invalid options.
    """
    validate_policy_config(cfg, world_size)
    options = {k: v for k, v in dict(cfg).items() if k != "name"}
    return _POLICIES[str(cfg["name"])].build(rank=rank, world_size=world_size, device=device, **options)


# The other built-in policies (local_sgd, hierarchical, hierarchical_momentum, wagma, eager_*) live in
# wagma.app.policies, which imports this module; importing it here, after everything above exists, registers
# them whenever wagma.app.policy is imported, whichever of the two modules is imported first.
from wagma.app import policies as _builtin_policies  # noqa: E402, F401
