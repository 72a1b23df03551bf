"""The progress thread of :class:`wagma.engine.WaitAvoidingGroupAllreduce` and the state it shares.

The engine's protocol is stated in :mod:`wagma.engine`. :class:`EngineCore` holds everything the
main thread and the progress thread share, and runs the progress thread; it holds no reference to
the engine, so an engine dropped without ``close()`` is collected and its finalizer
(:meth:`EngineCore.shutdown`) stops the threads and releases the communicators.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

import torch
import torch.distributed as dist

from wagma.engine_store import ActivationChannel
from wagma.groups import destroy_groups
from wagma.schedule import GroupSchedule
from wagma.shm import SharedMemoryAllreduce
from wagma.world import World


class EngineSettings(Protocol):
    """What the core reads of its engine (:class:`wagma.engine.WaitAvoidingGroupAllreduce`) when it starts.

    A protocol rather than the engine's class, so that this module imports nothing above it.
    """

    rank: int
    world_size: int
    world: World
    schedule: GroupSchedule
    sync_period: int
    max_lead: int
    accumulate: bool
    timeout: datetime.timedelta
    device: torch.device
    progress_nice: int
    seed: int
    keep_contributions: bool
    transport: str
    wire_dtype: torch.dtype | None
    error_feedback: bool

    # Read-only, so that the engine's Literal-typed attributes match.
    @property
    def sync(self) -> str: ...

    @property
    def trigger(self) -> str: ...


__all__ = ["Done", "EngineCore", "EngineSettings", "initiator_of", "is_sync"]

#: How many spare CPU buffers an engine keeps for reuse (superseded snapshots, sums handed back by ``recycle``).
SPARES = 4
#: Whether a thread's nice value is its own (Linux: ``setpriority(PRIO_PROCESS, tid)`` changes one thread).
PER_THREAD_NICE = sys.platform.startswith("linux")
_T = TypeVar("_T")


@dataclasses.dataclass
class Done:
    """One finished round, kept for the main thread until it consumes it."""

    round: int
    is_sync: bool
    group: tuple[int, ...]
    sum: torch.Tensor
    version: int
    exchange_s: float
    activated_at: float
    event: torch.cuda.Event | None
    contributed: torch.Tensor | None = None  # keep_contributions: the snapshot the thread sent (pinned)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def initiator_of(seed: int, k: int, world_size: int) -> int:
    """The rank whose arrival triggers round ``k`` under ``trigger="initiator"`` (the same on every rank)."""
    return _splitmix64((seed << 32) ^ k) % world_size


def is_sync(k: int, sync_period: int) -> bool:
    """Whether round ``k`` is a blocking global round for this sync period."""
    return k % (sync_period + 1) == sync_period


class EngineCore:
    """The state the main thread and the progress thread share, and the progress thread itself.

    It holds no reference to its engine, so that an engine dropped without ``close()`` is collected and
    its finalizer (:meth:`shutdown`) stops the thread. Fields below ``cond`` are guarded by it.
    """

    def __init__(self, eng: EngineSettings, initial: torch.Tensor, store: dist.Store, prefix: str, start: int) -> None:
        self.rank, self.world_size, self.schedule = eng.rank, eng.world_size, eng.schedule
        self.sync_period, self.max_lead, self.accumulate = eng.sync_period, eng.max_lead, eng.accumulate
        self.timeout, self.device = eng.timeout, eng.device
        self.blocking_sync = eng.sync == "barrier"
        self.cuda = self.device.type == "cuda"
        # CPU only: how much nicer than the caller the progress thread and the communicators' threads run.
        self.nice = eng.progress_nice if not self.cuda and PER_THREAD_NICE else 0
        self.trigger_phase = (
            "waiting for any rank to trigger round {k}"
            if eng.trigger == "any"
            else "waiting for round {k} to be triggered by its initiator, rank {i}"
        )
        self.seed = eng.seed
        self.all = tuple(range(self.world_size))
        self.start = start
        self.calls = start
        self.cond = threading.Condition()
        self.snapshot = initial.detach().clone()  # replace: immutable published tensor; accumulate: pending
        # accumulate: whether the pending contribution is the zeros an exchange (or take()) left, with nothing added
        # since; then a submitted staging buffer replaces it instead of being added into it.
        self.pending_empty = False
        self.staging: torch.Tensor | None = None  # accumulate: the buffer staging_buffer() hands out
        self.snapshot_version = start - 1  # `initial` counts as the call before the first
        self.side_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.snapshot_event = self.record_event()
        # CPU only: buffers of the tensor's shape that nothing reads any more, reused instead of allocating a fresh
        # one per round (a fresh multi-MB CPU tensor costs page faults and zeroing, on every rank, every round).
        # CUDA tensors come from PyTorch's caching allocator already, and their reuse would need stream fences.
        self.spares: list[torch.Tensor] = []
        self.reading: torch.Tensor | None = None  # replace mode: the snapshot the thread is copying right now
        # keep_contributions: snapshots a round result still hands to the main thread, by data pointer -> how many
        # results hold it. A pinned snapshot is never made a spare: nothing may overwrite it before it is released.
        self.keep_contributions = eng.keep_contributions
        self.pins: dict[int, int] = {}
        # wire_dtype (wagma.wire): replace mode sends snapshot - reference, the reference being the mean of the last
        # sync round (the same on every rank: all take part, all receive the same sum), before the first one world
        # rank 0's initial tensor (broadcast at construction).
        self.wire, self.error_feedback = eng.wire_dtype, eng.error_feedback
        self.reference: torch.Tensor | None = None
        self.arrived = start - 1  # newest call the main thread has published
        self.results: dict[int, Done] = {}
        self.thread_round = start  # the round the thread works on
        self.activated = start - 1  # newest round known to have started (seen by the watcher, or triggered here)
        self.watching = start  # the round the watcher waits for: no act key below it is needed here
        self.triggering: int | None = None  # a round whose trigger the main thread is sending
        self.phase = "starting"
        self.error: BaseException | None = None
        self.stop = False
        self.shut = False
        # The first progress record is written before the communicators: their creation is collective, so
        # every rank's record exists by the time any thread reads them.
        self.channel = ActivationChannel(
            store,
            prefix,
            self.rank,
            self.world_size,
            start,
            self.timeout,
            self.on_activated,
            self.next_wait,
            self.on_watch_error,
            None if eng.world.whole_job else eng.world.ranks,
        )
        self.shm: dict[tuple[int, ...], SharedMemoryAllreduce] = {}  # transport 'shm': by group
        # Communicators, created by every rank in the same order (docs/design.md §2.1). Singleton groups need none.
        try:
            # A rank whose store connects stalled is waited for here, under the connect deadline, rather than by
            # the group creation below, which gives a late member only the (possibly short) engine timeout.
            self.channel.meet()
            # Gloo starts a group's worker and I/O threads in its constructor, and a thread starts with its
            # creator's nice value: built from a niced helper thread, they run at the progress thread's priority.
            deadline = (
                self.channel.connect_s + (len(self.schedule.distinct_groups()) + 1) * self.timeout.total_seconds()
            )
            self.groups, self.global_pg = _niced(
                self.nice, lambda: _communicators(self.schedule, self.rank, self.timeout, eng.world), deadline
            )
            if self.global_pg is not None:
                # Gloo connects a group's members inside its constructor: a rank that returned first and
                # closed (or exited) could drop a connection a slower rank is still making ("Connection
                # closed by peer"). The global group is created last, so once all ranks meet on it every
                # group is complete. Issued here, before the progress thread (its only issuer) starts.
                dist.barrier(group=self.global_pg)
            if self.wire is not None and not self.accumulate:
                # The first reference: world rank 0's initial tensor, which every rank then holds bit for bit.
                self.reference = initial.detach().clone()
                if self.global_pg is not None:
                    dist.broadcast(self.reference, group=self.global_pg, group_src=0)
            # transport 'shm': one shared segment per group of this rank, each built by its members alone, in
            # one order on every rank (by the groups' ranks, the global group last), so no two wait on each other.
            if eng.transport == "shm":
                mine = sorted(g for g, pg in self.groups.items() if pg is not None)
                for g in mine:
                    self.shm[g] = SharedMemoryAllreduce(self.groups[g], initial.numel(), initial.dtype)
                if self.global_pg is not None:
                    self.shm[self.all] = SharedMemoryAllreduce(self.global_pg, initial.numel(), initial.dtype)
        except BaseException:
            self.channel.abandon()
            raise
        self.thread = threading.Thread(target=self.run, name=f"wagma-progress-{prefix.strip('/')}", daemon=True)
        self.thread.start()
        self.channel.start()

    def group_of(self, k: int) -> tuple[int, ...]:
        return self.all if is_sync(k, self.sync_period) else self.schedule.group_of(self.rank, k)

    def blocking(self, k: int) -> bool:
        """Whether round ``k`` waits for every rank's fresh tensor instead of being activated."""
        return self.blocking_sync and is_sync(k, self.sync_period)

    # ------------------------------------------------------------------------------------ main side
    def publish(self, tensor: torch.Tensor, k: int, *, arrive: bool = True) -> None:
        """Make ``tensor`` this rank's contribution, as of call ``k``. ``arrive=False`` (replace mode: a snapshot
        published ahead of call ``k``) leaves ``arrived``, which the lead bound and blocking rounds wait on, as it
        is."""
        if self.accumulate:
            staged = tensor is self.staging
            with self.cond:
                if self.snapshot_event is not None:
                    stream = torch.cuda.current_stream(self.device)
                    stream.wait_event(self.snapshot_event)
                    self.snapshot.record_stream(stream)  # it may come from the thread's stream
                if staged and self.pending_empty:
                    # The pending zeros become the next staging buffer and the staged values the pending
                    # contribution: the same sum as adding, without a pass over either buffer.
                    self.staging, self.snapshot = self.snapshot, tensor
                else:
                    self.snapshot.add_(tensor.detach())
                    if staged:
                        tensor.zero_()  # handed out again by staging_buffer(): zeros, as promised
                self.pending_empty = False
                self.snapshot_version = k
                self.snapshot_event = self.record_event()
                self.arrived = k
                self.cond.notify_all()
        else:
            with self.cond:
                spare = self.take_spare()
            # Immutable once published: the thread reads it without a lock (a spare is read by no one).
            snap = tensor.detach().clone() if spare is None else spare.copy_(tensor.detach())
            event = self.record_event()
            with self.cond:
                old = self.snapshot
                self.snapshot, self.snapshot_version, self.snapshot_event = snap, k, event
                if old is not self.reading:  # else the thread hands it back once its copy is done
                    self.give_spare(old)
                if arrive:
                    self.arrived = k
                self.cond.notify_all()

    def shutdown(self) -> None:
        """Stop the threads, release the communicators and the store keys (close() and the finalizer)."""
        with self.cond:
            if self.shut:
                return
            self.shut = self.stop = True
            self.cond.notify_all()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=self.timeout.total_seconds() + 5.0)  # a collective ends within its timeout
        if not self.thread.is_alive():  # a thread stuck in a collective keeps its communicators
            destroy_groups([*self.groups.values(), self.global_pg])
        self.channel.close(self.calls)
        for shm in self.shm.values():
            shm.close()
        self.results.clear()
        self.spares.clear()
        self.pins.clear()
        self.groups.clear()
        self.global_pg = None

    # ---------------------------------------------------------------------------------- watcher side
    def on_activated(self, k: int) -> None:
        with self.cond:
            self.activated = max(self.activated, k)
            self.cond.notify_all()

    def next_wait(self, k: int) -> int | None:
        if self.sync_period == 0 and self.blocking_sync:  # every round blocks: no round is ever activated
            return None
        with self.cond:
            while self.blocking(k) or self.activated >= k:  # no key, or started here already
                k += 1
            self.watching = k
            return None if self.stop else k

    def on_watch_error(self, exc: BaseException) -> None:
        with self.cond:
            if self.error is None and not self.stop:
                self.error = exc
            self.cond.notify_all()

    # -------------------------------------------------------------------------------- progress thread
    def run(self) -> None:
        try:
            if self.nice:
                renice_current_thread(self.nice)
            if self.cuda:
                torch.cuda.set_device(self.device)
                with torch.cuda.stream(self.side_stream):
                    self.loop()
            else:
                self.loop()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread, re-raised there
            with self.cond:
                self.error = exc
                self.cond.notify_all()

    def loop(self) -> None:
        k = self.start
        while True:
            sync, blocking = is_sync(k, self.sync_period), self.blocking(k)
            needed = k if blocking else k - self.max_lead
            with self.cond:
                self.thread_round = k
                self.phase = f"waiting for this rank's main thread to reach round {needed}"
                while not self.stop and self.arrived < needed:
                    self.cond.wait()
                if not blocking:
                    self.phase = self.trigger_phase.format(k=k, i=initiator_of(self.seed, k, self.world_size))
                    while not self.stop and self.error is None and self.activated < k:
                        self.cond.wait()
                # A trigger the main thread is sending for an earlier round goes out before this round's
                # record, on the same connection: no rank can delete that round's key before it is written.
                while self.triggering is not None and self.triggering < k:
                    self.cond.wait()
                if self.stop or self.error is not None:
                    return
                activated_at = time.time()
                group = self.group_of(k)
                self.phase = f"exchanging with group {group}"
                if self.accumulate:
                    send, event = self.swap_pending()
                    version = self.snapshot_version
                else:
                    send, version, event = self.snapshot, self.snapshot_version, self.snapshot_event
                    self.reading = send
                    spare = self.take_spare()
                    if self.keep_contributions:
                        self.pins[send.data_ptr()] = self.pins.get(send.data_ptr(), 0) + 1
                contributed = send if self.keep_contributions else None
                gc_floor, published = min(k, self.watching), self.arrived
            self.channel.record(k, gc_floor, published)
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)
                send.record_stream(torch.cuda.current_stream(self.device))
            source = None  # replace mode: the snapshot, until the exchange has read it
            wire = None  # wire_dtype: what goes out, narrow
            if self.wire is not None:
                if self.accumulate:
                    wire = self.encode(send, None)
                else:  # the delta is computed in `spare`, which then receives the sum
                    spare = torch.empty_like(send) if spare is None else spare
                    wire, send = self.encode(send, spare), spare
            elif not self.accumulate:  # the snapshot may be contributed again next round: reduce into another buffer
                if self.shm:  # shared memory reads the snapshot and writes the sum elsewhere: no copy of ours
                    source, send = send, torch.empty_like(send) if spare is None else spare
                else:
                    snapshot, send = send, send.clone() if spare is None else spare.copy_(send)
                    self.done_reading(snapshot)
            t0 = time.perf_counter()
            pg = self.global_pg if sync else self.groups[group]
            try:
                if wire is not None:
                    if pg is not None:
                        dist.all_reduce(wire, group=pg)
                    self.decode(wire, send, len(group), sync)
                elif pg is None:
                    if source is not None:
                        send.copy_(source)
                elif self.shm:
                    self.shm[group].all_reduce(send if source is None else source, out=send)
                else:
                    dist.all_reduce(send, group=pg)
            except Exception as exc:
                raise RuntimeError(
                    f"round {k}: {self.channel.who_is_missing(k, group)}. The exchange failed with: {exc}"
                ) from exc
            finally:
                if source is not None:
                    self.done_reading(source)
            exchange_s = time.perf_counter() - t0
            with self.cond:
                self.results[k] = Done(
                    k, sync, group, send, version, exchange_s, activated_at, self.record_event(), contributed
                )
                self.cond.notify_all()
            self.channel.collect(k)
            k += 1

    # -------------------------------------------------------------------------------------- helpers
    def encode(self, send: torch.Tensor, spare: torch.Tensor | None) -> torch.Tensor:
        """wire_dtype: the narrow tensor to send for ``send``, the contribution taken (accumulate mode) or the
        snapshot read (replace mode, which it hands back; ``spare`` is scratch for the delta)."""
        assert self.wire is not None
        if self.accumulate:
            wire = send.to(self.wire)
            if self.error_feedback:  # what the cast rounded off stays pending, for a later round
                rounded_off = send.sub_(wire)  # (`send` becomes the round's sum once the exchange is done)
                with self.cond:
                    if self.snapshot_event is not None:
                        torch.cuda.current_stream(self.device).wait_event(self.snapshot_event)
                    self.snapshot.add_(rounded_off)
                    self.pending_empty = False
                    self.snapshot_event = self.record_event()
            return wire
        if self.reference is None:
            wire = send.to(self.wire)
        else:
            wire = torch.sub(send, self.reference, out=spare).to(self.wire)
        self.done_reading(send)
        return wire

    def decode(self, wire: torch.Tensor, out: torch.Tensor, size: int, sync: bool) -> None:
        """wire_dtype: widen the exchanged sum ``wire`` of ``size`` contributions into ``out``; in replace mode add
        back their references, and after a sync round make its mean the new reference."""
        out.copy_(wire)
        if self.accumulate:
            return
        if self.reference is not None:
            out.add_(self.reference, alpha=size)
        if sync:
            if self.reference is None:
                self.reference = torch.empty_like(out)
            torch.div(out, size, out=self.reference)

    def done_reading(self, snapshot: torch.Tensor) -> None:
        """Replace mode: the thread has read ``snapshot``; keep it for reuse if a newer one superseded it."""
        with self.cond:
            self.reading = None
            if snapshot is not self.snapshot:  # superseded while it was being read
                self.give_spare(snapshot)

    def swap_pending(self) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Take the pending contribution and leave zeros in its place; caller holds the lock."""
        out, event = self.snapshot, self.snapshot_event  # the consumer waits on `event` before reading
        spare = self.take_spare()
        self.snapshot = torch.zeros_like(out) if spare is None else spare.zero_()
        self.pending_empty = True
        self.snapshot_event = self.record_event()
        return out, event

    def unpin(self, snapshot: torch.Tensor) -> None:
        """keep_contributions: a result that held ``snapshot`` was released; once no result holds it and it is
        neither the current snapshot nor being read, its memory is reused. Caller holds the lock."""
        ptr = snapshot.data_ptr()
        count = self.pins.get(ptr, 0)
        if count <= 0:
            raise ValueError("release: this result's contribution is not held by the engine (released already?)")
        if count > 1:
            self.pins[ptr] = count - 1
            return
        del self.pins[ptr]
        if snapshot is not self.snapshot and snapshot is not self.reading:
            self.give_spare(snapshot)

    def take_spare(self) -> torch.Tensor | None:
        """A buffer to overwrite, or None (then allocate); caller holds the lock."""
        return self.spares.pop() if self.spares else None

    def give_spare(self, tensor: torch.Tensor) -> None:
        """Keep ``tensor``, which nothing reads any more, for reuse (CPU only, at most :data:`SPARES`); caller
        holds the lock."""
        if not self.cuda and len(self.spares) < SPARES and tensor.data_ptr() not in self.pins:
            self.spares.append(tensor)

    def record_event(self) -> torch.cuda.Event | None:
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event


def renice_current_thread(increment: int) -> None:
    """Make the calling thread ``increment`` nice levels nicer (capped at 19); threads it starts inherit that.

    Linux only (elsewhere a nice value belongs to the whole process); raising a nice value needs no privilege.
    """
    tid = threading.get_native_id()
    os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))


def _niced(increment: int, fn: Callable[[], _T], deadline_s: float) -> _T:
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


def _communicators(
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
