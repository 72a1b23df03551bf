"""K-step averaging (K-AVG): local optimizer steps, a global model average every ``period`` steps."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from wagma.averaging.base import AveragerBase, Reduction
from wagma.checks import check_int
from wagma.groups import DEFAULT_TIMEOUT
from wagma.wire import WireDtype
from wagma.world import WorldLike

__all__ = ["PeriodicAverager"]


class PeriodicAverager(AveragerBase):
    """Global mean of the model every ``period`` steps after ``warmup_steps`` (K-AVG; docs/design.md §2.5).

    Step semantics are those of torch's ``PeriodicModelAverager``: the call with ``step`` averages iff
    ``step >= warmup_steps`` and ``(step - warmup_steps) % period == 0`` (so the first call after the
    warm-up averages). ``period=1`` is synchronous model averaging every step. Unlike torch's averager,
    parameters without a ``.grad`` are averaged too, and buffers can be (see :class:`AveragerBase`).

    Args:
        period: steps between global averages (K); at least 1.
        warmup_steps: calls before the first average (during warm-up, DDP usually averages gradients);
            at least 0.
        process_group: group of the global mean; ``None`` creates a timeout-bound group over all ranks.
        average_buffers: also average the floating-point buffers passed to ``average_parameters``.
        timeout: timeout of the group this averager creates (``timedelta`` or seconds).
        world: the ranks to average over (:func:`wagma.world.as_world`; ``None``: the whole job).
        wire_dtype: the dtype averages send and sum in (:mod:`wagma.wire`; ``None``: the model's own): deltas from
            the previous average, in ``"bf16"`` or ``"fp16"``, half the bytes; replicas stay bit for bit equal.
    """

    def __init__(
        self,
        period: int,
        warmup_steps: int = 0,
        process_group: dist.ProcessGroup | None = None,
        *,
        average_buffers: bool = True,
        timeout: datetime.timedelta | float = DEFAULT_TIMEOUT,
        world: WorldLike = None,
        wire_dtype: WireDtype = None,
    ) -> None:
        self.period = check_int("period", period, 1)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        super().__init__(
            process_group, average_buffers=average_buffers, timeout=timeout, world=world, wire_dtype=wire_dtype
        )

    def reduction_at(self, step: int) -> Reduction | None:
        """The reduction the call with this ``step`` runs: ``"global"`` or ``None``."""
        if step >= self.warmup_steps and (step - self.warmup_steps) % self.period == 0:
            return "global"
        return None

    def _average_step(self, tensors: list[torch.Tensor]) -> Reduction | None:
        kind = self.reduction_at(self.step)
        if kind is not None:
            self.allreduce_mean(tensors, self.process_group, kind)
        return kind

    def __repr__(self) -> str:
        return f"PeriodicAverager(period={self.period}, warmup_steps={self.warmup_steps}, step={self.step})"
