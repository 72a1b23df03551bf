"""Synchronous DDP communication hooks: global allreduce, allreduce inside fixed groups, no communication.

Hooks follow torch's contract: a plain function ``hook(state, bucket) -> Future[Tensor]`` registered with
``DistributedDataParallel.register_comm_hook(state, hook)``; the future's value replaces the bucket's
gradients. Their tunables live on small state classes that drop process groups when pickled, as torch's
hook states do.

No ``from __future__ import annotations`` in hook modules: DDP checks that a hook's ``bucket`` and return
annotations are the real ``dist.GradBucket`` and ``Future[Tensor]`` objects, and strings fail that check.
"""

import datetime
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from wagma.averaging.base import OwnedResources, reduced_parameters
from wagma.checks import check_int
from wagma.groups import DEFAULT_TIMEOUT, as_timeout, contiguous_subgroups, default_group, require_initialized
from wagma.schedule import check_group_fits
from wagma.shm import SharedMemoryAllreduce, check_transport
from wagma.wire import WireDtype, as_wire_dtype, wire_dtype_for

__all__ = [
    "AllreduceState",
    "GroupAllreduceState",
    "allreduce_hook",
    "group_allreduce_hook",
    "local_hook",
    "no_state",
]


def _completed(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def _mean_future(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.futures.Future[torch.Tensor]:
    # Divide first (as torch's default hook does) so low-precision sums do not overflow.
    tensor.div_(group.size())
    return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])


class AllreduceState:
    """State of :func:`allreduce_hook`: the process group to average over, and how to move the gradients.

    Pickling drops the group (and the shared segment); an unpickled state averages over the default group
    with the group's backend.

    Args:
        process_group: group to average over; ``None`` means the default group (what DDP uses).
        transport: ``"default"`` (the group's backend) or ``"shm"``: CPU gradients of ranks on one host are summed
            through shared memory (:class:`wagma.shm.SharedMemoryAllreduce`; collective: build the state on every
            member of the group at the same point).
        params: with ``"shm"``, the parameters of the module DDP wraps: their gradients' dtype and total size
            (an upper bound of any bucket's) size the shared segment.
        wire_dtype: ``None`` (the gradients' dtype), ``"bf16"`` or ``"fp16"`` (:mod:`wagma.wire`): float32/float64
            buckets are divided, cast, summed in that dtype and widened back, as torch's ``bf16_compress_hook`` does,
            on any backend (torch's needs NCCL); no error feedback (the eager hooks have it).
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        transport: str = "default",
        params: Iterable[torch.Tensor] | None = None,
        wire_dtype: WireDtype = None,
    ) -> None:
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise ValueError(f"process_group: expected a ProcessGroup or None, found {process_group!r}")
        self.process_group = process_group
        self.transport = check_transport(transport)
        self.wire_dtype: torch.dtype | None = as_wire_dtype(wire_dtype)
        if self.wire_dtype is not None and transport == "shm":
            raise ValueError(f"wire_dtype={self.wire_dtype} needs transport='default': shared memory has no wire")
        self.shm: SharedMemoryAllreduce | None = None
        if transport == "shm":
            if params is None:
                raise ValueError("params: transport 'shm' needs the parameters DDP reduces, found none")
            grads, dtype, device = reduced_parameters(params)
            check_transport(transport, device)
            self.shm = SharedMemoryAllreduce(process_group, sum(p.numel() for p in grads), dtype)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("process_group", "shm")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.process_group = None
        self.shm = None
        self.transport = "default"


def allreduce_hook(state: AllreduceState | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Gradient mean over ``state.process_group`` (default: all ranks): what DDP does without a hook.

    Args:
        state: an :class:`AllreduceState`, or ``None`` for the default group.
        bucket: the gradient bucket DDP hands over; its buffer is reduced in place.
    """
    group = state.process_group if state is not None and state.process_group is not None else default_group()
    if state is not None and state.shm is not None:
        buffer = bucket.buffer().div_(group.size())  # first, as the gloo path does
        return _completed(state.shm.all_reduce(buffer))
    narrow = wire_dtype_for(state.wire_dtype, bucket.buffer().dtype) if state is not None else None
    if narrow is not None:
        buffer = bucket.buffer()
        wire = buffer.div_(group.size()).to(narrow)

        def widen(fut: torch.futures.Future) -> torch.Tensor:
            return buffer.copy_(fut.value()[0])

        return dist.all_reduce(wire, group=group, async_op=True).get_future().then(widen)
    return _mean_future(bucket.buffer(), group)


class GroupAllreduceState:
    """State of :func:`group_allreduce_hook`: fixed contiguous groups of ``group_size`` ranks.

    The ranks of the default group are cut into blocks ``[0, S)``, ``[S, 2S)``, ...; the constructor
    creates every block's group on every rank, in the same order (group creation is collective). Pickling
    drops the groups; after unpickling call :meth:`create_groups` on every rank before using the state.
    :meth:`close` (or leaving a ``with`` block) destroys this rank's group; a dropped state does the same
    through a ``weakref.finalize`` finalizer.

    Args:
        group_size: ranks per group; must divide the number of ranks.
        timeout: timeout of the created groups (``timedelta`` or seconds).
    """

    def __init__(self, group_size: int, *, timeout: datetime.timedelta | float = DEFAULT_TIMEOUT) -> None:
        self.group_size = check_int("group_size", group_size, minimum=1)
        self.timeout = as_timeout(timeout)
        self.subgroup: dist.ProcessGroup | None = None
        self.blocks: list[list[int]] = []
        self.groups_created = False
        self._resources = OwnedResources()
        self._finalizer = weakref.finalize(self, self._resources.release)
        self.create_groups()

    def create_groups(self) -> None:
        """Create the block groups (collective: every rank calls it, in the same order as other groups).

        Raises:
            ValueError: if ``group_size`` is larger than the number of ranks or does not divide it.
        """
        require_initialized(type(self).__name__)
        world = dist.get_world_size()
        check_group_fits(self.group_size, world)
        if world % self.group_size != 0:
            raise ValueError(
                f"group_size: expected a divisor of the number of ranks ({world}), found {self.group_size}"
            )
        self.subgroup, self.blocks = contiguous_subgroups(self.group_size, list(range(world)), self.timeout)
        if self.subgroup is not None:
            self._resources.groups.append(self.subgroup)
        self.groups_created = True

    def close(self) -> None:
        """Destroy this rank's group; idempotent. The hook then raises until :meth:`create_groups`."""
        self.subgroup = None
        self.groups_created = False
        self._finalizer()

    def __enter__(self) -> "GroupAllreduceState":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        dropped = ("subgroup", "groups_created", "_resources", "_finalizer")
        return {k: v for k, v in self.__dict__.items() if k not in dropped}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.subgroup = None
        self.groups_created = False
        self._resources = OwnedResources()
        self._finalizer = weakref.finalize(self, self._resources.release)


def group_allreduce_hook(state: GroupAllreduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Gradient mean inside this rank's fixed group of ``state.group_size`` ranks.

    Args:
        state: a :class:`GroupAllreduceState` whose groups exist on every rank.
        bucket: the gradient bucket DDP hands over; its buffer is reduced in place.

    Raises:
        RuntimeError: if the state has no groups (it was unpickled and :meth:`GroupAllreduceState.create_groups`
            was not called).
    """
    if not state.groups_created:
        raise RuntimeError(
            "GroupAllreduceState has no process groups (it was unpickled or closed): call state.create_groups() "
            "on every rank before training"
        )
    if state.subgroup is None:  # a group of one: the mean is the gradient itself
        return _completed(bucket.buffer())
    return _mean_future(bucket.buffer(), state.subgroup)


def no_state() -> None:
    """State factory of :func:`local_hook`: it needs none."""
    return None


def local_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """No communication: the bucket's local gradients are used as they are (for model-averaging phases).

    Args:
        state: ignored (``None`` is fine).
        bucket: the gradient bucket DDP hands over.
    """
    return _completed(bucket.buffer())
