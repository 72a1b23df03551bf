"""A discrete-event simulator (SimPy) of the averaging policies' step timing under load imbalance.

It replays, for P ranks and N steps, a per-rank compute trace and a per-rank delay trace through each
policy's protocol, with an alpha-beta network model, and returns when the slowest rank finished
(after the policy's final flush and a closing barrier, as :mod:`benchmarks.regime` measures a real run).
The protocols are those of the library, with the library's own round rules:

- ``allreduce`` (DDP): every step a blocking allreduce of the gradients over all P ranks.
- ``local_sgd`` (K-AVG): a blocking global model mean on steps ``s >= w`` with ``(s - w) % period == 0``;
  warm-up steps ``s < w`` are DDP steps. Final flush: a global mean, unless the last step was one.
- ``hierarchical`` / ``hierarchical_momentum``: fixed contiguous blocks of ``local_group_size`` ranks
  average every ``local_period`` steps, all ranks every ``global_period`` (both firing: global only).
- ``wagma``: round k = step k; rounds with ``k % (tau + 1) == tau`` are global means (sync rounds); the
  other rounds are wait-avoiding group allreduces in the groups of :class:`wagma.schedule.GroupSchedule`
  (the library's schedule object, not a re-implementation): the first main thread to reach round k
  activates it for everyone; every rank's progress thread runs the rounds in order, at most
  ``max_lead`` rounds ahead of its main thread, and exchanges in its group as soon as round k is
  activated and every member's thread is there; a main thread waits only for its own group's result.
  With ``sync: barrier`` (the default) a sync round is blocking: every thread waits for its own main
  thread to reach it. With ``sync: wait_avoiding`` a sync round is run like the group rounds, over all
  ranks: activated by the first arrival, each thread at most ``max_lead`` rounds ahead of its main thread.
  With ``overlap: true`` a main thread does not wait for round k at step k: it waits for round k - 1
  (submitted by its previous step) first, then publishes and triggers round k and goes on; a blocking sync
  round is still waited for at once. The final flush first waits for the round in flight. eager with
  ``overlap: true`` the same, except that every round, sync rounds too, is waited for at the next step.
- ``eager_solo`` / ``eager_majority``: the first ``warmup_iters`` steps are DDP steps; round
  ``r = step - warmup_iters`` is a partial allreduce over all ranks run by the progress threads,
  activated by the first arrival (solo) or by the round's initiator, drawn exactly as the library's
  engine draws it (majority); rounds with ``r % (tau + 1) == tau`` are blocking and fully fresh.
- ``dpsgd`` / ``sgp`` / ``osgp`` / ``adpsgd``, the decentralized baselines (docs/design.md §2.6): point-to-point
  messages of the model (``nbytes``) instead of collectives, with the library's own peer functions. Warm-up steps
  ``s < warmup_steps`` are DDP steps (the policies' post-local hook allreduces the gradients; the averagers do
  nothing). A message is a rendezvous, as gloo's send of an unbound buffer: it travels once its sender has posted
  the send and its receiver the receive, and a rank waits for the sends it started as well as for its receives.
  ``dpsgd``: at every step each rank exchanges models with every neighbour of :func:`ring_neighbours` (``topology:
  ring``) or :func:`exponential_neighbours` (``exponential``) and waits for all of it: it waits for its
  neighbours to reach the same step (no global barrier, so a delay spreads one hop a step). ``sgp``: round
  ``r = step - warmup_steps`` sends to the two out-peers of :func:`sgp_peers` and receives from the two in-peers,
  blocking (so a rank waits for all four to reach round r). ``osgp``: the same messages, posted at step r and
  waited for at step r + 1 (the round in flight is collected by the final flush). ``adpsgd``: the main thread only
  publishes (never waits); a progress thread per rank runs exchange after exchange, exchange k with
  :func:`adpsgd_peer` ``(rank, P, k)``, each needing a model published since its previous exchange began and the
  partner's thread at exchange k. The first exchange of a trace that starts at ``first_step`` is numbered
  ``first_step - warmup_steps`` (as if each untimed step had run one). Its final flush is ``synchronize``: the
  ranks agree on the exchanges to finish (an allreduce of one integer once every rank ended its steps; each
  thread begins nothing new from then on), the threads finish exactly those, then the global mean. The other
  three flush with a global mean (OSGP after collecting its round in flight).

With a zero-cost network and the bare compute time, the simulated time is the policy's *protocol
bound* (:func:`protocol_bound`): the best its protocol permits on that delay trace.

**Shared cores.** By default every rank has its own device, as in the papers: a rank's compute and a
collective's cost are durations. Given ``cores`` (and the CPU work each rank does per step, ``cpu_s`` before
its exchange and ``after_cpu_s`` after it), the ranks' CPU work instead shares ``cores`` cores: by processor
sharing (while ``n`` pieces of work are running each advances at ``min(1, cores / n)``), or, given ``slice_s``,
round robin as an OS scheduler runs threads: a piece runs on a free core for at most ``slice_s``, then waits at
the end of the queue. The difference matters: under processor sharing ranks that start their work together end
it together and stay in step, while slices let them finish in turn and drift apart, so one rank's compute
overlaps another's sleep where the protocol does not put them back in step. A collective's
alpha-beta cost is then the CPU work each member does for it (gloo on one host: the copies, the reductions
and the loopback sockets are CPU), so a step cannot be shorter than the CPU its ranks burn in it divided by
the cores: the floor that ranks sharing one machine's cores meet, and that a model of an idle network misses.
A point-to-point message costs each of its two ends half of :meth:`Network.p2p_s` of CPU work (a pairwise
exchange, one message each way, costs each end ``alpha + n / bw``: a step of the ring allreduce). With cores of
their own, a message instead takes ``n / bw`` of its sender's injection link, which the sender's messages in flight
share (processor sharing), then ``alpha``: a rank that sends the model to d peers at once needs ``d n / bw``.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import types
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

import numpy as np
import simpy

from wagma.averaging.adpsgd import adpsgd_peer
from wagma.averaging.gossip import TOPOLOGIES, exponential_neighbours, ring_neighbours, sgp_peers
from wagma.engine import SYNCS, WaitAvoidingGroupAllreduce
from wagma.schedule import GroupSchedule

__all__ = ["Network", "SimResult", "ZERO_NETWORK", "no_wait_ms", "protocol_bound", "simulate", "SIMULATED_POLICIES"]

SIMULATED_POLICIES: tuple[str, ...] = (
    "allreduce",
    "local_sgd",
    "hierarchical",
    "hierarchical_momentum",
    "wagma",
    "eager_solo",
    "eager_majority",
    "dpsgd",
    "sgp",
    "osgp",
    "adpsgd",
)
GOSSIP_POLICIES: tuple[str, ...] = ("dpsgd", "sgp", "osgp", "adpsgd")
"""The decentralized baselines: point-to-point messages (:meth:`Network.p2p_s`) instead of collectives."""


@dataclasses.dataclass(frozen=True)
class Network:
    """Alpha-beta cost of a ring allreduce of ``n`` bytes over ``p`` ranks: ``2 (p-1) alpha + 2 (p-1)/p n / bw``,
    and of a point-to-point message of ``n`` bytes: ``alpha + n / bw`` (:meth:`p2p_s`).

    Args:
        alpha_s: latency per message (seconds).
        bandwidth_Bps: bytes per second a rank can send (injection bandwidth); ``inf``: free transfers.
        activation_s: time from the first arrival to every progress thread seeing a round's activation.
    """

    alpha_s: float = 0.0
    bandwidth_Bps: float = float("inf")
    activation_s: float = 0.0

    def __post_init__(self) -> None:
        if self.alpha_s < 0 or self.bandwidth_Bps <= 0 or self.activation_s < 0:
            raise ValueError(f"Network needs alpha_s >= 0, bandwidth_Bps > 0, activation_s >= 0, got {self}")

    def allreduce_s(self, p: int, nbytes: float) -> float:
        """Seconds one allreduce of ``nbytes`` over ``p`` ranks takes (0 for a single rank)."""
        if p <= 1:
            return 0.0
        return 2 * (p - 1) * self.alpha_s + 2 * (p - 1) / p * nbytes / self.bandwidth_Bps

    def p2p_s(self, nbytes: float) -> float:
        """Seconds one point-to-point message of ``nbytes`` takes alone on its sender's link: ``alpha + n / bw``.

        Messages a rank sends at the same time share its injection bandwidth: the simulator runs their ``n / bw``
        parts on one link per sender (module docstring, "Shared cores").
        """
        return self.alpha_s + nbytes / self.bandwidth_Bps


ZERO_NETWORK = Network()
"""Communication costs nothing: the network of the protocol bound."""


@dataclasses.dataclass
class SimResult:
    """What a simulation found.

    ``total_s`` is the time from the common start to the closing barrier (the slowest rank, final flush
    included); ``ms_per_step`` is ``1e3 * total_s / steps``; ``finish_s`` is each rank's time after its
    last step, before the flush; ``wait_s`` each rank's summed waiting in steps (not in the flush);
    ``cpu_work_s`` the work run on shared cores.
    """

    policy: str
    world_size: int
    steps: int
    total_s: float
    finish_s: list[float]
    wait_s: list[float]
    cpu_work_s: float = 0.0
    """The CPU work run on shared cores, all ranks together (0 with cores of their own)."""
    comm_s: list[float] = dataclasses.field(default_factory=list)
    """Per rank, the network's cost (unscaled) of the collectives it took part in during its steps (the final
    flush and barrier not counted), and half of :meth:`Network.p2p_s` for each point-to-point message it sent or
    received in them: set by the protocol alone (except AD-PSGD's: its exchanges begun before the rank's flush,
    as many as its thread managed)."""

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.total_s / self.steps


class _Cores:
    """Processor sharing of ``cores`` cores: :meth:`run` starts ``work`` seconds of CPU work and returns the
    event of its end. While ``n`` pieces of work run, each advances at ``min(1, cores / n)`` (``inf`` cores:
    always 1, so work is a plain duration)."""

    _EPS = 1e-12

    def __init__(self, env: simpy.Environment, cores: float) -> None:
        if not cores > 0:
            raise ValueError(f"cores must be > 0 (or inf), got {cores}")
        self.env, self.cores = env, float(cores)
        self._jobs: list[list[Any]] = []  # [remaining seconds of work, event]
        self._last = 0.0
        self._generation = 0
        self.total_work = 0.0

    def run(self, work: float) -> simpy.Event:
        if work <= 0 or math.isinf(self.cores):
            return self.env.timeout(max(0.0, work))
        self.total_work += work
        self._advance()
        event = self.env.event()
        self._jobs.append([float(work), event])
        self._schedule()
        return event

    def _rate(self) -> float:
        return min(1.0, self.cores / len(self._jobs)) if self._jobs else 1.0

    def _advance(self) -> None:
        done = (self.env.now - self._last) * self._rate()
        for job in self._jobs:
            job[0] -= done
        self._last = self.env.now

    def _schedule(self) -> None:
        self._generation += 1
        if self._jobs:
            wait = max(0.0, min(job[0] for job in self._jobs) / self._rate())
            generation = self._generation
            self.env.timeout(wait).callbacks.append(lambda _e: self._tick(generation))

    def _tick(self, generation: int) -> None:
        if generation != self._generation:  # work started or ended since: a newer tick is scheduled
            return
        self._advance()
        finished = [job for job in self._jobs if job[0] <= self._EPS]
        self._jobs = [job for job in self._jobs if job[0] > self._EPS]
        for _, event in finished:
            event.succeed()
        self._schedule()


class _SlicedCores:
    """Round-robin time slicing of ``cores`` cores: work waits in one FIFO queue, runs for at most ``slice_s`` on a
    free core, and goes back to the end of the queue while some is left (the interface of :class:`_Cores`)."""

    _EPS = 1e-12

    def __init__(self, env: simpy.Environment, cores: float, slice_s: float) -> None:
        if not cores > 0 or math.isinf(cores) or cores != int(cores):
            raise ValueError(f"time slicing needs a whole number of cores > 0, got {cores}")
        if not slice_s > 0:
            raise ValueError(f"slice_s must be > 0, got {slice_s}")
        self.env, self.cores, self.slice_s = env, int(cores), float(slice_s)
        self._queue: collections.deque[list[Any]] = collections.deque()  # [remaining seconds of work, event]
        self._busy = 0
        self.total_work = 0.0

    def run(self, work: float) -> simpy.Event:
        if work <= 0:
            return self.env.timeout(0.0)
        self.total_work += work
        event = self.env.event()
        self._queue.append([float(work), event])
        self._dispatch()
        return event

    def _dispatch(self) -> None:
        while self._busy < self.cores and self._queue:
            job = self._queue.popleft()
            self._busy += 1
            ran = min(self.slice_s, job[0])
            self.env.timeout(ran).callbacks.append(lambda _e, job=job, ran=ran: self._end_slice(job, ran))

    def _end_slice(self, job: list[Any], ran: float) -> None:
        self._busy -= 1
        job[0] -= ran
        if job[0] <= self._EPS:
            job[1].succeed()
        else:
            self._queue.append(job)
        self._dispatch()


class _Rendezvous:
    """Collectives by key: the ``join`` of a key by each of its ``members`` returns an event that fires when,
    after the last member joined, every member has done ``cost * scale`` seconds of work on ``cores`` (with
    cores of their own: ``cost * scale`` after the last join). ``done`` gives the event without joining;
    ``nominal[rank]`` sums the ``cost`` of the collectives joined with ``in_steps`` (those of the steps, not the
    final flush and barrier) that each rank took part in."""

    def __init__(self, env: simpy.Environment, cores: _Cores | _SlicedCores, world: int, scale: float) -> None:
        self.env, self.cores, self.scale = env, cores, scale
        self._open: dict[Any, list[Any]] = {}
        self.nominal = [0.0] * world

    def done(self, key: Any) -> simpy.Event:
        entry = self._open.setdefault(key, [None, self.env.event()])
        return entry[1]

    def join(self, key: Any, members: Sequence[int], cost: float, in_steps: bool = True) -> simpy.Event:
        entry = self._open.setdefault(key, [None, self.env.event()])
        entry[0] = (len(members) if entry[0] is None else entry[0]) - 1
        if entry[0] == 0:
            event = entry[1]
            if in_steps:
                for rank in members:
                    self.nominal[rank] += cost
            work = cost * self.scale
            jobs = [self.cores.run(work) for _ in members] if len(members) > 1 and work > 0 else [self.env.timeout(0)]
            self.env.all_of(jobs).callbacks.append(lambda _e: event.succeed())
        return entry[1]


class _Sim:
    """One simulation: P main-thread processes (and progress threads for wagma, eager and AD-PSGD)."""

    def __init__(
        self,
        options: Mapping[str, Any],
        compute: np.ndarray,
        net: Network,
        nbytes: float,
        first_step: int,
        cpu: np.ndarray | None = None,
        after_cpu: np.ndarray | None = None,
        cores: float = math.inf,
        comm_scale: float = 1.0,
        slice_s: float | None = None,
    ) -> None:
        self.opt = dict(options)
        self.name = str(self.opt.get("name"))
        if self.name not in SIMULATED_POLICIES:
            raise ValueError(f"cannot simulate policy {self.name!r}: expected one of {', '.join(SIMULATED_POLICIES)}")
        self.compute, self.net, self.nbytes, self.first = compute, net, float(nbytes), int(first_step)
        self.p, self.n = compute.shape
        zeros = np.zeros_like(compute)
        self.cpu = zeros if cpu is None else cpu
        self.after_cpu = zeros if after_cpu is None else after_cpu
        self.env = simpy.Environment()
        self.cores = (
            _Cores(self.env, cores) if slice_s is None or math.isinf(cores) else _SlicedCores(self.env, cores, slice_s)
        )
        self.shared = not math.isinf(cores)
        # Point-to-point messages (gossip): open rendezvous by key, and with cores of their own one injection
        # link per rank, shared by the messages it sends at once.
        self._messages: dict[Any, list[Any]] = {}
        self.links = [_Cores(self.env, 1.0) for _ in range(self.p)]
        self.coll = _Rendezvous(self.env, self.cores, self.p, comm_scale)
        self.wait = [0.0] * self.p
        self.finish = [0.0] * self.p
        self.arrived: list[dict[int, simpy.Event]] = [{} for _ in range(self.p)]  # rank -> round -> event
        self.activated: dict[int, simpy.Event] = {}
        self._triggered: set[int] = set()
        self._setup()

    # -- the policies' rules ---------------------------------------------------------------------------
    def _setup(self) -> None:
        o, p = self.opt, self.p
        self.async_rounds = self.name == "wagma" or self.name.startswith("eager")
        if self.name == "wagma":
            self.tau = int(o.get("sync_period", 10))
            sched = o.get("schedule", "auto")
            self.schedule = (
                GroupSchedule.create(str(sched), p, int(o.get("group_size", 2)))
                if isinstance(sched, str)
                else GroupSchedule.from_partitions(sched)
            )
            self.warmup = 0
            sync = o.get("sync", "barrier")
            if sync not in SYNCS:
                raise ValueError(f"wagma's sync must be one of {SYNCS}, got {sync!r}")
            self.blocking_sync = sync == "barrier"
        elif self.name.startswith("eager"):
            self.tau = int(o.get("sync_period", 32))
            self.warmup = int(o.get("warmup_iters", 2))
            majority = o.get("mode", self.name.removeprefix("eager_")) == "majority"
            # The library's own initiator draw (a method that needs only seed and world_size).
            who = types.SimpleNamespace(seed=int(o.get("seed", 0)), world_size=p)
            self.initiator: Callable[[int], int] | None = (
                (lambda k: WaitAvoidingGroupAllreduce.initiator(who, k)) if majority else None
            )
            self.blocking_sync = True
        else:
            self.warmup = int(o.get("warmup_steps", 0))
        if self.name in GOSSIP_POLICIES:
            self._setup_gossip()
        # overlap (wagma, eager): a step first waits for the round its previous step submitted.
        self.overlap = self.async_rounds and bool(o.get("overlap", False))
        self.pending: list[int | None] = [None] * p
        lead = o.get("max_lead")
        self.lead = int(lead) if lead is not None else getattr(self, "tau", 0)
        if self.name.startswith("hierarchical"):
            s = int(o.get("local_group_size", 2))
            self.local_period, self.global_period = int(o.get("local_period", 4)), int(o.get("global_period", 16))
            self.global_every = self.local_period if s == p else self.global_period
            self.has_local = 1 < s < p
            self.block = [tuple(range(r - r % s, r - r % s + s)) for r in range(p)]

    def _setup_gossip(self) -> None:
        """Peers of the decentralized baselines, from the library's own functions (which refuse P < 2, and
        AD-PSGD an odd P)."""
        p = self.p
        self.inflight: list[simpy.Event | None] = [None] * p  # OSGP: the round a rank's previous step posted
        if self.name == "dpsgd":
            topology = self.opt.get("topology", "ring")
            if topology not in TOPOLOGIES:
                raise ValueError(f"dpsgd's topology must be one of {TOPOLOGIES}, got {topology!r}")
            graph = ring_neighbours if topology == "ring" else exponential_neighbours
            self.neighbours = [graph(rank, p) for rank in range(p)]
        elif self.name in ("sgp", "osgp"):
            sgp_peers(0, p, 0)
        else:  # adpsgd: a progress thread per rank, and what its main thread shares with it
            adpsgd_peer(0, p, 0)
            first = max(0, self.first - self.warmup)  # exchanges before the trace: one per untimed step
            self.versions = [0] * p  # models published
            self.started = [first] * p  # exchanges begun (the next one's number)
            self.done = [first] * p  # exchanges finished
            self.frozen = [False] * p  # the main thread is in the final synchronize: begin nothing new
            self.agreed: list[int | None] = [None] * p  # exchanges begun when frozen, then the agreed target
            self.target: list[int | None] = [None] * p
            self._changed = [self.env.event() for _ in range(p)]

    def _ended_global(self) -> bool:
        """Whether the last step was a global mean after the optimizer step, so finalize has nothing to do
        (local SGD and hierarchical; WAGMA and eager always flush)."""
        last = self.first + self.n - 1 - self.warmup
        if last < 0:
            return False
        if self.name == "local_sgd":
            return last % int(self.opt.get("period", 8)) == 0
        return self.name.startswith("hierarchical") and last % self.global_every == 0

    def _round(self, step: int) -> int:
        """The engine round of ``step`` (negative during the eager warm-up)."""
        return step - self.warmup if self.name.startswith("eager") else step

    def _is_sync(self, k: int) -> bool:
        return k % (self.tau + 1) == self.tau

    def _is_blocking(self, k: int) -> bool:
        """Whether round ``k`` waits for every rank's fresh contribution (a sync round under ``sync: barrier``)."""
        return self.blocking_sync and self._is_sync(k)

    def _group(self, rank: int, k: int) -> tuple[int, ...]:
        return self.schedule.group_of(rank, k) if self.name == "wagma" else tuple(range(self.p))

    def _arrival(self, rank: int, k: int) -> simpy.Event:
        return self.arrived[rank].setdefault(k, self.env.event())

    def _activation(self, k: int) -> simpy.Event:
        return self.activated.setdefault(k, self.env.event())

    def _global(self, key: Any, in_steps: bool = True) -> simpy.Event:
        return self.coll.join(key, range(self.p), self.net.allreduce_s(self.p, self.nbytes), in_steps)

    # -- processes -------------------------------------------------------------------------------------
    def _main(self, rank: int) -> Generator[simpy.Event, Any, None]:
        env = self.env
        for i in range(self.n):
            yield env.timeout(float(self.compute[rank, i]))
            if self.cpu[rank, i] > 0:
                yield self.cores.run(float(self.cpu[rank, i]))
            step = self.first + i
            arrive = env.now
            yield from self._exchange(rank, step)
            self.wait[rank] += env.now - arrive
            if self.after_cpu[rank, i] > 0:
                yield self.cores.run(float(self.after_cpu[rank, i]))
        self.finish[rank] = env.now
        if self.overlap and self.pending[rank] is not None:  # synchronize() / flush() collect it first
            j = self.pending[rank]
            yield self.coll.done(("round", j, tuple(range(self.p)) if self._is_sync(j) else self._group(rank, j)))
        if self.name == "osgp" and self.inflight[rank] is not None:  # synchronize() drains the round in flight
            yield self.inflight[rank]
        if self.name == "adpsgd" and self.first + self.n > self.warmup:  # the thread runs: synchronize quiesces it
            yield from self._adpsgd_quiesce(rank)
        if self.name != "allreduce" and not self._ended_global():
            yield self._global(
                ("flush",), in_steps=False
            )  # the final flush: a blocking global mean (or eager's residual flush)
        yield self.coll.join(("barrier",), range(self.p), self.net.allreduce_s(self.p, 0.0), in_steps=False)

    def _exchange(self, rank: int, step: int) -> Generator[simpy.Event, Any, None]:
        name = self.name
        if name == "allreduce" or step < self.warmup:
            yield self._global(("ddp", step))
        elif name == "local_sgd":
            if (step - self.warmup) % int(self.opt.get("period", 8)) == 0:
                yield self._global(("avg", step))
        elif name.startswith("hierarchical"):
            s = step - self.warmup
            if s % self.global_every == 0:
                yield self._global(("avg", step))
            elif self.has_local and s % self.local_period == 0:
                group = self.block[rank]
                yield self.coll.join(("local", step, group), group, self.net.allreduce_s(len(group), self.nbytes))
        elif name in GOSSIP_POLICIES:
            yield from self._gossip(rank, step)
        else:  # wagma, eager: the main thread publishes, may trigger, and waits for its round's result
            k = self._round(step)
            sync = self._is_sync(k)
            overlap = self.overlap
            if overlap and self.pending[rank] is not None:  # first the round the previous step submitted
                j, self.pending[rank] = self.pending[rank], None
                yield self.coll.done(("round", j, tuple(range(self.p)) if self._is_sync(j) else self._group(rank, j)))
            self._arrival(rank, k).succeed()
            if (
                not self._is_blocking(k)
                and k not in self._triggered
                and (self.name == "wagma" or self.initiator is None or self.initiator(k) == rank)
            ):
                self._triggered.add(k)
                event = self._activation(k)
                env_timeout = self.env.timeout(self.net.activation_s)
                env_timeout.callbacks.append(lambda _e, ev=event: ev.succeed())
            if overlap and not (name == "wagma" and self._is_blocking(k)):
                self.pending[rank] = k  # not waited for: collected at the next step (wagma: a barrier sync at once)
                return
            yield self.coll.done(("round", k, tuple(range(self.p)) if sync else self._group(rank, k)))

    # -- the decentralized baselines -------------------------------------------------------------------------
    def _message(self, key: Any, src: int, dst: int, me: int, in_steps: bool = True) -> simpy.Event:
        """Post ``me``'s end (``src`` its send, ``dst`` its receive) of the message ``key`` of ``nbytes`` from ``src``
        to ``dst``; the event fires when it has arrived. It travels once both ends are posted, taking ``nbytes / bw``
        of ``src``'s link, then ``alpha`` (on shared cores: half of :meth:`Network.p2p_s` of CPU work at each end);
        every cost times the ``comm_scale``."""
        cost = self.net.p2p_s(self.nbytes)
        if in_steps:
            self.coll.nominal[me] += cost / 2
        entry = self._messages.setdefault(key, [2, self.env.event()])
        entry[0] -= 1
        if entry[0] == 0:
            del self._messages[key]
            event, scale = entry[1], self.coll.scale
            if self.shared:
                work = cost * scale / 2
                jobs = [self.cores.run(work) for _ in (src, dst)] if work > 0 else [self.env.timeout(0)]
                self.env.all_of(jobs).callbacks.append(lambda _e: event.succeed())
            else:
                alpha = self.net.alpha_s * scale
                sent = self.links[src].run(scale * self.nbytes / self.net.bandwidth_Bps)
                sent.callbacks.append(lambda _e: self.env.timeout(alpha).callbacks.append(lambda _e2: event.succeed()))
        return entry[1]

    def _swap(self, tag: Any, rank: int, peer: int, in_steps: bool = True) -> list[simpy.Event]:
        """``rank``'s ends of a pairwise exchange with ``peer``: its send to it and its receive from it."""
        return [
            self._message((tag, rank, peer), rank, peer, rank, in_steps),
            self._message((tag, peer, rank), peer, rank, rank, in_steps),
        ]

    def _gossip(self, rank: int, step: int) -> Generator[simpy.Event, Any, None]:
        """A main thread's gossip at ``step`` (after the warm-up): D-PSGD, SGP and OSGP exchange, AD-PSGD publishes."""
        if self.name == "adpsgd":  # publish a copy for the progress thread; never wait
            self.versions[rank] += 1
            self._notify(rank)
            return
        if self.name == "dpsgd":  # every neighbour, both ways, blocking
            posted = [e for peer in self.neighbours[rank] for e in self._swap(("dpsgd", step), rank, peer)]
        else:  # sgp, osgp: push to the round's two out-peers, receive from its two in-peers
            r = step - self.warmup
            out, into = sgp_peers(rank, self.p, r)
            posted = [self._message(("sgp", r, rank, o, j), rank, o, rank) for j, o in enumerate(out)] + [
                self._message(("sgp", r, i, rank, j), i, rank, rank) for j, i in enumerate(into)
            ]
        current = self.env.all_of(posted)
        if self.name == "osgp":  # this round travels during the next local step; wait for the previous one's
            previous, self.inflight[rank] = self.inflight[rank], current
            if previous is not None:
                yield previous
            return
        yield current

    def _notify(self, rank: int) -> None:
        """Wake ``rank``'s AD-PSGD thread and main thread (the condition variable's ``notify_all``)."""
        event, self._changed[rank] = self._changed[rank], self.env.event()
        event.succeed()

    def _adpsgd_thread(self, rank: int) -> Generator[simpy.Event, Any, None]:
        """AD-PSGD's progress thread (``ADPSGDAverager._run``): exchange k begins once the thread finished exchange
        k - 1 and a model newer than the one that exchange used is published (or, in the final synchronize,
        while k is below the agreed target: with the newest copy); it ends when the partner's end is there too."""
        used = 0
        while True:
            target = self.target[rank]
            k = self.started[rank]
            if target is not None:
                if k >= target:
                    yield self._changed[rank]  # done: nothing more will wake it
                    continue
            elif self.frozen[rank] or self.versions[rank] <= used:
                yield self._changed[rank]
                continue
            used = self.versions[rank]
            self.started[rank] = k + 1
            peer = adpsgd_peer(rank, self.p, k)
            yield self.env.all_of(self._swap(("adpsgd", k), rank, peer, in_steps=not self.frozen[rank]))
            self.done[rank] = k + 1
            self._notify(rank)

    def _adpsgd_quiesce(self, rank: int) -> Generator[simpy.Event, Any, None]:
        """``ADPSGDAverager._quiesce``: freeze the thread, agree on the exchanges begun (an allreduce MAX of one
        integer), let the thread finish exactly those."""
        yield self.env.timeout(0)  # the thread, woken by the last step's publish, takes that copy first
        self.frozen[rank] = True
        self.agreed[rank] = self.started[rank]
        yield self.coll.join(("agree",), range(self.p), self.net.allreduce_s(self.p, 8.0), in_steps=False)
        target = max(a for a in self.agreed if a is not None)
        self.versions[rank] += 1  # the flush's publish (the thread finishes with the newest copy, new or not)
        self.target[rank] = target
        self._notify(rank)
        while self.done[rank] < target:
            yield self._changed[rank]

    def _thread(self, rank: int) -> Generator[simpy.Event, Any, None]:
        """A progress thread: rounds in order, each after its lead permit and its activation."""
        for i in range(self.n):
            k = self._round(self.first + i)
            if k < 0:
                continue
            sync, blocking = self._is_sync(k), self._is_blocking(k)
            needed = k if blocking else k - self.lead
            if needed >= max(0, self._round(self.first)):
                yield self._arrival(rank, needed)
            if not blocking:
                yield self._activation(k)
            group = tuple(range(self.p)) if sync else self._group(rank, k)
            yield self.coll.join(("round", k, group), group, self.net.allreduce_s(len(group), self.nbytes))

    def run(self) -> SimResult:
        for rank in range(self.p):
            self.env.process(self._main(rank))
            if self.async_rounds:
                self.env.process(self._thread(rank))
            if self.name == "adpsgd":
                self.env.process(self._adpsgd_thread(rank))
        self.env.run()
        total = self.env.now
        return SimResult(
            self.name,
            self.p,
            self.n,
            total,
            list(self.finish),
            list(self.wait),
            self.cores.total_work,
            list(self.coll.nominal),
        )


def simulate(
    options: Mapping[str, Any],
    compute_s: np.ndarray,
    *,
    network: Network = ZERO_NETWORK,
    nbytes: float = 0.0,
    first_step: int = 0,
    cpu_s: np.ndarray | None = None,
    after_cpu_s: np.ndarray | None = None,
    cores: float = math.inf,
    comm_scale: float = 1.0,
    slice_s: float | None = None,
) -> SimResult:
    """Simulate one policy on one trace.

    Args:
        options: the policy's ``averaging`` config (``name`` and its keys, as in ``configs/averaging/``).
        compute_s: ``(P, N)`` seconds each rank spends before its step's exchange (compute + injected delay)
            that take no shared core (with ``cpu_s``: the sleeps; without it: everything before the exchange).
        network: the cost model of collectives, of point-to-point messages and of a round's activation.
        nbytes: bytes each allreduce carries (model or gradient size), and each gossip message (the model).
        first_step: the step index of column 0 (a trace measured after warm-up steps starts there, so
            that sync rounds fall where the library puts them).
        cpu_s: ``(P, N)`` seconds of CPU work each rank's main thread does after ``compute_s`` and before its
            exchange (the forward/backward and optimizer step), run on the shared ``cores``.
        after_cpu_s: ``(P, N)`` seconds of CPU work after the exchange (the policy's own work on the main
            thread: copies, the averaging passes), on the shared ``cores``.
        cores: the cores all ranks' CPU work shares, collectives' included (module docstring, "Shared
            cores"); ``inf`` (the default): every rank has its own, and work is a plain duration.
        slice_s: with finite ``cores``, run the CPU work round robin in slices of this many seconds (the OS
            scheduler's, :func:`benchmarks.machine.scheduler_slice_s`) instead of processor sharing.
        comm_scale: a factor on every collective's cost: with the network calibrated on an idle world, the ratio
            of the CPU a run's collectives really took (measured under load) to what the calibration predicts
            for them (:attr:`SimResult.comm_s`, which the protocol alone sets).

    Raises:
        ValueError: an unknown policy, wagma ``sync`` or dpsgd ``topology``, a gossip policy on fewer than 2
            ranks (adpsgd: an odd number), a trace that is not a non-negative ``(P, N)`` array with N >= 1, CPU
            traces of another shape, ``cores <= 0``, or, with ``slice_s`` and finite ``cores``, a slice that is not
            > 0 or a number of cores that is not whole.
    """
    trace = _trace("compute_s", compute_s)
    cpu = None if cpu_s is None else _trace("cpu_s", cpu_s, trace.shape)
    after = None if after_cpu_s is None else _trace("after_cpu_s", after_cpu_s, trace.shape)
    if first_step < 0:
        raise ValueError(f"first_step must be >= 0, got {first_step}")
    if not (comm_scale >= 0 and math.isfinite(comm_scale)):
        raise ValueError(f"comm_scale must be a finite number >= 0, got {comm_scale}")
    return _Sim(options, trace, network, nbytes, first_step, cpu, after, cores, comm_scale, slice_s).run()


def _trace(name: str, values: np.ndarray, shape: tuple[int, ...] | None = None) -> np.ndarray:
    trace = np.asarray(values, dtype=np.float64)
    if trace.ndim != 2 or trace.shape[1] < 1 or trace.shape[0] < 1 or (trace < 0).any() or not np.isfinite(trace).all():
        raise ValueError(f"{name} must be a finite non-negative (P, N) array with N >= 1, got shape {trace.shape}")
    if shape is not None and trace.shape != shape:
        raise ValueError(f"{name} must have compute_s's shape {shape}, got {trace.shape}")
    return trace


def protocol_bound(
    options: Mapping[str, Any], compute_s: float, delays_s: np.ndarray, first_step: int = 0
) -> SimResult:
    """The best time ``options``' protocol permits on the ``(P, N)`` delay trace: zero-cost communication
    and exactly ``compute_s`` of compute per step, so only the protocol's waits remain."""
    delays = np.asarray(delays_s, dtype=np.float64)
    return simulate(options, compute_s + delays, network=ZERO_NETWORK, first_step=first_step)


def no_wait_ms(compute_s: float, delays_s: np.ndarray) -> float:
    """ms per step of ranks that never wait for each other (nor communicate) on the ``(P, N)`` delay trace:
    ``compute_s`` + the largest total delay of one rank, / N. A run ends when its last rank does, so no
    protocol's bound (:func:`protocol_bound`) is below it."""
    delays = np.asarray(delays_s, dtype=np.float64)
    return 1e3 * (compute_s + float(delays.sum(axis=1).max()) / delays.shape[1])
