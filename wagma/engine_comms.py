"""The engine's communicators and the priority of the threads that use them.

:func:`communicators` creates one process group per group of this rank in a schedule and one over its whole world,
on every rank in the same order (docs/design.md §2.1); :func:`run_niced` runs that creation on a thread nicer than
the caller's, so that the communicators' own threads inherit the progress thread's priority.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from wagma.schedule import GroupSchedule
from wagma.world import World

__all__ = ["PER_THREAD_NICE", "communicators", "renice_current_thread", "run_niced"]

#: Whether a thread's nice value is its own (Linux: ``setpriority(PRIO_PROCESS, tid)`` changes one thread).
PER_THREAD_NICE = sys.platform.startswith("linux")
_T = TypeVar("_T")


def renice_current_thread(increment: int) -> None:
    """Make the calling thread ``increment`` nice levels nicer (capped at 19); threads it starts inherit that.

    Linux only (elsewhere a nice value belongs to the whole process); raising a nice value needs no privilege.
    """
    tid = threading.get_native_id()
    os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))


def run_niced(increment: int, fn: Callable[[], _T], deadline_s: float) -> _T:
    """``fn()``, run on a helper thread ``increment`` nice levels nicer than the caller (at once if 0).

    Raises:
        TimeoutError: if ``fn`` has not returned after ``deadline_s`` (the helper is left behind, a daemon).
    """
    if not increment:
        return fn()
    box: list[tuple[bool, object]] = []

    def target() -> None:
        try:
            renice_current_thread(increment)
            box.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - re-raised by the caller
            box.append((False, exc))

    helper = threading.Thread(target=target, name="wagma-communicators", daemon=True)
    helper.start()
    helper.join(deadline_s)
    if not box:
        raise TimeoutError(
            f"creating the engine's communicators did not finish within {deadline_s:.0f} s: a rank may not be "
            f"constructing its engines, or be constructing them in another order"
        )
    ok, value = box[0]
    if not ok:
        raise value  # type: ignore[misc]
    return value  # type: ignore[return-value]


def _can_split(world: World) -> bool:
    """Whether sub-communicators can be split from the default group (NCCL bound to a device).

    The answer is the same on every rank of a job, so all ranks take the same path. A world smaller than the job
    creates its groups with ``new_group`` (in every world of its family), on NCCL too.
    """
    default = dist.distributed_c10d._get_default_group()
    return (
        world.whole_job
        and hasattr(dist, "split_group")
        and dist.get_backend() == "nccl"
        and getattr(default, "bound_device_id", None) is not None
    )


def communicators(
    schedule: GroupSchedule, rank: int, timeout: datetime.timedelta, world: World
) -> tuple[dict[tuple[int, ...], dist.ProcessGroup | None], dist.ProcessGroup | None]:
    """This rank's communicator for each of its groups in the schedule, and one over all ranks of its world.

    With NCCL bound to a device, each round's partition is one ``split_group`` call (one
    ``ncclCommSplit`` for all its groups); otherwise every distinct group is a ``new_group`` (gloo).
    """
    size = schedule.world_size
    groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
    if size == 1:
        return {(0,): None}, None
    if _can_split(world):
        seen: set[tuple[tuple[int, ...], ...]] = set()
        for r in range(schedule.period):
            partition = tuple(schedule.groups(r))
            if partition in seen:
                continue
            seen.add(partition)
            pg = dist.split_group(split_ranks=[list(g) for g in partition], timeout=timeout)
            mine = schedule.group_of(rank, r)
            groups.setdefault(mine, pg if len(mine) > 1 else None)
        return groups, dist.split_group(split_ranks=[list(range(size))], timeout=timeout)
    # The same groups in every world of the family, each world keeping its own (the whole job: one world).
    for members in schedule.distinct_groups():
        pg = world.new_group(members, timeout, wait=False) if len(members) > 1 else None
        if rank in members:
            groups[members] = pg
    return groups, world.new_group(None, timeout, wait=False)
