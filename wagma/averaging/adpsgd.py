"""AD-PSGD: asynchronous pairwise model averaging on a progress thread (Lian et al., 2018; docs/design.md §2.6).

Ranks are bipartite: even ranks are *active*, odd ranks *passive*. A communication thread, not the training
loop, runs exchange after exchange; in exchange k, active rank ``a`` and passive rank ``a + o_k`` (mod P)
swap the models they published last and each adds half the difference to its live model:
``x ← x + (x̂_peer - x̂_own) / 2``. The offsets ``o_k`` cycle over ``1`` and ``1 + 2^i`` (``2^i < P``, the
reference's bipartite exponential graph), all odd, so every exchange pairs an active rank with a passive one
and each round is a perfect matching (P must be even).

What the training loop does (:meth:`ADPSGDAverager.average_parameters`, after every optimizer step): add the
differences of the exchanges finished since the last call, then publish a copy of the model for the next
exchange. It never waits for a peer. What stays true:

- *Atomic exchanges.* The thread only ever sends a published copy (never the tensors the optimizer is
  writing), and hands a finished exchange's difference over under a lock; the training loop adds it whole, and
  only the training loop writes the model, so a model never mixes halves of two exchanges.
- *The mean is kept.* The two sides of an exchange add opposite differences computed from the same two
  copies, so Σ models over the ranks changes only by the local steps (up to float rounding).
- *Both sides or neither.* Before exchange k moves any data its two ranks *meet* in the c10d store: each adds 1
  to the exchange's key, and the one whose ``add`` returns 2 starts the transfers while the first looks at the key
  until it reads 2. A rank that will not come adds 10 instead, atomically with the other's arrival, so an exchange is
  run by both ranks or by neither: no transfer is ever posted that its peer will not match.
- *Closing needs no agreement.* :meth:`~ADPSGDAverager.close` (with or without a
  :meth:`~ADPSGDAverager.synchronize` first, on one rank or on all) lets the thread finish an exchange both sides
  met for (its peer runs it at once), withdraws from the one it is waiting for, and withdraws from its next
  ``L`` exchanges (``L``: the number of offsets), the only ones a peer can wait in for this rank. A peer that finds
  an exchange withdrawn skips it and every later one with the closed rank, and goes on with its other partners; no
  thread waits for ``timeout``, and the default group stays usable at once.
- *Bounded waits.* A meeting, every send and receive of the thread and every store call are bounded by ``timeout``;
  a failure (naming the peer and the exchange; a peer that never came to a meeting is one) is raised by the
  training loop's next call. A process that dies does not withdraw: its partners time out. Joining the thread is
  bounded too.

:meth:`~ADPSGDAverager.synchronize` and :meth:`~ADPSGDAverager.state_dict` are collective (every rank calls
them at the same step): the ranks agree on the number of exchanges to finish, the threads finish exactly those
(every pair meets, nothing is left in flight), the differences are added, and ``synchronize`` then takes the
global mean. Resume continues at the agreed exchange.
"""

from __future__ import annotations

import datetime
import itertools
import math
import threading
import time
from typing import Any, Literal

import torch
import torch.distributed as dist

from wagma.averaging.base import AveragerBase, ParamsLike, Reduction
from wagma.averaging.gossip import _check_world, _Exchange
from wagma.averaging.tensors import BuffersLike, widened
from wagma.checks import check_int
from wagma.engine_store import CONNECT_S, StoreCaller, _address, _clone
from wagma.groups import DEFAULT_TIMEOUT
from wagma.world import WorldLike

__all__ = ["ADPSGDAverager", "adpsgd_peer"]

_instance_ids = itertools.count()  # the same sequence on every rank: averagers are built on all ranks, in order
#: Added to an exchange's meeting key by a rank that will not come to it (or no longer waits there).
_WITHDRAWN = 10
#: The first and the longest pause (s) between two looks at a meeting key by the rank that came first.
_LOOK_S = (0.0005, 0.005)
#: How long close() waits for the thread beyond ``timeout`` (its last store calls).
_JOIN_GRACE_S = 5.0

Meeting = Literal["run", "left", "withdrew"]


def _offsets(world_size: int) -> list[int]:
    """AD-PSGD's offsets for a world of ``world_size`` ranks: ``1`` and ``1 + 2^i`` below it, in turn."""
    _check_world("adpsgd", world_size)
    if world_size % 2:
        raise ValueError(
            f"adpsgd: the active / passive split pairs even ranks with odd ones, so the world must be even; "
            f"found {world_size} ranks"
        )
    return [1] + [1 + 2**i for i in range(1, int(math.log2(world_size - 1)) + 1) if 1 + 2**i < world_size]


def adpsgd_peer(rank: int, world_size: int, exchange: int) -> int:
    """The partner of ``rank`` in AD-PSGD's exchange number ``exchange`` (P even).

    The offsets are ``1`` and ``1 + 2^i`` for ``i = 1 .. ⌊log2(P - 1)⌋`` (those below P), in turn; an active
    (even) rank ``a`` meets ``a + o``, a passive (odd) rank ``p`` meets ``p - o``.

    Raises:
        ValueError: for a world of fewer than 2 ranks or an odd one (no bipartite split into pairs).
    """
    offsets = _offsets(world_size)
    o = offsets[exchange % len(offsets)]
    return (rank + o) % world_size if rank % 2 == 0 else (rank - o) % world_size


class ADPSGDAverager(AveragerBase):
    """AD-PSGD: asynchronous pairwise averaging with the active / passive bipartite split (module docstring).

    Call :meth:`average_parameters` after every ``optimizer.step()``; it never waits for a peer. The thread
    starts at the first call after ``warmup_steps`` and runs one exchange per published model at most (an
    exchange whose copy is older than the newest is not repeated).

    Statistics: every added exchange counts as a ``"local"`` reduction (``bytes_sent``: the copy sent) and as a
    contribution whose staleness is the number of models this rank published between the copy the exchange
    used and the call that added it (0: added at the next call).

    All ranks of the default group take part; the averager creates two groups over them, one for the thread's
    exchanges and one for :meth:`synchronize`'s agreement and global mean (the main thread's), and its exchanges
    meet through the default group's c10d store (a client of its own; at most ``L`` keys per rank, ``L`` the
    number of offsets, stay there after :meth:`close`).

    Ending a run: :meth:`close` is not collective and needs no :meth:`synchronize` first; it returns without
    waiting for any peer (module docstring). A rank whose partner closed skips that partner's exchanges from then
    on (:attr:`departed`) and keeps averaging with the others; call :meth:`synchronize` on every rank first when
    the final models should be the global mean.

    Args:
        warmup_steps: calls before the thread starts; at least 0.
        average_buffers: also average the floating-point buffers passed to ``average_parameters``.
        timeout: bound of every meeting, send, receive, store call and join (``timedelta`` or seconds).
        world: the ranks to gossip among (:func:`wagma.world.as_world`; ``None``: the whole job).

    Raises:
        ValueError: for a world of fewer than 2 ranks or an odd one.
    """

    def __init__(
        self,
        warmup_steps: int = 0,
        *,
        average_buffers: bool = True,
        timeout: datetime.timedelta | float = DEFAULT_TIMEOUT,
        world: WorldLike = None,
    ) -> None:
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        super().__init__(None, average_buffers=average_buffers, timeout=timeout, world=world)
        self._period = len(_offsets(self.world_size))  # validates the world; a rank meets each peer once a period
        self._p2p = self._new_world_group()  # the thread's own: never used by two threads at once
        # The meetings' store: a client of its own, whose request/response calls run with a deadline
        base = dist.distributed_c10d._get_default_store()
        prefix = f"wagma/adpsgd/{self.world.key}{next(_instance_ids)}/"
        address = _address(base)
        client = _clone(base, max(CONNECT_S, self.timeout.total_seconds()), self.timeout, address)
        self._store = StoreCaller(dist.PrefixStore(prefix, client), f"wagma-adpsgd-store-rank{dist.get_rank()}")
        self._resources.closers.append(self._store)
        self._cond = threading.Condition()
        self._snapshot: list[torch.Tensor] | None = None  # the published copy; replaced, never written
        self._version = 0  # models published so far
        self._used = 0  # the version the thread's last exchange used (it waits for a newer one)
        self._deltas: list[tuple[list[torch.Tensor], int]] = []  # finished exchanges: (difference, copy's version)
        self._started = 0  # exchanges the thread has begun
        self._done = 0  # exchanges the thread has finished or skipped
        self._skipped = 0  # of those, skipped: the partner had closed
        self._departed: set[int] = set()  # group ranks of the partners that closed (their exchanges are skipped)
        self._target: int | None = None  # when set: finish exactly this many exchanges, then idle
        self._frozen = False  # begin no new exchange
        self._closing = False
        self._left = False  # this rank withdrew from its next exchanges (it will run none)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    @property
    def exchanges(self) -> int:
        """Exchanges this rank's thread has finished (not counting those skipped because the partner closed)."""
        with self._cond:
            return self._done - self._skipped

    @property
    def departed(self) -> list[int]:
        """The job ranks of the partners that closed their averagers: their exchanges are skipped from then on."""
        with self._cond:
            return sorted(self.world.global_rank(r) for r in self._departed)

    # -- the training loop's side ---------------------------------------------------------------------

    def _average_step(self, tensors: list[torch.Tensor]) -> Reduction | None:
        if self.step < self.warmup_steps:
            return None
        self._raise_thread_error()
        flat = self.flat_buffers(tensors)
        buffers = flat.pack()
        added = self._add_finished(buffers)
        self._publish(buffers)
        flat.unpack()
        if self._thread is None:
            self._start_thread()
        return "local" if added else None

    def _add_finished(self, buffers: list[torch.Tensor]) -> int:
        """Add every finished exchange's difference to ``buffers`` (under the lock); return how many."""
        with self._cond:
            deltas, self._deltas = self._deltas, []
            version = self._version
        for delta, used in deltas:
            for buffer, d in zip(buffers, delta):
                buffer.add_(d.to(buffer.dtype))
            self.stats.record_reduction("local", sum(d.numel() * d.element_size() for d in delta), 0.0)
            self.stats.record_contribution(max(0, version - used))
        return len(deltas)

    def _publish(self, buffers: list[torch.Tensor], *, trigger: bool = True) -> None:
        """Make a copy of ``buffers`` the model the next exchange sends. ``trigger=False`` replaces the copy
        without asking for an exchange of its own (the thread still waits for the next training step's)."""
        copy = [widened(b).clone() for b in buffers]
        with self._cond:
            self._snapshot = copy
            self._version += 1
            if not trigger:
                self._used = self._version
            self._cond.notify_all()

    def _raise_thread_error(self) -> None:
        with self._cond:
            error = self._error
        if error is not None:
            raise error

    # -- the thread ---------------------------------------------------------------------------------------

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"wagma-adpsgd-rank{dist.get_rank()}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        me = self._p2p.rank()
        met: int | None = None  # the last exchange whose meeting key this thread came to
        try:
            while True:
                with self._cond:
                    while True:
                        if self._closing:
                            return
                        if self._target is not None:
                            if self._started < self._target:
                                break  # finishing the agreed exchanges: use the newest copy, new or not
                        elif not self._frozen and self._version > self._used:
                            break
                        self._cond.wait(0.1)
                    assert self._snapshot is not None
                    copy, used, k = self._snapshot, self._version, self._started
                    self._used = used
                    self._started += 1
                    peer = adpsgd_peer(me, self.world_size, k)
                    known_gone = peer in self._departed
                if not known_gone:
                    met = k
                meeting: Meeting = "left" if known_gone else self._meet(k, peer)
                if meeting == "withdrew":
                    return  # closing: the peer learns it from the key
                if meeting == "left":
                    with self._cond:
                        self._departed.add(peer)
                        self._done += 1
                        self._skipped += 1
                        self._cond.notify_all()
                    continue
                inbox = self._swap(copy, peer, k)
                delta = [(theirs - mine).mul_(0.5) for theirs, mine in zip(inbox, copy)]
                with self._cond:
                    self._deltas.append((delta, used))
                    self._done += 1
                    self._cond.notify_all()
        except BaseException as err:  # noqa: BLE001 - handed to the training loop, which raises it
            with self._cond:
                self._error = err
                self._cond.notify_all()
        finally:
            self._leave(skip=met)

    def _key(self, k: int, peer: int) -> str:
        """The meeting key of exchange ``k`` between this rank and group rank ``peer`` (the same on both)."""
        return f"x/{k}/{min(self._p2p.rank(), peer)}"

    def _store_call(self, what: str, fn: Any) -> Any:
        return self._store.call(what, fn, self.timeout.total_seconds())

    def _meet(self, k: int, peer: int) -> Meeting:
        """Meet group rank ``peer`` for exchange ``k`` in the store (module docstring), within ``timeout``.

        Returns:
            ``"run"``: both came, run the exchange; ``"left"``: the peer withdrew (it closed), skip it;
            ``"withdrew"``: this rank is closing and withdrew before the peer came.

        Raises:
            TimeoutError: naming the peer and the exchange, when the peer neither came nor withdrew in time.
        """
        key = self._key(k, peer)
        owner = f"{type(self).__name__} (progress thread)"
        deadline = time.monotonic() + self.timeout.total_seconds()
        came = self._store_call(f"the arrival at exchange {k}", lambda s: s.add(key, 1))
        if came == 2:
            return "run"  # the peer came first and looks for us; it deletes the key
        if came >= _WITHDRAWN:
            self._store.submit("a key's deletion", lambda s: s.delete_key(key))  # nobody reads it again
            return "left"
        pause = _LOOK_S[0]
        while True:
            with self._cond:
                if not self._closing and time.monotonic() < deadline:
                    self._cond.wait(pause)
                closing = self._closing
            if closing or time.monotonic() >= deadline:
                value = self._store_call(f"the withdrawal from exchange {k}", lambda s: s.add(key, _WITHDRAWN))
                if value == 2 + _WITHDRAWN:  # the peer came just before: the exchange runs on both sides
                    self._store.submit("a key's deletion", lambda s: s.delete_key(key))
                    return "run"
                if closing:
                    return "withdrew"
                if value >= 2 * _WITHDRAWN:  # the peer had withdrawn at the same moment
                    self._store.submit("a key's deletion", lambda s: s.delete_key(key))
                    return "left"
                rank, limit = self.world.global_rank(peer), self.timeout.total_seconds()
                raise TimeoutError(
                    f"{owner}: exchange {k}: no model arrived from rank {rank} within {limit:g} s "
                    f"(expected its progress thread at the exchange's meeting in the store, found neither it nor a "
                    f"withdrawal); rank {rank} is slow, hung or gone"
                )
            value = self._store_call(f"a look at exchange {k}'s meeting", lambda s: s.add(key, 0))
            if value == 2 or value >= _WITHDRAWN:
                self._store.submit("a key's deletion", lambda s: s.delete_key(key))  # the last to read it
                return "run" if value == 2 else "left"
            pause = min(2 * pause, _LOOK_S[1])

    def _leave(self, skip: int | None = None) -> None:
        """Withdraw from the exchanges this rank will not run: the next ``L`` after the last it finished, the
        only ones a peer can wait in for it (a peer is at most one period ahead). ``skip``: an exchange this rank
        already came to (and ran or withdrew from). Bounded; store errors are dropped (a peer then times out)."""
        with self._cond:
            if self._left:
                return
            self._left = True
            first = self._done
            departed = set(self._departed)
        me = self._p2p.rank()
        keys = []
        for j in range(first, first + self._period):
            peer = adpsgd_peer(me, self.world_size, j)
            if j != skip and peer not in departed:
                keys.append(self._key(j, peer))
        try:
            self._store_call("the withdrawals from the next exchanges", lambda s: [s.add(x, _WITHDRAWN) for x in keys])
        except (TimeoutError, RuntimeError):
            pass  # the store is frozen or gone: the peers time out instead

    def _swap(self, copy: list[torch.Tensor], peer: int, k: int) -> list[torch.Tensor]:
        exchange = _Exchange(f"{type(self).__name__} (progress thread)", k, self._p2p, self.timeout, unit="exchange")
        inbox = [torch.empty_like(c) for c in copy]
        for b, theirs in enumerate(inbox):  # every receive posted before the first send (_Exchange)
            exchange.recv(theirs, peer, tag=b)
        for b, mine in enumerate(copy):
            exchange.send(mine, peer, tag=b)
        exchange.wait()
        return inbox

    # -- collective points: synchronize, state_dict ---------------------------------------------------------

    def _quiesce(self, buffers: list[torch.Tensor]) -> None:
        """Agree on the number of exchanges, let every thread finish exactly those, add them (collective)."""
        if self._thread is None:
            return
        with self._cond:
            self._frozen = True  # begin nothing new while the ranks agree
            started = self._started
        count = torch.tensor([started], dtype=torch.int64)
        work = dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.process_group, async_op=True)
        self.wait_collective([work], "agreeing on the exchanges to finish", self.world_size)
        target = int(count.item())
        self._add_finished(buffers)
        self._publish(buffers)
        deadline = time.monotonic() + self.timeout.total_seconds()
        with self._cond:
            self._target = target
            self._cond.notify_all()
            while self._done < target and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"{type(self).__name__}: the progress thread finished {self._done} of the {target} exchanges "
                        f"the ranks agreed on within {self.timeout.total_seconds():g} s at step {self.step}"
                    )
                self._cond.wait(min(left, 0.1))
        self._raise_thread_error()
        self._add_finished(buffers)
        with self._cond:
            # The next exchange waits for the next published model: every rank publishes one at its next step,
            # while a rank that never steps again (the end of training) must not be waited for.
            self._target, self._frozen, self._used = None, False, self._version
            self._cond.notify_all()

    def synchronize(self, params: ParamsLike, buffers: BuffersLike | None = None) -> None:
        """Finish the exchanges the ranks agree on, add them, then the blocking global mean (collective).

        Does not advance ``self.step``; counts as a global reduction. The thread goes on afterwards.
        """
        self._check_open()
        if not self.is_member:
            return
        self._raise_thread_error()
        tensors = self.tensors_to_average(params, buffers, where="synchronize")
        flat = self.flat_buffers(tensors)
        packed = flat.pack()
        self._quiesce(packed)
        flat.unpack()
        self.allreduce_mean(tensors, self.process_group, "global")
        if self._thread is not None:
            # The averaged model replaces the copy, but an exchange of identical models adds nothing: the
            # next one waits for the next training step (and a rank that never steps again is not waited for).
            self._publish(self.flat_buffers(tensors).pack(), trigger=False)

    def state_dict(self) -> dict[str, Any]:
        """The base's state plus ``exchanges`` (the next exchange's number). Collective once the thread runs: the
        agreed exchanges are finished and added to the bound tensors first, so nothing in flight is lost."""
        if self._thread is not None and self._flat is not None:
            packed = self._flat.pack()
            self._quiesce(packed)
            self._flat.unpack()
        state = super().state_dict()
        with self._cond:
            state["exchanges"] = self._started
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the step, counters and the next exchange's number (before the thread starts).

        Raises:
            ValueError: if a key is missing or the thread already runs.
        """
        if "exchanges" not in state_dict:
            raise ValueError(
                f"state_dict: expected the keys ['exchanges', 'stats', 'step'], found {sorted(state_dict)}"
            )
        if self._thread is not None:
            raise ValueError("ADPSGDAverager.load_state_dict: load the state before the first average_parameters call")
        super().load_state_dict(state_dict)
        exchanges = check_int("state_dict['exchanges']", state_dict["exchanges"], 0)
        with self._cond:
            self._started = self._done = exchanges

    def close(self) -> None:
        """Stop the thread and release the groups; idempotent. Not collective, needs no :meth:`synchronize` first.

        The thread finishes an exchange whose peer met it, withdraws from the one it waits for and from its next
        ones, and ends: no peer is kept waiting (module docstring). The join is bounded by ``timeout`` (and a few
        seconds for the store). Exchanges finished since the last call are not added (call :meth:`synchronize`
        first to keep them and end at the global mean).
        """
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        thread, self._thread = self._thread, None
        if thread is None:
            if not self._closed:
                self._leave()  # the thread never ran: partners that did may wait in this rank's first exchanges
        elif thread is not threading.current_thread():
            thread.join(self.timeout.total_seconds() + _JOIN_GRACE_S)  # it withdraws as it ends
        if not self._closed:
            super().close()

    def __repr__(self) -> str:
        return f"ADPSGDAverager(warmup_steps={self.warmup_steps}, step={self.step}, exchanges={self.exchanges})"
