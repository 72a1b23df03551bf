"""eager-SGD partial allreduce of gradients as a DDP comm hook (docs/design.md §2.4).

Round r is iteration ``warmup_iters + r`` of DDP's backward passes. At the end of a rank's backward pass
(its last bucket) the rank adds its fresh gradient to its *residual* and calls the engine
(:class:`~wagma.AccumulatingGroupAllreduce` over one group of all ranks):

- ``solo``: the first rank to finish its backward pass triggers round r for everyone;
- ``majority``: only the initiator of round r, drawn from a seed shared by all ranks, triggers it.

Every rank contributes whatever its residual holds when the exchange reaches it; the exchange takes the
residual and zeroes it atomically, so a late gradient is carried to a later round, never dropped, and
counted exactly once. All ranks apply the same round-r result (sum / P), so replicas stay identical.
Every ``(sync_period + 1)``-th round is blocking and fully fresh. The first ``warmup_iters`` iterations run
a plain allreduce (DDP rebuilds its buckets after the first), and :meth:`PartialAllreduceState.flush`
applies what is left in the residuals at the end.

``late="lookahead"`` (design §2.4) makes each backward pass run at the point momentum will have carried the model to
when its gradient is applied, ``w - lr * (mu + ... + mu**s) * v`` for ``s = lookahead_rounds``, instead of at ``w``:
:meth:`PartialAllreduceState.attach` hooks the optimizer (:class:`wagma.hooks.lookahead.LookAhead`) so that the
parameters hold that point between steps and the true weights during ``optimizer.step()``.

Nearly all of it is :class:`PartialAllreduceState`, one state machine over DDP's backward passes (warm-up, partial
rounds with overlap, flush, checkpoints) whose methods share its residual, engine and round counters. What it shares
with the FSDP hook lives beside it: the look-ahead in :mod:`wagma.hooks.lookahead`, the engine's set-up and the
flush's sum in :mod:`wagma.hooks.rounds`.

No ``from __future__ import annotations`` here: DDP checks the hook's annotations as real objects.
"""

import datetime
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from wagma.averaging.base import AveragerStats, OwnedResources, reduced_parameters
from wagma.checks import check_bool, check_choice, check_int
from wagma.engine import AccumulatingGroupAllreduce, check_progress_nice
from wagma.groups import DEFAULT_TIMEOUT, as_timeout
from wagma.hooks.ddp_group import LocalUsedMapGroup
from wagma.hooks.lookahead import LATE, Late, LookAhead
from wagma.hooks.rounds import MODES, Mode, eager_engine, sum_residuals
from wagma.shm import check_transport
from wagma.wire import WireDtype, as_wire_dtype, wire_dtype_for
from wagma.world import World, WorldLike, member_world

__all__ = ["LATE", "MODES", "Late", "Mode", "PartialAllreduceState", "partial_allreduce_hook", "sum_residuals"]


def _checked_late(late: Late, overlap: bool) -> Late:
    """``late``, one of :data:`~wagma.hooks.lookahead.LATE`; ``"lookahead_local"`` only with ``overlap``."""
    checked: Late = check_choice("late", late, LATE)
    if checked == "lookahead_local" and not overlap:
        raise ValueError(
            "late: 'lookahead_local' needs overlap=True (this rank's gradient stands in for the round in flight; "
            f"without overlap none is), found overlap={overlap!r}"
        )
    return checked


class PartialAllreduceState:
    """State of :func:`partial_allreduce_hook`: the engine, the residual and the counters.

    Build it on every rank, in the same order (it creates communicators and starts a progress thread),
    from the parameters of the module DDP wraps; then ``ddp.register_comm_hook(state, partial_allreduce_hook)``.
    After the last training step call :meth:`flush` so that no computed gradient is left unapplied, and
    :meth:`close` at the end. Pickling drops the engine and the group (torch's convention); an unpickled
    state must not be used for training.

    Args:
        params: the parameters of the module DDP wraps (those requiring a gradient are reduced; they must
            share one dtype and device).
        mode: ``"solo"`` or ``"majority"``.
        sync_period: every ``(sync_period + 1)``-th round is a blocking, fully fresh allreduce.
        warmup_iters: iterations of plain allreduce before partial rounds start (at least 2: DDP
            rebuilds its buckets after the first).
        seed: seed of the majority initiator draw (the same on all ranks).
        max_lead: rounds the progress thread may run ahead of its backward passes (default ``sync_period``).
        overlap: ``False`` (default): iteration r waits for round r (triggered by the first rank to finish
            its backward pass) and applies its result. ``True``: iteration r submits round r and applies
            round r - 1's result, which its exchange computed during this iteration's forward/backward, so
            no rank waits for the exchange. Every rank still applies every round once, in order, the same
            result on all ranks; gradients are one iteration older when applied (``stats.staleness_hist``
            counts them one older) and the first partial iteration applies a zero gradient (nothing is in
            flight yet). Blocking sync rounds stay fully fresh; a rank waits for the slowest at the
            iteration after one. :meth:`flush` and :meth:`state_dict` take the round in flight along.
        timeout: bound of every wait.
        progress_nice: CPU gradients on Linux: the progress thread and its communicators' threads run this many
            nice levels below the caller (:class:`~wagma.AccumulatingGroupAllreduce`'s ``progress_nice``).
        transport: how the rounds move CPU gradients: ``"default"`` (gloo) or ``"shm"`` (shared memory, every
            rank on one host: :class:`wagma.shm.SharedMemoryAllreduce`). The warm-up and :meth:`flush` use gloo.
        world: the ranks whose gradients are reduced (:func:`wagma.world.as_world`; ``None``: the whole job).
            Wrap the model with ``DistributedDataParallel(..., process_group=...)`` over the same ranks.
        wire_dtype: the dtype the partial rounds send and sum gradients in (:mod:`wagma.wire`): ``None`` (their
            own), ``"bf16"`` or ``"fp16"`` for float32 gradients: half the bytes. The warm-up and :meth:`flush` send
            the gradients' own dtype.
        error_feedback: with a ``wire_dtype``: what the cast rounds off stays in this rank's residual and goes out
            with a later round (the conservation above then holds exactly, up to the rounding of the sums
            themselves); ``False`` drops it.
        late: what is done about gradients applied a round late (design §2.4). ``"apply"`` (default): nothing,
            the optimizer applies them as they are. ``"lookahead"``: the backward passes run at the look-ahead
            point ``w - lr * mu * v`` of the optimizer's heavy-ball momentum (``v`` its momentum buffer, ``lr``
            and ``mu`` its group's), where the model will be, up to the one round still in flight, when a
            gradient computed now is applied one round later. Needs :meth:`attach` with the optimizer (an SGD
            with momentum and ``nesterov=False``); what the rounds carry and apply is unchanged.
            ``"lookahead_local"`` (with ``overlap=True``): the point also takes the round still in flight into
            account, with this rank's own gradient of it standing in for its mean: ``w - lr * mu * v - lr * g_own``
            (plus ``lr * weight_decay * w``, times ``1 - dampening``), the point the next step reaches if the round's
            mean is ``g_own`` (design §2.4); with ``lookahead_rounds=s``, ``c_s`` steps of ``g_own``
            (:func:`wagma.hooks.lookahead.in_flight_steps`: ``2 + mu`` for ``s = 2``).
        lookahead_rounds: ``s >= 1``, the rounds of delay the look-ahead point covers: ``w - lr * (mu + mu**2 + ...
            + mu**s) * v``, where heavy-ball momentum alone carries the model in ``s`` steps, for gradients applied
            ``s`` rounds late (e.g. ``overlap=True, max_lead=s - 1``). ``s = 1`` (default) is Nesterov momentum; ``s >
            1`` is the weight prediction of delayed-momentum methods (SpecTrain, DANA), not Nesterov. Ignored with
            ``late="apply"``.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        *,
        mode: Mode = "solo",
        sync_period: int = 32,
        warmup_iters: int = 2,
        seed: int = 0,
        max_lead: int | None = None,
        overlap: bool = False,
        timeout: datetime.timedelta | float = DEFAULT_TIMEOUT,
        progress_nice: int = 0,
        transport: str = "default",
        world: WorldLike = None,
        wire_dtype: WireDtype = None,
        error_feedback: bool = True,
        late: Late = "apply",
        lookahead_rounds: int = 1,
    ) -> None:
        self.progress_nice = check_progress_nice(progress_nice)
        self.late: Late = _checked_late(late, overlap)
        self.mode: Mode = check_choice("mode", mode, MODES)
        self.sync_period = check_int("sync_period", sync_period, 0)
        self.warmup_iters = check_int("warmup_iters", warmup_iters, 2)
        self.seed = int(seed)
        self.max_lead = max_lead
        self.overlap = check_bool("overlap", overlap)
        self._pending: int | None = None  # overlap: the round submitted by the previous iteration
        self._ready: torch.Tensor | None = None  # overlap: its sum, once collected by state_dict()
        self.timeout = as_timeout(timeout)
        self.params, self.dtype, self.device = reduced_parameters(params)
        #: late="lookahead"/"lookahead_local": the look-ahead point, its anchor w and the optimizer's hooks
        self.lookahead = LookAhead(self.params, lookahead_rounds, local=self.late == "lookahead_local")
        self.transport = check_transport(transport, self.device)
        # Residuals and round sums of half-precision gradients are kept in float32: a sum over P ranks (and
        # over carried rounds) would overflow float16 before the division by P.
        self.sum_dtype = torch.float32 if self.dtype in (torch.float16, torch.bfloat16) else self.dtype
        #: The dtype the partial rounds send gradients in (``None``: their own; :mod:`wagma.wire`).
        self.wire_dtype: torch.dtype | None = wire_dtype_for(as_wire_dtype(wire_dtype), self.dtype)
        self.error_feedback = error_feedback
        #: Where each parameter's gradient lies in the flat residual: ``(offset, numel)`` by ``id``.
        self._offsets = _flat_offsets(self.params)
        self.numel = sum(numel for _, numel in self._offsets.values())
        self.stats = AveragerStats()
        self.rounds = 0
        self.iteration = 0
        #: The ranks whose gradients are reduced (:func:`wagma.world.as_world`); the whole job by default.
        self.world: World = member_world(world, self.timeout)
        self.group: dist.ProcessGroup | None = self._own_group()
        self.world_size = self.world.size
        self.engine: AccumulatingGroupAllreduce | None = None
        self._start_engine(torch.zeros(self.numel, dtype=self.sum_dtype, device=self.device))
        self._waiting: list[tuple[dist.GradBucket, torch.futures.Future]] = []
        self._warmup_views: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._warmup_nbytes = 0  # bytes of the warm-up iteration's buckets so far
        #: late="lookahead_local": this rank's gradient of the round in flight, flat, and its views by parameter
        self._own: torch.Tensor | None = None
        self._own_views: list[torch.Tensor] = []

    def _own_group(self) -> dist.ProcessGroup | None:
        """Create the world's group (warm-up and flush) and the finalizer that releases what the state owns.

        Released by :meth:`close`, or by the finalizer when the state is dropped or alive at interpreter exit
        (a progress thread inside a collective at exit would otherwise abort the process).
        """
        group = self.world.new_world_group(self.timeout)
        self._resources = OwnedResources()
        self._resources.groups.append(group)
        self._finalizer = weakref.finalize(self, self._resources.release)
        return group

    def _start_engine(self, residual: torch.Tensor) -> None:
        if self.engine is not None:
            self.engine.close()
        self._pending = None
        self.engine = eager_engine(residual, self, wire_dtype=self.wire_dtype, transport=self.transport)
        self._resources.closers[:] = [self.engine]
        # Where the buckets' gradients go, in parameter order. The engine takes it over at the end of the
        # backward pass when nothing is pending (no add, no zeroing) and hands back zeros.
        self._staging = self.engine.staging_buffer()

    # --------------------------------------------------------------------------------------- the hook
    def _on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        if self.engine is None or self.group is None:
            raise RuntimeError(
                "this PartialAllreduceState has no engine (it was closed or unpickled): build a new one on every rank"
            )
        if self.iteration < self.warmup_iters:
            return self._warmup_allreduce(bucket)
        if self.late != "apply":
            self.lookahead.check_attached()
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            offset, n = self._offsets[id(p)]
            self._staging[offset : offset + n].copy_(g.reshape(-1))
        future: torch.futures.Future = torch.futures.Future()
        self._waiting.append((bucket, future))
        if bucket.is_last():
            self._finish_iteration()
        return future

    def _warmup_allreduce(self, bucket: dist.GradBucket) -> torch.futures.Future:
        buffer = bucket.buffer().div_(self.world_size)
        start = time.perf_counter()
        work = dist.all_reduce(buffer, group=self.group, async_op=True)
        base = buffer.storage_offset()
        self._warmup_views += [
            (p, buffer[g.storage_offset() - base :][: p.numel()])
            for p, g in zip(bucket.parameters(), bucket.gradients())
        ]
        self._warmup_nbytes += buffer.nbytes  # every bucket's bytes: the iteration counts as one reduction
        nbytes = self._warmup_nbytes
        if bucket.is_last():
            views, self._warmup_views = self._warmup_views, []
            self._after_ddp_finalize(lambda: views)
            self.iteration += 1
            self._warmup_nbytes = 0
        stats = self.stats

        def done(fut: torch.futures.Future) -> torch.Tensor:
            if bucket.is_last():
                stats.record_reduction("global", nbytes, time.perf_counter() - start)
            return fut.value()[0]

        return work.get_future().then(done)

    def _finish_iteration(self) -> None:
        assert self.engine is not None
        if self.overlap:
            if self.lookahead.local:  # this rank's share of the round now sent: the look-ahead's estimate of it
                self._hold_own(self._staging)
            k = self.engine.submit(self._staging)
            self._staging = self.engine.staging_buffer()
            total, res = self._take_in_flight()
            self._pending = k
        else:
            res = self.engine(self._staging)
            self._staging = self.engine.staging_buffer()
            total = res.sum
        values: list[tuple[torch.Tensor, torch.Tensor]] = []
        for bucket, future in self._waiting:
            # The mean goes into the bucket's own buffer, as DDP's allreduce hook does (its gradients are in the
            # staging buffer already), divided on the way: one pass over the round's sum.
            out = bucket.buffer()
            base = out.storage_offset()
            for p, g in zip(bucket.parameters(), bucket.gradients()):
                offset, n = self._offsets[id(p)]
                at = g.storage_offset() - base
                view = out[at : at + n]
                torch.div(total[offset : offset + n], self.world_size, out=view)
                values.append((p, view))
            future.set_result(out)
        self._waiting = []
        self.lookahead.counted()
        if res is not None and self.engine is not None:
            self.engine.recycle(total)  # nothing reads the round's sum any more: the engine reuses its memory
        # DDP copies the buckets into the .grad of the parameters it saw used; the writer covers the others.
        self._after_ddp_finalize(lambda: values)
        self.iteration += 1
        self.rounds += 1
        if res is not None:
            lag = 1 if self.overlap else 0  # overlap: applied one iteration after its round
            nbytes = self.engine.wire_nbytes if self.engine is not None else total.nbytes
            self.stats.record_reduction("global" if res.is_sync else "local", nbytes, res.wait_s)
            self.stats.record_contribution(res.staleness + lag)  # 0 when this rank's fresh gradient made it in

    def _hold_own(self, staging: torch.Tensor) -> None:
        if self._own is None:
            self._own = torch.empty_like(staging)
            self._own_views = [
                self._own[offset : offset + n].view_as(p) for p in self.params for offset, n in [self._offsets[id(p)]]
            ]
        self._own.copy_(staging)
        self.lookahead.hold_local(self._own_views)

    def _take_in_flight(self) -> tuple[torch.Tensor, Any]:
        """overlap: the sum of the round in flight (and its result; None when state_dict() collected it, or
        zeros and None when there is none)."""
        assert self.engine is not None
        if self._ready is not None:
            total, self._ready = self._ready, None
            return total, None
        if self._pending is None:
            return torch.zeros(self.numel, dtype=self.sum_dtype, device=self.device), None
        res = self.engine.collect(self._pending)
        self._pending = None
        return res.sum, res

    def _after_ddp_finalize(self, values: Callable[[], list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Make each parameter's ``.grad`` its (flat) value in ``values()`` once DDP has finished the pass.

        With ``find_unused_parameters=True`` DDP leaves the ``.grad`` of a parameter it thinks no rank used
        untouched, although this iteration's result for it may hold gradients carried from earlier rounds
        (or, with :meth:`process_group_for_ddp`, the other ranks' gradients): they would be lost. DDP
        queues its finalizer right after the last bucket's hook, so a callback queued now runs before it;
        that callback queues the writer, which then runs after DDP's finalizer.
        """
        engine = torch.autograd.Variable._execution_engine
        engine.queue_callback(lambda: engine.queue_callback(lambda: self._write_grads(values())))

    def _write_grads(self, values: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        with torch.no_grad():
            for p, flat in values:
                value = flat.view_as(p)
                if p.grad is None:
                    if bool(value.ne(0).any()):
                        p.grad = value.to(self.dtype, copy=True)
                elif not (p.grad.data_ptr() == value.data_ptr() and p.grad.stride() == value.stride()):
                    p.grad.copy_(value)  # (DDP with gradient_as_bucket_view: .grad is the bucket's view already)

    # ------------------------------------------------------------------------------ late="lookahead"
    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """``late="lookahead"``: hook ``optimizer`` so that the backward passes run at the look-ahead point.

        Call it once on every rank, after building the optimizer over (at least) the parameters of this state and
        before the first step. After every ``optimizer.step()`` the parameters are moved from the weights ``w`` the
        step computed to ``w - lr * (mu + ... + mu**s) * v`` (``v``: the parameter's momentum buffer after the step;
        ``lr``, ``mu``: its parameter group's; ``s``: ``lookahead_rounds``) and ``w`` is kept; before the next step
        ``w`` is put back, so the optimizer, its weight decay and the rounds' results all act on ``w``. :meth:`flush`
        ends with the parameters at ``w`` (evaluate and keep the model after it); :meth:`weights` gives ``w`` at any
        other time. With ``s = 1`` and every gradient exactly one round late (``overlap=True, max_lead=0``) this is
        SGD with Nesterov momentum whose parameters are the look-ahead point. With ``late="apply"`` it does nothing.

        Raises:
            ValueError: the optimizer lacks a parameter of this state (by identity), is not SGD with momentum > 0
                and ``nesterov=False`` in every group holding them, or another optimizer is attached already.
        """
        if self.late != "apply":
            self.lookahead.attach(optimizer)

    def weights(self) -> list[torch.Tensor]:
        """The true weights ``w``, one tensor per reduced parameter: the parameters themselves unless
        ``late="lookahead"`` holds them at the look-ahead point (then a copy kept since the last step)."""
        return self.lookahead.weights()

    def process_group_for_ddp(self) -> LocalUsedMapGroup:
        """A process group to build DDP with, so that ``find_unused_parameters=True`` is not a barrier.

        ``DDP(model, process_group=state.process_group_for_ddp(), find_unused_parameters=True)``: DDP's
        per-iteration allreduce of the used-parameter map is answered locally (see
        :class:`~wagma.hooks.ddp_group.LocalUsedMapGroup`), so a rank does not wait for a slow one at the
        end of its backward pass; this state writes every parameter's ``.grad`` itself. DDP's initial
        broadcast and buffer broadcasts run on this state's group. Use the group with this hook only.
        """
        if self.group is None:
            raise RuntimeError("this PartialAllreduceState is closed or unpickled: it has no group for DDP")
        return LocalUsedMapGroup(self.group)

    # ------------------------------------------------------------------------------------ end of run
    def flush(self, optimizer: torch.optim.Optimizer) -> bool:
        """Apply every rank's leftover residual: one blocking, fully fresh round, then ``optimizer.step()``.

        Collective: call it on every rank after the last training step (and before evaluation or a
        checkpoint that must hold every computed gradient). Writes the averaged residual into the
        parameters' ``.grad`` and steps, unless every rank's residual was empty: then neither the
        gradients nor the parameters are touched (a step with zero gradients would still move them
        through momentum or weight decay).

        With ``late="lookahead"`` the parameters hold the true weights ``w`` afterwards, not the look-ahead point.

        Returns:
            Whether the optimizer stepped (the same answer on every rank).
        """
        if self.engine is None or self.group is None:
            raise RuntimeError("this PartialAllreduceState is closed; flush() needs its engine")
        in_flight, _ = self._take_in_flight() if self.overlap else (None, None)
        self.lookahead.hold_local(None)  # nothing is in flight after this round
        residual = self.engine.take_pending()
        start = time.perf_counter()
        # overlap: the last round's sum, the same on every rank, not applied yet, goes along
        total = sum_residuals(residual, self.group, self.timeout, in_flight)
        self.stats.record_reduction("global", residual.nbytes, time.perf_counter() - start)
        if total is None:
            self.lookahead.restore()  # late="lookahead": the model to evaluate and keep is w
            return False
        residual = total.div_(self.world_size)
        for p in self.params:
            offset, n = self._offsets[id(p)]
            p.grad = residual[offset : offset + n].view_as(p).to(self.dtype, copy=True)
        optimizer.step()
        self.lookahead.restore()
        return True

    def fresh_fraction(self) -> float | None:
        """Fraction of partial rounds into which this rank's fresh gradient went (None before the first)."""
        total = self.stats.fresh_contributions + self.stats.stale_contributions
        return self.stats.fresh_contributions / total if total else None

    def stats_dict(self) -> dict[str, Any]:
        """Counters for the metrics stream."""
        out = self.stats.as_dict()
        hist = out["staleness_hist"]
        count = sum(hist.values())
        out.update(
            rounds=self.rounds,
            iteration=self.iteration,
            fresh_fraction=self.fresh_fraction(),
            staleness=sum(k * v for k, v in hist.items()) / count if count else 0.0,
            staleness_max=max(hist) if hist else 0,
        )
        return out

    def state_dict(self) -> dict[str, Any]:
        """``{"iteration", "rounds", "stats", "residual", "in_flight"}``: the residual is copied, not taken;
        ``in_flight`` (overlap) is the sum of the round the next iteration applies, collected now, or None;
        ``late="lookahead"`` adds ``"anchor"``, the true weights while the parameters hold the look-ahead point;
        ``"lookahead_local"`` also ``"point"``, this rank's parameters: each rank's point is its own, and
        :meth:`load_state_dict` puts it back (load it after wrapping the model in DDP, whose constructor copies rank
        0's parameters to every rank)."""
        if self._pending is not None and self.engine is not None:
            # First: the round in flight takes its share of the residual when its exchange starts.
            self._ready = self.engine.collect(self._pending).sum
            self._pending = None
        residual = self.engine.pending() if self.engine is not None else torch.zeros(self.numel, dtype=self.sum_dtype)
        in_flight = None if self._ready is None else self._ready.clone()
        out = {
            "iteration": self.iteration,
            "rounds": self.rounds,
            "stats": self.stats.as_dict(),
            "residual": residual,
            "in_flight": in_flight,
        }
        if self.late != "apply":  # the parameters hold the look-ahead point: w is kept here
            out["anchor"] = self.lookahead.anchor_state()
        if self.late == "lookahead_local":
            out["point"] = self.lookahead.point_state()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` and restart the engine at its round with its residual.

        Collective: every rank calls it (the engine's communicators are created anew).
        """
        missing = {"iteration", "rounds", "stats", "residual"} - set(state)
        if missing:
            raise ValueError(f"state: expected the keys of state_dict(), missing {sorted(missing)}")
        residual = state["residual"].to(device=self.device, dtype=self.sum_dtype)
        if residual.numel() != self.numel:
            raise ValueError(f"state['residual']: expected {self.numel} elements, found {residual.numel()}")
        self.iteration = check_int("iteration", state["iteration"], 0)
        self.rounds = check_int("rounds", state["rounds"], 0)
        self.stats = AveragerStats.from_dict(state["stats"])
        in_flight = state.get("in_flight")
        if in_flight is not None and in_flight.numel() != self.numel:
            raise ValueError(f"state['in_flight']: expected {self.numel} elements, found {in_flight.numel()}")
        self._start_engine(residual)
        self._ready = None if in_flight is None else in_flight.to(device=self.device, dtype=self.sum_dtype)
        self.lookahead.load_anchor(
            state.get("anchor") if self.late != "apply" else None,
            state.get("point") if self.late == "lookahead_local" else None,
        )

    def close(self) -> None:
        """Stop the engine's thread and release the groups; idempotent. A context manager does the same."""
        self.engine = None
        self.group = None
        self.lookahead.detach()
        self._finalizer()

    def __enter__(self) -> "PartialAllreduceState":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(engine=None, group=None, _waiting=[], _warmup_views=[], _resources=None, _finalizer=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._resources = OwnedResources()  # nothing to release: the engine and group were dropped
        self._finalizer = weakref.finalize(self, self._resources.release)


def _flat_offsets(params: list[torch.Tensor]) -> dict[int, tuple[int, int]]:
    """``(offset, numel)`` of each parameter, by ``id``, when their gradients are laid end to end in order."""
    offsets: dict[int, tuple[int, int]] = {}
    total = 0
    for p in params:
        offsets[id(p)] = (total, p.numel())
        total += p.numel()
    return offsets


def partial_allreduce_hook(state: PartialAllreduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """eager-SGD partial allreduce (solo or majority, as ``state.mode``); see the module docstring.

    During warm-up: a plain allreduce mean. After it, every bucket's future completes at the end of the
    same backward pass with the round's result (sum of the contributions / world size); this rank's fresh
    gradient is in that result if it made it into the exchange, else it is carried to a later round.
    With ``state.late == "lookahead"`` the backward passes run at the look-ahead point ``w - lr * mu * v`` (call
    ``state.attach(optimizer)`` once); the results are the same sums of what the ranks computed.
    """
    return state._on_bucket(bucket)
