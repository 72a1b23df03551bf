"""The wait-avoiding group allreduce: the engine under WAGMA-SGD and eager-SGD (docs/design.md §2.3, §3).

Two engines, one per mode, on one protocol (:class:`GroupAllreduceEngine`): :class:`WaitAvoidingGroupAllreduce`
(replace mode: a call publishes a copy of its tensor; model averaging) and :class:`AccumulatingGroupAllreduce`
(accumulate mode: a call adds its tensor into the pending contribution; gradients).

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
progress records. The thread state lives in :class:`wagma.engine_core.EngineCore` (one subclass per mode in
:mod:`wagma.engine_modes`), which holds no
reference to the engine: an engine dropped without ``close()``, or alive at interpreter exit, is
closed by a finalizer instead of aborting the process with a collective in flight.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from wagma.checks import check_bool
from wagma.engine_base import GroupAllreduceEngine, RoundResult
from wagma.engine_core import CoreSetup
from wagma.engine_modes import AccumulateCore, ReplaceCore
from wagma.engine_options import SYNCS, RoundOptions, Sync, Trigger, check_max_lead, check_progress_nice
from wagma.schedule import GroupSchedule
from wagma.wire import WireDtype
from wagma.world import WorldLike

__all__ = [
    "SYNCS",
    "AccumulatingGroupAllreduce",
    "GroupAllreduceEngine",
    "RoundOptions",
    "RoundResult",
    "Sync",
    "Trigger",
    "WaitAvoidingGroupAllreduce",
    "check_max_lead",
    "check_progress_nice",
]

#: What the replace-mode engine does not take: they belong to :class:`AccumulatingGroupAllreduce`.
_ACCUMULATE_ONLY = ("accumulate", "error_feedback")


class WaitAvoidingGroupAllreduce(GroupAllreduceEngine):
    """The replace-mode engine, for model averaging: a call publishes a copy of its tensor (docs/design.md §2.3).

    Each call ``engine(tensor)`` makes a copy of ``tensor`` this rank's snapshot, runs its next round, and returns
    a :class:`RoundResult` whose ``sum`` is the sum of the group members' snapshots. It takes the arguments of
    :class:`GroupAllreduceEngine` (the fields of :class:`RoundOptions` as keywords of their own) and:

    Args:
        keep_contributions: every :class:`RoundResult` also carries ``contributed``, the snapshot this rank's
            thread sent into the round, kept unchanged until the result is handed back with :meth:`release`
            (instead of :meth:`recycle`). For a caller that applies a round against what it contributed even when
            that was an older snapshot than its last call's; no copy is made.

    With a ``wire_dtype``, each snapshot is sent as its delta from a reference every rank holds identically
    (world rank 0's ``initial``, broadcast at construction, then the mean of each sync round), and the group's
    share of it is added back to the sum. For gradients (a call adds a delta), use
    :class:`AccumulatingGroupAllreduce`: passing ``accumulate=`` here raises a ``TypeError`` that says so.
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
        store: dist.Store | None = None,
        name: str | None = None,
        start_round: int = 0,
        progress_nice: int = 0,
        transport: str = "default",
        keep_contributions: bool = False,
        world: WorldLike = None,
        wire_dtype: WireDtype = None,
        **accumulate_options: object,
    ) -> None:
        if accumulate_options:
            _refuse(type(self).__name__, accumulate_options)
        self._require_process_group()
        options = RoundOptions(
            sync_period=sync_period,
            max_lead=max_lead,  # type: ignore[arg-type]  # None becomes sync_period in __post_init__
            sync=sync,
            trigger=trigger,
            timeout=timeout,
            seed=seed,
            start_round=start_round,
            progress_nice=progress_nice,
        )
        #: Whether results carry ``contributed`` (see :meth:`release`).
        self.keep_contributions = check_bool("keep_contributions", keep_contributions)
        self._unreleased: set[int] = set()  # collected rounds whose result is not released yet
        super().__init__(
            schedule, initial, options, store=store, name=name, transport=transport, world=world, wire_dtype=wire_dtype
        )

    def _start_core(self, setup: CoreSetup) -> ReplaceCore:
        return ReplaceCore(setup, keep_contributions=self.keep_contributions)

    @property
    def _replace(self) -> ReplaceCore:
        return self._core  # type: ignore[return-value]

    def publish_ahead(self, tensor: torch.Tensor) -> None:
        """Publish ``tensor`` now as this rank's contribution to the round its next call runs, without running that
        round or triggering it.

        For a caller whose next call will submit this very tensor unchanged, known before the work that precedes
        the call (WAGMA's ``average_then_step`` order: the model after ``optimizer.step()`` is the one the next
        step's gradient is computed at and the next call publishes). A round that starts before that call then
        takes this snapshot, counted fresh (``RoundResult.fresh``, staleness 0, ``version`` the next call), instead
        of the previous call's. The next call still publishes its own tensor (it replaces this snapshot if its
        round has not started yet), and nothing else changes: the lead bound and blocking sync rounds still wait
        for that call.
        """
        self._check_usable()
        self._check_tensor(tensor)
        self._replace.publish(tensor, self._calls, arrive=False)

    def published(self) -> torch.Tensor:
        """This rank's snapshot, the copy of the tensor it submitted last, itself (no copy is made).

        For a caller that needs what it submitted later on (an overlapped round is applied against it) and would
        otherwise keep a copy of its own. Only read it: the progress thread may be reading it for an exchange. It
        stays as it is until this rank's next submit (or call), after which the engine may reuse its memory, so
        read it before then.
        """
        self._check_usable()
        core = self._core
        with core.cond:
            snapshot, event = core.snapshot, core.snapshot_event
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        return snapshot

    def collect(self, k: int) -> RoundResult:
        """Wait (within the timeout) for round ``k``, which this rank submitted, and return its result once.

        With ``keep_contributions=True``, hand the result back with :meth:`release` once it is read.
        """
        result = super().collect(k)
        if self.keep_contributions:
            self._unreleased.add(k)
        return result

    def release(self, result: RoundResult) -> None:
        """``keep_contributions=True``: hand back a collected result once its ``sum`` and ``contributed`` are read
        for the last time. The sum is recycled (:meth:`recycle`); the snapshot is reused once no other result
        holds it and a newer one has replaced it. Every collected result must be released once: a snapshot
        still held is never reused (correct, but each round then allocates)."""
        self._check_usable()
        if not isinstance(result, RoundResult):
            raise ValueError(f"release: expected a RoundResult, found {type(result).__name__}")
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
        core = self._replace
        with core.cond:
            core.release_contribution(result.contributed)
        self._recycle(result.sum)


class AccumulatingGroupAllreduce(GroupAllreduceEngine):
    """The accumulate-mode engine, for deltas such as gradients: a call adds its tensor into this rank's pending
    contribution, and an exchange takes the pending contribution and zeroes it atomically, so every value is
    counted in exactly one round (eager-SGD's partial allreduce, docs/design.md §2.4).

    ``initial`` is the pending contribution it starts from; :meth:`take_pending` hands the main thread what is
    still pending. It takes the arguments of :class:`GroupAllreduceEngine` (the fields of :class:`RoundOptions`
    as keywords of their own) and:

    Args:
        error_feedback: with a ``wire_dtype`` (which casts the pending contribution itself): keep what the cast
            rounds off in the pending contribution, so it goes out with a later round and :meth:`take_pending` still
            accounts for every value (``False``: drop it, a plain cast). Ignored without a ``wire_dtype``.
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
        store: dist.Store | None = None,
        name: str | None = None,
        start_round: int = 0,
        progress_nice: int = 0,
        transport: str = "default",
        world: WorldLike = None,
        wire_dtype: WireDtype = None,
        error_feedback: bool = True,
    ) -> None:
        self._require_process_group()
        options = RoundOptions(
            sync_period=sync_period,
            max_lead=max_lead,  # type: ignore[arg-type]  # None becomes sync_period in __post_init__
            sync=sync,
            trigger=trigger,
            timeout=timeout,
            seed=seed,
            start_round=start_round,
            progress_nice=progress_nice,
        )
        #: Whether what a wire-dtype cast rounds off stays pending.
        self.error_feedback = check_bool("error_feedback", error_feedback)
        super().__init__(
            schedule, initial, options, store=store, name=name, transport=transport, world=world, wire_dtype=wire_dtype
        )

    def _start_core(self, setup: CoreSetup) -> AccumulateCore:
        return AccumulateCore(setup, error_feedback=self.error_feedback)

    @property
    def _accumulate(self) -> AccumulateCore:
        return self._core  # type: ignore[return-value]

    def staging_buffer(self) -> torch.Tensor:
        """A zeroed buffer of the engine's shape to write this rank's next contribution into.

        Fill it (copy or add into it), then pass this very tensor to :meth:`submit` (or call the engine with it):
        when nothing is pending (the usual case: the last exchange took it all), the engine keeps the buffer
        as the pending contribution instead of adding it into its own, and hands out the pending zeros as the
        next staging buffer; otherwise it adds the buffer and zeroes it. Either way the sums are those of
        :meth:`submit` with any other tensor, with one to three passes over the tensor fewer. Call this again
        after each submit: the buffer it returned before belongs to the engine once submitted.
        """
        self._check_usable()
        core = self._accumulate
        with core.cond:
            if core.staging is None:
                core.staging = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
            return core.staging

    def take_pending(self) -> torch.Tensor:
        """Hand over what is still pending (not yet taken by an exchange) and zero it.

        Together with the sums of all rounds, this accounts for every value ever passed in, each
        once. Use it for a final flush.
        """
        self._check_usable()
        core = self._accumulate
        with core.cond:
            out, event = core.take_pending()
        if event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)
            out.record_stream(stream)
        return out

    def pending(self) -> torch.Tensor:
        """A copy of what is pending now, without taking it (for checkpoints)."""
        self._check_usable()
        core = self._core
        with core.cond:
            if core.snapshot_event is not None:
                torch.cuda.current_stream(self.device).wait_event(core.snapshot_event)
            return core.snapshot.clone()


def _refuse(engine: str, options: dict[str, object]) -> None:
    """The one-line ``TypeError`` for keywords the replace-mode engine does not take."""
    mode_options = sorted(set(options) & set(_ACCUMULATE_ONLY))
    if mode_options:
        raise TypeError(
            f"{engine} is the replace-mode engine and takes no {', '.join(mode_options)}=: for accumulate mode use "
            "wagma.AccumulatingGroupAllreduce (the same arguments, without accumulate=)"
        )
    raise TypeError(f"{engine}.__init__() got an unexpected keyword argument {sorted(options)[0]!r}")
