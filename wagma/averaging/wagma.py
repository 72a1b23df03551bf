"""WAGMA-SGD: wait-avoiding group model averaging (DESIGN §2.2), on the engine of :mod:`wagma.engine`.

Each call of :meth:`WagmaAverager.average_parameters` is one round r of the engine. On an async round the
rank's group G (S members, itself included) has exchanged what each member had published when the
exchange started at that member, and the rank mixes with its fresh model::

    reference mixing:  a = (w + sum_{j in G} w_hat_j) / (S + 1)
    mean mixing:       a = sum_{j in G} w_hat_j / S         (when this rank's contribution was fresh)

A rank whose fresh model made it into the exchange counts itself twice in the reference mixing; a late rank
counts its stale snapshot once and its fresh model once, so nothing it computed is lost. Under mean mixing a
fully fresh group ends identical; a late rank there falls back to the reference form, for the same reason.
Every ``(sync_period + 1)``-th round is a blocking global mean of fresh models: all replicas become equal.

The model passed at construction is published right away: until a rank's first call, that is what its
progress thread contributes (never zeros).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist

from wagma.averaging.base import AveragerBase, ParamsLike, Reduction, check_int
from wagma.averaging.groups import DEFAULT_TIMEOUT, require_initialized
from wagma.engine import WaitAvoidingGroupAllreduce
from wagma.kernels import wagma_combine_
from wagma.schedule import GroupSchedule, check_group_fits

__all__ = ["ORDERS", "WagmaAverager"]

Mixing = Literal["reference", "mean"]
Order = Literal["average_then_step", "step_then_average"]
#: "average_then_step" (the reference): gradient at w_t, average w_t, then the optimizer step applies the
#: gradient to the average. "step_then_average": the step first, then the average (torch's post-local-SGD).
ORDERS: tuple[str, ...] = ("average_then_step", "step_then_average")
_SCHEDULE_KINDS = ("auto", "butterfly", "mixed_radix")


class WagmaAverager(AveragerBase):
    """WAGMA-SGD model averaging: wait-avoiding group averages with a global average every ``sync_period + 1`` rounds.

    Construct it on every rank, in the same order (it creates its communicators and starts a progress
    thread), with the model already identical on all ranks (broadcast from rank 0). Then call
    :meth:`average_parameters` once per optimizer step, before or after ``optimizer.step()`` as
    ``order`` says (:class:`~wagma.averaging.AveragingOptimizer` and the training application follow it).

    Args:
        group_size: S, ranks per averaging group; must divide the world size (a larger one is refused
            as such). ``S`` equal to the world size is allowed and means one group of every rank: every
            round is then a wait-avoiding *global* average (the progress thread still lets a late rank
            contribute its snapshot), not a group average; the sync rounds differ only in being blocking
            and fully fresh.
        sync_period: rounds between blocking global averages (every ``(sync_period + 1)``-th round is one;
            0: every round). Also bounds staleness.
        params: the model's parameters (``model.parameters()``, tensors or ``optimizer.param_groups``),
            published at once as this rank's first contribution.
        buffers: e.g. ``model.buffers()``; floating-point ones are averaged too when ``average_buffers``.
        schedule: ``"auto"`` (butterfly when P is a power of S, else mixed radix), ``"butterfly"``,
            ``"mixed_radix"``, a :class:`~wagma.GroupSchedule`, or explicit partitions (one per round).
        mixing: ``"reference"`` ((w + group sum) / (S + 1)) or ``"mean"`` (group sum / S when fresh).
        order: ``"average_then_step"`` (the reference) or ``"step_then_average"``; informs callers.
        average_buffers: average floating-point buffers with the parameters.
        max_lead: rounds the progress thread may run ahead of its main thread (default ``sync_period``).
        timeout: bound of every wait (collectives, the wait for a round's result).
    """

    def __init__(
        self,
        group_size: int,
        sync_period: int,
        *,
        params: ParamsLike,
        buffers: Iterable[torch.Tensor] | None = None,
        schedule: str | GroupSchedule | Sequence[Sequence[Sequence[int]]] = "auto",
        mixing: Mixing = "reference",
        order: Order = "average_then_step",
        average_buffers: bool = True,
        max_lead: int | None = None,
        timeout: datetime.timedelta | float = DEFAULT_TIMEOUT,
    ) -> None:
        group_size = check_int("group_size", group_size, 1)
        sync_period = check_int("sync_period", sync_period, 0)
        if mixing not in ("reference", "mean"):
            raise ValueError(f"mixing: expected 'reference' or 'mean', found {mixing!r}")
        if order not in ORDERS:
            raise ValueError(f"order: expected one of {ORDERS}, found {order!r}")
        if max_lead is not None:
            max_lead = check_int("max_lead", max_lead, 0)
            if max_lead > sync_period:
                raise ValueError(f"max_lead: expected at most sync_period={sync_period}, found {max_lead}")
        # Checked before any group exists, so a bad size leaves no rank inside a collective group creation.
        require_initialized(type(self).__name__)
        world = dist.get_world_size()
        check_group_fits(group_size, world)
        if world % group_size:
            raise ValueError(f"group_size: expected a divisor of the world size {world}, found {group_size}")
        super().__init__(None, average_buffers=average_buffers, timeout=timeout)
        self.group_size = group_size
        self.sync_period = sync_period
        self.mixing: Mixing = mixing
        self.order: Order = order
        self.max_lead = max_lead
        self.schedule = _build_schedule(schedule, self.world_size, group_size)
        self._tensors = self.tensors_to_average(params, buffers)
        if not self._tensors:
            raise ValueError("params: expected at least one tensor to average, found none")
        self._engines: list[WaitAvoidingGroupAllreduce] = []  # one per flat buffer, also in the finalizer's list
        self._start_engines(0)

    def _start_engines(self, start_round: int) -> None:
        """One engine per flat (dtype, device) buffer, each publishing the current model.

        Half-precision buffers (float16, bfloat16) run their engine in float32: a group sum of S models
        would overflow float16 (or lose bfloat16's few bits) before the division.
        """
        self._close_engines()
        self._engines[:] = [
            WaitAvoidingGroupAllreduce(
                self.schedule, _wide(buffer), sync_period=self.sync_period, max_lead=self.max_lead,
                timeout=self.timeout, start_round=start_round,
            )
            for buffer in self.flat_buffers(self._tensors).pack()
        ]
        self._resources.closers[:] = list(self._engines)

    def _close_engines(self) -> None:
        engines, self._engines[:] = list(self._engines), []
        self._resources.closers[:] = []
        for engine in engines:
            engine.close()

    def _average_step(self, tensors: list[torch.Tensor]) -> Reduction | None:
        flat = self.flat_buffers(tensors)
        if len(flat.buffers) != len(self._engines):  # unreachable while tensors come bound; kept as a guard
            raise RuntimeError(
                f"WagmaAverager: expected the {len(self._engines)} dtype/device buffer(s) of the bound model, "
                f"found {len(flat.buffers)}; call bind() on every rank to change the parameters"
            )
        results = []
        for buffer, engine in zip(flat.pack(), self._engines):
            wide = _wide(buffer)
            res = engine(wide)
            results.append(res)
            size = len(res.group)
            if res.is_sync or (self.mixing == "mean" and res.fresh):
                wide.copy_(res.sum).div_(size)
            else:
                wagma_combine_(wide, res.sum, float(size + 1))
            if wide is not buffer:
                buffer.copy_(wide)
        # One round is one reduction, however many dtype buffers carry it; all engines run the same round.
        first = results[0]
        kind: Reduction = "global" if first.is_sync else "local"
        self.stats.record_reduction(kind, flat.nbytes, sum(r.wait_s for r in results))
        self.stats.record_contribution(first.staleness)
        flat.unpack()
        return kind

    def bind(self, params: ParamsLike, buffers: Iterable[torch.Tensor] | None = None) -> None:
        """Average another set of tensors from now on: rebind and restart the engines at this step.

        Collective: every rank calls it at the same step (it creates communicators), with the model
        identical across ranks or at least as each rank wants to publish it.
        """
        super().bind(params, buffers)
        assert self._binding is not None
        self._tensors = self._binding.tensors
        self._start_engines(self.step)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the step and counters (``state_dict()`` is the base's: the round to continue from is the
        step) and restart the engines at that round.

        Collective: every rank calls it, in the same order, with the same step (it creates communicators).
        The model as it is now (load the checkpoint's parameters first) is what each rank publishes.
        """
        self._check_open()
        super().load_state_dict(state_dict)
        self._start_engines(self.step)

    def close(self) -> None:
        """Stop the progress threads and release the communicators; idempotent.

        Without ``close()``, the base's finalizer does the same when the averager is dropped or the
        interpreter exits.
        """
        super().close()


def _wide(buffer: torch.Tensor) -> torch.Tensor:
    """``buffer`` itself, or a float32 copy of a half-precision one (what its engine sums)."""
    return buffer.float() if buffer.dtype in (torch.float16, torch.bfloat16) else buffer


def _build_schedule(
    schedule: str | GroupSchedule | Sequence[Sequence[Sequence[int]]], world_size: int, group_size: int
) -> GroupSchedule:
    if isinstance(schedule, GroupSchedule):
        if schedule.world_size != world_size:
            raise ValueError(f"schedule: expected one for {world_size} ranks, found one for {schedule.world_size}")
        return schedule
    if isinstance(schedule, str):
        if schedule not in _SCHEDULE_KINDS:
            raise ValueError(f"schedule: expected one of {_SCHEDULE_KINDS} or a GroupSchedule, found {schedule!r}")
        return GroupSchedule.create(schedule, world_size, group_size)
    return GroupSchedule.from_partitions(schedule)
