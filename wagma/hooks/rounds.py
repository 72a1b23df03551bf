"""The rounds behind both partial hooks (DDP's :mod:`wagma.hooks.partial`, FSDP2's :mod:`wagma.hooks.fsdp`): the
engine's set-up (:func:`eager_engine`) and the flush's sum of the residuals (:func:`sum_residuals`)."""

from __future__ import annotations

import datetime
from typing import Literal, Protocol

import torch
import torch.distributed as dist

from wagma.engine import AccumulatingGroupAllreduce
from wagma.schedule import GroupSchedule
from wagma.world import World

__all__ = ["MODES", "EagerSettings", "Mode", "eager_engine", "sum_residuals"]

Mode = Literal["solo", "majority"]
MODES = ("solo", "majority")


class EagerSettings(Protocol):
    """What :func:`eager_engine` reads off a partial hook's state (DDP's or FSDP2's): its checked arguments, its
    world, and how many backward passes it has run."""

    world: World
    mode: Mode
    sync_period: int
    max_lead: int | None
    timeout: datetime.timedelta
    seed: int
    progress_nice: int
    error_feedback: bool
    iteration: int
    warmup_iters: int


def eager_engine(
    residual: torch.Tensor,
    hook: EagerSettings,
    *,
    wire_dtype: torch.dtype | None,
    transport: str = "default",
) -> AccumulatingGroupAllreduce:
    """The engine behind both partial hooks (DDP's and FSDP2's): one group of every rank of ``hook.world``,
    accumulating (a contribution that misses a round stays in ``residual`` for the next), triggered by any rank
    (``"solo"``) or by the round's initiator (``"majority"``), starting at the round of ``hook.iteration`` (after the
    warm-up; a resumed run's)."""
    schedule = GroupSchedule.from_partitions([[list(range(hook.world.size))]], name="global")
    return AccumulatingGroupAllreduce(
        schedule,
        residual,
        sync_period=hook.sync_period,
        max_lead=hook.max_lead,
        timeout=hook.timeout,
        trigger="any" if hook.mode == "solo" else "initiator",
        seed=hook.seed,
        start_round=max(0, hook.iteration - hook.warmup_iters),
        progress_nice=hook.progress_nice,
        transport=transport,
        world=hook.world,
        wire_dtype=wire_dtype,
        error_feedback=hook.error_feedback,
    )


def sum_residuals(
    residual: torch.Tensor,
    group: dist.ProcessGroup,
    timeout: datetime.timedelta,
    in_flight: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The flush of the partial hooks: every rank's ``residual`` summed over ``group`` (plus ``in_flight``, a sum
    that is the same on every rank), or ``None`` when all of them were zero.

    One collective carries the residual and a count of the ranks whose residual is not empty, so that ranks with
    nothing left agree, without a second collective, to leave their parameters untouched.
    """
    payload = torch.cat([residual, residual.ne(0).any().to(residual.dtype).reshape(1)])
    dist.all_reduce(payload, group=group, async_op=True).wait(timeout)
    if in_flight is not None:
        payload[:-1].add_(in_flight)
        payload[-1] += float(bool(in_flight.ne(0).any()))
    return None if payload[-1].item() == 0 else payload[:-1]
