"""The decentralized baselines WAGMA-SGD is measured against: D-PSGD, SGP and OSGP (docs/design.md §2.6).

Gossip averagers exchange models with a few peers per round instead of reducing over a group:

- :class:`DPSGDAverager` -- D-PSGD (Lian et al., 2017): every round each rank averages with its neighbours on
  a fixed undirected graph (a ring, or the exponential graph), blocking. The mixing matrix is doubly stochastic,
  so the mean of the models is kept exactly (up to rounding).
- :class:`SGPAverager` -- Stochastic Gradient Push (Assran et al., 2019): push-sum on the time-varying directed
  exponential graph; each round a rank keeps a third of its push-sum numerator and weight and pushes a third to
  each of two out-peers. ``overlap=True`` is OSGP: a round's messages travel while the next local step runs
  and are added one round late. Σ numerators and Σ weights are conserved (messages in flight included); the
  model a rank trains, evaluates and saves is the de-biased ``z = x / w``.

Both are :class:`~wagma.averaging.AveragerBase` subclasses (torch ``ModelAverager``\\ s): call
``average_parameters`` after every ``optimizer.step()``. Every wait (each point-to-point send and receive) is
bounded by the averager's timeout, and a timed-out receive names the peer that did not send and the round.
The peer rules are in :func:`ring_neighbours`, :func:`exponential_neighbours` and :func:`sgp_peers`.
"""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist

from wagma.averaging.base import AveragerBase, ParamsLike, Reduction
from wagma.averaging.tensors import BuffersLike, widened
from wagma.checks import check_bool, check_choice, check_int, check_number
from wagma.groups import DEFAULT_TIMEOUT, is_timeout
from wagma.world import WorldLike

__all__ = [
    "TOPOLOGIES",
    "DPSGDAverager",
    "SGPAverager",
    "exponential_neighbours",
    "ring_neighbours",
    "sgp_peers",
]

Topology = Literal["ring", "exponential"]
#: D-PSGD's graphs.
TOPOLOGIES: tuple[str, ...] = ("ring", "exponential")


def _check_world(name: str, world_size: int, minimum: int = 2) -> None:
    if not isinstance(world_size, int) or world_size < minimum:
        raise ValueError(
            f"{name}: gossip needs at least {minimum} ranks to have a peer, found a world of {world_size!r}"
        )


def ring_neighbours(rank: int, world_size: int) -> list[int]:
    """The distinct neighbours of ``rank`` on a ring: ``rank - 1`` and ``rank + 1`` (one peer when P = 2)."""
    _check_world("ring", world_size)
    return sorted({(rank - 1) % world_size, (rank + 1) % world_size} - {rank})


def exponential_neighbours(rank: int, world_size: int) -> list[int]:
    """The distinct neighbours of ``rank`` on the undirected exponential graph: ``rank ± 2^k`` for ``2^k < P``.

    The offsets are closed under negation, so the graph is undirected and every rank has the same degree:
    uniform weights make its mixing matrix doubly stochastic.
    """
    _check_world("exponential", world_size)
    peers = set()
    k = 1
    while k < world_size:
        peers.update({(rank + k) % world_size, (rank - k) % world_size})
        k *= 2
    return sorted(peers - {rank})


def sgp_peers(rank: int, world_size: int, round_: int) -> tuple[list[int], list[int]]:
    """SGP's (out-peers, in-peers) of ``rank`` at ``round_``, as the reference code runs them.

    The directed exponential graph's offsets are ``2^i`` for ``i = 0 .. ⌊log2(P - 1)⌋`` (the "phone book");
    round r uses the two entries ``2r mod n`` and ``2r + 1 mod n`` of it (n = its length), so consecutive rounds
    rotate through every offset. A rank sends to ``rank + offset`` and receives from ``rank - offset``, for the
    same two offsets, in that order (when n = 1, at P = 2, both are the one peer).
    """
    _check_world("sgp", world_size)
    n = int(math.log2(world_size - 1)) + 1
    offsets = [2 ** ((2 * round_) % n), 2 ** ((2 * round_ + 1) % n)]
    return [(rank + o) % world_size for o in offsets], [(rank - o) % world_size for o in offsets]


class _Exchange:
    """Point-to-point sends and receives started together and waited for with a deadline, each naming its peer.

    gloo sends and receives CPU tensors only: CUDA tensors on a gloo group travel through host copies (a receive
    lands in a host buffer and is copied into its tensor by :meth:`wait`). NCCL takes them as they are.

    Post every receive before the first send: gloo starts a send once its peer's receive is posted, and when
    neighbours both post their sends first the transfers serialize (on 200 Mbit/s links, P = 4, a ring exchange
    of 1 MB with both neighbours took 138 ms sends first and 83 ms receives first, against 80 ms of wire:
    ``benchmarks/rank_net.py``).
    """

    def __init__(
        self, owner: str, round_: int, group: dist.ProcessGroup, timeout: datetime.timedelta, unit: str = "round"
    ) -> None:
        self.owner, self.round, self.group, self.timeout, self.unit = owner, round_, group, timeout, unit
        self._works: list[tuple[str, int, Any, torch.Tensor, torch.Tensor | None]] = []
        self._host_only = dist.get_backend(group) == "gloo"

    def _staged(self, tensor: torch.Tensor) -> bool:
        return self._host_only and tensor.device.type != "cpu"

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        """Start sending ``tensor`` (kept alive until :meth:`wait`) to group rank ``peer``."""
        dst = dist.get_global_rank(self.group, peer)
        wire = tensor.cpu() if self._staged(tensor) else tensor
        try:
            work = dist.isend(wire, dst=dst, group=self.group, tag=tag)
        except RuntimeError as err:  # the connection is already gone
            raise self._timeout("send", peer, err) from err
        self._works.append(("send", peer, work, wire, None))

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        """Start receiving into ``tensor`` from group rank ``peer`` (filled by :meth:`wait`).

        Raises:
            RuntimeError: a send was posted already (receives come first: class docstring).
        """
        if any(kind == "send" for kind, *_ in self._works):
            raise RuntimeError(
                f"{self.owner}: {self.unit} {self.round}: a receive posted after a send; post every "
                "receive first (gloo serializes exchanges whose sends come first)"
            )
        src = dist.get_global_rank(self.group, peer)
        staged = self._staged(tensor)
        wire = torch.empty(tensor.shape, dtype=tensor.dtype) if staged else tensor
        try:
            work = dist.irecv(wire, src=src, group=self.group, tag=tag)
        except RuntimeError as err:
            raise self._timeout("recv", peer, err) from err
        self._works.append(("recv", peer, work, wire, tensor if staged else None))

    def wait(self) -> float:
        """Wait for every transfer (receives first); return the seconds waited.

        Raises:
            TimeoutError: naming the peer and the round, when a transfer did not finish within the timeout.
            RuntimeError: naming the peer and the round, when a transfer failed (the peer's connection closed).
        """
        start = time.perf_counter()
        deadline = start + self.timeout.total_seconds()
        works, self._works = sorted(self._works, key=lambda w: w[0] != "recv"), []
        for kind, peer, work, wire, target in works:
            left = datetime.timedelta(seconds=max(0.001, deadline - time.perf_counter()))
            try:
                ok = work.wait(left)
            except RuntimeError as err:
                raise self._timeout(kind, peer, err) from err
            if ok is False:
                raise self._timeout(kind, peer, None)
            if target is not None:
                target.copy_(wire)  # a receive staged through the host
        return time.perf_counter() - start

    def _timeout(self, kind: str, peer: int, err: BaseException | None) -> Exception:
        rank = dist.get_global_rank(self.group, peer)
        if err is not None and not is_timeout(err):
            return RuntimeError(
                f"{self.owner}: {self.unit} {self.round}: the {kind} with rank {rank} failed; rank {rank} is probably "
                f"gone ({err})"
            )
        what = "no model arrived from" if kind == "recv" else "could not hand its model to"
        return TimeoutError(
            f"{self.owner}: {self.unit} {self.round}: {what} rank {rank} within {self.timeout.total_seconds():g} s; "
            f"rank {rank} is slow, hung or gone" + (f" ({err})" if err is not None else "")
        )


class DPSGDAverager(AveragerBase):
    """D-PSGD: every round each rank replaces its model by the mean of itself and its neighbours, blocking.

    On a ring with P >= 3 that is ``x ← (x + x_left + x_right) / 3`` (docs/design.md §2.6); at P = 2 the two
    ranks are each other's only neighbour and take the mean of the two. With ``topology="exponential"`` the
    neighbours are ``rank ± 2^k`` (:func:`exponential_neighbours`), uniform weights. Either way the mixing matrix is
    doubly stochastic: the mean of the models over the ranks is what it was before the round.

    Step semantics: the call with ``step`` gossips iff ``step >= warmup_steps`` (during the warm-up, DDP usually
    averages gradients and the replicas stay identical). Each gossip round counts as a ``"local"`` reduction;
    ``stats.bytes_sent`` counts every byte sent to every neighbour.

    Args:
        topology: ``"ring"`` or ``"exponential"``.
        warmup_steps: calls before the first round; at least 0.
        process_group: group to gossip in (ranks are numbered inside it); ``None`` creates a timeout-bound group
            over all ranks. It needs at least 2 ranks.
        average_buffers: also average the floating-point buffers passed to ``average_parameters``.
        timeout: bound of every send and receive (``timedelta`` or seconds).
        world: the ranks to gossip among (:func:`wagma.world.as_world`; ``None``: the whole job).

    Raises:
        ValueError: for an unknown topology, a negative ``warmup_steps`` or a group of fewer than 2 ranks.
    """

    def __init__(
        self,
        topology: Topology = "ring",
        warmup_steps: int = 0,
        process_group: dist.ProcessGroup | None = None,
        *,
        average_buffers: bool = True,
        timeout: datetime.timedelta | float = DEFAULT_TIMEOUT,
        world: WorldLike = None,
    ) -> None:
        check_choice("topology", topology, TOPOLOGIES)
        self.topology = topology
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        super().__init__(process_group, average_buffers=average_buffers, timeout=timeout, world=world)
        self.neighbours: list[int] = []
        if self.is_member:
            _check_world(type(self).__name__, self.world_size)
            me = self.process_group.rank()
            graph = ring_neighbours if topology == "ring" else exponential_neighbours
            self.neighbours = graph(me, self.world_size)
        self._inbox: list[list[torch.Tensor]] | None = None

    def _average_step(self, tensors: list[torch.Tensor]) -> Reduction | None:
        if self.step < self.warmup_steps:
            return None
        flat = self.flat_buffers(tensors)
        buffers = flat.pack()
        if self._inbox is None or [b.shape for b in self._inbox[0]] != [b.shape for b in buffers]:
            self._inbox = [[torch.empty_like(b) for b in buffers] for _ in self.neighbours]
        exchange = _Exchange(type(self).__name__, self.step, self.process_group, self.timeout)
        for j, peer in enumerate(self.neighbours):  # every receive posted before the first send (_Exchange)
            for b in range(len(buffers)):
                exchange.recv(self._inbox[j][b], peer, tag=b)
        for peer in self.neighbours:
            for b, buffer in enumerate(buffers):
                exchange.send(buffer, peer, tag=b)
        waited = exchange.wait()
        share = 1.0 / (len(self.neighbours) + 1)
        for b, buffer in enumerate(buffers):
            for inbox in self._inbox:
                buffer.add_(inbox[b])
            buffer.mul_(share)
        flat.unpack()
        self.stats.record_reduction("local", flat.nbytes * len(self.neighbours), waited)
        return "local"

    def __repr__(self) -> str:
        return f"DPSGDAverager(topology={self.topology!r}, warmup_steps={self.warmup_steps}, step={self.step})"


class SGPAverager(AveragerBase):
    """Stochastic Gradient Push (``overlap=False``) and its overlapped form OSGP (``overlap=True``).

    Push-sum state per rank: a numerator ``x`` (one flat copy of the averaged tensors) and a weight ``w``
    (initially the model and 1). The tensors the training loop holds are the de-biased model ``z = x / w``:
    the optimizer steps on ``z``, and each call first folds that local step into the numerator
    (``x += z_now - z_last``, the gradient applied to ``x`` as in the reference). A round r then

    1. keeps ``x / 3`` and ``w / 3`` and pushes a copy of each to the two out-peers of :func:`sgp_peers`,
    2. adds what its two in-peers pushed: in SGP, their round-r messages (blocking); in OSGP, their round
       r - 1 messages (the round-r ones travel during the next local step: a bounded delay of one round),
    3. writes ``z = x / w`` back into the tensors.

    Σx and Σw over the ranks, messages in flight included, are exactly what they were (up to rounding): at the
    start Σw = P. Without delays every rank keeps and receives thirds, so ``w`` stays 1; with overlap ``w``
    settles at 3/5 and ``z`` is not ``x``, which is why the de-biased model is the one trained and saved.

    :meth:`synchronize` (evaluation, the end of training) collects a round in flight, then sets every rank to
    ``Σx / Σw`` with ``w = 1``, a global reduction. ``state_dict`` holds ``w``, the numerator and ``z_last``
    (resume is bitwise for SGP); with overlap it first collects the round in flight (every rank calls it at the
    same step, as checkpoints do), so nothing in flight is lost. Collecting that round changes what the next
    rounds split (Σx and Σw stay the same), so an OSGP run that saves checkpoints is not bitwise one that does not.
    End a run with :meth:`synchronize` before :meth:`close`: closing with OSGP's round still in flight can make a
    slower peer's last receive fail ("Connection closed by peer").

    Args:
        overlap: OSGP instead of SGP.
        warmup_steps: calls before the first round (the replicas are identical then); at least 0.
        process_group: group to gossip in; ``None`` creates a timeout-bound group over all ranks (>= 2 ranks).
        average_buffers: also average the floating-point buffers passed to ``average_parameters``.
        timeout: bound of every send and receive (``timedelta`` or seconds).
        world: the ranks to gossip among (:func:`wagma.world.as_world`; ``None``: the whole job).
    """

    SHARE = 1.0 / 3.0  # kept, and pushed to each of the two out-peers

    def __init__(
        self,
        overlap: bool = False,
        warmup_steps: int = 0,
        process_group: dist.ProcessGroup | None = None,
        *,
        average_buffers: bool = True,
        timeout: datetime.timedelta | float = DEFAULT_TIMEOUT,
        world: WorldLike = None,
    ) -> None:
        self.overlap = check_bool("overlap", overlap)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        super().__init__(process_group, average_buffers=average_buffers, timeout=timeout, world=world)
        if self.is_member:
            _check_world(type(self).__name__, self.world_size)
        #: The push-sum weight w of this rank.
        self.weight: float = 1.0
        self._numerator: list[torch.Tensor] | None = None  # x, per flat buffer
        self._last: list[torch.Tensor] | None = None  # z as last written into the tensors
        self._pending: tuple[_Exchange, list[list[torch.Tensor]], list[torch.Tensor]] | None = None
        self._loaded: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        """``"osgp"`` or ``"sgp"``."""
        return "osgp" if self.overlap else "sgp"

    # -- the round ------------------------------------------------------------------------------------

    def _state_for(self, buffers: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The numerator and ``z_last`` (created from the tensors, or restored), checked against their layout."""
        if self._loaded is not None:
            loaded, self._loaded = self._loaded, None
            numerator, last = list(loaded["numerator"]), list(loaded["last"])
            expected = [(b.dtype, tuple(b.shape)) for b in buffers]
            for what, found in (("numerator", numerator), ("last", last)):
                got = [(t.dtype, tuple(t.shape)) for t in found]
                if got != [(torch.float32 if d in (torch.float16, torch.bfloat16) else d, s) for d, s in expected]:
                    raise ValueError(
                        f"{type(self).__name__}.load_state_dict: the saved {what} has buffers {got}, the model's "
                        f"flat buffers are {expected}: the state belongs to another model"
                    )
            self._numerator = [t.to(b.device).clone() for t, b in zip(numerator, buffers)]
            self._last = [t.to(b.device).clone() for t, b in zip(last, buffers)]
        if self._numerator is None or self._last is None:
            self._numerator = [widened(b).clone() for b in buffers]
            self._last = [widened(b).clone() for b in buffers]
        return self._numerator, self._last

    def _fold_local_step(self, buffers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        numerator, last = self._state_for(buffers)
        for x, z, z_last in zip(numerator, buffers, last):
            x.add_(widened(z)).sub_(z_last)  # the local step since the last round, applied to the numerator
        return numerator

    def _receive(self, pending: tuple[_Exchange, list[list[torch.Tensor]], list[torch.Tensor]]) -> float:
        exchange, inboxes, weights = pending
        waited = exchange.wait()
        assert self._numerator is not None
        for inbox in inboxes:
            for x, received in zip(self._numerator, inbox):
                x.add_(received)
        for w in weights:
            self.weight += float(w.item())
        return waited

    def _write_back(self, flat: Any, buffers: Sequence[torch.Tensor]) -> None:
        assert self._numerator is not None and self._last is not None
        for x, z, z_last in zip(self._numerator, buffers, self._last):
            torch.div(x, self.weight, out=z_last)
            z.copy_(z_last)
        flat.unpack()

    def _average_step(self, tensors: list[torch.Tensor]) -> Reduction | None:
        if self.step < self.warmup_steps:
            return None
        flat = self.flat_buffers(tensors)
        buffers = flat.pack()
        numerator = self._fold_local_step(buffers)
        round_ = self.step - self.warmup_steps  # one round a call after the warm-up
        out_peers, in_peers = sgp_peers(self.process_group.rank(), self.world_size, round_)
        for x in numerator:
            x.mul_(self.SHARE)
        self.weight *= self.SHARE
        exchange = _Exchange(type(self).__name__, self.step, self.process_group, self.timeout)
        sent = [x.clone() for x in numerator] if self.overlap else numerator  # x changes while OSGP's copies travel
        weight = torch.tensor([self.weight], dtype=torch.float64)
        nb = len(numerator)
        inboxes = [[torch.empty_like(x) for x in numerator] for _ in in_peers]
        weights = [torch.empty(1, dtype=torch.float64) for _ in in_peers]
        for j, peer in enumerate(in_peers):  # every receive posted before the first send (_Exchange)
            for b in range(nb):
                exchange.recv(inboxes[j][b], peer, tag=j * (nb + 1) + b)
            exchange.recv(weights[j], peer, tag=j * (nb + 1) + nb)
        for j, peer in enumerate(out_peers):
            for b, x in enumerate(sent):
                exchange.send(x, peer, tag=j * (nb + 1) + b)
            exchange.send(weight, peer, tag=j * (nb + 1) + nb)
        current = (exchange, inboxes, weights)
        waited = 0.0
        if self.overlap:
            if self._pending is not None:
                waited = self._receive(self._pending)
            self._pending = current
        else:
            waited = self._receive(current)
        self._write_back(flat, buffers)
        self.stats.record_reduction("local", sum(x.numel() * x.element_size() for x in numerator) * 2, waited)
        return "local"

    def _drain(self) -> None:
        """Add the round in flight (OSGP) to the numerator; blocking, bounded by the timeout."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._receive(pending)

    # -- evaluation, state ------------------------------------------------------------------------------

    def synchronize(self, params: ParamsLike, buffers: BuffersLike | None = None) -> None:
        """Blocking global push-sum average: every rank gets ``Σx / Σw`` and ``w = 1`` (nothing in flight is lost).

        Does not advance ``self.step``; counts as a global reduction.
        """
        self._check_open()
        if not self.is_member:
            return
        tensors = self.tensors_to_average(params, buffers, where="synchronize")
        if self._numerator is None and self._loaded is None:
            self.allreduce_mean(tensors, self.process_group, "global")  # no gossip yet: w = 1, x = z
            return
        flat = self.flat_buffers(tensors)
        buffers_ = flat.pack()
        numerator = self._fold_local_step(buffers_)
        self._drain()
        start = time.perf_counter()
        weight = torch.tensor([self.weight], dtype=torch.float64)
        works = [dist.all_reduce(x, group=self.process_group, async_op=True) for x in numerator]
        works.append(dist.all_reduce(weight, group=self.process_group, async_op=True))
        self.wait_collective(works, "the global average", self.world_size)
        total = float(weight.item())
        for x in numerator:
            x.div_(total)  # Σx / Σw, with w = 1 from here on
        self.weight = 1.0
        self._write_back(flat, buffers_)
        self.stats.record_reduction("global", flat.nbytes, time.perf_counter() - start)

    def state_dict(self) -> dict[str, Any]:
        """The base's state plus ``weight``, the ``numerator`` and ``last`` buffers (``None`` before
        the first round). With overlap, collects the round in flight first (call it on every rank at the same
        step)."""
        self._drain()
        state = super().state_dict()
        if self._loaded is not None:
            numerator, last = self._loaded["numerator"], self._loaded["last"]
        else:
            numerator, last = self._numerator, self._last
        state.update(
            weight=self.weight,
            numerator=None if numerator is None else [x.detach().cpu().clone() for x in numerator],
            last=None if last is None else [x.detach().cpu().clone() for x in last],
        )
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; the buffers are checked against the model at the next round.

        Raises:
            ValueError: if a key is missing, or (at the next round) the saved buffers do not fit the model.
        """
        missing = {"weight", "numerator", "last"} - set(state_dict)
        if missing:
            raise ValueError(
                f"state_dict: expected the keys {sorted(self.state_dict())}, found {sorted(state_dict)} "
                f"(missing {sorted(missing)})"
            )
        super().load_state_dict(state_dict)
        weight = state_dict["weight"]
        self.weight = check_number("state_dict['weight']", weight, 0.0, above=True)
        self._pending = None
        self._numerator = self._last = None
        if state_dict["numerator"] is None:
            self._loaded = None
        else:
            self._loaded = {"numerator": state_dict["numerator"], "last": state_dict["last"]}

    def __repr__(self) -> str:
        return (
            f"SGPAverager(overlap={self.overlap}, warmup_steps={self.warmup_steps}, step={self.step}, "
            f"weight={self.weight:.4f})"
        )
