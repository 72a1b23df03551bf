"""The wait-avoiding group allreduce: the engine under WAGMA-SGD and eager-SGD (DESIGN §2.3, §3).

Protocol, for call k on rank i (call k of every rank is round k):

1. The main thread *publishes*: in replace mode a copy of its tensor becomes the rank's snapshot; in
   accumulate mode the tensor is added into the pending contribution.
2. It *triggers* round k unless the round is a sync round or this rank may not trigger it: the first
   rank to ``compare_set`` the round's activation key wins and writes every rank's inbox key in one
   ``multi_set``. Activation is global: one arrival anywhere starts round k for every group.
3. Every rank's progress thread, the only issuer on the engine's communicators, runs the rounds in
   order. For round k it waits until its own main thread is at most ``max_lead`` rounds behind, then
   for its inbox key, then takes whatever the rank has published *at that moment* (a consistent
   snapshot: published tensors are immutable, pending buffers are swapped out under the lock) and
   allreduces it in round k's group. Sync rounds skip activation: the thread waits for its own main
   thread's fresh tensor and allreduces over all ranks.
4. The main thread waits for round k's result, which the thread keeps, tagged with its round, until
   the main thread consumes it: every round exactly once, in order, however late the rank is.

Store keys: ``act/k`` (the trigger race) and ``in/k/r`` (rank r's inbox). A thread deletes its inbox
key once it has consumed it; rank 0 deletes the ``act`` keys of a period once the following sync round
is done, when no rank can touch them any more. So the store holds O(P * sync_period) keys at most.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import threading
import time
from typing import Literal

import torch
import torch.distributed as dist

from wagma.schedule import GroupSchedule

__all__ = ["RoundResult", "WaitAvoidingGroupAllreduce"]

Trigger = Literal["any", "initiator"]
_instance_ids = itertools.count()
# How long one blocking store wait lasts before the thread looks at its stop flag again. close() wakes
# the thread through its own inbox key, so this only bounds the c10d timeout warnings of an idle run.
_IDLE_WAIT = datetime.timedelta(seconds=60)


@dataclasses.dataclass
class RoundResult:
    """What one call of :class:`WaitAvoidingGroupAllreduce` returns.

    Attributes:
        round: the round this call ran (call k is round k).
        is_sync: whether it was a blocking global round over all ranks with fresh tensors.
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
        triggered_at: ``time.time()`` when this rank won the trigger of the round, else ``None``.
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


@dataclasses.dataclass
class _Done:
    round: int
    is_sync: bool
    group: tuple[int, ...]
    sum: torch.Tensor
    version: int
    exchange_s: float
    activated_at: float
    event: torch.cuda.Event | None


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


class WaitAvoidingGroupAllreduce:
    """A group allreduce that the first rank to arrive triggers for everyone (DESIGN §2.3, §3).

    Construct it collectively, on every rank in the same order, after ``init_process_group`` (it
    creates its communicators up front). Each call ``engine(tensor)`` runs this rank's next round and
    returns a :class:`RoundResult`. Use it as a context manager or call :meth:`close`.

    Args:
        schedule: which ranks exchange in which round; its world size must be the job's.
        initial: what this rank contributes until its first call; fixes shape, dtype and device.
            Replace mode copies it; accumulate mode starts its pending contribution from it.
        sync_period: rounds k with ``k % (sync_period + 1) == sync_period`` are blocking global
            allreduces of fresh tensors (0: every round). Bounds staleness.
        max_lead: how many rounds the progress thread may run ahead of its main thread (0: it waits
            for the main thread every round). Defaults to ``sync_period``; each round of lead can
            hold one result buffer until the main thread consumes it.
        timeout: bound of every wait: collectives, and the main thread's wait for a result.
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
    """

    def __init__(
        self,
        schedule: GroupSchedule,
        initial: torch.Tensor,
        *,
        sync_period: int,
        max_lead: int | None = None,
        timeout: datetime.timedelta = datetime.timedelta(minutes=5),
        trigger: Trigger = "any",
        seed: int = 0,
        accumulate: bool = False,
        store: dist.Store | None = None,
        name: str | None = None,
        start_round: int = 0,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "WaitAvoidingGroupAllreduce needs an initialized default process group: "
                "call torch.distributed.init_process_group() first"
            )
        if not isinstance(schedule, GroupSchedule):
            raise ValueError(f"schedule must be a wagma.GroupSchedule, got {type(schedule).__name__}")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if schedule.world_size != self.world_size:
            raise ValueError(
                f"the schedule is for {schedule.world_size} ranks but the job has {self.world_size}: "
                f"build it with world_size={self.world_size}"
            )
        if not isinstance(sync_period, int) or isinstance(sync_period, bool) or sync_period < 0:
            raise ValueError(f"sync_period must be an int >= 0, got {sync_period!r}")
        if max_lead is None:
            max_lead = sync_period
        if not isinstance(max_lead, int) or isinstance(max_lead, bool) or not 0 <= max_lead <= max(sync_period, 0):
            raise ValueError(
                f"max_lead must be an int in [0, sync_period={sync_period}] (a sync round needs the fresh "
                f"tensor, so the thread can never lead by more), got {max_lead!r}"
            )
        if trigger not in ("any", "initiator"):
            raise ValueError(f"trigger must be 'any' or 'initiator', got {trigger!r}")
        if not isinstance(initial, torch.Tensor):
            raise ValueError(f"initial must be a torch.Tensor, got {type(initial).__name__}")
        if not isinstance(start_round, int) or isinstance(start_round, bool) or start_round < 0:
            raise ValueError(f"start_round must be an int >= 0, got {start_round!r}")
        if not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
            raise ValueError(f"timeout must be a positive datetime.timedelta, got {timeout!r}")

        self.schedule = schedule
        self.sync_period = sync_period
        self.max_lead = max_lead
        self.timeout = timeout
        self.trigger = trigger
        self.seed = int(seed)
        self.accumulate = accumulate
        self.shape, self.dtype, self.device = initial.shape, initial.dtype, initial.device
        self._cuda = self.device.type == "cuda"

        # Communicators, created by every rank in the same order (DESIGN §2.1). Singleton groups need none.
        self._all = tuple(range(self.world_size))
        self._groups, self._global = _communicators(schedule, self.rank, timeout)

        base = store if store is not None else dist.distributed_c10d._get_default_store()
        prefix = f"wagma/{name if name is not None else next(_instance_ids)}/"
        self._main_store = dist.PrefixStore(prefix, _clone(base))
        self._thread_store = dist.PrefixStore(prefix, _clone(base))
        self._token = str(self.rank)

        self._side_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._cond = threading.Condition()
        # All fields below are guarded by self._cond.
        self._start = start_round
        self._arrived = start_round - 1  # newest call the main thread has published
        self._snapshot = initial.detach().clone()  # replace: immutable published tensor; accumulate: pending
        self._snapshot_version = start_round - 1  # `initial` counts as the call before the first
        self._snapshot_event = self._record()
        self._results: dict[int, _Done] = {}
        self._thread_round = start_round  # the round the thread works on
        self._activated = start_round - 1  # newest round whose activation the thread has seen
        self._phase = "starting"
        self._error: BaseException | None = None
        self._stop = False

        self._calls = start_round
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"wagma-progress-{prefix.strip('/')}", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------------------------- public API
    @property
    def round(self) -> int:
        """The round the next call will run."""
        return self._calls

    def is_sync_round(self, k: int) -> bool:
        """Whether round ``k`` is a blocking global round."""
        return k % (self.sync_period + 1) == self.sync_period

    def initiator(self, k: int) -> int:
        """The rank whose arrival triggers round ``k`` when ``trigger="initiator"`` (same on all ranks)."""
        return _splitmix64((self.seed << 32) ^ k) % self.world_size

    def group_of(self, k: int) -> tuple[int, ...]:
        """This rank's group in round ``k`` (all ranks on a sync round)."""
        return self._all if self.is_sync_round(k) else self.schedule.group_of(self.rank, k)

    def __call__(self, tensor: torch.Tensor) -> RoundResult:
        """Publish ``tensor`` (or add it, in accumulate mode), run this rank's next round, return its result."""
        self._check_usable()
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.shape != self.shape or tensor.dtype != self.dtype or tensor.device != self.device:
            raise ValueError(
                f"expected a tensor of shape {tuple(self.shape)}, dtype {self.dtype} on {self.device} "
                f"(fixed by `initial`), got shape {tuple(tensor.shape)}, dtype {tensor.dtype} on {tensor.device}"
            )
        k = self._calls
        self._calls += 1
        self._publish(tensor, k)
        triggered_at = self._maybe_trigger(k)
        t0 = time.perf_counter()
        done = self._wait_result(k)
        wait_s = time.perf_counter() - t0
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
        )

    def take(self) -> torch.Tensor:
        """Accumulate mode: hand over what is still pending (not yet taken by an exchange) and zero it.

        Together with the sums of all rounds, this accounts for every value ever passed in, each
        once. Use it for a final flush.
        """
        self._check_usable()
        if not self.accumulate:
            raise RuntimeError("take() needs accumulate=True: in replace mode nothing is pending")
        with self._cond:
            out, event = self._swap_pending()
        if event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)
            out.record_stream(stream)
        return out

    def pending(self) -> torch.Tensor:
        """Accumulate mode: a copy of what is pending now, without taking it (for checkpoints)."""
        self._check_usable()
        if not self.accumulate:
            raise RuntimeError("pending() needs accumulate=True: in replace mode nothing is pending")
        with self._cond:
            if self._snapshot_event is not None:
                torch.cuda.current_stream(self.device).wait_event(self._snapshot_event)
            return self._snapshot.clone()

    def close(self) -> None:
        """Stop the progress thread and drop the communicators. A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        with self._cond:
            self._stop = True
            k = self._thread_round
            self._cond.notify_all()
        if self._thread.is_alive():
            wake = f"in/{k}/{self.rank}"  # only this rank's thread reads this key
            try:
                self._main_store.set(wake, "close")
                self._thread.join(timeout=self.timeout.total_seconds() + 5.0)
                if not self._thread.is_alive():
                    self._main_store.delete_key(wake)
            except Exception:  # noqa: BLE001 - the store may be gone already
                self._thread.join(timeout=self.timeout.total_seconds() + 5.0)
        self._results.clear()
        self._groups.clear()
        self._global = None

    def __enter__(self) -> WaitAvoidingGroupAllreduce:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------------------------- main thread
    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("this WaitAvoidingGroupAllreduce is closed; create a new one to continue")
        if self._error is not None:
            raise RuntimeError(
                f"wagma progress thread of rank {self.rank} failed in round {self._thread_round} "
                f"(group {self.group_of(self._thread_round)}): {self._error}"
            ) from self._error

    def _publish(self, tensor: torch.Tensor, k: int) -> None:
        if self.accumulate:
            with self._cond:
                if self._snapshot_event is not None:
                    stream = torch.cuda.current_stream(self.device)
                    stream.wait_event(self._snapshot_event)
                    self._snapshot.record_stream(stream)  # it may come from the thread's stream
                self._snapshot.add_(tensor.detach())
                self._snapshot_version = k
                self._snapshot_event = self._record()
                self._arrived = k
                self._cond.notify_all()
        else:
            snap = tensor.detach().clone()  # immutable once published: the thread reads it without a lock
            event = self._record()
            with self._cond:
                self._snapshot, self._snapshot_version, self._snapshot_event = snap, k, event
                self._arrived = k
                self._cond.notify_all()

    def _maybe_trigger(self, k: int) -> float | None:
        if self.is_sync_round(k) or (self.trigger == "initiator" and self.initiator(k) != self.rank):
            return None
        with self._cond:
            if self._activated >= k:  # our thread has seen round k start: someone else triggered it
                return None
        store = self._main_store
        if store.compare_set(f"act/{k}", "", self._token) != self._token.encode():
            return None
        store.multi_set([f"in/{k}/{r}" for r in range(self.world_size)], ["1"] * self.world_size)
        return time.time()

    def _wait_result(self, k: int) -> _Done:
        # The thread's own collective timeout normally fires first and explains more; this is the backstop.
        limit = self.timeout.total_seconds() * 1.5 + 1.0
        deadline = time.monotonic() + limit
        with self._cond:
            while k not in self._results:
                if self._error is not None:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"rank {self.rank}: round {k} did not complete within {limit:.1f} s; the progress "
                        f"thread is in round {self._thread_round}, {self._phase}. A peer may have died or "
                        f"be slower than the timeout ({self.timeout}); raise `timeout` if that is expected."
                    )
                self._cond.wait(timeout=left)
            if k in self._results:
                return self._results.pop(k)
        self._check_usable()
        raise AssertionError("unreachable")

    # -------------------------------------------------------------------------------- progress thread
    def _run(self) -> None:
        try:
            if self._cuda:
                torch.cuda.set_device(self.device)
                with torch.cuda.stream(self._side_stream):
                    self._loop()
            else:
                self._loop()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread, re-raised there
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _loop(self) -> None:
        k = self._start
        last_sync = k - 1
        while True:
            is_sync = self.is_sync_round(k)
            needed = k if is_sync else k - self.max_lead
            with self._cond:
                self._thread_round = k
                self._phase = f"waiting for this rank's main thread to reach round {needed}"
                while not self._stop and self._arrived < needed:
                    self._cond.wait()
                if self._stop:
                    return
                if not is_sync:
                    self._phase = self._activation_phase(k)
            if not is_sync and not self._wait_activation(k):
                return
            activated_at = time.time()
            group = self.group_of(k)
            with self._cond:
                self._activated = k
                self._phase = f"exchanging with group {group}"
                if self.accumulate:
                    send, event = self._swap_pending()
                    version = self._snapshot_version
                else:
                    send, version, event = self._snapshot, self._snapshot_version, self._snapshot_event
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)
                send.record_stream(torch.cuda.current_stream(self.device))
            if not self.accumulate:
                send = send.clone()  # the snapshot may be contributed again next round: reduce a copy
            t0 = time.perf_counter()
            pg = self._global if is_sync else self._groups[group]
            if pg is not None:
                dist.all_reduce(send, group=pg)
            exchange_s = time.perf_counter() - t0
            with self._cond:
                self._results[k] = _Done(k, is_sync, group, send, version, exchange_s, activated_at, self._record())
                self._cond.notify_all()
            if not is_sync:
                self._thread_store.delete_key(f"in/{k}/{self.rank}")
            elif self.rank == 0:
                for j in range(last_sync + 1, k):  # nobody can touch these keys any more
                    self._thread_store.delete_key(f"act/{j}")
            if is_sync:
                last_sync = k
            k += 1

    def _activation_phase(self, k: int) -> str:
        if self.trigger == "initiator":
            return f"waiting for round {k} to be triggered by its initiator, rank {self.initiator(k)}"
        return f"waiting for any rank to trigger round {k}"

    def _wait_activation(self, k: int) -> bool:
        key = f"in/{k}/{self.rank}"
        while True:
            t0 = time.monotonic()
            try:
                self._thread_store.wait([key], _IDLE_WAIT)
                break
            except dist.DistStoreError:
                # An idle timeout is not an error (nobody may have arrived yet); a store that broke fails fast.
                if time.monotonic() - t0 < _IDLE_WAIT.total_seconds() * 0.9:
                    raise
            if self._stop:
                return False
        return not self._stop

    # -------------------------------------------------------------------------------------- helpers
    def _swap_pending(self) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Take the pending contribution and leave zeros in its place; caller holds the lock."""
        out, event = self._snapshot, self._snapshot_event  # the consumer waits on `event` before reading
        self._snapshot = torch.zeros_like(out)
        self._snapshot_event = self._record()
        return out, event

    def _record(self) -> torch.cuda.Event | None:
        if not self._cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event


def _can_split() -> bool:
    """Whether sub-communicators can be split from the default group (NCCL bound to a device).

    The answer is the same on every rank of a job, so all ranks take the same path.
    """
    default = dist.distributed_c10d._get_default_group()
    return (
        hasattr(dist, "split_group")
        and dist.get_backend() == "nccl"
        and getattr(default, "bound_device_id", None) is not None
    )


def _communicators(
    schedule: GroupSchedule, rank: int, timeout: datetime.timedelta
) -> tuple[dict[tuple[int, ...], dist.ProcessGroup | None], dist.ProcessGroup | None]:
    """This rank's communicator for each of its groups in the schedule, and one over all ranks.

    With NCCL bound to a device, each round's partition is one ``split_group`` call (one
    ``ncclCommSplit`` for all its groups); otherwise every distinct group is a ``new_group`` (gloo).
    """
    world = schedule.world_size
    groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
    if world == 1:
        return {(0,): None}, None
    if _can_split():
        seen: set[tuple[tuple[int, ...], ...]] = set()
        for r in range(schedule.period):
            partition = tuple(schedule.groups(r))
            if partition in seen:
                continue
            seen.add(partition)
            pg = dist.split_group(split_ranks=[list(g) for g in partition], timeout=timeout)
            mine = schedule.group_of(rank, r)
            groups.setdefault(mine, pg if len(mine) > 1 else None)
        return groups, dist.split_group(split_ranks=[list(range(world))], timeout=timeout)
    for members in schedule.distinct_groups():
        pg = dist.new_group(list(members), timeout=timeout) if len(members) > 1 else None
        if rank in members:
            groups[members] = pg
    return groups, dist.new_group(list(range(world)), timeout=timeout)


def _clone(store: dist.Store) -> dist.Store:
    """A store client of its own: one connection serializes its calls, and the thread blocks in wait()."""
    try:
        return store.clone()
    except (AttributeError, RuntimeError, NotImplementedError):
        return store
