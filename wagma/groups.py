"""Process groups for the synchronous averagers and the group hooks: timeouts and contiguous blocks.

Creating a process group is collective over the default group in ``torch.distributed``: every rank must
create every group, in the same order, even the groups it is not a member of. The helpers here are
therefore called from constructors only (never lazily from ``average_parameters`` or a hook), and each
group carries an explicit timeout so a hung or dead peer ends in an error instead of gloo's default
30-minute wait.
"""

from __future__ import annotations

import datetime
import itertools
from collections.abc import Sequence

import torch.distributed as dist

from wagma.checks import check_int, fail, is_number
from wagma.schedule import check_group_fits

__all__ = [
    "DEFAULT_TIMEOUT",
    "as_timeout",
    "contiguous_subgroups",
    "destroy_groups",
    "group_ranks",
    "is_timeout",
    "new_timeout_group",
    "require_initialized",
]

#: Timeout of the groups wagma creates when the caller does not pass one.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)


def as_timeout(timeout: datetime.timedelta | float) -> datetime.timedelta:
    """Return ``timeout`` as a positive ``timedelta``; a number is taken as seconds.

    Raises:
        ValueError: if the timeout is not positive or not a number or ``timedelta``.
    """
    if isinstance(timeout, datetime.timedelta):
        value = timeout
    elif is_number(timeout):
        value = datetime.timedelta(seconds=float(timeout))
    else:
        raise fail("timeout", "a datetime.timedelta or seconds as a number", timeout)
    if value.total_seconds() <= 0:
        raise ValueError(f"timeout: expected a positive duration, found {value.total_seconds()} s")
    return value


def is_timeout(exc: BaseException) -> bool:
    """Whether a ``torch.distributed`` error (a collective's, a point-to-point's, the c10d store's) says that a
    deadline passed, rather than that a connection broke. torch raises both as ``RuntimeError`` subclasses
    (``DistBackendError``, ``DistStoreError``, ``DistNetworkError``) and tells them apart only in the message."""
    if isinstance(exc, TimeoutError):
        return True
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def default_group() -> dist.ProcessGroup:
    """The job's default process group (``dist.group.WORLD``).

    Raises:
        RuntimeError: torch.distributed is not initialized.
    """
    require_initialized("default_group")
    group = dist.group.WORLD
    assert group is not None  # initialized
    return group


def require_initialized(what: str) -> None:
    """Raise ``RuntimeError`` naming ``what`` if the default process group does not exist yet."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{what} needs torch.distributed: call torch.distributed.init_process_group() on every rank first"
        )


def destroy_groups(groups: Sequence[dist.ProcessGroup | None]) -> None:
    """Destroy the process groups a component created (``None`` entries are skipped).

    Nothing to do once the default group is gone, and a group destroyed with it already is ignored,
    so ``close()`` methods can call this in any order relative to ``destroy_process_group()``.
    """
    if not dist.is_initialized():
        return
    for group in groups:
        if group is None:
            continue
        try:
            dist.destroy_process_group(group)
        except (RuntimeError, ValueError):  # already destroyed with the default group
            pass


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """Global ranks of ``group`` in group-rank order; ``None`` means every rank of the default group."""
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def new_timeout_group(ranks: Sequence[int] | None, timeout: datetime.timedelta) -> dist.ProcessGroup:
    """Create a process group over ``ranks`` (``None``: all ranks) whose collectives time out.

    Collective over the default group: every rank calls it with the same arguments, in the same order.
    Ranks outside ``ranks`` get ``GroupMember.NON_GROUP_MEMBER`` back.

    Returns only once every rank has finished creating the group. Gloo connects a new group's members
    inside its constructor, and a member that returned first could otherwise destroy the group (or exit)
    while a slower member is still connecting: that member's constructor then fails with "Connection
    closed by peer" (seen under load in about one world in seven). The wait is a store barrier, not a
    collective on the new group.

    Raises:
        TimeoutError: if some rank did not finish creating the group within ``timeout``.
    """
    group = dist.new_group(ranks=None if ranks is None else list(ranks), timeout=timeout)
    _wait_until_all_created(next(_created), timeout)
    return group


_created = itertools.count()  # the same sequence on every rank: group creation is collective and ordered


def store_barrier(store: dist.Store, key: str, world: int, timeout: datetime.timedelta) -> None:
    """Wait until ``world`` callers have reached ``key`` on ``store`` (a counter, then a release key).

    Raises:
        torch.distributed.DistStoreError: if they did not all arrive within ``timeout``.
    """
    if store.add(key, 1) == world:
        store.set(f"{key}/all", "1")  # the last rank to arrive releases the others
    store.wait([f"{key}/all"], timeout)


def _wait_until_all_created(index: int, timeout: datetime.timedelta) -> None:
    """Store barrier over the default group: every rank has returned from creating group ``index``."""
    store = dist.distributed_c10d._get_default_store()
    world = dist.get_world_size()
    key = f"wagma/groups/{index}"
    try:
        store_barrier(store, key, world, timeout)
    except dist.DistStoreError as err:
        raise TimeoutError(
            f"new_timeout_group: expected all {world} ranks to create process group #{index} within "
            f"{timeout.total_seconds():.0f} s, found {int(store.add(key, 0))} done; every rank must create "
            "the same groups in the same order (a rank that is slow, hung or gone stops the others)"
        ) from err


def contiguous_subgroups(
    group_size: int, ranks: Sequence[int], timeout: datetime.timedelta
) -> tuple[dist.ProcessGroup | None, list[list[int]]]:
    """Split ``ranks`` into contiguous blocks of ``group_size`` and create one group per block.

    Every rank of the default group must call this with the same arguments, in the same order: it creates
    all blocks' groups, also those it is not in. A block of one rank gets no group (there is nothing to
    reduce); callers skip communication for it.

    Args:
        group_size: ranks per block; must divide ``len(ranks)``.
        ranks: global ranks to partition, in order (block ``k`` is ``ranks[k*group_size:(k+1)*group_size]``).
        timeout: timeout of every created group.

    Returns:
        ``(mine, blocks)``: the group of the block holding the calling rank (``None`` when the calling rank
        is in no block or its block has one rank) and the blocks as lists of global ranks.

    Raises:
        ValueError: if ``group_size`` is not a positive integer dividing ``len(ranks)`` (one larger than
            ``len(ranks)`` is named as such).
    """
    check_int("group_size", group_size, minimum=1)
    check_group_fits(group_size, len(ranks))
    if len(ranks) % group_size != 0:
        raise fail("group_size", f"a divisor of the number of ranks ({len(ranks)})", group_size)
    me = dist.get_rank()
    blocks = [list(ranks[i : i + group_size]) for i in range(0, len(ranks), group_size)]
    mine: dist.ProcessGroup | None = None
    if group_size == 1:
        return None, blocks
    for block in blocks:
        group = new_timeout_group(block, timeout)
        if me in block:
            mine = group
    return mine, blocks
