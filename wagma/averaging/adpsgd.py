"""AD-PSGD: asynchronous pairwise model averaging on a progress thread (Lian et al., 2018; DESIGN §2.6).

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
- *Bounded waits.* Every send and receive of the thread is bounded by ``timeout``; its failure (naming the
  peer and the exchange) is raised by the training loop's next call. Joining the thread is bounded too.

:meth:`~ADPSGDAverager.synchronize` and :meth:`~ADPSGDAverager.state_dict` are collective (every rank calls
them at the same step): the ranks agree on the number of exchanges to finish, the threads finish exactly those
(every pair meets, nothing is left in flight), the differences are added, and ``synchronize`` then takes the
global mean. Resume continues at the agreed exchange.
"""

from __future__ import annotations

import datetime
import math
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from wagma.averaging.base import AveragerBase, ParamsLike, Reduction, check_int
from wagma.averaging.gossip import _Exchange, _check_world
from wagma.averaging.tensors import widened
from wagma.groups import DEFAULT_TIMEOUT
from wagma.world import WorldLike

__all__ = ["ADPSGDAverager", "adpsgd_peer"]


def adpsgd_peer(rank: int, world_size: int, exchange: int) -> int:
    """The partner of ``rank`` in AD-PSGD's exchange number ``exchange`` (P even).

    The offsets are ``1`` and ``1 + 2^i`` for ``i = 1 .. ⌊log2(P - 1)⌋`` (those below P), in turn; an active
    (even) rank ``a`` meets ``a + o``, a passive (odd) rank ``p`` meets ``p - o``.

    Raises:
        ValueError: for a world of fewer than 2 ranks or an odd one (no bipartite split into pairs).
    """
    _check_world("adpsgd", world_size)
    if world_size % 2:
        raise ValueError(
            f"adpsgd: the active / passive split pairs even ranks with odd ones, so the world must be even; "
            f"found {world_size} ranks"
        )
    offsets = [1] + [1 + 2 ** i for i in range(1, int(math.log2(world_size - 1)) + 1) if 1 + 2 ** i < world_size]
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
    exchanges and one for :meth:`synchronize`'s agreement and global mean (the main thread's).

    Args:
        warmup_steps: calls before the thread starts; at least 0.
        average_buffers: also average the floating-point buffers passed to ``average_parameters``.
        timeout: bound of every send, receive and join (``timedelta`` or seconds).
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
        adpsgd_peer(0, self.world_size, 0)  # validates the world
        self._p2p = self._new_group(None)  # the thread's own: never used by two threads at once
        self._cond = threading.Condition()
        self._snapshot: list[torch.Tensor] | None = None  # the published copy; replaced, never written
        self._version = 0  # models published so far
        self._used = 0  # the version the thread's last exchange used (it waits for a newer one)
        self._deltas: list[tuple[list[torch.Tensor], int]] = []  # finished exchanges: (difference, copy's version)
        self._started = 0  # exchanges the thread has begun
        self._done = 0  # exchanges the thread has finished
        self._target: int | None = None  # when set: finish exactly this many exchanges, then idle
        self._frozen = False  # begin no new exchange
        self._closing = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    @property
    def exchanges(self) -> int:
        """Exchanges this rank's thread has finished."""
        with self._cond:
            return self._done

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
            try:
                inbox = self._swap(copy, adpsgd_peer(me, self.world_size, k), k)
            except BaseException as err:  # noqa: BLE001 - handed to the training loop, which raises it
                with self._cond:
                    self._error = err
                    self._cond.notify_all()
                return
            delta = [(theirs - mine).mul_(0.5) for theirs, mine in zip(inbox, copy)]
            with self._cond:
                self._deltas.append((delta, used))
                self._done += 1
                self._cond.notify_all()

    def _swap(self, copy: list[torch.Tensor], peer: int, k: int) -> list[torch.Tensor]:
        exchange = _Exchange(f"{type(self).__name__} (progress thread)", k, self._p2p, self.timeout, unit="exchange")
        inbox = [torch.empty_like(c) for c in copy]
        for b, (mine, theirs) in enumerate(zip(copy, inbox)):
            exchange.send(mine, peer, tag=b)
            exchange.recv(theirs, peer, tag=b)
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

    def synchronize(self, params: ParamsLike, buffers: Iterable[torch.Tensor] | None = None) -> None:
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
            raise ValueError(f"state_dict: expected the keys ['exchanges', 'stats', 'step'], found {sorted(state_dict)}")
        if self._thread is not None:
            raise ValueError("ADPSGDAverager.load_state_dict: load the state before the first average_parameters call")
        super().load_state_dict(state_dict)
        exchanges = check_int("state_dict['exchanges']", state_dict["exchanges"], 0)
        with self._cond:
            self._started = self._done = exchanges

    def close(self) -> None:
        """Stop the thread (bounded join) and release the groups; idempotent."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(self.timeout.total_seconds() + 1.0)
        if not self._closed:
            super().close()

    def __repr__(self) -> str:
        return f"ADPSGDAverager(warmup_steps={self.warmup_steps}, step={self.step}, exchanges={self._done})"
