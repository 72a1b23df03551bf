"""Reduction momentum: a momentum step on the models' progress between reductions (docs/design.md §2.5).

At a reduction, with ``a`` the model right after the previous reduction (the *anchor*) and ``x̄`` the new
average::

    Δ = x̄ − a;   v ← μ·v + Δ;   a ← a + lr·v        (Nesterov: a ← a + lr·(μ·v + Δ))

and every participant continues from ``a``. This is the family of BMUF block momentum and SlowMo (slow
learning rate ``lr``); Cong et al. call it reduction momentum. :func:`reduction_momentum_update_` is the
torch reference of the update on flat buffers (a fused kernel may replace it; it stays the oracle).
"""

from __future__ import annotations

import dataclasses
from types import TracebackType
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging.averagers import ModelAverager

from wagma.averaging.base import AveragerBase, AveragerStats, Reduction
from wagma.averaging.tensors import BuffersLike, FlatBuffers, ParameterBinding, ParamsLike, collect_named, local_tensor
from wagma.checks import check_bool, check_choice, check_number

__all__ = ["MomentumLevels", "ReductionMomentum", "reduction_momentum_update_"]

#: Which reductions get momentum: only global ones, or local ones too (each level with its own state).
MomentumLevels = Literal["global", "all"]


def reduction_momentum_update_(
    average: torch.Tensor,
    anchor: torch.Tensor,
    velocity: torch.Tensor,
    *,
    momentum: float,
    lr: float,
    nesterov: bool,
) -> None:
    """One reduction-momentum update, in place, on flat tensors of one dtype and device.

    Args:
        average: ``x̄`` on entry; on return the new anchor (the model to continue from).
        anchor: ``a`` on entry, the new ``a`` on return.
        velocity: ``v`` on entry, the new ``v`` on return.
        momentum: ``μ`` in [0, 1).
        lr: outer learning rate (> 0).
        nesterov: use ``a + lr·(μ·v + Δ)`` instead of ``a + lr·v``.
    """
    delta = average.sub_(anchor)  # reuse x̄'s storage for Δ; it is overwritten with a below
    velocity.mul_(momentum).add_(delta)
    if nesterov:
        anchor.add_(velocity, alpha=lr * momentum).add_(delta, alpha=lr)
    else:
        anchor.add_(velocity, alpha=lr)
    average.copy_(anchor)


@dataclasses.dataclass
class _LevelState:
    """Momentum state of one level, one tensor per flat buffer of the parameters."""

    anchor: list[torch.Tensor] | None = None
    velocity: list[torch.Tensor] | None = None
    established: bool = False  # set by the level's first reduction; until then the anchor follows the model


class ReductionMomentum(ModelAverager):
    """Wraps a synchronous averager and applies reduction momentum at its reductions.

    Anchors, per level (the anchor is the model a level's participants last had in common):

    - **global**: the model right after the previous *global* reduction, identical on all ranks. Local
      reductions in between do not move it, so a global ``Δ`` measures all progress since the last global
      reduction (local steps and local averages together). With ``apply_to="global"`` local reductions
      just average.
    - **local** (``apply_to="all"``): the model right after the previous reduction of *any* level that
      this rank's group took part in, identical inside the group. A local reduction applies momentum with
      the local velocity; a global reduction applies the global momentum and then resets the local anchor
      to the new global model (the group's latest common point). The local velocity is kept across global
      reductions: it is the group's own buffer.

    Initialisation: the anchors are taken from the parameters at the first call and follow the parameters
    at every call without a reduction of their level until that level's first reduction (in a DDP
    warm-up, the model after the last synchronous step); models must then be identical across ranks,
    which DDP guarantees. If the very first call already reduces (no warm-up), there is no common earlier
    model: that reduction only sets the anchors to ``x̄`` with zero velocity. Momentum acts on
    parameters only; averaged buffers keep the plain average.

    Parameters are bound by identity at the first call (see :class:`AveragerBase`): later calls may list
    them in any order and the anchors and velocities still pair with the same parameters; another set
    raises ``ValueError`` (use :meth:`bind`, which also starts the momentum state afresh).

    ``step``, ``order``, ``stats``, ``last_reduction``, ``process_group`` and ``close`` are the wrapped averager's;
    closing the wrapper closes it.

    Args:
        averager: a synchronous averager (:class:`PeriodicAverager`, :class:`HierarchicalAverager`, ...).
        momentum: ``μ`` in [0, 1).
        lr: outer learning rate (> 0); 1 makes a plain average when ``μ = 0``.
        nesterov: Nesterov update ``a ← a + lr·(μ·v + Δ)``.
        apply_to: ``"global"`` (only global reductions) or ``"all"`` (local ones too, with their own state).
    """

    def __init__(
        self,
        averager: AveragerBase,
        momentum: float,
        lr: float = 1.0,
        nesterov: bool = False,
        apply_to: MomentumLevels = "global",
    ) -> None:
        check_number("momentum", momentum, 0.0, 1.0, below=True)
        check_number("lr", lr, 0.0, above=True)
        check_bool("nesterov", nesterov)
        check_choice("apply_to", apply_to, ("global", "all"))
        if not isinstance(averager, AveragerBase):
            raise ValueError(
                f"averager: expected a wagma AveragerBase (PeriodicAverager, HierarchicalAverager, ...), "
                f"found {type(averager).__name__}"
            )
        # ModelAverager.__init__ is not called: step and process_group are the wrapped averager's.
        self.averager = averager
        self.momentum = float(momentum)
        self.lr = float(lr)
        self.nesterov = nesterov
        self.apply_to: MomentumLevels = apply_to
        self._levels: dict[str, _LevelState] = {"global": _LevelState()}
        if apply_to == "all":
            self._levels["local"] = _LevelState()
        self._flat: FlatBuffers | None = None
        self._binding: ParameterBinding | None = None
        self._saved_signature: list[Any] | None = None  # from load_state_dict, until the next bind

    # -- the wrapped averager's view --------------------------------------------------------------------

    @property
    def step(self) -> int:
        """The wrapped averager's step counter."""
        return self.averager.step

    @step.setter
    def step(self, value: int) -> None:
        self.averager.step = value

    @property
    def process_group(self) -> dist.ProcessGroup | None:  # type: ignore[override]
        """The wrapped averager's global group."""
        return self.averager.process_group

    @property
    def order(self) -> str:
        """The wrapped averager's ``order`` (``"step_then_average"`` for averagers without one).

        Passed through so that :class:`~wagma.averaging.AveragingOptimizer` and the training policies run
        a wrapped :class:`~wagma.averaging.WagmaAverager` in the order it was built with.
        """
        return str(getattr(self.averager, "order", "step_then_average"))

    @property
    def stats(self) -> AveragerStats:
        """The wrapped averager's counters."""
        return self.averager.stats

    @property
    def last_reduction(self) -> Reduction | None:
        """The kind of reduction the last call ran."""
        return self.averager.last_reduction

    # -- averaging --------------------------------------------------------------------------------------

    def average_parameters(self, params: ParamsLike, buffers: BuffersLike | None = None) -> Reduction | None:
        """Run the wrapped averager's step, then the momentum update if it reduced at a momentum level.

        Args:
            params: ``model.parameters()``, a list of tensors, or ``optimizer.param_groups``.
            buffers: passed on to the wrapped averager (averaged there if it averages buffers).

        Returns:
            The kind of reduction the wrapped averager ran (``None``, ``"local"`` or ``"global"``).
        """
        tensors, names = collect_named(params)
        if self._binding is None:
            saved, self._saved_signature = self._saved_signature, None
            self._binding = (
                ParameterBinding(tensors, names) if saved is None else ParameterBinding.like(tensors, names, saved)
            )
        tensors = self._binding.arrange(tensors, names, where="ReductionMomentum.average_parameters")
        kind = self.averager.average_parameters(tensors, buffers)
        if kind not in self._levels and all(level.established for level in self._levels.values()):
            return kind  # nothing to update (a global reduction always has a level)
        self._flat = flat = FlatBuffers.reuse_or_build(self._flat, [local_tensor(t) for t in tensors])
        values = flat.pack()  # the model after the wrapped averager: x̄ at a reduction
        if kind is not None and kind in self._levels:
            level = self._levels[kind]
            if level.anchor is None:
                # First call and already a reduction: x̄ is the first model all participants share.
                level.anchor = [v.clone() for v in values]
                level.velocity = [torch.zeros_like(v) for v in values]
            else:
                self._check_layout(kind, level, flat)
                if level.velocity is None:
                    level.velocity = [torch.zeros_like(v) for v in values]
                for x, a, v in zip(values, level.anchor, level.velocity):
                    reduction_momentum_update_(x, a, v, momentum=self.momentum, lr=self.lr, nesterov=self.nesterov)
                flat.unpack()
            level.established = True
        if kind == "global" and "local" in self._levels:
            # The group's latest common model is now the global one.
            local = self._levels["local"]
            local.anchor = [v.clone() for v in values]
            local.established = True
            if local.velocity is None:
                local.velocity = [torch.zeros_like(v) for v in values]
        for name, level in self._levels.items():
            if not level.established and name != kind:
                level.anchor = [v.clone() for v in values]
        return kind

    def synchronize(self, params: ParamsLike, buffers: BuffersLike | None = None) -> None:
        """The wrapped averager's blocking global mean (no momentum; anchors are left as they are)."""
        self.averager.synchronize(params, buffers)

    def bind(self, params: ParamsLike, buffers: BuffersLike | None = None) -> None:
        """Rebind the wrapped averager and the momentum to these tensors; the momentum state starts afresh.

        Every rank must call it at the same step.
        """
        self.averager.bind(params, buffers)
        self._binding = ParameterBinding(*collect_named(params))
        self._flat = None
        self._levels = {name: _LevelState() for name in self._levels}

    def _check_layout(self, name: str, level: _LevelState, flat: FlatBuffers) -> None:
        layout = flat.layout()
        assert level.anchor is not None
        found = [(t.dtype, t.device, t.numel()) for t in level.anchor]
        if found != layout:
            # Same sizes on another device (a checkpoint loaded on CPU): move the state over.
            if [(d, n) for d, _, n in found] == [(d, n) for d, _, n in layout]:
                level.anchor = [t.to(device) for t, (_, device, _) in zip(level.anchor, layout)]
                if level.velocity is not None:
                    level.velocity = [t.to(device) for t, (_, device, _) in zip(level.velocity, layout)]
                return
            raise RuntimeError(
                f"ReductionMomentum: the {name} momentum state was built for buffers {found}, but the parameters "
                f"now flatten to {layout}; pass the same parameters every step"
            )

    # -- state and lifetime ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``{"averager", "levels": {level: {"anchor", "velocity", "established"}}, "params"}`` (copies).

        ``"params"`` is the binding's (name, shape, dtype) per parameter, in the order the flat state
        follows, so that a resumed run can pair the state with its parameters by name.
        """

        def copy(tensors: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
            return None if tensors is None else [t.detach().clone() for t in tensors]

        return {
            "averager": self.averager.state_dict(),
            "levels": {
                name: {"anchor": copy(s.anchor), "velocity": copy(s.velocity), "established": s.established}
                for name, s in self._levels.items()
            },
            "params": self._binding.signature() if self._binding is not None else self._saved_signature,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, into a wrapper with the same ``apply_to``.

        Raises:
            ValueError: if keys are missing or the checkpoint has other momentum levels.
        """
        if not {"averager", "levels"} <= set(state_dict) <= {"averager", "levels", "params"}:
            raise ValueError(
                f"state_dict: expected the keys ['averager', 'levels', 'params'], found {sorted(state_dict)}"
            )
        levels = state_dict["levels"]
        if set(levels) != set(self._levels):
            raise ValueError(
                f"state_dict: expected momentum levels {sorted(self._levels)} (apply_to={self.apply_to!r}), "
                f"found {sorted(levels)}"
            )
        self.averager.load_state_dict(state_dict["averager"])
        # The next call binds the parameters in the order the saved flat state follows.
        self._binding, self._flat = None, None
        self._saved_signature = state_dict.get("params")
        for name, saved in levels.items():
            self._levels[name] = _LevelState(
                anchor=None if saved["anchor"] is None else [t.detach().clone() for t in saved["anchor"]],
                velocity=None if saved["velocity"] is None else [t.detach().clone() for t in saved["velocity"]],
                established=bool(saved["established"]),
            )

    def close(self) -> None:
        """Close the wrapped averager; idempotent."""
        self.averager.close()

    def __enter__(self) -> ReductionMomentum:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"ReductionMomentum({self.averager!r}, momentum={self.momentum}, lr={self.lr}, "
            f"nesterov={self.nesterov}, apply_to={self.apply_to!r})"
        )
