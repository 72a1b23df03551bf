"""WAGMA-SGD: wait-avoiding group model averaging (docs/design.md §2.2), on the engine of :mod:`wagma.engine`.

Each call of :meth:`WagmaAverager.average_parameters` is one round r of the engine. On an async round the
rank's group G (S members, itself included) has exchanged what each member had published when the
exchange started at that member, and the rank mixes with its fresh model::

    reference mixing:  a = (w + sum_{j in G} w_hat_j) / (S + 1)
    mean mixing:       a = sum_{j in G} w_hat_j / S         (when this rank's contribution was fresh)
    conserve mixing:   a = w + sum_{j in G} w_hat_j / S - w_hat_i

A rank whose fresh model made it into the exchange counts itself twice in the reference mixing; a late rank
counts its stale snapshot once and its fresh model once, so nothing it computed is lost, but its progress
since that snapshot enters with weight 1 / (S + 1). Under mean mixing a fully fresh group ends identical; a
late rank there falls back to the reference form, for the same reason. Conserve mixing (not in the paper)
replaces what this rank contributed, w_hat_i, by the group's mean and keeps the rest of its model whole: a
fresh rank takes the mean, a late rank the mean plus all its progress since its snapshot. The members' terms
``w_hat_j / S - w_hat_i`` sum to zero, so every round keeps the sum of its group's models, stale members or
not: the mean of all models moves by the mean of the local steps alone, as under DDP.
Every ``(sync_period + 1)``-th round is a *sync round*, a global mean over all P ranks. How it runs is the
``sync`` option:

- ``sync="barrier"`` (the default, docs/design.md §2.2): a blocking global mean of fresh models, ``a = sum / P``;
  every rank waits for the last one to arrive, and all replicas become equal.
- ``sync="wait_avoiding"``: the sync round is run like the group rounds with the group of all ranks: the
  first rank to arrive triggers it for everyone, and a rank still computing takes part through its
  progress thread with the model it published last. A rank whose fresh model made it in takes the mean
  ``sum / P``; a late rank mixes ``(w + sum) / (P + 1)``, so nothing it computed is lost. No rank ever
  waits for another to *arrive*; staleness stays bounded by ``max_lead`` (proof in :class:`WagmaAverager`).

The model passed at construction is published right away: until a rank's first call, that is what its
progress thread contributes (never zeros).
"""

from __future__ import annotations

import datetime
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import torch

from wagma.averaging.base import AveragerBase, ParamsLike, Reduction
from wagma.averaging.tensors import BuffersLike, FlatBuffers, local_tensor, widened
from wagma.checks import check_bool, check_choice, check_int, fail
from wagma.engine import SYNCS, RoundResult, Sync, WaitAvoidingGroupAllreduce, check_progress_nice
from wagma.groups import DEFAULT_TIMEOUT, as_timeout, require_initialized
from wagma.kernels import wagma_combine_
from wagma.schedule import GroupSchedule, check_group_fits
from wagma.shm import check_transport
from wagma.wire import WireDtype, wire_dtype_for
from wagma.world import World, WorldLike, as_world

__all__ = ["MIXINGS", "ORDERS", "SYNCS", "WagmaAverager"]

Mixing = Literal["reference", "mean", "conserve"]
MIXINGS: tuple[str, ...] = ("reference", "mean", "conserve")
Order = Literal["average_then_step", "step_then_average"]
#: "average_then_step" (the reference): gradient at w_t, average w_t, then the optimizer step applies the
#: gradient to the average. "step_then_average": the step first, then the average (torch's post-local-SGD).
ORDERS: tuple[str, ...] = ("average_then_step", "step_then_average")
_SCHEDULE_KINDS = ("auto", "butterfly", "mixed_radix")


class WagmaAverager(AveragerBase):
    """WAGMA-SGD model averaging: wait-avoiding group averages with a global average every ``sync_period + 1`` rounds
    (blocking by default; wait-avoiding with ``sync="wait_avoiding"``).

    Construct it on every rank, in the same order (it creates its communicators and starts a progress
    thread), with the model already identical on all ranks (broadcast from rank 0). Then call
    :meth:`average_parameters` once per optimizer step, before or after ``optimizer.step()`` as
    ``order`` says (:class:`~wagma.averaging.AveragingOptimizer` and the training application follow it).

    Args:
        group_size: S, ranks per averaging group; must divide the world size (a larger one is refused
            as such). ``S`` equal to the world size is allowed and means one group of every rank: every
            round is then a wait-avoiding *global* average (the progress thread still lets a late rank
            contribute its snapshot), not a group average; the sync rounds differ only in being blocking
            and fully fresh (under ``sync="barrier"``; under ``"wait_avoiding"`` only in their mixing).
        sync_period: rounds between sync rounds, the global averages (every ``(sync_period + 1)``-th round is
            one; 0: every round). Also bounds staleness, through ``max_lead <= sync_period``.
        params: the model's parameters (``model.parameters()``, tensors or ``optimizer.param_groups``),
            published at once as this rank's first contribution.
        buffers: e.g. ``model.buffers()``; floating-point ones are averaged too when ``average_buffers``.
        schedule: ``"auto"`` (butterfly when P is a power of S, else mixed radix), ``"butterfly"``,
            ``"mixed_radix"``, a :class:`~wagma.GroupSchedule`, or explicit partitions (one per round).
        mixing: ``"reference"`` ((w + group sum) / (S + 1)), ``"mean"`` (group sum / S when fresh) or
            ``"conserve"`` (``w + group sum / S - w_hat``, with ``w_hat`` what this rank contributed: the mean
            when fresh, the mean plus this rank's progress since its snapshot when late; on every round, sync
            rounds included, it keeps the group's sum of models). The engines then keep each round's
            contributed snapshot for the main thread (``keep_contributions``), without a copy.
        order: ``"average_then_step"`` (the reference) or ``"step_then_average"``; informs callers.
        average_buffers: average floating-point buffers with the parameters.
        max_lead: rounds the progress thread may run ahead of its main thread (default ``sync_period``);
            the staleness bound L below.
        sync: ``"barrier"`` (default: every sync round is a blocking mean of fresh models) or
            ``"wait_avoiding"`` (a sync round is a global round that the first rank to arrive triggers;
            late ranks contribute their last published model).
        overlap: ``False`` (default): a call waits for its round and mixes the result into the model it
            published. ``True``: a call first applies the round the *previous* call submitted, then submits
            its own and returns without waiting for it, so the exchange runs while the rank computes its
            next step. A round's result meets a model that has moved on by one local step ``w``: the round's
            average of the models submitted replaces the one this rank submitted, and the local step is kept
            whole, ``w + (sent + sum) / (S + 1) - sent`` (``sum / S`` under mean mixing and on sync rounds), the
            update the round makes without overlap, one call later. If this rank was late for its own round
            (its thread sent an older snapshot), it mixes as a late rank, ``(w + sum) / (S + 1)``; under
            ``mixing="conserve"``, fresh or late, ``w + sum / S - w_hat`` with ``w_hat`` the snapshot sent. Every
            contribution is applied one call after its round (``stats.staleness_hist`` counts it 1 older). A blocking
            sync round (``sync="barrier"``) still runs at once with the fresh, just-mixed model, and
            :meth:`synchronize` collects the round in flight without applying it (the mean of fresh
            models supersedes its mix). A resumed run starts without a round in flight: one group mix
            fewer than an uninterrupted run, so resume is not bitwise equal in this mode.
        timeout: bound of every wait (collectives, the wait for a round's result).
        progress_nice: CPU models on Linux: the progress threads, and their communicators' threads, run this many
            nice levels below the caller (:class:`~wagma.WaitAvoidingGroupAllreduce`'s ``progress_nice``). Worth
            it with ``overlap=True`` where ranks share cores: compute goes first, the exchanges nobody is waiting
            for yet fill the idle time.
        transport: how the engines' rounds move CPU models: ``"default"`` (gloo) or ``"shm"`` (shared memory,
            every rank on one host: :class:`wagma.shm.SharedMemoryAllreduce`). CUDA models use NCCL.
        world: the ranks to average over (:func:`wagma.world.as_world`): ``None`` for the whole job, a process
            group, or ``(mesh, "replicate")`` for HSDP's replicas. Groups, rounds and sync rounds stay inside the
            calling rank's world; every rank of the job builds its averager at the same time.
        wire_dtype: the dtype rounds send and sum in (:mod:`wagma.wire`): ``None`` (the model's own), ``"bf16"`` or
            ``"fp16"``. A float32 model then travels as its delta from a reference every rank holds identically
            (world rank 0's model, then the mean of each sync round), half the bytes, and the sums are widened back
            before the mixing formulas above apply. After a blocking sync round the replicas are bit for bit equal.
            Under ``mixing="conserve"`` the group's sum of models is then kept up to the rounding of the deltas
            (``w_hat`` is the snapshot as published, not as rounded).
        publish_after_step: ``False`` (the reference): a rank publishes its model at each call, so a round that
            starts while it is still computing takes the model of its previous call. ``True``: the caller also
            calls :meth:`publish` right after ``optimizer.step()`` (:class:`~wagma.averaging.AveragingOptimizer`
            and the training application do), publishing the model the next call will submit; a rank late for a
            round then contributes its current model (fresh, staleness 0) instead of one a local step and a round
            older, and only a rank still inside an earlier call or step contributes a stale one. The mixing
            formulas are unchanged. Needs ``order="average_then_step"`` and ``overlap=False``.

    **Staleness under** ``sync="wait_avoiding"``. Let L = ``max_lead`` (<= τ = ``sync_period``), and call
    rank i's k-th call of :meth:`average_parameters` its call k (round k); call k publishes the model
    rank i has at that call.

    1. *Every model that enters any round k, sync rounds included, is at most L rounds old:* what rank i
       contributes to round k is its published model of a call v >= k - L, so its staleness k - v is
       at most L. Proof: only rank i's progress thread contributes for rank i, and it does so with the
       snapshot it reads when it starts round k; it starts round k only once rank i's main thread has
       published call k - L (the lead bound, checked for every round in this mode), and a snapshot is
       only ever replaced by a newer call's. Hence v >= k - L. (Under ``"barrier"`` the same holds for
       group rounds, and sync rounds are fresh: v = k.) Every contribution is counted in
       ``stats.staleness_hist``, whose largest key is therefore <= L.
    2. *No rank runs more than τ + L calls ahead of any other:* let rank i finish call k (its
       :meth:`average_parameters` returned round k's result) and let s be the last sync round <= k, so
       s > k - (τ + 1). Round s is an allreduce over all P ranks that rank i's thread ran before round k,
       so every rank's thread started round s, so by 1. every rank had published call s - L >= k - τ - L.
       The fast ranks are held back only there, by the slowest rank's lead bound, never by a barrier.
    3. *Consensus after a sync round:* the ranks whose fresh model made it in hold the same model
       m = sum / P exactly; a late rank holds m + (w - m) / (P + 1), i.e. within 1/(P + 1) of its
       own distance to m, which by 1. and 2. is a bounded number of local steps and group mixes. Under
       ``mixing="conserve"`` a late rank holds m + (w - w_hat) instead: the mean plus what it did since the
       snapshot it contributed, at most L calls of its own (local steps and the group rounds they applied).
    4. *Under* ``mixing="conserve"`` *no progress is lost to staleness:* each member i of a round's group
       replaces its contribution w_hat_i by the group mean, so the members' changes (mean - w_hat_i) sum to
       zero and a round, applied by all its members, leaves the sum of their models as it was, whichever
       snapshots went in. Once every rank has applied rounds 0..k, the sum of all models is therefore the
       initial sum plus every local step taken, the same as under DDP.

    **With** ``overlap=True`` **as well** (``averaging=reference/wagma_relaxed_overlap``), every round, sync rounds
    included, is submitted and applied by the next call, so a call waits only where a bound holds it. 1. holds
    as stated for what enters each round (the engine is the same); applied one call later, a contribution is at
    most L + 1 calls old when it meets the model, which is what ``stats.staleness_hist`` counts (largest key
    <= L + 1). 2. becomes τ + L + 1: a rank that finished call k has collected round k - 1, so the last sync
    round it has seen completed is s > k - 1 - (τ + 1), and every rank had published call s - L >= k - τ - L - 1.
    """

    def __init__(
        self,
        group_size: int,
        sync_period: int,
        *,
        params: ParamsLike,
        buffers: BuffersLike | None = None,
        schedule: str | GroupSchedule | Sequence[Sequence[Sequence[int]]] = "auto",
        mixing: Mixing = "reference",
        order: Order = "average_then_step",
        average_buffers: bool = True,
        max_lead: int | None = None,
        sync: Sync = "barrier",
        overlap: bool = False,
        timeout: datetime.timedelta | float = DEFAULT_TIMEOUT,
        progress_nice: int = 0,
        transport: str = "default",
        world: WorldLike = None,
        wire_dtype: WireDtype = None,
        publish_after_step: bool = False,
    ) -> None:
        check_progress_nice(progress_nice)
        check_transport(transport)
        overlap = check_bool("overlap", overlap)
        group_size = check_int("group_size", group_size, 1)
        sync_period = check_int("sync_period", sync_period, 0)
        mixing = check_choice("mixing", mixing, MIXINGS)
        order = check_choice("order", order, ORDERS)
        sync = check_choice("sync", sync, SYNCS)
        _check_publish_after_step(publish_after_step, order, overlap)
        if max_lead is not None and check_int("max_lead", max_lead, 0) > sync_period:
            raise fail("max_lead", f"at most sync_period={sync_period}", max_lead)
        resolved = _world_of_groups(world, timeout, group_size, type(self).__name__)
        super().__init__(None, average_buffers=average_buffers, timeout=timeout, world=resolved, wire_dtype=wire_dtype)
        self.group_size = group_size
        self.sync_period = sync_period
        self.mixing: Mixing = mixing
        self.order: Order = order
        self.max_lead = max_lead
        self.sync: Sync = sync
        self.overlap = overlap
        self.publish_after_step = publish_after_step
        self._published = False  # publish() was called since the last average_parameters (publish_after_step)
        self._engines_fresh = True  # no average_parameters call since the engines (re)started
        self._warned_ahead = False
        self.progress_nice = progress_nice
        self.transport = transport
        self._pending: int | None = None  # overlap: the round submitted and not yet applied
        # overlap: per engine, the model the pending round was submitted with (the engine's snapshot of it)
        self._submitted: list[torch.Tensor] = []
        self.schedule = _build_schedule(schedule, self.world_size, group_size)
        self._tensors = self.tensors_to_average(params, buffers)
        if not self._tensors:
            raise ValueError("params: expected at least one tensor to average, found none")
        for tensor in self._tensors:
            check_transport(transport, tensor.device)
        self._engines: list[WaitAvoidingGroupAllreduce] = []  # one per flat buffer, also in the finalizer's list
        self._start_engines(0)

    def _start_engines(self, start_round: int) -> None:
        """One engine per flat (dtype, device) buffer, each publishing the current model.

        Half-precision buffers (float16, bfloat16) run their engine in float32: a group sum of S models
        would overflow float16 (or lose bfloat16's few bits) before the division.
        """
        self._close_engines()
        self._engines_fresh = True
        self._pending = None
        self._submitted = []
        self._engines[:] = [
            WaitAvoidingGroupAllreduce(
                self.schedule,
                widened(buffer),
                sync_period=self.sync_period,
                max_lead=self.max_lead,
                sync=self.sync,
                timeout=self.timeout,
                start_round=start_round,
                progress_nice=self.progress_nice,
                transport=self.transport,
                keep_contributions=self.mixing == "conserve",
                world=self.world,
                wire_dtype=wire_dtype_for(self.wire_dtype, buffer.dtype),
            )
            for buffer in self.flat_buffers(self._tensors).pack()
        ]
        self._round_nbytes = sum(engine.wire_nbytes for engine in self._engines)
        self._resources.closers[:] = list(self._engines)

    def _close_engines(self) -> None:
        engines, self._engines[:] = list(self._engines), []
        self._resources.closers[:] = []
        for engine in engines:
            engine.close()

    def _average_step(self, tensors: list[torch.Tensor]) -> Reduction | None:
        flat = self.flat_buffers(tensors)
        if len(flat.buffers) != len(self._engines):  # unreachable while tensors come bound; kept as a guard
            raise RuntimeError(
                f"WagmaAverager: expected the {len(self._engines)} dtype/device buffer(s) of the bound model, "
                f"found {len(flat.buffers)}; call bind() on every rank to change the parameters"
            )
        if self.overlap:
            return self._overlapped_step(flat)
        if self.publish_after_step:
            self._check_published_ahead()
        results = []
        for buffer, engine in zip(flat.pack(), self._engines):
            wide = widened(buffer)
            res = engine(wide)
            results.append(res)
            size = len(res.group)
            # A sync round under "barrier" is always fresh; under "wait_avoiding" a late rank mixes as in a group round.
            if self._takes_mean(res) and res.fresh:
                wide.copy_(res.sum).div_(size)
            elif self.mixing == "conserve":
                assert res.contributed is not None
                wide.add_(res.sum, alpha=1.0 / size).sub_(res.contributed)  # w + sum / S - w_hat
            else:
                wagma_combine_(wide, res.sum, float(size + 1))
            if wide is not buffer:
                buffer.copy_(wide)
            self._give_back(engine, res)  # read for the last time: its memory serves a later round
        # One round is one reduction, however many dtype buffers carry it; all engines run the same round.
        first = results[0]
        kind: Reduction = "global" if first.is_sync else "local"
        self.stats.record_reduction(kind, self._round_nbytes, sum(r.wait_s for r in results))
        self.stats.record_contribution(first.staleness)
        flat.unpack()
        return kind

    def _overlapped_step(self, flat: FlatBuffers) -> Reduction | None:
        """``overlap=True``: apply the round submitted by the previous call, then submit this call's round
        (a blocking sync round instead runs at once, with this rank's fresh, just-mixed model)."""
        buffers = flat.pack()
        wides = [widened(buffer) for buffer in buffers]
        kind: Reduction | None = None
        if self._pending is not None:
            previous = [engine.collect(self._pending) for engine in self._engines]
            self._pending = None
            for engine, wide, res, sent in zip(self._engines, wides, previous, self._submitted):
                self._apply_late_round(wide, res, sent)
                self._give_back(engine, res)
            first = previous[0]
            kind = "global" if first.is_sync else "local"
            self.stats.record_reduction(kind, self._round_nbytes, sum(r.wait_s for r in previous))
            self.stats.record_contribution(first.staleness + 1)  # applied one call after its round
        k = self._engines[0].round
        if self.sync == "barrier" and self._engines[0].is_sync_round(k):
            results = [engine(wide) for engine, wide in zip(self._engines, wides)]
            for engine, wide, res in zip(self._engines, wides, results):
                wide.copy_(res.sum).div_(len(res.group))
                self._give_back(engine, res)
            kind = "global"
            self.stats.record_reduction(kind, self._round_nbytes, sum(r.wait_s for r in results))
            self.stats.record_contribution(results[0].staleness)
        else:
            for engine, wide in zip(self._engines, wides):
                engine.submit(wide)
            # The next call applies the round against the model submitted now: each engine's snapshot is a copy
            # of it that stays unchanged until that call's submit, so no copy of our own is needed.
            self._submitted = [engine.published() for engine in self._engines]
            self._pending = k
        for buffer, wide in zip(buffers, wides):
            if wide is not buffer:
                buffer.copy_(wide)
        flat.unpack()
        return kind

    def publish(self, params: ParamsLike, buffers: BuffersLike | None = None) -> None:
        """``publish_after_step=True``: publish the model as it is now, right after ``optimizer.step()``, as this
        rank's contribution to its next round.

        The next :meth:`average_parameters` call submits this same model (in ``average_then_step`` order nothing
        changes the parameters in between: the forward and backward passes only read them), so a round that a
        faster rank starts while this one still computes its gradient takes it rather than the model of the
        previous call, one local step and one round older. Such a contribution counts as fresh (staleness 0).
        Floating-point buffers that the forward pass changes (BatchNorm's running statistics) enter as they were
        after the step. Does nothing before a blocking sync round, which waits for the call's own model anyway.

        Args:
            params: as in :meth:`average_parameters` (the same bound tensors).
            buffers: as in :meth:`average_parameters`.
        """
        self._check_open()
        if not self.publish_after_step:
            raise RuntimeError("publish() needs publish_after_step=True (construct the averager with it)")
        self._published = True
        if not self.is_member or (self.sync == "barrier" and self._engines[0].is_sync_round(self._engines[0].round)):
            return
        tensors = self.tensors_to_average(params, buffers, where="publish")
        for buffer, engine in zip(self.flat_buffers(tensors).pack(), self._engines):
            engine.publish_ahead(widened(buffer))

    def _check_published_ahead(self) -> None:
        """Warn once when a caller of a ``publish_after_step`` averager did not call :meth:`publish` after its last
        step: the option then changes nothing."""
        if not self._published and not self._engines_fresh and not self._warned_ahead:
            self._warned_ahead = True
            warnings.warn(
                "WagmaAverager(publish_after_step=True): publish() was not called after the optimizer step before "
                f"round {self._engines[0].round}; call averager.publish(params, buffers) after optimizer.step(), or "
                "use wagma.averaging.AveragingOptimizer, which does",
                RuntimeWarning,
                stacklevel=4,
            )
        self._published, self._engines_fresh = False, False

    def _give_back(self, engine: WaitAvoidingGroupAllreduce, res: RoundResult) -> None:
        """Hand a result read for the last time back to its engine: its sum (and, under conserve mixing, the
        snapshot it holds) serve later rounds."""
        if self.mixing == "conserve":
            engine.release(res)
        else:
            engine.recycle(res.sum)

    def _takes_mean(self, res: RoundResult) -> bool:
        """Whether a fresh contribution to round ``res`` takes the group's mean ``sum / S`` (sync rounds, mean
        mixing, and conserve mixing, whose ``w + sum / S - w_hat`` is the mean when ``w`` is what was sent) rather
        than the reference ``(w + sum) / (S + 1)``."""
        return res.is_sync or self.mixing in ("mean", "conserve")

    def _apply_late_round(self, wide: torch.Tensor, res: RoundResult, sent: torch.Tensor) -> None:
        """``overlap=True``: apply round ``res``, submitted one call ago with the model ``sent``, to ``wide``, the
        model as it is now (one local step further).

        If ``sent`` is what this rank contributed (``res.fresh``), the round's average of the submitted models
        replaces ``sent`` and this rank's progress since then is kept whole: ``w + avg - sent``, with ``avg``
        the reference ``(sent + sum) / (S + 1)`` (``sum / S`` under mean mixing, and on sync rounds). That is
        the update the round would have made without overlap, applied one call later: the optimizer's step is
        not scaled down, and where every member was fresh the group's sum of models is conserved. If the
        progress thread contributed an older snapshot (this rank was late for its own round), ``sent`` is not in
        the sum and the rank mixes as a late rank does (docs/design.md §2.3), ``(w + sum) / (S + 1)``. Under conserve
        mixing, fresh or late, the round's mean replaces what the thread contributed: ``w + sum / S - w_hat``.
        """
        size = len(res.group)
        if self.mixing == "conserve":
            assert res.contributed is not None
            wide.add_(res.sum, alpha=1.0 / size).sub_(res.contributed)
        elif not res.fresh:
            wagma_combine_(wide, res.sum, float(size + 1))
        elif self._takes_mean(res):
            wide.add_(res.sum, alpha=1.0 / size).sub_(sent)  # w + sum / S - sent
        else:
            wide.add_(res.sum, alpha=1.0 / (size + 1)).sub_(
                sent, alpha=size / (size + 1)
            )  # w + (sent + sum)/(S+1) - sent

    def synchronize(self, params: ParamsLike, buffers: BuffersLike | None = None) -> None:
        """Blocking mean over all ranks (for evaluation and checkpoints); with ``overlap``, the round in flight
        is collected first and not applied: the mean of fresh models supersedes its mix."""
        self._check_open()
        self._drain()
        super().synchronize(params, buffers)

    def _drain(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            for engine in self._engines:
                self._give_back(engine, engine.collect(pending))

    def bind(self, params: ParamsLike, buffers: BuffersLike | None = None) -> None:
        """Average another set of tensors from now on: rebind and restart the engines at this step.

        Collective: every rank calls it at the same step (it creates communicators), with the model
        identical across ranks or at least as each rank wants to publish it.
        """
        super().bind(params, buffers)
        assert self._binding is not None
        self._tensors = [local_tensor(t) for t in self._binding.tensors]
        self._start_engines(self.step)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the step and counters (``state_dict()`` is the base's: the round to continue from is the
        step) and restart the engines at that round.

        Collective: every rank calls it, in the same order, with the same step (it creates communicators).
        The model as it is now (load the checkpoint's parameters first) is what each rank publishes.
        """
        self._check_open()
        super().load_state_dict(state_dict)
        self._start_engines(self.step)

    def close(self) -> None:
        """Stop the progress threads and release the communicators; idempotent.

        Without ``close()``, the base's finalizer does the same when the averager is dropped or the
        interpreter exits.
        """
        super().close()


def _build_schedule(
    schedule: str | GroupSchedule | Sequence[Sequence[Sequence[int]]], world_size: int, group_size: int
) -> GroupSchedule:
    if isinstance(schedule, GroupSchedule):
        if schedule.world_size != world_size:
            raise ValueError(f"schedule: expected one for {world_size} ranks, found one for {schedule.world_size}")
        return schedule
    if isinstance(schedule, str):
        if schedule not in _SCHEDULE_KINDS:
            raise fail("schedule", f"one of {', '.join(map(repr, _SCHEDULE_KINDS))} or a GroupSchedule", schedule)
        return GroupSchedule.create(schedule, world_size, group_size)
    return GroupSchedule.from_partitions(schedule)


def _check_publish_after_step(publish_after_step: object, order: str, overlap: bool) -> None:
    """``publish_after_step`` is a bool, and ``True`` only with ``order="average_then_step"`` and no overlap."""
    if check_bool("publish_after_step", publish_after_step) and (order != "average_then_step" or overlap):
        raise ValueError(  # the form of wagma.checks.fail, with two values found
            "publish_after_step=True: expected order='average_then_step' and overlap=False, "
            f"found order={order!r}, overlap={overlap}; only then is the model after the optimizer step the one "
            "the next call submits"
        )


def _world_of_groups(world: WorldLike, timeout: datetime.timedelta | float, group_size: int, owner: str) -> World:
    """Resolve ``world`` and check that groups of ``group_size`` tile it.

    Runs before any group exists, so a bad size leaves no rank inside a collective group creation.
    """
    require_initialized(owner)
    resolved = as_world(world, as_timeout(timeout))
    check_group_fits(group_size, resolved.size)
    if resolved.size % group_size:
        raise fail("group_size", f"a divisor of the world size {resolved.size}", group_size)
    return resolved
