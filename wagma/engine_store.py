"""The engine's activation channel over the c10d store: one key per round, progress records, cleanup.

What bounds c10d store calls (measured on torch 2.13 with a ``TCPStore`` whose host process is
SIGSTOPped; ``tests/test_engine.py`` keeps the engine honest about it):

- ``set`` and ``multi_set`` do not wait for a reply: they return at once even when the host is frozen.
- Every request/response call (``get``, ``compare_set``, ``add``, ``check``, ``multi_get``,
  ``delete_key``, ``num_keys``) blocks without bound: the store's timeout (``set_timeout``) is not
  applied to the reply. ``wait(keys, t)`` gives up polling after ``t`` but then blocks without bound
  on the reply to its cancellation.

So the main thread only ever calls ``set``; the watcher thread's blocking ``wait`` is watched by the
deadlines of those who wait on it; and every other call goes through :class:`StoreCaller`, which runs
it on a thread of its own and gives up after a deadline.

Connecting: each rank opens 3 clients of the store per engine (``set`` s, the watcher's waits, the
caller), all ranks at about the same time. Such a burst (8 ranks, 32 connects and more) made some connects
stall for about 5 s on the 2-core test machine, so a clone connects under :data:`CONNECT_S` (not the
engine's timeout, which a clone would inherit as its connect deadline), and
:meth:`ActivationChannel.wait_for_every_rank` waits, under the same deadline, for every rank's first progress
record before the communicators are created: a rank slowed by its connects delays the others instead of failing
their group creation, which waits for a late member only as long as the engine's timeout.

Keys, under the engine's prefix:

- ``act/k``: round k's activation. A rank that reaches round k before it has seen the round start
  ``set`` s it (its own thread starts at once, without waiting for the echo); every rank's watcher
  thread waits for it. One key per round, whatever the world size.
- ``at/r``: rank r's progress record ``"k g m"``: its thread entered round k's exchange; no round
  below g will ever be waited for again on rank r; its main thread had published call m. Written
  once per round with a ``set``; read only to clean up and to explain a failure.
- ``floor``: the ``act`` keys below it are deleted. Rank 0's thread deletes ``act/j`` for all j below
  every rank's g every few rounds, off its critical path, so at most the rounds in flight plus a
  few keep a key, whatever the sync period.
- ``closed``: how many ranks have closed; the last to close deletes everything that is left.
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from wagma.groups import is_timeout

__all__ = ["ActivationChannel", "StoreCaller"]

# How long one blocking activation wait lasts before the watcher looks at its stop flag again. Each expiry
# costs c10d two warning lines, so it is long; close() does not wait for the watcher (see ActivationChannel).
_IDLE_WAIT = datetime.timedelta(seconds=60)
# Rank 0 deletes used activation keys every this many rounds.
_COLLECT_EVERY = 8
# Deadline of opening the channel's store clients and of the start meeting (at least the engine's timeout).
# A connect made while every rank opens its clients stalls for about 5 s at times on a loaded machine.
CONNECT_S = 60.0


class StoreCaller:
    """Runs request/response store calls on a thread of its own, so that every caller has a deadline.

    A call that does not answer in time raises ``TimeoutError`` naming the call and the store; the
    thread stays blocked in it (nothing can interrupt a c10d call), and later calls queue behind it and
    time out the same way. Args: ``store``, a client of its own (clone); ``name``, of the thread.
    """

    def __init__(self, store: dist.Store, name: str) -> None:
        self._store = store
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._busy: tuple[str, float] | None = None  # (what, since) of the call in progress
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            what, fn, box, done = item
            self._busy = (what, time.monotonic())
            try:
                box.append((True, fn(self._store)))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box.append((False, exc))
            self._busy = None
            done.set()

    @property
    def busy(self) -> bool:
        """Whether a call is in progress or queued."""
        return self._busy is not None or not self._queue.empty()

    def call(self, what: str, fn: Callable[[dist.Store], Any], timeout_s: float) -> Any:
        """Run ``fn(store)`` and return its value; raise ``TimeoutError`` if it takes over ``timeout_s``."""
        box: list[tuple[bool, Any]] = []
        done = threading.Event()
        self._queue.put((what, fn, box, done))
        if not done.wait(timeout_s):
            busy = self._busy
            stuck = f"; it has been in {busy[0]} for {time.monotonic() - busy[1]:.1f} s" if busy else ""
            raise TimeoutError(
                f"the c10d store did not answer {what} within {timeout_s:.1f} s{stuck}: the process hosting "
                f"the store may be frozen or dead"
            )
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def submit(self, what: str, fn: Callable[[dist.Store], Any]) -> None:
        """Run ``fn(store)`` later, without waiting for it (its errors are dropped)."""
        self._queue.put((what, fn, [], threading.Event()))

    def close(self) -> None:
        """Let the thread end after what is queued (at once if idle; never if a call hangs)."""
        self._queue.put(None)


def _clone(store: dist.Store, connect_s: float, timeout: datetime.timedelta, address: str) -> dist.Store:
    """A store client of its own: one connection serializes its calls, and the watcher blocks in wait().

    The clone connects under ``connect_s``, not the engine's timeout: a clone inherits its parent's
    timeout as its connect deadline, and on a loaded machine a connect made in a burst (every rank opening
    its clients at once) has been measured to stall for about 5 s, which failed jobs whose timeout was 5 s.
    Once connected, the clone's calls are bounded by ``timeout`` again. A store that cannot be cloned (a
    Python store) is shared; a clone that cannot connect raises instead of silently sharing the parent's
    connection (the watcher's blocking wait would then stall every other call on it).
    """
    if not hasattr(store, "clone"):
        return store
    parent_timeout = store.timeout  # type: ignore[attr-defined]  # a property torch's stubs omit
    store.set_timeout(datetime.timedelta(seconds=connect_s))
    try:
        clone = store.clone()
    except NotImplementedError:
        return store
    except RuntimeError as exc:  # DistNetworkError, DistStoreError: the connect or its validation failed
        kind = TimeoutError if is_timeout(exc) else RuntimeError
        raise kind(
            f"could not open a client of the c10d store at {address} within {connect_s:.0f} s (each engine opens "
            f"3 per rank): the store's host may be overloaded, frozen or gone; check it, or the machine's load "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    finally:
        store.set_timeout(parent_timeout)
    clone.set_timeout(timeout)
    return clone


def _address(store: dist.Store) -> str:
    """Where the store lives, as far as the store object tells."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    return f"{host}:{port}" if host is not None else type(store).__name__


class ActivationChannel:
    """Round activation and progress records of one engine on one rank (protocol: module docstring).

    Args:
        store: the c10d store every rank reaches; the channel uses clones of it.
        prefix: the engine's namespace, the same on every rank.
        rank, world_size: this rank and the job's size.
        start_round: the first round.
        timeout: the engine's timeout; bounds every request/response call.
        on_activated: called by the watcher thread with each round it sees activated, in order.
        next_wait: the round the watcher should wait for next, given the one it would wait for (it skips
            rounds that need no activation or were already started locally); ``None``: stop.
        on_error: called by the watcher thread with the exception that ended it.
    """

    def __init__(
        self,
        store: dist.Store,
        prefix: str,
        rank: int,
        world_size: int,
        start_round: int,
        timeout: datetime.timedelta,
        on_activated: Callable[[int], None],
        next_wait: Callable[[int], int | None],
        on_error: Callable[[BaseException], None],
        global_ranks: Sequence[int] | None = None,
    ) -> None:
        self.rank, self.world_size, self.address = rank, world_size, _address(store)
        # a sub-world's ranks are named by their job rank in messages (None: world rank = job rank)
        self._global = tuple(global_ranks) if global_ranks is not None else None
        self._diagnose_s = min(1.0, timeout.total_seconds() / 4)
        self._timeout_s = timeout.total_seconds()
        self._start = start_round
        self.connect_s = max(CONNECT_S, self._timeout_s)
        clients = [_clone(store, self.connect_s, timeout, self.address) for _ in range(3)]
        self._sets = dist.PrefixStore(prefix, clients[0])  # set() only: never blocks
        self._waits = dist.PrefixStore(prefix, clients[1])  # the watcher's blocking waits
        self._caller = StoreCaller(dist.PrefixStore(prefix, clients[2]), f"wagma-store-{prefix.strip('/')}")
        self._floor = start_round  # rank 0's collector: act keys below it are deleted
        self.record(start_round - 1, start_round, start_round - 1)
        self._on_activated, self._next_wait, self._on_error = on_activated, next_wait, on_error
        self._watcher = threading.Thread(target=self._watch, name=f"wagma-watch-{prefix.strip('/')}", daemon=True)

    def start(self) -> None:
        """Start the watcher thread (after every rank has written its first progress record)."""
        self._watcher.start()

    def wait_for_every_rank(self) -> None:
        """Wait, at most ``connect_s``, until every rank has opened its clients and written its first record.

        Called before the communicators are created: their creation waits for every member only as long as the
        engine's timeout, so a rank whose connects stalled would make its peers fail; here it only delays them.

        Raises:
            TimeoutError: naming the ranks whose first record did not appear in time.
        """
        keys = self._progress_keys()
        wait = datetime.timedelta(seconds=self.connect_s)
        try:
            self._caller.call("the start meeting", lambda s: s.wait(keys, wait), self.connect_s + self._diagnose_s)
        except (TimeoutError, RuntimeError) as exc:
            try:
                there = self._caller.call(
                    "a check of the progress records", lambda s: [s.check([k]) for k in keys], self._diagnose_s
                )
                missing = f"{self._names([r for r, ok in enumerate(there) if not ok])} did not"
            except (TimeoutError, RuntimeError):
                missing = "which ranks did not is unknown (the store could not be read either); some rank did not"
            raise TimeoutError(
                f"{self._name(self.rank)}: the engine's start meeting in the c10d store at {self.address} "
                f"did not complete within {self.connect_s:.0f} s: {missing} open its store clients and write its "
                f"first progress record; check that every rank constructs its engines in the same order ({exc})"
            ) from exc

    # ------------------------------------------------------------------------ per round, O(1) each
    def trigger(self, k: int) -> None:
        """Start round ``k`` for every rank (a ``set``: returns at once, even if the store is frozen)."""
        self._sets.set(f"act/{k}", str(self.rank))

    def record(self, entered: int, gc_floor: int, published: int) -> None:
        """This rank's progress record (a ``set``). ``gc_floor``: no ``act`` key below it is needed here."""
        self._sets.set(f"at/{self.rank}", f"{entered} {gc_floor} {published}")

    def collect(self, k: int) -> None:
        """Rank 0, every few rounds: delete the ``act`` keys no rank needs any more (in the background)."""
        if self.rank != 0 or k % _COLLECT_EVERY or self._caller.busy:
            return
        self._caller.submit("collect", self._collect)

    def _collect(self, store: dist.Store) -> None:
        low = min(int(v.split()[1]) for v in store.multi_get(self._progress_keys()))
        for j in range(self._floor, low):
            store.delete_key(f"act/{j}")
        if low > self._floor:
            self._floor = low
            store.set("floor", str(low))

    def _watch(self) -> None:
        k: int | None = self._start
        try:
            while k is not None:  # never None here: the loop returns when it becomes None
                k = self._next_wait(k)
                if k is None:
                    return
                t0 = time.monotonic()
                try:
                    self._waits.wait([f"act/{k}"], _IDLE_WAIT)
                except dist.DistStoreError:
                    # An idle timeout is not an error (nobody may have arrived yet); a store that broke fails fast.
                    if time.monotonic() - t0 < _IDLE_WAIT.total_seconds() * 0.9:
                        raise
                    continue
                self._on_activated(k)
                k += 1
        except BaseException as exc:  # noqa: BLE001 - handed to the engine
            err = RuntimeError(f"waiting for round {k}'s activation in the c10d store at {self.address} failed: {exc}")
            err.__cause__ = exc
            self._on_error(err)

    # ------------------------------------------------------------------------------- diagnosis
    def _progress_keys(self) -> list[str]:
        return [f"at/{r}" for r in range(self.world_size)]

    def progress(self) -> dict[int, tuple[int, int]]:
        """Every rank's (round its thread entered, call its main thread published); bounded by a deadline."""
        values = self._caller.call(
            "a read of the progress records", lambda s: s.multi_get(self._progress_keys()), self._diagnose_s
        )
        out = {}
        for r, v in enumerate(values):
            entered, _, published = (int(x) for x in v.split())
            out[r] = (entered, published)
        return out

    def who_is_missing(self, k: int, group: tuple[int, ...]) -> str:
        """Explain why round ``k`` in ``group`` did not complete: which ranks had not arrived, and where they are.

        Reads every rank's progress record (one store call, bounded by a short deadline).
        """
        try:
            seen = self.progress()
        except (TimeoutError, RuntimeError) as exc:
            return (
                f"who did not arrive is unknown, because the c10d store at {self.address} could not be read "
                f"either ({exc})"
            )

        def where(ranks: list[int]) -> str:
            return ", ".join(
                f"{self._name(r)} last seen in round {seen[r][0]} (its main thread at call {seen[r][1]})" for r in ranks
            )

        missing = [r for r in group if r != self.rank and seen[r][0] < k]
        if missing:
            text = f"{self._names(missing)} of group {self._group_name(group)} did not arrive: {where(missing)}"
        else:
            text = (
                f"every member of group {self._group_name(group)} had reached round {k}, "
                "so one of them failed during the exchange"
            )
        low = min(e for e, _ in seen.values())
        behind = [r for r, (e, _) in seen.items() if e == low and e < k and r not in missing]
        if behind:
            text += f"; furthest behind: {self._names(behind)}: {where(behind)}"
        return text

    def _name(self, rank: int) -> str:
        """``"rank 3"``; in a sub-world the job's rank, with the world rank after it."""
        return f"rank {rank}" if self._global is None else f"rank {self._global[rank]} (world rank {rank})"

    def _names(self, ranks: list[int]) -> str:
        """``"rank(s) [1, 3]"``; in a sub-world the job's ranks, with the world ranks after them."""
        if self._global is None:
            return f"rank(s) {ranks}"
        return f"rank(s) {[self._global[r] for r in ranks]} (world rank(s) {ranks})"

    def _group_name(self, group: tuple[int, ...]) -> str:
        return str(group) if self._global is None else str(tuple(self._global[r] for r in group))

    # ----------------------------------------------------------------------------------- closing
    def close(self, next_round: int) -> None:
        """Stop watching; the last rank to close deletes the engine's keys. Bounded; store errors are dropped.

        The last rank to close also wakes every rank's watcher (they wait for round ``next_round`` or, after a
        sync round, the one after it), so all watchers end at once. Until then a closed rank's watcher stays
        blocked in its store wait (it holds no key). ``next_round``: the round this rank would have run next
        (no ``act`` key exists at or above it).
        """
        try:
            closed = self._caller.call("the close count", lambda s: s.add("closed", 1), self._diagnose_s)
            if closed == self.world_size:
                self._caller.call("the cleanup", lambda s: self._delete_all(s, next_round), self._timeout_s)
        except (TimeoutError, RuntimeError):
            pass  # the store is gone or frozen: nothing left to clean up that anyone could see
        self._caller.close()

    def abandon(self) -> None:
        """Release the channel's threads without touching the store (the engine failed to start)."""
        self._caller.close()

    def _delete_all(self, store: dist.Store, next_round: int) -> None:
        floor = int(store.get("floor")) if store.check(["floor"]) else self._start
        for j in range(floor, next_round):
            store.delete_key(f"act/{j}")
        wake = [f"act/{next_round}", f"act/{next_round + 1}"]  # every rank has closed: nobody runs these
        for key in wake:
            store.set(key, "closed")
        for key in [*wake, *self._progress_keys(), "floor", "closed"]:
            store.delete_key(key)
