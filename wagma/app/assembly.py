"""One rank's run assembled from the config: data, model, layout, policy, optimizer, and the state it resumes.

:func:`set_up` builds what needs no closing yet (the seeds, the data and this rank's shard, the model made identical
by rank 0's broadcast, the layout of the ranks, the averaging policy) into a :class:`Run`; :func:`prepare` wraps the
model with the policy and builds the optimizer, the imbalance injector and the consensus meter, then resumes from
the newest complete checkpoint (:func:`wagma.app.checkpoint.resume_checkpoint`) or refuses an earlier run's
history. :mod:`wagma.app.train` runs the steps on what they built. The log speaks as ``wagma.app.train``: these
are steps of its run.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn

from wagma.app import launch
from wagma.app.checkpoint import RESETTABLE, CheckpointError, ensure_no_history, restore_rng_state, resume_checkpoint
from wagma.app.config import build_optimizer, configured_dataset, configured_model, data_options, group_options
from wagma.app.consensus import ConsensusMeter
from wagma.app.data import BatchIterator, Dataset, make_batches
from wagma.app.imbalance import Imbalance, build_imbalance
from wagma.app.metrics import MetricsWriter, preload_tensorboard
from wagma.app.parallel import Layout, build_layout, load_local_model_state, load_local_optimizer_state
from wagma.app.policies import AllreducePolicy, ModelAveragingPolicy, Policy, build_policy
from wagma.app.progress import Progress
from wagma.app.report import Totals
from wagma.app.sequences import TokenBatchIterator
from wagma.telemetry import GpuMetrics

__all__ = ["Run", "prepare", "restored_totals", "set_up"]

log = logging.getLogger("wagma.app.train")


@dataclasses.dataclass
class Run:
    """One rank's run: what :func:`set_up` built before anything needed closing, then what :func:`prepare` added
    and the metrics writer and progress display of the loop (:mod:`wagma.app.train`), whose steps share it;
    :meth:`close` closes what it opened."""

    cfg: DictConfig
    ctx: launch.DistContext
    run_dir: Path
    dataset: Dataset
    batches: BatchIterator | TokenBatchIterator  # this rank's shard of the training split, on the device
    test: tuple[torch.Tensor, torch.Tensor]  # the test split, on the device
    net: nn.Module  # the model as built; the policy's wrapper shares it
    layout: Layout
    policy: Policy
    gpu: GpuMetrics
    model: nn.Module = dataclasses.field(init=False)  # the wrapped model
    optimizer: torch.optim.Optimizer = dataclasses.field(init=False)
    imbalance: Imbalance = dataclasses.field(init=False)
    fingerprint: dict[str, Any] = dataclasses.field(init=False)
    totals: Totals = dataclasses.field(default_factory=Totals)
    start_step: int = 0
    resume_from: int | None = None  # the step of the checkpoint it resumed from
    meter: ConsensusMeter | None = None
    writer: MetricsWriter | None = None
    progress: Progress | None = None

    def close(self) -> None:
        """The metrics first (a failing run leaves complete files even if a close below raises), then the
        telemetry, the consensus meter and the policy."""
        try:
            if self.progress is not None:
                self.progress.close()
            if self.writer is not None:
                self.writer.close()
        finally:
            self.gpu.close()
            if self.meter is not None:
                self.meter.close()
            self.policy.close()


def set_up(cfg: DictConfig, ctx: launch.DistContext, run_dir: Path) -> Run:
    """Seed, load the data, build the model (rank 0's, broadcast), the layout of the ranks and the policy.

    The data: the same split on every rank, a disjoint shard of the training split per rank. The model: built
    from each rank's seed, then made identical by rank 0's broadcast. The layout: whole replicas (``ddp``), or
    an HSDP mesh whose replicas the policy averages (``hsdp``).
    """
    rank, world_size, device = ctx.rank, ctx.world_size, ctx.device
    seed = int(cfg.seed)
    _seed_everything(seed, rank)
    dataset = configured_dataset(cfg)
    x_shard, y_shard = dataset.shard(rank, world_size)
    batch_size = int(cfg.batch_size)
    batches = make_batches(x_shard.to(device), y_shard.to(device), data_options(cfg), batch_size, seed=seed, rank=rank)
    test = dataset.x_test.to(device), dataset.y_test.to(device)
    net = configured_model(cfg, dataset).to(device)
    if rank == 0:  # rank 0 writes the events; importing them before this collective keeps step 1 unaffected
        preload_tensorboard()
    _broadcast_from_rank0(net)
    timeout_s = float(cfg.get("dist_timeout_s", 300.0))
    layout = build_layout(str(cfg.get("parallel", "ddp")), int(cfg.get("shard_size", 1)), world_size, device, timeout_s)
    policy = build_policy(
        group_options(cfg, "averaging"),
        device=device,
        mesh=layout.mesh,
        rank=layout.mesh.get_local_rank("replicate") if layout.sharded else rank,
        world_size=layout.replicas,
    )
    gpu = GpuMetrics(device, float(cfg.get("telemetry_interval_s", 0.0)))
    return Run(cfg, ctx, run_dir, dataset, batches, test, net, layout, policy, gpu)


def prepare(run: Run) -> None:
    """Wrap the model with the policy; build the consensus meter, the optimizer and the imbalance; resume."""
    cfg = run.cfg
    run.model = run.policy.wrap(run.net)
    if int(cfg.get("consensus_every", 0)):  # its own group, created after the policy's on every rank
        timeout = datetime.timedelta(seconds=float(cfg.get("dist_timeout_s", 300.0)))
        run.meter = ConsensusMeter(timeout, mesh=run.layout.mesh)
    run.optimizer = build_optimizer(group_options(cfg, "optim"), run.net.parameters())
    run.imbalance = build_imbalance(group_options(cfg, "imbalance"), run.ctx.rank, run.ctx.world_size)
    run.fingerprint = _fingerprint(cfg, run.layout)
    _resume(run)


def _resume(run: Run) -> None:
    """Resume when asked, and always in an attempt that torchrun restarted (``--max-restarts N``): from the newest
    complete checkpoint, or from step 0 when the failed attempt completed none. Otherwise refuse a run directory
    that holds an earlier run's history."""
    cfg, rank = run.cfg, run.ctx.rank
    restarts = launch.restart_count()
    if not (cfg.resume or restarts > 0):
        ensure_no_history(run.run_dir)
        return
    allow_changed = RESETTABLE if cfg.get("resume_policy_change", False) else ()
    resumed = resume_checkpoint(run.run_dir, run.fingerprint, allow_changed=allow_changed)
    if resumed is not None:
        run.resume_from, state, changed = resumed
        run.totals, run.start_step = _restore(run, state, changed)
        if not run.layout.sharded and isinstance(run.policy, (AllreducePolicy, ModelAveragingPolicy)):  # DDP only
            _rebuild_ddp_buckets(run.model, run.test[0][:1])
    elif rank == 0:
        why = "resume=true" if cfg.resume else f"restart {restarts} of this job"
        log.warning("%s but %s holds no complete checkpoint; starting from step 0", why, run.run_dir)


def _fingerprint(cfg: DictConfig, layout: Layout) -> dict[str, Any]:
    """What a checkpoint records of its run and a resume must match (``averaging`` may be allowed to change)."""
    plain: dict[str, Any] = {group: group_options(cfg, group) for group in ("model", "optim", "averaging", "data")}
    plain |= {"batch_size": int(cfg.batch_size), "seed": int(cfg.seed)}
    plain |= {"parallel": layout.parallel, "shard_size": layout.shard_size}
    return json.loads(json.dumps(plain, sort_keys=True))  # as meta.json gives it back: lists, sorted keys


def _restore(run: Run, state: dict[str, Any], changed: list[str]) -> tuple[Totals, int]:
    """Load this rank's checkpointed state into the (already wrapped) module, optimizer, data and policy.

    Every rank loads its own shard (replicas and optimizer state may differ between ranks), into the
    module the wrapper shares -- after the wrapper's own broadcast from rank 0. Under ``parallel=hsdp`` the
    checkpoint holds this rank's parameter and optimizer shards, copied back into the ``DTensor``s
    (:mod:`wagma.app.parallel`). With ``averaging`` in ``changed`` (``resume_policy_change=true``) the policy keeps
    its fresh state.
    """
    try:
        if run.layout.sharded:
            load_local_model_state(run.net, state["model"])
            load_local_optimizer_state(run.optimizer, state["optimizer"])
        else:
            run.net.load_state_dict(state["model"])
            run.optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0]
        raise CheckpointError(
            f"the checkpoint in {run.run_dir} does not fit this model or optimizer: {first}"
        ) from None
    run.batches.load_state_dict(state["data"])
    if "averaging" in changed:
        if run.ctx.rank == 0:
            log.warning(
                "resume_policy_change=true: the averaging policy changed; its state starts fresh "
                "(round counters, residuals, momentum); model, optimizer, data order and RNG are restored"
            )
    else:
        run.policy.load_state_dict(state["policy_state"])
    restore_rng_state(state["rng"])
    return restored_totals(state["counters"], run.batches), int(state["step"])


def restored_totals(counters: dict[str, Any], batches: BatchIterator | TokenBatchIterator) -> Totals:
    """A checkpoint's counters as :class:`~wagma.app.report.Totals`. Checkpoints from before samples were counted
    (they lack ``samples``) could only batch by sample count, so their steps carried ``batch_size`` examples each."""
    counters = dict(counters)
    if "samples" not in counters:
        if not isinstance(batches, BatchIterator):
            raise CheckpointError(
                "the checkpoint predates counted samples and so cannot have batched by tokens; "
                "resume it with data.batching=samples"
            )
        counters["samples"] = int(counters["steps"]) * batches.batch_size
    return Totals(**counters)


def _rebuild_ddp_buckets(model: nn.Module, example: torch.Tensor) -> None:
    """Make a resumed DDP model reduce in the bucket layout the uninterrupted run has at this step.

    DDP reduces its first iteration in one bucket in parameter order and then rebuilds its buckets in
    the order gradients became ready. With P >= 3 ranks gloo's ring allreduce sums each element in an
    order set by its position in the bucket, so a resumed run whose first step used the initial layout
    differed in the last bits from the uninterrupted run (P = 2 hid this: a + b = b + a). One backward of
    a zero loss (all ranks, eval mode, so no buffer or RNG changes; its zero gradients are discarded by
    the next ``zero_grad``) records the ready order, and DDP rebuilds before the first resumed step.

    Only for a DDP whose comm hook keeps no per-call state: DDP's own allreduce (``allreduce``) and the
    post-local hook of the model-averaging policies (allreduce during their warm-up, nothing after).
    The eager policies' partial hook counts rounds and carries residuals; a dummy backward would run a
    round there (they resume bitwise without it: their hook reduces in a layout of its own).
    """
    was_training = model.training
    model.eval()
    (model(torch.zeros_like(example)).sum() * 0.0).backward()
    model.train(was_training)


def _seed_everything(seed: int, rank: int) -> None:
    # Per-rank streams (anything random during training differs between ranks); the model's initial
    # weights come from rank 0 through the broadcast, not from these seeds.
    torch.manual_seed(seed + rank)
    np.random.seed(seed + rank)
    random.seed(seed + rank)


@torch.no_grad()
def _broadcast_from_rank0(net: nn.Module) -> None:
    for tensor in net.state_dict().values():
        dist.broadcast(tensor, src=0)
