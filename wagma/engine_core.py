"""The progress thread of the engines of :mod:`wagma.engine` and the state it shares with the main thread.

The engine's protocol is stated in :mod:`wagma.engine`. :class:`EngineCore` holds everything the main thread and
the progress thread share, and runs the progress thread: it waits until a round may start, takes this rank's
contribution, exchanges it and keeps the result. What a contribution is (a published copy, or a pending sum)
is the business of its two subclasses in :mod:`wagma.engine_modes`. The core holds no reference to the engine, so
an engine dropped without ``close()`` is collected and its finalizer (:meth:`EngineCore.shutdown`) stops the
threads and releases the communicators.
"""

from __future__ import annotations

import abc
import dataclasses
import threading
import time

import torch
import torch.distributed as dist

from wagma.engine_comms import PER_THREAD_NICE, communicators, renice_current_thread, run_niced
from wagma.engine_options import RoundOptions
from wagma.engine_store import ActivationChannel
from wagma.groups import destroy_groups
from wagma.schedule import GroupSchedule
from wagma.shm import SharedMemoryAllreduce
from wagma.world import World

__all__ = ["CoreSetup", "EngineCore", "FinishedRound", "Outgoing", "TakenContribution", "initiator_of", "is_sync"]

#: How many spare CPU buffers an engine keeps for reuse (superseded snapshots, sums handed back by ``recycle``).
SPARES = 4


@dataclasses.dataclass
class FinishedRound:
    """One finished round, kept for the main thread until it consumes it."""

    round: int
    is_sync: bool
    group: tuple[int, ...]
    sum: torch.Tensor
    version: int
    exchange_s: float
    activated_at: float
    event: torch.cuda.Event | None
    contributed: torch.Tensor | None = None  # keep_contributions: the snapshot the thread sent (held for it)


@dataclasses.dataclass
class TakenContribution:
    """What the progress thread took, under the lock, for one round: this rank's contribution and the round."""

    round: int
    is_sync: bool
    group: tuple[int, ...]
    activated_at: float
    send: torch.Tensor  # the contribution taken (replace mode: the snapshot itself, read only)
    version: int  # the newest call it includes
    event: torch.cuda.Event | None  # CUDA: recorded once `send` was written
    spare: torch.Tensor | None = None  # replace mode: a buffer nothing reads, to write the round's sum into
    contributed: torch.Tensor | None = None  # keep_contributions: handed to the main thread with the result


@dataclasses.dataclass
class Outgoing:
    """The buffers of one exchange: ``sum`` receives the round's sum; ``source`` (replace mode) is the snapshot the
    exchange reads, handed back once read; ``wire`` (with a wire dtype) is the narrow tensor that goes out."""

    sum: torch.Tensor
    source: torch.Tensor | None = None
    wire: torch.Tensor | None = None


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def initiator_of(seed: int, k: int, world_size: int) -> int:
    """The rank whose arrival triggers round ``k`` under ``trigger="initiator"`` (the same on every rank)."""
    return _splitmix64((seed << 32) ^ k) % world_size


def is_sync(k: int, sync_period: int) -> bool:
    """Whether round ``k`` is a global round for this sync period."""
    return k % (sync_period + 1) == sync_period


@dataclasses.dataclass(frozen=True)
class CoreSetup:
    """What an engine builds its core from, whatever the mode: the checked round options, the world and schedule,
    the tensor the core starts from, where its keys go (``store`` under ``prefix``), how the rounds move tensors
    and the dtype they send in (``None``: the tensor's own). The core keeps none of it as it is."""

    options: RoundOptions
    world: World
    schedule: GroupSchedule
    initial: torch.Tensor
    store: dist.Store
    prefix: str
    transport: str
    wire_dtype: torch.dtype | None


class EngineCore(abc.ABC):
    """The state the main thread and the progress thread share, and the progress thread itself.

    It holds no reference to its engine, so that an engine dropped without ``close()`` is collected and its
    finalizer (:meth:`shutdown`) stops the thread. Fields below ``cond`` are guarded by it. ``snapshot`` is this
    rank's contribution as it stands: the published copy (replace mode) or the pending sum (accumulate mode).
    A subclass sets its own fields before calling this constructor, which starts the threads.
    """

    def __init__(self, setup: CoreSetup) -> None:
        self._init_state(setup.options, setup.world, setup.schedule, setup.initial, setup.wire_dtype)
        # The first progress record is written before the communicators: their creation is collective, so
        # every rank's record exists by the time any thread reads them.
        self.channel = ActivationChannel(
            setup.store,
            setup.prefix,
            self.rank,
            self.world_size,
            self.start,
            self.timeout,
            self.on_activated,
            self.next_wait,
            self.on_watch_error,
            None if setup.world.whole_job else setup.world.ranks,
        )
        try:
            self._connect(setup.world, setup.initial, setup.transport)
        except BaseException:
            self.channel.abandon()
            raise
        name = f"wagma-progress-{setup.prefix.strip('/')}"
        self.thread = threading.Thread(target=self.run, name=name, daemon=True)
        self.thread.start()
        self.channel.start()

    def _init_state(
        self,
        options: RoundOptions,
        world: World,
        schedule: GroupSchedule,
        initial: torch.Tensor,
        wire_dtype: torch.dtype | None,
    ) -> None:
        """The fields, before any store call or communicator."""
        self.rank, self.world_size, self.schedule = world.rank, world.size, schedule
        self.sync_period, self.max_lead, self.timeout = options.sync_period, options.max_lead, options.timeout
        self.device = initial.device
        self.blocking_sync = options.sync == "barrier"
        self.cuda = self.device.type == "cuda"
        # CPU only: how much nicer than the caller the progress thread and the communicators' threads run.
        self.nice = options.progress_nice if not self.cuda and PER_THREAD_NICE else 0
        self.trigger_phase = (
            "waiting for any rank to trigger round {k}"
            if options.trigger == "any"
            else "waiting for round {k} to be triggered by its initiator, rank {i}"
        )
        self.seed = options.seed
        self.all = tuple(range(self.world_size))
        self.start = self.calls = options.start_round
        self.wire = wire_dtype  # wagma.wire: what the exchanges send and sum in (None: the tensor's own dtype)
        self.cond = threading.Condition()
        self.snapshot = initial.detach().clone()
        self.snapshot_version = self.start - 1  # `initial` counts as the call before the first
        self.side_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.snapshot_event = self.record_event()
        # CPU only: buffers of the tensor's shape that nothing reads any more, reused instead of allocating a fresh
        # one per round (a fresh multi-MB CPU tensor costs page faults and zeroing, on every rank, every round).
        # CUDA tensors come from PyTorch's caching allocator already, and their reuse would need stream fences.
        self.spares: list[torch.Tensor] = []
        self.arrived = self.start - 1  # newest call the main thread has published
        self.results: dict[int, FinishedRound] = {}
        self.thread_round = self.start  # the round the thread works on
        self.activated = self.start - 1  # newest round known to have started (seen by the watcher, or triggered here)
        self.watching = self.start  # the round the watcher waits for: no act key below it is needed here
        self.triggering: int | None = None  # a round whose trigger the main thread is sending
        self.phase = "starting"
        self.error: BaseException | None = None
        self.stopping = False  # the threads are asked to stop (close(), the finalizer)
        self.drain_to = self.start - 1  # once stopping: the newest round the thread still runs (activated before)
        self.shut_down = False  # shutdown() has run
        self.shm: dict[tuple[int, ...], SharedMemoryAllreduce] = {}  # transport 'shm': by group

    def _connect(self, world: World, initial: torch.Tensor, transport: str) -> None:
        """Create the communicators, by every rank in the same order (docs/design.md §2.1); singleton groups need
        none. Then the mode's first exchange (:meth:`first_exchange`) and the shared-memory segments."""
        # A rank whose store connects stalled is waited for here, under the connect deadline, rather than by
        # the group creation below, which gives a late member only the (possibly short) engine timeout.
        self.channel.wait_for_every_rank()
        # Gloo starts a group's worker and I/O threads in its constructor, and a thread starts with its
        # creator's nice value: built from a niced helper thread, they run at the progress thread's priority.
        deadline = self.channel.connect_s + (len(self.schedule.distinct_groups()) + 1) * self.timeout.total_seconds()
        self.groups, self.global_pg = run_niced(
            self.nice, lambda: communicators(self.schedule, self.rank, self.timeout, world), deadline
        )
        if self.global_pg is not None:
            # Gloo connects a group's members inside its constructor: a rank that returned first and
            # closed (or exited) could drop a connection a slower rank is still making ("Connection
            # closed by peer"). The global group is created last, so once all ranks meet on it every
            # group is complete. Issued here, before the progress thread (its only issuer) starts.
            dist.barrier(group=self.global_pg)
        self.first_exchange(initial)
        # transport 'shm': one shared segment per group of this rank, each built by its members alone, in
        # one order on every rank (by the groups' ranks, the global group last), so no two wait on each other.
        if transport == "shm":
            for g in sorted(g for g, pg in self.groups.items() if pg is not None):
                self.shm[g] = SharedMemoryAllreduce(self.groups[g], initial.numel(), initial.dtype)
            if self.global_pg is not None:
                self.shm[self.all] = SharedMemoryAllreduce(self.global_pg, initial.numel(), initial.dtype)

    def group_of(self, k: int) -> tuple[int, ...]:
        """This rank's group in round ``k`` (all ranks on a sync round)."""
        return self.all if is_sync(k, self.sync_period) else self.schedule.group_of(self.rank, k)

    def blocking(self, k: int) -> bool:
        """Whether round ``k`` waits for every rank's fresh tensor instead of being activated."""
        return self.blocking_sync and is_sync(k, self.sync_period)

    # ------------------------------------------------------------------------------ what a mode defines
    def first_exchange(self, initial: torch.Tensor) -> None:  # noqa: B027 - a hook, empty unless a mode needs it
        """A collective the mode needs before the first round, over the global group (none by default)."""

    @abc.abstractmethod
    def publish(self, tensor: torch.Tensor, k: int) -> None:
        """Make ``tensor`` this rank's contribution, as of call ``k`` (main thread)."""

    @abc.abstractmethod
    def take_contribution(self, k: int, group: tuple[int, ...], activated_at: float) -> TakenContribution:
        """Progress thread, lock held: take this rank's contribution to round ``k``, which starts now."""

    @abc.abstractmethod
    def outgoing(self, taken: TakenContribution) -> Outgoing:
        """Progress thread, no lock: the buffers the exchange of ``taken`` reads and writes."""

    @abc.abstractmethod
    def decode(self, wire: torch.Tensor, out: torch.Tensor, size: int, sync: bool) -> None:
        """With a wire dtype: widen the exchanged sum ``wire`` of ``size`` contributions into ``out``."""

    @abc.abstractmethod
    def buffers_in_use(self) -> list[torch.Tensor | None]:
        """Lock held: the buffers the engine still reads or writes (a recycled tensor must be none of them)."""

    def is_in_use(self, tensor: torch.Tensor) -> bool:
        """Lock held: whether ``tensor``'s memory is one the engine still reads or writes (or keeps as a spare)."""
        ptr = tensor.data_ptr()
        return any(t is not None and t.data_ptr() == ptr for t in self.buffers_in_use())

    def done_reading(self, snapshot: torch.Tensor) -> None:  # noqa: B027 - only replace mode reads snapshots
        """The exchange has read ``snapshot``, an :attr:`Outgoing.source` (replace mode only has one)."""

    # ------------------------------------------------------------------------------------ main side
    def shutdown(self) -> None:
        """Stop the threads, release the communicators and the store keys (close() and the finalizer)."""
        with self.cond:
            if self.shut_down:
                return
            self.shut_down = self.stopping = True
            # A round activated before the stop (triggered here or by a peer) is still run, with this rank's last
            # contribution: its group waits for this rank, and every peer's exchange would fail without it.
            self.drain_to = self.activated
            rounds = max(self.drain_to - self.thread_round, 0) + 1
            self.cond.notify_all()
        if self.thread is not threading.current_thread():
            # each collective ends within its timeout
            self.thread.join(timeout=rounds * self.timeout.total_seconds() + 5.0)
        if not self.thread.is_alive():  # a thread stuck in a collective keeps its communicators
            destroy_groups([*self.groups.values(), self.global_pg])
        self.channel.close(self.calls)
        for shm in self.shm.values():
            shm.close()
        self.results.clear()
        self.spares.clear()
        self.forget_buffers()
        self.groups.clear()
        self.global_pg = None

    def forget_buffers(self) -> None:  # noqa: B027 - a hook, for what a mode keeps beyond the spares
        """On shutdown: drop what the mode keeps of its buffers."""

    # ---------------------------------------------------------------------------------- watcher side
    def on_activated(self, k: int) -> None:
        """Watcher: round ``k`` was activated (by any rank)."""
        with self.cond:
            self.activated = max(self.activated, k)
            self.cond.notify_all()

    def next_wait(self, k: int) -> int | None:
        """Watcher: the next round from ``k`` on whose activation key is worth waiting for (blocking rounds have
        none; rounds started here need none), or ``None`` once the engine stops or no round is ever activated."""
        if self.sync_period == 0 and self.blocking_sync:  # every round blocks: no round is ever activated
            return None
        with self.cond:
            while self.blocking(k) or self.activated >= k:  # no key, or started here already
                k += 1
            self.watching = k
            return None if self.stopping else k

    def on_watch_error(self, exc: BaseException) -> None:
        """Watcher: it failed with ``exc``; the main thread raises it at its next call (unless stopping)."""
        with self.cond:
            if self.error is None and not self.stopping:
                self.error = exc
            self.cond.notify_all()

    # -------------------------------------------------------------------------------- progress thread
    def run(self) -> None:
        """The progress thread: :meth:`loop` at its priority and on its CUDA stream; an exception is kept for the
        main thread."""
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
        """Run the rounds in order: wait until one may start, take the contribution, record, exchange, keep."""
        k = self.start
        while True:
            with self.cond:
                if not self.wait_until_startable(k):
                    return
                activated_at = time.time()
                group = self.group_of(k)
                self.phase = f"exchanging with group {group}"
                taken = self.take_contribution(k, group, activated_at)
                gc_floor, published = min(k, self.watching), self.arrived
            self.channel.record(k, gc_floor, published)
            self.exchange(taken)
            self.channel.collect(k)
            k += 1

    def wait_until_startable(self, k: int) -> bool:
        """Lock held: wait until round ``k`` may start here; ``False`` if the engine stops or failed first.

        Three conditions, in this order: the main thread is close enough (:meth:`wait_for_main_thread`), the
        round was activated (unless it is a blocking sync round, which has no activation), and no trigger of an
        earlier round is still being sent (:meth:`wait_for_earlier_trigger`). Once the engine stops, only a round
        activated before the stop (``drain_to``) may still start, and only if the main thread is close enough.
        """
        self.thread_round = k
        blocking = self.blocking(k)
        needed = k if blocking else k - self.max_lead
        self.wait_for_main_thread(needed)
        if not blocking:
            self.phase = self.trigger_phase.format(k=k, i=initiator_of(self.seed, k, self.world_size))
            while not self.stopping and self.error is None and self.activated < k:
                self.cond.wait()
        self.wait_for_earlier_trigger(k)
        if self.error is not None:
            return False
        return not self.stopping or (k <= self.drain_to and self.arrived >= needed)

    def wait_for_main_thread(self, needed: int) -> None:
        """Lock held: wait until this rank's main thread has published call ``needed`` (the lead bound, or a
        blocking round's fresh tensor), or the engine stops."""
        self.phase = f"waiting for this rank's main thread to reach round {needed}"
        while not self.stopping and self.arrived < needed:
            self.cond.wait()

    def wait_for_earlier_trigger(self, k: int) -> None:
        """Lock held: a trigger the main thread is sending for an earlier round goes out before round ``k``'s
        progress record, on the same connection: no rank can delete that round's key before it is written."""
        while self.triggering is not None and self.triggering < k:
            self.cond.wait()

    def exchange(self, taken: TakenContribution) -> None:
        """Allreduce ``taken`` in its round's group and keep the result for the main thread."""
        if taken.event is not None:
            torch.cuda.current_stream(self.device).wait_event(taken.event)
            taken.send.record_stream(torch.cuda.current_stream(self.device))
        out = self.outgoing(taken)
        k, group = taken.round, taken.group
        t0 = time.perf_counter()
        try:
            self.reduce(out, group, taken.is_sync)
        except Exception as exc:
            raise RuntimeError(
                f"round {k}: {self.channel.who_is_missing(k, group)}. The exchange failed with: {exc}"
            ) from exc
        finally:
            if out.source is not None:
                self.done_reading(out.source)
        exchange_s = time.perf_counter() - t0
        finished = FinishedRound(
            k, taken.is_sync, group, out.sum, taken.version, exchange_s, taken.activated_at, None, taken.contributed
        )
        with self.cond:
            finished.event = self.record_event()
            self.results[k] = finished
            self.cond.notify_all()

    def reduce(self, out: Outgoing, group: tuple[int, ...], sync: bool) -> None:
        """Sum this round's contributions into ``out.sum``: on the wire dtype, locally (a singleton group), through
        shared memory or with the group's communicator."""
        pg = self.global_pg if sync else self.groups[group]
        if out.wire is not None:
            if pg is not None:
                dist.all_reduce(out.wire, group=pg)
            self.decode(out.wire, out.sum, len(group), sync)
        elif pg is None:
            if out.source is not None:
                out.sum.copy_(out.source)
        elif self.shm:
            self.shm[group].all_reduce(out.sum if out.source is None else out.source, out=out.sum)
        else:
            dist.all_reduce(out.sum, group=pg)

    # -------------------------------------------------------------------------------------- helpers
    def take_spare(self) -> torch.Tensor | None:
        """A buffer to overwrite, or None (then allocate); caller holds the lock."""
        return self.spares.pop() if self.spares else None

    def give_spare(self, tensor: torch.Tensor) -> None:
        """Keep ``tensor``, which nothing reads any more, for reuse (CPU only, at most :data:`SPARES`); caller
        holds the lock."""
        if not self.cuda and len(self.spares) < SPARES:
            self.spares.append(tensor)

    def record_event(self) -> torch.cuda.Event | None:
        """CUDA: an event recorded on the current stream (what was written so far); ``None`` on CPU."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event
