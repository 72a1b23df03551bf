"""eager-SGD across the replicas of a sharded model: FSDP2's all-reduce hook runs a partial allreduce.

With HSDP's layout (a ``("replicate", "shard")`` mesh, ``fully_shard`` over the ``shard`` dimension alone), FSDP2
reduce-scatters each replica's gradients inside the replica and hands this rank's shard of them, one flat tensor,
to the hook set with ``set_all_reduce_hook``. :class:`FSDPPartialAllreduce` sums that tensor over the
``replicate`` world as eager-SGD's partial collective does for DDP (:mod:`wagma.hooks.partial`): the first replica
to finish its backward pass triggers the round (``solo``; ``majority``: the round's initiator), a replica still
computing takes part with its residual, and a late gradient is carried to a later round, never dropped, counted
exactly once. Every replica applies the same round sum / R, so the replicas stay identical; every
``(sync_period + 1)``-th round is blocking and fully fresh; the first ``warmup_iters`` iterations are plain
allreduces; :meth:`FSDPPartialAllreduce.flush` applies what is left in the residuals at the end.

``late="lookahead"`` runs the backward passes at the look-ahead point of the sharded (DTensor) parameters, as the
DDP hook does (:class:`wagma.hooks.lookahead.LookAhead`, design §2.4).
"""

from __future__ import annotations

import datetime
import time
import weakref
from typing import Any, Literal

import torch
import torch.distributed as dist

from wagma.averaging.base import AveragerStats, OwnedResources
from wagma.averaging.tensors import local_tensor
from wagma.checks import check_bool, check_choice, check_int
from wagma.engine import AccumulatingGroupAllreduce, check_progress_nice
from wagma.groups import DEFAULT_TIMEOUT, as_timeout
from wagma.hooks.lookahead import LATE, Late, LookAhead
from wagma.hooks.rounds import MODES, eager_engine, sum_residuals
from wagma.wire import WireDtype, as_wire_dtype, wire_dtype_for
from wagma.world import World, WorldLike, member_world

__all__ = ["FSDPPartialAllreduce"]


class FSDPPartialAllreduce:
    """eager-SGD partial allreduce of an FSDP2 module's shard gradients over a world (HSDP's replicas).

    Build it on every rank of the job at the same time, after ``fully_shard`` and before the first backward pass;
    it registers itself as the module's all-reduce hook. The module must be the only ``fully_shard``-ed module of
    the model (one flat reduce-scatter output a backward pass). Its engine starts at the first backward pass,
    sized by FSDP2's reduce-scatter output.

    Args:
        module: the ``fully_shard``-ed module (an ``FSDPModule``), sharded over the ``shard`` mesh dimension only.
        world: the replicas (``(mesh, "replicate")``, a process group, ...; :func:`wagma.world.as_world`).
        mode: ``"solo"`` (the first replica to arrive triggers the round) or ``"majority"``.
        sync_period: every ``(sync_period + 1)``-th round is blocking and fully fresh (0: every round).
        warmup_iters: plain allreduces first (at least 1).
        seed: seed of ``majority``'s initiator draw.
        max_lead: how many rounds the progress thread may run ahead (default ``sync_period``).
        timeout: bound of every wait.
        progress_nice: CPU: nice levels below the caller for the progress thread.
        wire_dtype: the dtype the partial rounds send and sum float32 gradients in (:mod:`wagma.wire`; ``None``:
            their own): ``"bf16"`` or ``"fp16"``, half the bytes. Warm-up and :meth:`flush` send the own dtype.
        error_feedback: with a ``wire_dtype``: what the cast rounds off stays in the residual for a later round.
        late: ``"apply"`` (default) or ``"lookahead"``: the backward passes run at ``w - lr * (mu + ... + mu**s) *
            v`` of the optimizer's heavy-ball momentum, as :class:`~wagma.PartialAllreduceState`'s ``late``; needs
            :meth:`attach`. What the rounds carry and apply is unchanged.
        lookahead_rounds: ``s >= 1``, the rounds of delay the look-ahead covers (1: Nesterov momentum; more: the
            weight prediction of delayed-momentum methods). Ignored with ``late="apply"``.

    Raises:
        ValueError: if ``module`` is not an FSDP2 module, holds nested ``fully_shard`` modules, or an argument is
            out of range (saying what was expected).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        world: WorldLike,
        mode: Literal["solo", "majority"] = "solo",
        sync_period: int = 32,
        warmup_iters: int = 1,
        seed: int = 0,
        max_lead: int | None = None,
        timeout: datetime.timedelta | float = DEFAULT_TIMEOUT,
        progress_nice: int = 0,
        wire_dtype: WireDtype = None,
        error_feedback: bool = True,
        late: Late = "apply",
        lookahead_rounds: int = 1,
    ) -> None:
        if late == "lookahead_local":
            raise ValueError(
                "late: expected 'apply' or 'lookahead' (FSDPPartialAllreduce has no overlap, so no round is in flight "
                "for 'lookahead_local' to estimate), found 'lookahead_local'"
            )
        _check_module(module)
        self.late: Late = check_choice("late", late, LATE)
        self.params = [p for p in module.parameters() if p.requires_grad]
        #: late="lookahead": the look-ahead point of the sharded parameters, its anchor w and the optimizer's hooks
        self.lookahead = LookAhead(self.params, lookahead_rounds)
        self.mode = check_choice("mode", mode, MODES)
        self.sync_period = check_int("sync_period", sync_period, 0)
        self.warmup_iters = check_int("warmup_iters", warmup_iters, 1)
        self.seed = int(seed)
        self.max_lead = max_lead
        self.progress_nice = check_progress_nice(progress_nice)
        self.timeout = as_timeout(timeout)
        self.wire_dtype: torch.dtype | None = as_wire_dtype(wire_dtype)
        self.error_feedback = check_bool("error_feedback", error_feedback)
        #: The replicas whose shard gradients are summed.
        self.world: World = member_world(world, self.timeout)
        self.world_size = self.world.size
        self.module = module
        self.stats = AveragerStats()
        self.iteration = 0
        self.rounds = 0
        self.group = self.world.new_world_group(self.timeout)  # warm-up and flush
        self._resources = OwnedResources()
        self._resources.groups.append(self.group)
        self._finalizer = weakref.finalize(self, self._resources.release)
        self.engine: AccumulatingGroupAllreduce | None = None
        self._restored: torch.Tensor | None = None  # load_state_dict(): the residual the engine starts from
        # Where each parameter's local gradient lies in the reduce-scatter output: (offset, numel, shape), by id
        self._layout: dict[int, tuple[int, int, torch.Size]] | None = None
        module.set_all_reduce_hook(self._hook)  # type: ignore[operator]  # an FSDPModule (checked above)

    # --------------------------------------------------------------------------------------- the hook
    def _hook(self, out: torch.Tensor) -> None:
        if self.engine is None:
            self._start_engine(out)
        assert self.engine is not None
        if self.iteration < self.warmup_iters:
            start = time.perf_counter()
            work = dist.all_reduce(out, group=self.group, async_op=True)
            work.wait(self.timeout)
            out.div_(self.world_size)
            self.stats.record_reduction("global", out.nbytes, time.perf_counter() - start)
        else:
            if self.late == "lookahead":
                self.lookahead.check_attached()
                self.lookahead.counted()
            staging = self.engine.staging_buffer()
            staging.copy_(out)
            res = self.engine(staging)
            torch.div(res.sum, self.world_size, out=out)
            self.engine.recycle(res.sum)
            self.rounds += 1
            self.stats.record_reduction("global" if res.is_sync else "local", self.engine.wire_nbytes, res.wait_s)
            self.stats.record_contribution(res.staleness)
        if self._layout is None:
            engine = torch.autograd.Variable._execution_engine
            engine.queue_callback(lambda: self._record_layout(out))  # once FSDP2 has made the gradients
        self.iteration += 1

    def _start_engine(self, out: torch.Tensor) -> None:
        initial = torch.zeros_like(out)
        if self._restored is not None:  # a resumed run: the residual of the checkpoint is pending again
            if self._restored.numel() != out.numel():
                raise ValueError(
                    f"FSDPPartialAllreduce.load_state_dict: expected a residual of the {out.numel()} elements FSDP2's "
                    f"reduce-scatter gives this rank, found {self._restored.numel()} (another model or shard layout?)"
                )
            initial.copy_(self._restored.reshape(initial.shape))
            self._restored = None
        self.engine = eager_engine(initial, self, wire_dtype=wire_dtype_for(self.wire_dtype, out.dtype))
        self._resources.closers[:] = [self.engine]

    def _record_layout(self, out: torch.Tensor) -> None:
        layout: dict[int, tuple[int, int, torch.Size]] = {}
        for p in self.params:
            if p.grad is None:
                continue
            local = local_tensor(p.grad)
            if local.numel() == 0:
                layout[id(p)] = (0, 0, local.shape)
                continue
            offset = (local.data_ptr() - out.data_ptr()) // out.element_size()
            if not (local.is_contiguous() and 0 <= offset and offset + local.numel() <= out.numel()):
                raise RuntimeError(
                    "FSDPPartialAllreduce: FSDP2 did not hand a parameter's gradient as a view of its reduce-scatter "
                    f"output (shape {tuple(local.shape)}), so flush() could not place the residual; mixed precision "
                    "and gradient accumulation across backward passes are not supported yet"
                )
            layout[id(p)] = (offset, local.numel(), local.shape)
        self._layout = layout

    # ------------------------------------------------------------------------------ late="lookahead"
    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """``late="lookahead"``: hook ``optimizer`` (SGD with momentum > 0, ``nesterov=False``, holding every
        parameter of the module) so that the sharded parameters hold the look-ahead point between steps and the true
        weights ``w`` during ``optimizer.step()``; :meth:`flush` ends at ``w``. Call it once on every rank before the
        first step; with ``late="apply"`` it does nothing.

        Raises:
            ValueError: the optimizer lacks a parameter (by identity), is not such an SGD, or another is attached.
        """
        if self.late == "lookahead":
            self.lookahead.attach(optimizer)

    def weights(self) -> list[torch.Tensor]:
        """The true weights ``w`` (DTensors, like the parameters): the parameters themselves unless they hold the
        look-ahead point (then a copy kept since the last step)."""
        return self.lookahead.weights()

    # ------------------------------------------------------------------------------------ end of run
    def flush(self, optimizer: torch.optim.Optimizer) -> bool:
        """Apply every replica's leftover residual: one blocking round, then ``optimizer.step()``.

        Collective over the world: call it on every rank after the last training step. Writes the mean residual
        into the parameters' gradients and steps, unless every residual was empty (then nothing is touched). With
        ``late="lookahead"`` the parameters hold the true weights ``w`` afterwards, not the look-ahead point.

        Returns:
            Whether the optimizer stepped (the same answer on every rank).
        """
        if self.engine is None or self._layout is None:
            raise RuntimeError("FSDPPartialAllreduce.flush: no backward pass ran through the hook yet")
        residual = self.engine.take_pending()
        start = time.perf_counter()
        total = sum_residuals(residual, self.group, self.timeout)
        self.stats.record_reduction("global", residual.nbytes, time.perf_counter() - start)
        if total is None:
            self.lookahead.restore()  # late="lookahead": the model to evaluate and keep is w
            return False
        mean = total.div_(self.world_size)
        from torch.distributed.tensor import DTensor

        for p in self.params:
            offset, n, shape = self._layout[id(p)]
            value = mean[offset : offset + n].view(shape).to(p.dtype, copy=True)
            if isinstance(p, DTensor):
                p.grad = DTensor.from_local(
                    value, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                )
            else:
                p.grad = value
        optimizer.step()
        self.lookahead.restore()
        return True

    def state_dict(self) -> dict[str, Any]:
        """``{"iteration", "rounds", "stats", "residual"}``: the residual (gradients no round has taken yet) is
        copied, not taken; ``None`` before the first backward pass (and after a restore not yet resumed: then the
        restored one). ``late="lookahead"`` adds ``"anchor"``: this rank's shards of the true weights while the
        parameters hold the look-ahead point, or ``None``."""
        if self.engine is not None:
            residual: torch.Tensor | None = self.engine.pending()
        else:
            residual = None if self._restored is None else self._restored.clone()
        out = {"iteration": self.iteration, "rounds": self.rounds, "stats": self.stats.as_dict(), "residual": residual}
        if self.late == "lookahead":
            out["anchor"] = self.lookahead.anchor_state()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` before the first backward pass of the resumed run: the engine then starts
        at the saved round with the saved residual pending, so no gradient a rank computed is lost.

        Raises:
            ValueError: if a key is missing, or the engine already runs (load into a freshly built state).
        """
        missing = {"iteration", "rounds", "stats", "residual"} - set(state)
        if missing:
            raise ValueError(f"state: expected the keys of state_dict(), missing {sorted(missing)}")
        if self.engine is not None:
            raise ValueError(
                "FSDPPartialAllreduce.load_state_dict: expected a state no backward pass ran through, "
                "found one whose engine runs; build a new one and load into it before training"
            )
        self.iteration = check_int("iteration", state["iteration"], 0)
        self.rounds = check_int("rounds", state["rounds"], 0)
        self.stats = AveragerStats.from_dict(state["stats"])
        residual = state["residual"]
        self._restored = None if residual is None else residual.detach().clone()
        self.lookahead.load_anchor(state.get("anchor") if self.late == "lookahead" else None)

    def close(self) -> None:
        """Stop the engine and release the groups; idempotent."""
        self.engine = None
        self.lookahead.detach()
        self._finalizer()

    def __enter__(self) -> FSDPPartialAllreduce:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _check_module(module: torch.nn.Module) -> None:
    """Refuse a module that is not ``fully_shard``-ed, or one with ``fully_shard``-ed modules inside it."""
    if not callable(getattr(module, "set_all_reduce_hook", None)):
        raise ValueError(
            f"module: expected a module sharded with torch.distributed.fsdp.fully_shard (an FSDPModule), "
            f"found {type(module).__name__}"
        )
    nested = [
        n for n, m in module.named_modules() if m is not module and callable(getattr(m, "set_all_reduce_hook", None))
    ]
    if nested:
        raise ValueError(
            f"module: expected one fully_shard-ed module (one reduce-scatter output a backward pass), found nested "
            f"ones: {nested[:4]}; shard the model with one fully_shard call for FSDPPartialAllreduce"
        )
