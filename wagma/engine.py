"""The wait-avoiding group allreduce: the engine under WAGMA-SGD and eager-SGD (docs/design.md §2.3, §3).

Protocol, for call k on rank i (call k of every rank is round k):

1. The main thread *publishes*: in replace mode a copy of its tensor becomes the rank's snapshot; in
   accumulate mode the tensor is added into the pending contribution.
2. It *triggers* round k unless the round is a sync round, this rank may not trigger it, or round k
   has started already: it sets the round's one activation key (a ``set``, which never blocks) and
   its own thread starts the round at once. Activation is global: one arrival anywhere starts round k
   for every group, through every rank's watcher thread, which waits for the activation keys in order.
3. Every rank's progress thread, the only issuer on the engine's communicators, runs the rounds in
   order. For round k it waits until its own main thread is at most ``max_lead`` rounds behind, then
   for the round's activation, then takes whatever the rank has published *at that moment* (a
   consistent snapshot: published tensors are immutable, pending buffers are swapped out under the
   lock), writes its progress record and allreduces the snapshot in round k's group. Sync rounds are over
   all ranks. With ``sync="barrier"`` (the default) they skip activation: the thread waits for its own
   main thread's fresh tensor. With ``sync="wait_avoiding"`` they run exactly like the other rounds
   (triggered by the first arrival, the thread at most ``max_lead`` rounds ahead of its main thread),
   so a late rank joins them with what it published last.
4. The main thread waits for round k's result, which the thread keeps, tagged with its round, until
   the main thread consumes it: every round exactly once, in order, however late the rank is.

A round costs each rank O(1) store calls: at most one trigger ``set`` (the main thread's only store
call), one progress ``set`` and one activation ``wait``. The keys, their cleanup (bounded whatever the
sync period; none left once every rank has closed) and what bounds each store call are described in
:mod:`wagma.engine_store`. A failed or timed-out round names the ranks that did not arrive, from their
progress records. The thread state lives in :class:`wagma.engine_core.EngineCore`, which holds no
reference to the engine: an engine dropped without ``close()``, or alive at interpreter exit, is
closed by a finalizer instead of aborting the process with a collective in flight.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import threading
import time
import weakref
from typing import Literal

import torch
import torch.distributed as dist

from wagma.engine_core import Done, EngineCore, initiator_of, is_sync
from wagma.groups import DEFAULT_TIMEOUT
from wagma.schedule import GroupSchedule
from wagma.shm import check_transport
from wagma.wire import WireDtype, as_wire_dtype, wire_nbytes
from wagma.world import WorldLike, as_world

__all__ = ["SYNCS", "RoundResult", "WaitAvoidingGroupAllreduce", "check_progress_nice"]

Trigger = Literal["any", "initiator"]
Sync = Literal["barrier", "wait_avoiding"]
#: How a sync round runs: "barrier" (blocking, fresh tensors of all ranks) or "wait_avoiding" (triggered by
#: the first arrival like the group rounds; a late rank contributes its last published tensor).
SYNCS: tuple[str, ...] = ("barrier", "wait_avoiding")
_instance_ids = itertools.count()


def check_progress_nice(value: object) -> int:
    """Return ``value`` if it is a valid ``progress_nice`` (an int in [0, 19]), else raise ``ValueError``."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 19:
        raise ValueError(f"progress_nice must be an int in [0, 19], got {value!r}")
    return value


@dataclasses.dataclass
class RoundResult:
    """What one call of :class:`WaitAvoidingGroupAllreduce` returns.

    Attributes:
        round: the round this call ran (call k is round k).
        is_sync: whether it was a sync round: a global round over all ranks (blocking, with fresh tensors,
            unless the engine's ``sync`` is ``"wait_avoiding"``; then ``fresh`` says whether this rank's was).
        group: the ranks that exchanged in this round (all ranks on a sync round).
        sum: the sum of the group members' contributions to this round (owned by the caller).
        fresh: whether this call's tensor went into the exchange.
        staleness: rounds between the newest call included in this rank's contribution and this
            round (0 when fresh; the initial tensor counts as call -1).
        version: the newest call included in this rank's contribution (``start_round - 1``: only
            ``initial``).
        wait_s: time the main thread waited for the result inside this call.
        exchange_s: time the thread spent in the collective.
        activated_at: ``time.time()`` when this rank's thread saw the round's activation.
        triggered_at: ``time.time()`` when this rank triggered the round (it arrived before it had seen
            the round start; ranks arriving at about the same time may all trigger it), else ``None``.
        contributed: with ``keep_contributions=True``, what this rank's thread sent into the round: its
            snapshot of call ``version`` (the tensor itself, not a copy; read it only). It stays unchanged until
            the result is handed back with :meth:`WaitAvoidingGroupAllreduce.release`. ``None`` otherwise.
    """

    round: int
    is_sync: bool
    group: tuple[int, ...]
    sum: torch.Tensor
    fresh: bool
    staleness: int
    version: int
    wait_s: float
    exchange_s: float
    activated_at: float
    triggered_at: float | None = None
    contributed: torch.Tensor | None = None


class WaitAvoidingGroupAllreduce:
    """A group allreduce that the first rank to arrive triggers for everyone (docs/design.md §2.3, §3).

    Construct it collectively, on every rank in the same order, after ``init_process_group`` (it
    creates its communicators up front). Each call ``engine(tensor)`` runs this rank's next round and
    returns a :class:`RoundResult`. Use it as a context manager or call :meth:`close`; an engine that is
    dropped, or still open when the interpreter exits, is closed by a finalizer.

    Args:
        schedule: which ranks exchange in which round, in world ranks; its world size must be the world's.
        initial: what this rank contributes until its first call; fixes shape, dtype and device.
            Replace mode copies it; accumulate mode starts its pending contribution from it.
        sync_period: rounds k with ``k % (sync_period + 1) == sync_period`` are blocking global
            allreduces of fresh tensors (0: every round). Bounds staleness.
        max_lead: how many rounds the progress thread may run ahead of its main thread (0: it waits
            for the main thread every round). Defaults to ``sync_period``; each round of lead can
            hold one result buffer until the main thread consumes it. It bounds staleness: a rank's
            contribution to round k is its call ``k - max_lead`` or newer, on every round.
        sync: ``"barrier"`` (sync rounds block until every rank's fresh tensor is in) or
            ``"wait_avoiding"`` (sync rounds are global rounds run like the group rounds: no rank waits
            for another to arrive; the staleness bound ``max_lead`` holds for them too).
        timeout: bound of every wait: collectives, store calls, and the main thread's wait for a result.
        trigger: ``"any"`` (the first rank to arrive triggers the round: WAGMA, eager-SGD solo) or
            ``"initiator"`` (one rank per round, drawn from ``seed`` identically on every rank,
            triggers it by its arrival alone: eager-SGD majority).
        seed: seed of the initiator draw.
        accumulate: accumulate mode for deltas such as gradients: a call adds its tensor into the
            pending contribution, and an exchange takes the pending contribution and zeroes it
            atomically, so every value is counted in exactly one round. :meth:`take` hands the
            main thread what is still pending.
        store: the c10d store for activation; defaults to the default process group's store.
        name: namespace of the engine's store keys; defaults to a per-process counter, which is the
            same on every rank because construction is collective.
        start_round: the round of the first call (to resume a run: every rank passes the same value).
        progress_nice: CPU tensors on Linux: run the progress thread, and the threads of the engine's gloo
            communicators, this many nice levels below the calling thread (0: the same priority; at most 19).
            Where ranks share cores, their compute then goes first and the exchanges fill the idle time, which
            pays when no one waits for the exchange at once (``submit`` now, ``collect`` a step later); an
            exchange someone waits for can take longer. Ignored for CUDA tensors, whose collectives run on the GPU.
        transport: ``"default"`` (the process groups' backend: gloo for CPU tensors, NCCL for CUDA ones) or
            ``"shm"``: CPU tensors of ranks on one host are summed through shared memory
            (:class:`wagma.shm.SharedMemoryAllreduce`, one segment per group of this rank, ``(S + 1) x`` the
            tensor's size; gloo still carries the barriers), which spares the cores gloo's socket copies.
        keep_contributions: replace mode: every :class:`RoundResult` also carries ``contributed``, the snapshot
            this rank's thread sent into the round, kept unchanged until the result is handed back with
            :meth:`release` (instead of :meth:`recycle`). For a caller that applies a round against what it
            contributed even when that was an older snapshot than its last call's; no copy is made.
        world: the ranks the engine averages over (:func:`wagma.world.as_world`): ``None`` for the whole job, a
            process group or a ``(DeviceMesh, dim_name)`` pair; ``schedule`` and ``rank`` are then in world ranks
            and every world of the family runs its own engine, constructed at the same time on every rank.
        wire_dtype: the dtype the exchanges send and sum in (:mod:`wagma.wire`): ``None`` (the tensor's own),
            ``torch.bfloat16`` or ``torch.float16`` (or their names) for a float32/float64 tensor. Results are
            widened back: ``RoundResult.sum`` keeps the tensor's dtype. Replace mode sends each snapshot as its
            delta from a reference every rank holds identically (world rank 0's ``initial``, broadcast at
            construction, then the mean of each sync round) and adds the group's share of it back to the sum;
            accumulate mode casts the pending contribution itself. Not with ``transport="shm"``, which moves no
            bytes over a wire.
        error_feedback: accumulate mode with a ``wire_dtype``: keep what the cast rounds off in the pending
            contribution, so it goes out with a later round and :meth:`take` still accounts for every value
            (``False``: drop it, a plain cast). Ignored without a ``wire_dtype`` and in replace mode.
    """

    def __init__(
        self,
        schedule: GroupSchedule,
        initial: torch.Tensor,
        *,
        sync_period: int,
        max_lead: int | None = None,
        timeout: datetime.timedelta = datetime.timedelta(minutes=5),
        sync: Sync = "barrier",
        trigger: Trigger = "any",
        seed: int = 0,
        accumulate: bool = False,
        store: dist.Store | None = None,
        name: str | None = None,
        start_round: int = 0,
        progress_nice: int = 0,
        transport: str = "default",
        keep_contributions: bool = False,
        world: WorldLike = None,
        wire_dtype: WireDtype = None,
        error_feedback: bool = True,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "WaitAvoidingGroupAllreduce needs an initialized default process group: "
                "call torch.distributed.init_process_group() first"
            )
        if not isinstance(schedule, GroupSchedule):
            raise ValueError(f"schedule must be a wagma.GroupSchedule, got {type(schedule).__name__}")
        resolved = as_world(world, timeout if isinstance(timeout, datetime.timedelta) else DEFAULT_TIMEOUT)
        if not resolved.is_member:
            raise ValueError(f"world: rank {dist.get_rank()} is in none of the worlds {list(resolved.family)}")
        world_size = resolved.size
        if schedule.world_size != world_size:
            where = "the job has" if resolved.whole_job else f"its world {list(resolved.ranks)} has"
            raise ValueError(
                f"the schedule is for {schedule.world_size} ranks but {where} {world_size}: "
                f"build it with world_size={world_size}"
            )
        if not isinstance(sync_period, int) or isinstance(sync_period, bool) or sync_period < 0:
            raise ValueError(f"sync_period must be an int >= 0, got {sync_period!r}")
        if max_lead is None:
            max_lead = sync_period
        if not isinstance(max_lead, int) or isinstance(max_lead, bool) or not 0 <= max_lead <= max(sync_period, 0):
            raise ValueError(
                f"max_lead must be an int in [0, sync_period={sync_period}] (a blocking sync round needs the "
                f"fresh tensor, so the thread can never lead by more; under sync='wait_avoiding' max_lead is the "
                f"staleness bound, kept within the sync period), got {max_lead!r}"
            )
        if sync not in SYNCS:
            raise ValueError(f"sync must be one of {SYNCS}, got {sync!r}")
        if trigger not in ("any", "initiator"):
            raise ValueError(f"trigger must be 'any' or 'initiator', got {trigger!r}")
        if not isinstance(initial, torch.Tensor):
            raise ValueError(f"initial must be a torch.Tensor, got {type(initial).__name__}")
        if not isinstance(start_round, int) or isinstance(start_round, bool) or start_round < 0:
            raise ValueError(f"start_round must be an int >= 0, got {start_round!r}")
        if not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
            raise ValueError(f"timeout must be a positive datetime.timedelta, got {timeout!r}")
        check_progress_nice(progress_nice)
        check_transport(transport, initial.device)
        if not isinstance(keep_contributions, bool):
            raise ValueError(f"keep_contributions must be True or False, got {keep_contributions!r}")
        narrow = as_wire_dtype(wire_dtype, initial.dtype)
        if narrow is not None and transport == "shm":
            raise ValueError(
                f"wire_dtype={narrow} needs transport='default': transport 'shm' sums in shared memory, with no wire "
                "to save bytes on"
            )
        if not isinstance(error_feedback, bool):
            raise ValueError(f"error_feedback must be True or False, got {error_feedback!r}")
        if keep_contributions and accumulate:
            raise ValueError(
                "keep_contributions=True needs accumulate=False: in accumulate mode a contribution is a sum that "
                "the exchange takes over, not a snapshot"
            )

        #: The world this engine averages over (the whole job unless ``world`` was given).
        self.world = resolved
        #: This rank's world rank (the job's rank when the world is the whole job).
        self.rank = resolved.rank
        self.world_size = world_size
        self.schedule = schedule
        self.sync_period = sync_period
        self.max_lead = max_lead
        self.timeout = timeout
        self.sync: Sync = sync
        self.trigger = trigger
        self.seed = int(seed)
        self.accumulate = accumulate
        self.progress_nice = progress_nice
        self.transport = transport
        self.keep_contributions = keep_contributions
        self.shape, self.dtype, self.device = initial.shape, initial.dtype, initial.device
        #: The dtype the exchanges send and sum in (``None``: the tensor's own).
        self.wire_dtype: torch.dtype | None = narrow
        self.error_feedback = error_feedback
        #: Bytes this rank hands to one exchange (the tensor's size in ``wire_dtype``).
        self.wire_nbytes: int = wire_nbytes(initial.numel(), initial.dtype, narrow)
        base = store if store is not None else dist.distributed_c10d._get_default_store()
        prefix = f"wagma/{resolved.key}{name if name is not None else next(_instance_ids)}/"
        # The progress thread and the finalizer see only the core, never `self`: a dropped engine is collected.
        self._core = EngineCore(self, initial, base, prefix, start_round)
        self._finalizer = weakref.finalize(self, self._core.shutdown)
        self._calls = start_round
        self._uncollected: dict[int, float | None] = {}  # submitted rounds -> when this rank triggered them
        self._unreleased: set[int] = set()  # keep_contributions: collected rounds whose result is not released yet

    # ----------------------------------------------------------------------------------- public API
    @property
    def round(self) -> int:
        """The round the next call will run."""
        return self._calls

    @property
    def _thread(self) -> threading.Thread:
        return self._core.thread

    def is_sync_round(self, k: int) -> bool:
        """Whether round ``k`` is a sync round (global; blocking unless ``sync="wait_avoiding"``)."""
        return is_sync(k, self.sync_period)

    def initiator(self, k: int) -> int:
        """The rank whose arrival triggers round ``k`` when ``trigger="initiator"`` (same on all ranks)."""
        return initiator_of(self.seed, k, self.world_size)

    def group_of(self, k: int) -> tuple[int, ...]:
        """This rank's group in round ``k`` (all ranks on a sync round)."""
        return self._core.group_of(k)

    def __call__(self, tensor: torch.Tensor) -> RoundResult:
        """Publish ``tensor`` (or add it, in accumulate mode), run this rank's next round, return its result.

        The same as ``engine.collect(engine.submit(tensor))``.
        """
        return self.collect(self.submit(tensor))

    def submit(self, tensor: torch.Tensor) -> int:
        """Publish ``tensor`` (or add it, in accumulate mode) as this rank's next call, trigger its round
        unless it has started already, and return the round's number without waiting for it.

        In accumulate mode, a tensor from :meth:`staging_buffer` is taken over rather than added where it can be.
        Every submitted round must be :meth:`collect`-ed once (its result is held until then), in any
        order; a blocking sync round's collective still waits for every rank's fresh tensor. Submitting
        round k + 1 before collecting round k lets round k's exchange overlap the caller's next step.
        """
        self._check_usable()
        self._check_tensor(tensor)
        k = self._calls
        self._calls += 1
        core = self._core
        core.calls = self._calls
        core.publish(tensor, k)
        self._uncollected[k] = self._maybe_trigger(k)
        return k

    def publish_ahead(self, tensor: torch.Tensor) -> None:
        """Replace mode: publish ``tensor`` now as this rank's contribution to the round its next call runs, without
        running that round or triggering it.

        For a caller whose next call will submit this very tensor unchanged, known before the work that precedes
        the call (WAGMA's ``average_then_step`` order: the model after ``optimizer.step()`` is the one the next
        step's gradient is computed at and the next call publishes). A round that starts before that call then
        takes this snapshot, counted fresh (``RoundResult.fresh``, staleness 0, ``version`` the next call), instead
        of the previous call's. The next call still publishes its own tensor (it replaces this snapshot if its
        round has not started yet), and nothing else changes: the lead bound and blocking sync rounds still wait
        for that call.
        """
        self._check_usable()
        if self.accumulate:
            raise RuntimeError(
                "publish_ahead() needs accumulate=False: in accumulate mode a call adds to what is "
                "pending, and nothing can be added ahead of it"
            )
        self._check_tensor(tensor)
        self._core.publish(tensor, self._calls, arrive=False)

    def _check_tensor(self, tensor: object) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.shape != self.shape or tensor.dtype != self.dtype or tensor.device != self.device:
            raise ValueError(
                f"expected a tensor of shape {tuple(self.shape)}, dtype {self.dtype} on {self.device} "
                f"(fixed by `initial`), got shape {tuple(tensor.shape)}, dtype {tensor.dtype} on {tensor.device}"
            )

    def staging_buffer(self) -> torch.Tensor:
        """Accumulate mode: a zeroed buffer of the engine's shape to write this rank's next contribution into.

        Fill it (copy or add into it), then pass this very tensor to :meth:`submit` (or call the engine with it):
        when nothing is pending (the usual case: the last exchange took it all), the engine keeps the buffer
        as the pending contribution instead of adding it into its own, and hands out the pending zeros as the
        next staging buffer; otherwise it adds the buffer and zeroes it. Either way the sums are those of
        :meth:`submit` with any other tensor, with one to three passes over the tensor fewer. Call this again
        after each submit: the buffer it returned before belongs to the engine once submitted.
        """
        self._check_usable()
        if not self.accumulate:
            raise RuntimeError("staging_buffer() needs accumulate=True: in replace mode a call copies its tensor")
        core = self._core
        with core.cond:
            if core.staging is None:
                core.staging = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
            return core.staging

    def collect(self, k: int) -> RoundResult:
        """Wait (within the timeout) for round ``k``, which this rank submitted, and return its result once."""
        if k not in self._uncollected:
            raise ValueError(
                f"round {k}: expected a round this rank submitted and has not collected yet "
                f"({sorted(self._uncollected) or 'none'}), found {k}"
            )
        self._check_usable()
        t0 = time.perf_counter()
        done = self._wait_result(k)
        wait_s = time.perf_counter() - t0
        triggered_at = self._uncollected.pop(k)
        if self.keep_contributions:
            self._unreleased.add(k)
        if done.event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(done.event)
            done.sum.record_stream(stream)
        return RoundResult(
            round=k,
            is_sync=done.is_sync,
            group=done.group,
            sum=done.sum,
            fresh=done.version >= k,
            staleness=k - done.version,
            version=done.version,
            wait_s=wait_s,
            exchange_s=done.exchange_s,
            activated_at=done.activated_at,
            triggered_at=triggered_at,
            contributed=done.contributed,
        )

    def recycle(self, tensor: torch.Tensor) -> None:
        """Hand back a result's ``sum`` that the caller no longer reads or writes: a later round reuses its memory.

        Optional, and only worth it on CPU, where it spares every round a fresh allocation of the tensor's size
        (page faults and zeroing); on CUDA it does nothing (PyTorch's caching allocator does that job). The
        tensor must be one this engine returned (same shape, dtype, device, its own storage) and must not be
        used again by the caller: the engine will overwrite it.
        """
        self._check_usable()
        self._recycle(tensor)

    def _recycle(self, tensor: torch.Tensor) -> None:
        """:meth:`recycle` once the engine is known to be usable."""
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"recycle: expected a torch.Tensor, got {type(tensor).__name__}")
        if (
            tensor.shape != self.shape
            or tensor.dtype != self.dtype
            or tensor.device != self.device
            or not tensor.is_contiguous()
            or tensor.storage_offset() != 0
            or tensor.untyped_storage().nbytes() != tensor.nbytes
        ):
            raise ValueError(
                f"recycle: expected a result sum of this engine (shape {tuple(self.shape)}, dtype {self.dtype} on "
                f"{self.device}, its own contiguous storage), got shape {tuple(tensor.shape)}, dtype {tensor.dtype} "
                f"on {tensor.device}"
            )
        core = self._core
        with core.cond:
            ptr = tensor.data_ptr()
            in_use = [core.snapshot, core.reading, core.staging, *core.spares, *(d.sum for d in core.results.values())]
            if ptr in core.pins or any(t is not None and t.data_ptr() == ptr for t in in_use):
                raise ValueError("recycle: this tensor is still in use by the engine (or was recycled already)")
            core.give_spare(tensor)

    def release(self, result: RoundResult) -> None:
        """``keep_contributions=True``: hand back a collected result once its ``sum`` and ``contributed`` are read
        for the last time. The sum is recycled (:meth:`recycle`); the snapshot is reused once no other result
        holds it and a newer one has replaced it. Every collected result must be released once: a snapshot
        still held is never reused (correct, but each round then allocates)."""
        self._check_usable()
        if not isinstance(result, RoundResult):
            raise ValueError(f"release: expected a RoundResult, got {type(result).__name__}")
        if result.contributed is None:
            raise ValueError(
                "release: expected a result of an engine with keep_contributions=True (it carries `contributed`), "
                "found one without; hand its sum back with recycle()"
            )
        if result.round not in self._unreleased:
            raise ValueError(
                f"release: round {result.round} is not a collected, unreleased round of this engine (released "
                f"already?); unreleased: {sorted(self._unreleased) or 'none'}"
            )
        self._unreleased.discard(result.round)
        core = self._core
        with core.cond:
            core.unpin(result.contributed)
        self._recycle(result.sum)

    def take(self) -> torch.Tensor:
        """Accumulate mode: hand over what is still pending (not yet taken by an exchange) and zero it.

        Together with the sums of all rounds, this accounts for every value ever passed in, each
        once. Use it for a final flush.
        """
        self._check_usable()
        if not self.accumulate:
            raise RuntimeError("take() needs accumulate=True: in replace mode nothing is pending")
        core = self._core
        with core.cond:
            out, event = core.swap_pending()
        if event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)
            out.record_stream(stream)
        return out

    def published(self) -> torch.Tensor:
        """Replace mode: this rank's snapshot, the copy of the tensor it submitted last, itself (no copy is made).

        For a caller that needs what it submitted later on (an overlapped round is applied against it) and would
        otherwise keep a copy of its own. Only read it: the progress thread may be reading it for an exchange. It
        stays as it is until this rank's next submit (or call), after which the engine may reuse its memory, so
        read it before then.
        """
        self._check_usable()
        if self.accumulate:
            raise RuntimeError(
                "published() needs accumulate=False: in accumulate mode what is pending is a sum (see pending())"
            )
        core = self._core
        with core.cond:
            snapshot, event = core.snapshot, core.snapshot_event
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        return snapshot

    def pending(self) -> torch.Tensor:
        """Accumulate mode: a copy of what is pending now, without taking it (for checkpoints)."""
        self._check_usable()
        if not self.accumulate:
            raise RuntimeError("pending() needs accumulate=True: in replace mode nothing is pending")
        core = self._core
        with core.cond:
            if core.snapshot_event is not None:
                torch.cuda.current_stream(self.device).wait_event(core.snapshot_event)
            return core.snapshot.clone()

    def close(self) -> None:
        """Stop the progress thread, release the communicators and this rank's store keys.

        A caller blocked in this engine on another thread wakes at once with a ``RuntimeError``. The
        join is bounded by the timeout (a collective in flight runs to its end or its timeout). Once every
        rank has closed, no key of the engine is left in the store. A second call does nothing.
        """
        self._finalizer()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (or the engine was finalized)."""
        return not self._finalizer.alive

    def __enter__(self) -> WaitAvoidingGroupAllreduce:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------------------------- main thread
    def _check_usable(self) -> None:
        if self.closed:
            raise RuntimeError("this WaitAvoidingGroupAllreduce is closed; create a new one to continue")
        core = self._core
        if core.error is not None:
            raise RuntimeError(
                f"wagma progress thread of {self.world.describe(self.rank)} failed in round {core.thread_round} "
                f"(group {self.group_of(core.thread_round)}): {core.error}"
            ) from core.error

    def _maybe_trigger(self, k: int) -> float | None:
        if self._core.blocking(k) or (self.trigger == "initiator" and self.initiator(k) != self.rank):
            return None
        core = self._core
        with core.cond:
            if core.activated >= k:  # round k has started already: someone else triggered it
                return None
            core.triggering = k  # the thread records no later round before this trigger is sent
        try:
            core.channel.trigger(k)  # a set(): never blocks, even on a frozen store
            return time.time()
        finally:
            with core.cond:
                core.triggering = None
                core.activated = max(core.activated, k)  # our own thread starts without waiting for the echo
                core.cond.notify_all()

    def _wait_result(self, k: int) -> Done:
        # Once the round has started, the thread's own collective timeout normally fires first and explains
        # more; `limit` is the backstop. A round that has not even started after the timeout (its initiator
        # never triggered it) has no collective in flight to time out: it fails at the timeout.
        limit = self.timeout.total_seconds() * 1.5 + 1.0
        start = time.monotonic()
        deadline, unstarted = start + limit, start + self.timeout.total_seconds()
        core = self._core
        with core.cond:
            while k not in core.results and core.error is None and not core.stop:
                now = time.monotonic()
                waiting_trigger = not core.blocking(k) and core.activated < k
                if now >= deadline or (waiting_trigger and now >= unstarted):
                    limit = now - start
                    break
                core.cond.wait(timeout=(unstarted if waiting_trigger else deadline) - now)
            if k in core.results:
                return core.results.pop(k)
            stopped, round_, phase = core.stop and core.error is None, core.thread_round, core.phase
        if stopped:
            raise RuntimeError(
                f"{self.world.describe(self.rank)}: this engine was closed (from another thread) "
                f"while waiting for round {k}; "
                f"create a new one to continue"
            )
        self._check_usable()
        why = core.channel.who_is_missing(round_, self.group_of(round_))
        raise TimeoutError(
            f"{self.world.describe(self.rank)}: round {k} did not complete within {limit:.1f} s; "
            f"the progress thread is in round {round_}, {phase}; {why}. "
            f"A peer may have died, hung or be slower than the timeout ({self.timeout}); "
            "raise `timeout` if that is expected."
        )
