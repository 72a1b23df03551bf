"""The part both engines of :mod:`wagma.engine` share: :class:`GroupAllreduceEngine`, the main thread's side of the
protocol (submit, trigger, collect, recycle, close), and :class:`RoundResult`, what a call returns.

The protocol itself is stated in :mod:`wagma.engine`; the progress thread in :mod:`wagma.engine_core`.
"""

from __future__ import annotations

import abc
import dataclasses
import datetime
import itertools
import time
import weakref
from typing import TypeVar

import torch
import torch.distributed as dist

from wagma.checks import fail
from wagma.engine_core import CoreSetup, EngineCore, FinishedRound, initiator_of, is_sync
from wagma.engine_options import RoundOptions, Sync, Trigger
from wagma.schedule import GroupSchedule
from wagma.shm import check_transport
from wagma.wire import WireDtype, as_wire_dtype, wire_nbytes
from wagma.world import World, WorldLike, as_world

__all__ = ["GroupAllreduceEngine", "RoundResult"]

_instance_ids = itertools.count()
_Engine = TypeVar("_Engine", bound="GroupAllreduceEngine")


@dataclasses.dataclass
class RoundResult:
    """What one call of an engine (:class:`WaitAvoidingGroupAllreduce`, :class:`AccumulatingGroupAllreduce`) returns.

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


class GroupAllreduceEngine(abc.ABC):
    """The protocol both engines share: rounds that the first rank to arrive triggers for everyone
    (docs/design.md §2.3, §3). Construct :class:`WaitAvoidingGroupAllreduce` (replace mode) or
    :class:`AccumulatingGroupAllreduce` (accumulate mode); this class is their common part.

    Construct an engine collectively, on every rank in the same order, after ``init_process_group`` (it
    creates its communicators up front). Each call ``engine(tensor)`` runs this rank's next round and
    returns a :class:`RoundResult`. Use it as a context manager or call :meth:`close`; an engine that is
    dropped, or still open when the interpreter exits, is closed by a finalizer.

    Both engines take these arguments, the fields of ``options`` (:class:`RoundOptions`) as keywords of their own:

    Args:
        schedule: which ranks exchange in which round, in world ranks; its world size must be the world's.
        initial: what this rank contributes until its first call; fixes shape, dtype and device.
        options: the round options, checked (:class:`RoundOptions`), kept as :attr:`options`.
        store: the c10d store for activation; defaults to the default process group's store.
        name: namespace of the engine's store keys; defaults to a per-process counter, which is the
            same on every rank because construction is collective.
        transport: ``"default"`` (the process groups' backend: gloo for CPU tensors, NCCL for CUDA ones) or
            ``"shm"``: CPU tensors of ranks on one host are summed through shared memory
            (:class:`wagma.shm.SharedMemoryAllreduce`, one segment per group of this rank, ``(S + 1) x`` the
            tensor's size; gloo still carries the barriers), which spares the cores gloo's socket copies.
        world: the ranks the engine averages over (:func:`wagma.world.as_world`): ``None`` for the whole job, a
            process group or a ``(DeviceMesh, dim_name)`` pair; ``schedule`` and ``rank`` are then in world ranks
            and every world of the family runs its own engine, constructed at the same time on every rank.
        wire_dtype: the dtype the exchanges send and sum in (:mod:`wagma.wire`): ``None`` (the tensor's own),
            ``torch.bfloat16`` or ``torch.float16`` (or their names) for a float32/float64 tensor. Results are
            widened back: ``RoundResult.sum`` keeps the tensor's dtype. Not with ``transport="shm"``, which moves
            no bytes over a wire.
    """

    def __init__(
        self,
        schedule: GroupSchedule,
        initial: torch.Tensor,
        options: RoundOptions,
        *,
        store: dist.Store | None,
        name: str | None,
        transport: str,
        world: WorldLike,
        wire_dtype: WireDtype,
    ) -> None:
        if not isinstance(schedule, GroupSchedule):
            raise fail("schedule", "a wagma.GroupSchedule", type(schedule))
        resolved = self._resolve_world(schedule, world, options.timeout)
        if not isinstance(initial, torch.Tensor):
            raise fail("initial", "a torch.Tensor", type(initial))
        check_transport(transport, initial.device)
        wire = as_wire_dtype(wire_dtype, initial.dtype)
        if wire is not None and transport == "shm":
            raise ValueError(
                f"wire_dtype={wire} needs transport='default': transport 'shm' sums in shared memory, with no wire "
                "to save bytes on"
            )
        #: The round options, checked.
        self.options = options
        #: The world this engine averages over (the whole job unless ``world`` was given).
        self.world = resolved
        #: This rank's world rank (the job's rank when the world is the whole job).
        self.rank = resolved.rank
        self.world_size = resolved.size
        self.schedule = schedule
        self.sync_period, self.max_lead, self.timeout = options.sync_period, options.max_lead, options.timeout
        self.sync: Sync = options.sync
        self.trigger: Trigger = options.trigger
        self.seed, self.progress_nice = options.seed, options.progress_nice
        self.transport = transport
        self.shape, self.dtype, self.device = initial.shape, initial.dtype, initial.device
        #: The dtype the exchanges send and sum in (``None``: the tensor's own).
        self.wire_dtype: torch.dtype | None = wire
        #: Bytes this rank hands to one exchange (the tensor's size in ``wire_dtype``).
        self.wire_nbytes: int = wire_nbytes(initial.numel(), initial.dtype, wire)
        base = store if store is not None else dist.distributed_c10d._get_default_store()
        prefix = f"wagma/{resolved.key}{name if name is not None else next(_instance_ids)}/"
        # The progress thread and the finalizer see only the core, never `self`: a dropped engine is collected.
        self._core = self._start_core(
            CoreSetup(self.options, resolved, schedule, initial, base, prefix, transport, wire)
        )
        self._finalizer = weakref.finalize(self, self._core.shutdown)
        self._calls = options.start_round
        self._uncollected: dict[int, float | None] = {}  # submitted rounds -> when this rank triggered them

    @classmethod
    def _require_process_group(cls) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                f"{cls.__name__} needs an initialized default process group: "
                "call torch.distributed.init_process_group() first"
            )

    @staticmethod
    def _resolve_world(schedule: GroupSchedule, world: WorldLike, timeout: datetime.timedelta) -> World:
        """The engine's world, which this rank must be in and the schedule must fit."""
        resolved = as_world(world, timeout)
        if not resolved.is_member:
            raise ValueError(f"world: rank {dist.get_rank()} is in none of the worlds {list(resolved.family)}")
        if schedule.world_size != resolved.size:
            where = "the job has" if resolved.whole_job else f"its world {list(resolved.ranks)} has"
            raise ValueError(
                f"the schedule is for {schedule.world_size} ranks but {where} {resolved.size}: "
                f"build it with world_size={resolved.size}"
            )
        return resolved

    @abc.abstractmethod
    def _start_core(self, setup: CoreSetup) -> EngineCore:
        """The mode's core (which starts the threads); every attribute of the engine is set when it is called."""

    # ----------------------------------------------------------------------------------- public API
    @property
    def round(self) -> int:
        """The round the next call will run."""
        return self._calls

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

        In accumulate mode, a tensor from :meth:`AccumulatingGroupAllreduce.staging_buffer` is taken over rather
        than added where it can be. Every submitted round must be :meth:`collect`-ed once (its result is held
        until then), in any order; a blocking sync round's collective still waits for every rank's fresh tensor.
        Submitting round k + 1 before collecting round k lets round k's exchange overlap the caller's next step.
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

    def _check_tensor(self, tensor: object) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"tensor: expected a torch.Tensor, found {type(tensor).__name__}")
        if tensor.shape != self.shape or tensor.dtype != self.dtype or tensor.device != self.device:
            raise ValueError(
                f"expected a tensor of shape {tuple(self.shape)}, dtype {self.dtype} on {self.device} "
                f"(fixed by `initial`), got shape {tuple(tensor.shape)}, dtype {tensor.dtype} on {tensor.device}"
            )

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
            raise ValueError(f"recycle: expected a torch.Tensor, found {type(tensor).__name__}")
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
            if core.is_in_use(tensor):
                raise ValueError("recycle: this tensor is still in use by the engine (or was recycled already)")
            core.give_spare(tensor)

    def close(self) -> None:
        """Stop the progress thread, release the communicators and this rank's store keys.

        A caller blocked in this engine on another thread wakes at once with a ``RuntimeError``. A round
        already activated (triggered here or by a peer) is still run, with this rank's last contribution, so
        that its group completes it instead of failing on this rank; no later round starts. The join is bounded
        by the timeout for each such round (a collective runs to its end or its timeout). Once every rank has
        closed, no key of the engine is left in the store. A second call does nothing.
        """
        self._finalizer()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (or the engine was finalized)."""
        return not self._finalizer.alive

    def __enter__(self: _Engine) -> _Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------------------------- main thread
    def _check_usable(self) -> None:
        if self.closed:
            raise RuntimeError(f"this {type(self).__name__} is closed; create a new one to continue")
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

    def _wait_result(self, k: int) -> FinishedRound:
        # Once the round has started, the thread's own collective timeout normally fires first and explains
        # more; `limit` is the backstop. A round that has not even started after the timeout (its initiator
        # never triggered it) has no collective in flight to time out: it fails at the timeout.
        limit = self.timeout.total_seconds() * 1.5 + 1.0
        start = time.monotonic()
        deadline, unstarted = start + limit, start + self.timeout.total_seconds()
        core = self._core
        with core.cond:
            while k not in core.results and core.error is None and not core.stopping:
                now = time.monotonic()
                waiting_trigger = not core.blocking(k) and core.activated < k
                if now >= deadline or (waiting_trigger and now >= unstarted):
                    limit = now - start
                    break
                core.cond.wait(timeout=(unstarted if waiting_trigger else deadline) - now)
            if k in core.results:
                return core.results.pop(k)
            stopped, round_, phase = core.stopping and core.error is None, core.thread_round, core.phase
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
