"""The look-ahead of the partial hooks' ``late="lookahead"`` (docs/design.md §2.4): backward passes at ``w - c * v``.

Gradients that a partial hook applies ``s`` rounds after they were computed are computed better at the point SGD's
heavy-ball momentum alone carries the model to in those ``s`` steps than at the true weights ``w``:

    ŵ = w - lr * (mu + mu**2 + ... + mu**s) * v        (v: the momentum buffer after the step)

:class:`LookAhead` keeps ``w`` while the parameters hold ``ŵ``: an optimizer step pre-hook puts ``w`` back (the
optimizer, its weight decay and the rounds' results act on ``w``), a post-hook keeps the ``w`` the step computed and
moves the parameters to ``ŵ``. With ``s = 1`` this is SGD with Nesterov momentum whose parameters are the look-ahead
point; with ``s > 1`` it is the weight prediction of delayed-momentum methods (SpecTrain, DANA), not Nesterov.

``late="lookahead_local"`` (``local=True``) also takes the rounds in flight into account, which the point above leaves
out: the steps that will have been taken when a gradient computed now is applied add those rounds' mean gradients,
not known yet; this rank's own gradient of the round it has just sent stands in for each of them (the correction of
delayed gradient averaging, Zhu et al., NeurIPS 2021):

    ŵ = w - lr * mu * v - lr * (1 - dampening) * (g_own + weight_decay * w)                          (s = 1)

where ``g_own`` is this rank's gradient of the round in flight (negated with ``maximize``): exactly the point the
next step reaches if the round's mean equals ``g_own``. For ``s`` rounds the momentum part is as above and the own
step is taken ``c_s`` times (:func:`in_flight_steps`: ``c_1 = 1``, ``c_2 = 2 + mu``), where ``s`` steps that each
apply ``g_own`` carry ``w`` (up to the weight decay of the steps in between). Only where the backward passes run
changes, never what the rounds carry or the optimizer applies.
Both partial hooks (:class:`~wagma.PartialAllreduceState` for DDP, :class:`~wagma.FSDPPartialAllreduce` for FSDP2's
sharded DTensor parameters) hold one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch

from wagma.averaging.tensors import local_tensor
from wagma.checks import check_int

__all__ = ["LATE", "Late", "LookAhead", "in_flight_steps", "lookahead_coefficient"]

#: what a partial hook does about late gradients: apply them as they are, or compute them at the look-ahead point
Late = Literal["apply", "lookahead", "lookahead_local"]
LATE = ("apply", "lookahead", "lookahead_local")

_NEEDS = "torch.optim.SGD with momentum > 0 and nesterov=False"
_WHY = "the look-ahead point is where its heavy-ball momentum carries the model"


def lookahead_coefficient(lr: float, momentum: float, rounds: int) -> float:
    """``lr * (mu + mu**2 + ... + mu**rounds)``: how far along ``-v`` the look-ahead point lies (``rounds = 1``:
    exactly ``lr * mu``)."""
    total, power = 0.0, 1.0
    for _ in range(rounds):
        power *= momentum
        total += power
    return lr * total


def in_flight_steps(momentum: float, rounds: int) -> float:
    """``c_s = sum_{j=1..s} (1 + mu + ... + mu**(j - 1))``: a gradient ``g`` applied at each of ``s`` steps of
    heavy-ball SGD moves the model by ``lr * c_s * g`` in all (``c_1 = 1``, ``c_2 = 2 + mu``)."""
    total, partial, power = 0.0, 0.0, 1.0
    for _ in range(rounds):
        partial += power
        power *= momentum
        total += partial
    return total


class LookAhead:
    """The look-ahead point ``w - lr * (mu + ... + mu**rounds) * v`` of a list of parameters, kept between steps.

    Bound to ``params`` by identity; :meth:`attach` hooks an optimizer that holds every one of them. Between steps
    the parameters hold the look-ahead point and :attr:`anchor` the true weights ``w``; :meth:`restore` puts ``w``
    back (the pre-step hook does), :meth:`weights` reads it. Pickling drops the optimizer and its hooks, keeps the
    anchor.

    Args:
        params: the parameters to move (plain tensors or DTensors; the optimizer's own objects).
        rounds: ``s >= 1``, the rounds of heavy-ball momentum the point looks ahead.
        local: also step by this rank's own gradient of the round in flight (:meth:`hold_local`), ``c_s`` times
            (:func:`in_flight_steps`), as the next ``rounds`` steps would if each round's mean were it
            (``late="lookahead_local"``).

    Raises:
        ValueError: ``rounds`` is not an integer >= 1.
    """

    def __init__(self, params: Iterable[torch.Tensor], rounds: int = 1, *, local: bool = False) -> None:
        self.params = list(params)
        self.rounds = check_int("lookahead_rounds", rounds, 1)
        self.local = bool(local)
        #: local: this rank's gradient of the round in flight, one tensor per parameter, until the next step uses it
        self._held: list[torch.Tensor] | None = None
        #: the true weights while the parameters hold the look-ahead point (None: they hold w)
        self.anchor: list[torch.Tensor] | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._hooks: list[Any] = []
        self._groups: dict[int, dict[str, Any]] = {}  # by id(p): its parameter group (lr read at every step)
        self._unattached = 0  # backward passes counted by counted() without an attached optimizer

    @property
    def attached(self) -> bool:
        """Whether an optimizer is hooked."""
        return self._optimizer is not None

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Hook ``optimizer`` (idempotent for the same one): before each step put ``w`` back, after it keep ``w`` and
        move the parameters to the look-ahead point.

        Raises:
            ValueError: another optimizer is attached, ``optimizer`` lacks one of the parameters (by identity), or
                it is not SGD with momentum > 0 and ``nesterov=False`` in every parameter group holding them.
        """
        if self._optimizer is optimizer:
            return
        if self._optimizer is not None:
            raise ValueError("attach(): another optimizer is attached to this state already")
        if not isinstance(optimizer, torch.optim.SGD):
            raise ValueError(f"optimizer: expected {_NEEDS} ({_WHY}), found {type(optimizer).__name__}")
        self._groups = self._checked_groups(optimizer)
        self._optimizer = optimizer
        self._hooks = [
            optimizer.register_step_pre_hook(lambda *_: self.restore()),
            optimizer.register_step_post_hook(lambda *_: self._look_ahead()),
        ]

    def _checked_groups(self, optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
        """Every parameter's group, by ``id``, each checked: momentum > 0, no Nesterov."""
        groups = {id(p): (i, g) for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        missing = [i for i, p in enumerate(self.params) if id(p) not in groups]
        if missing:
            shapes = ", ".join(f"#{i} {tuple(self.params[i].shape)}" for i in missing[:4])
            raise ValueError(
                f"optimizer: expected every parameter the look-ahead moves (the same objects), found "
                f"{len(missing)} of {len(self.params)} missing: {shapes}{' ...' if len(missing) > 4 else ''}"
            )
        for i, g in {groups[id(p)][0]: groups[id(p)][1] for p in self.params}.items():
            if not g.get("momentum", 0) > 0 or g.get("nesterov"):
                raise ValueError(
                    f"optimizer.param_groups[{i}]: expected {_NEEDS} ({_WHY}), found "
                    f"momentum={g.get('momentum')}, nesterov={g.get('nesterov')}"
                )
        return {id(p): groups[id(p)][1] for p in self.params}

    def hold_local(self, grads: list[torch.Tensor] | None) -> None:
        """``local``: this rank's gradient of the round just sent (one tensor per parameter, in order; kept by
        reference, so the caller must not change them before the step), for the look-ahead after the next step;
        ``None`` drops it (nothing in flight any more). Used by that step's post-hook, then dropped: a step with
        none held (warm-up, after a flush) looks ahead by momentum alone."""
        if grads is not None and len(grads) != len(self.params):
            raise ValueError(
                f"hold_local: expected one gradient per parameter ({len(self.params)}), found {len(grads)}"
            )
        self._held = grads

    @torch.no_grad()
    def _look_ahead(self) -> None:
        """After a step: keep ``w``, move the parameters to ``w - lr * (mu + ... + mu**s) * v`` (``local``: and by
        ``c_s`` steps of the held gradient of the round in flight, as the next ``s`` steps would)."""
        assert self._optimizer is not None
        state = self._optimizer.state
        anchor = [p.detach().clone() for p in self.params]
        held, self._held = self._held, None
        for i, p in enumerate(self.params):
            g = self._groups[id(p)]
            v = state.get(p, {}).get("momentum_buffer")
            if v is not None:
                p.sub_(v, alpha=lookahead_coefficient(g["lr"], g["momentum"], self.rounds))
            if held is not None:
                step = held[i].neg() if g.get("maximize") else held[i]
                if g.get("weight_decay"):
                    step = step.add(anchor[i], alpha=g["weight_decay"])
                p.sub_(step, alpha=g["lr"] * (1 - g.get("dampening", 0)) * in_flight_steps(g["momentum"], self.rounds))
        self.anchor = anchor

    @torch.no_grad()
    def restore(self) -> None:
        """Put the true weights ``w`` back into the parameters (nothing when they hold them already)."""
        if self.anchor is None:
            return
        for p, w in zip(self.params, self.anchor):
            p.copy_(w)
        self.anchor = None

    def weights(self) -> list[torch.Tensor]:
        """The true weights ``w``, one tensor per parameter: the parameters themselves, or the anchor while they
        hold the look-ahead point."""
        return [p.detach() for p in self.params] if self.anchor is None else list(self.anchor)

    def counted(self) -> None:
        """A backward pass ran at the (un)moved parameters: count it when no optimizer is attached yet."""
        self._unattached += self._optimizer is None

    def check_attached(self) -> None:
        """Refuse a backward pass without an attached optimizer after one has run so since the start or a load (a
        resumed loop attaches at its first step, after that iteration's backward pass)."""
        if self._optimizer is None and self._unattached > 0:
            raise RuntimeError(
                "late='lookahead' needs the optimizer: call state.attach(optimizer) once, before the first step"
            )

    def anchor_state(self) -> list[torch.Tensor] | None:
        """For a state_dict: copies of the true weights' local tensors (this rank's shards of DTensors), or None."""
        return None if self.anchor is None else [local_tensor(w).detach().clone() for w in self.anchor]

    def point_state(self) -> list[torch.Tensor] | None:
        """For a state_dict (``local``): copies of the parameters' local tensors while they hold this rank's own
        point, or None."""
        return None if self.anchor is None else [local_tensor(p).detach().clone() for p in self.params]

    def _check_shapes(self, key: str, tensors: list[torch.Tensor]) -> None:
        found = [tuple(w.shape) for w in tensors]
        expected = [tuple(local_tensor(p).shape) for p in self.params]
        if len(found) != len(expected):
            raise ValueError(
                f"state[{key!r}]: expected one tensor per reduced parameter ({len(expected)}), found {len(found)}"
            )
        for i, (want, have) in enumerate(zip(expected, found)):
            if want != have:
                raise ValueError(
                    f"state[{key!r}][{i}]: expected the shape of reduced parameter {i}, {list(want)}, "
                    f"found {list(have)}"
                )

    @torch.no_grad()
    def load_anchor(self, anchor: list[torch.Tensor] | None, point: list[torch.Tensor] | None = None) -> None:
        """Restore :meth:`anchor_state`'s tensors (the parameters hold the look-ahead point of a checkpoint) and,
        given :meth:`point_state`'s, put this rank's point back into the parameters."""
        self._unattached = 0
        self._held = None
        if anchor is None:
            return
        self._check_shapes("anchor", anchor)
        if point is not None:
            self._check_shapes("point", point)
        restored = [p.detach().clone() for p in self.params]
        for w, value in zip(restored, anchor):
            local_tensor(w).copy_(value)
        for p, value in zip(self.params, point or []):
            local_tensor(p).copy_(value)
        self.anchor = restored

    def detach(self) -> None:
        """Remove the optimizer's hooks (the parameters stay where they are); idempotent."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__ | {"_optimizer": None, "_hooks": [], "_groups": {}, "_held": None}
