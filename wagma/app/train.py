"""The training loop: set up, train with a pluggable averaging policy, checkpoint, evaluate, record.

:func:`train` is what ``train.py`` (the Hydra entry point) calls and what tests call on forked ranks.
Read top to bottom, it does:

1. check the config (:func:`wagma.app.config.validate_config`) before any communication, so a bad config
   fails alike and at once on every rank;
2. with ``rank_net``, move into this rank's network namespace (:mod:`wagma.app.network`), before any socket; join
   or create the process group (:func:`wagma.app.launch.init_distributed`) and agree on the device; with
   ``rank_cpus``, join this rank's CPU quota (:mod:`wagma.app.quota`);
3. load the dataset and this rank's shard, build the model, broadcast it from rank 0, build the layout
   (``parallel=hsdp``: a ``("replicate", "shard")`` mesh, :mod:`wagma.app.parallel`) and the policy
   (:mod:`wagma.app.policies`; under HSDP on the replicas), wrap the model with it (under HSDP: shard it with
   FSDP2), build the optimizer and the imbalance injector;
4. resume from the newest complete checkpoint when ``resume=true``, or when torchrun restarted the job
   (``torchrun --max-restarts N``: ``TORCHELASTIC_RESTART_COUNT`` > 0) (:func:`wagma.app.checkpoint.resume_checkpoint`:
   verified, and refused if the world size, model, optimizer, data or averaging differ -- the averaging
   may with ``resume_policy_change=true``, its state then starts fresh); with ``resume=false``, refuse a
   run directory that holds an earlier run's checkpoints or metrics rather than overwrite them;
5. per step: inject the imbalance, forward, backward (DDP and the policy's comm hook average there),
   ``policy.before_step``, ``optimizer.step()``, ``policy.after_step``; record (every rank its JSON lines,
   rank 0 also ``metrics.csv`` and TensorBoard events: :mod:`wagma.app.metrics`) and show progress on rank 0
   (:mod:`wagma.app.progress`); evaluate every ``eval_every`` steps; measure the consensus distance every
   ``consensus_every`` steps (:mod:`wagma.app.consensus`, recorded as ``consensus``); checkpoint every
   ``checkpoint_every`` steps; on a CUDA device, records also carry ``gpu_*`` telemetry sampled every
   ``telemetry_interval_s`` (:class:`wagma.telemetry.GpuMetrics`);
6. checkpoint the final training state, ``policy.finalize``, evaluate on the test split, and have rank 0
   write ``summary.json`` (with the time split ``startup_s`` / ``train_s`` / ``finish_s``, see
   :func:`_summary`) and ``model.pt`` (the finalized model's state dict). The metrics files are closed
   in a ``finally``, so a failing run leaves them complete.

When a step fails (one of its collectives -- averaging, evaluation, consensus, checkpoint -- timed out,
a peer died), every rank that sees it raises a ``RuntimeError`` naming the ranks that did not arrive at
that step (:mod:`wagma.app.roll_call`; ``failure_report_s`` bounds the wait for the other ranks' reports).

How time is split (per rank and step, host clocks):

- ``imbalance_s``: the injected sleep, before the step's compute.
- ``compute_s``: forward, plus backward up to the moment the *last* parameter gradient was accumulated
  (seen through post-accumulate-grad hooks on the parameters), plus ``optimizer.step()``.
- ``wait_s``: the rest of the step: the time ``backward()`` still took after the last gradient was ready
  (DDP blocks there on the outstanding bucket reductions -- communication that compute did not hide, and
  waiting for slower ranks), plus ``policy.before_step`` and ``policy.after_step`` (model averaging).

On CUDA these are host-side times (kernels are asynchronous), so the split between compute and wait is
approximate there; ``step_s`` is exact because the step ends with ``loss.item()``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import random
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn

from wagma.app import launch
from wagma.app.checkpoint import (
    RESETTABLE,
    CheckpointError,
    capture_rng_state,
    ensure_no_history,
    restore_rng_state,
    resume_checkpoint,
    save_checkpoint,
)
from wagma.app.config import ConfigError, build_optimizer, group_options, validate_config
from wagma.app.consensus import ConsensusMeter
from wagma.app.data import BatchIterator, load_dataset, make_batches
from wagma.app.guard import TrainingGuard
from wagma.app.imbalance import Imbalance, build_imbalance
from wagma.app.metrics import MetricsWriter, preload_tensorboard, write_summary
from wagma.app.models import build_model
from wagma.app.network import RankNetwork, rate_name
from wagma.app.network import current as current_network
from wagma.app.parallel import (
    Layout,
    build_layout,
    full_model_state,
    load_local_model_state,
    load_local_optimizer_state,
    local_state,
)
from wagma.app.policies import AllreducePolicy, ModelAveragingPolicy, Policy, build_policy
from wagma.app.progress import Progress, progress_every
from wagma.app.quota import RankQuota, job_name
from wagma.app.roll_call import FINAL, RollCall
from wagma.app.sequences import TokenBatchIterator
from wagma.app.source_text import bits_per_byte, token_cross_entropy
from wagma.telemetry import GpuMetrics

__all__ = ["StepCallback", "evaluate", "train"]

log = logging.getLogger(__name__)

StepCallback = Callable[[int, dict[str, Any]], None]
"""Called on every rank after every step with the number of completed steps and that step's timings."""


def train(cfg: DictConfig, *, step_callback: StepCallback | None = None) -> dict[str, Any]:
    """Train as ``cfg`` says on every rank of the default process group (created from torchrun's env if need be).

    Args:
        cfg: the composed root config (``configs/config.yaml``). ``run_dir`` (or, under Hydra, the Hydra
            run directory) is where metrics, checkpoints, ``summary.json`` and ``model.pt`` go; all ranks
            must see the same directory.
        step_callback: optional ``f(completed_steps, timings)`` called on every rank after every step
            (after any checkpoint of that step), e.g. for custom logging or early stopping by raising.

    Returns:
        The run summary (the contents of ``summary.json``), on every rank.

    Raises:
        ConfigError: (a ``ValueError``) before any communication, on every rank, for a bad config.
    """
    started = time.perf_counter()
    validate_config(cfg, launch.env_world_size())
    progress_every(cfg.get("progress_every"), int(cfg.steps))  # checked here too: before any communication
    run_dir = _resolve_run_dir(cfg)
    net = _join_rank_net(cfg.get("rank_net"), job_name(run_dir))  # before any socket: all of them in the namespace
    try:
        ctx = launch.init_distributed(str(cfg.device), timeout_s=float(cfg.get("dist_timeout_s", 300.0)))
        quota: RankQuota | None = None
        try:
            if cfg.get("rank_cpus"):  # before any work: every thread of the rank runs under the cap
                quota = RankQuota(float(cfg.rank_cpus), job=job_name(run_dir), rank=ctx.rank)
            return _train(cfg, ctx, run_dir, started, step_callback)
        finally:
            try:
                launch.shutdown(ctx)
            finally:
                if quota is not None:
                    quota.leave()
    finally:
        if net is not None:
            net.leave()


def _join_rank_net(rate: object, job: str) -> RankNetwork | None:
    """This rank's network for ``rank_net=rate`` (:class:`wagma.app.network.RankNetwork`), made here unless the
    process is in it already (forked ranks make it before their process group: ``run_workers(setup=...)``); None
    without ``rank_net``, or when it was made before (then its maker removes it).

    Raises:
        ConfigError: the process group exists already but this rank is not on the network ``rate`` asks for (its
            traffic would go through loopback while the summary records the rate).
    """
    name = rate_name(rate)
    if name is None:
        return None
    joined = current_network()
    if joined is not None and joined.rate == name and joined.job == job:
        return None
    if joined is not None or (dist.is_available() and dist.is_initialized()):
        where = f"on {joined.rate} of job {joined.job}" if joined is not None else "in no network of its own"
        raise ConfigError(
            f"rank_net={name}: the process group was made before train() could put this rank on its "
            f"network, and the rank is {where}: make the network before the group "
            "(wagma.testing.run_workers(..., setup=wagma.app.network.worker_setup(rate, job)))"
        )
    return RankNetwork(name, job=job, rank=launch.env_rank())


@dataclasses.dataclass
class _Totals:
    """Sums over every step this rank has run in the whole run (checkpointed, so they survive a resume)."""

    steps: int = 0
    train_s: float = 0.0
    compute_s: float = 0.0
    wait_s: float = 0.0
    imbalance_s: float = 0.0
    elapsed_s: float = 0.0  # wall seconds since the run's first step, as of the last checkpoint
    samples: int = 0  # examples this rank trained on (batches by tokens vary in size)

    def add(self, timings: dict[str, float]) -> None:
        self.steps += 1
        self.samples += int(timings["samples"])
        self.train_s += timings["step_s"]
        self.compute_s += timings["compute_s"]
        self.wait_s += timings["wait_s"]
        self.imbalance_s += timings["imbalance_s"]


def _train(
    cfg: DictConfig, ctx: launch.DistContext, run_dir: Path, started: float, step_callback: StepCallback | None
) -> dict[str, Any]:
    rank, world_size, device = ctx.rank, ctx.world_size, ctx.device
    steps, batch_size, seed = int(cfg.steps), int(cfg.batch_size), int(cfg.seed)
    _seed_everything(seed, rank)

    # Data: the same split on every rank, a disjoint shard of the training split per rank.
    data_cfg = group_options(cfg, "data")
    data_options = {k: v for k, v in data_cfg.items() if k not in ("name", "test_fraction")}
    dataset = load_dataset(
        data_cfg["name"], seed=seed, test_fraction=float(data_cfg.get("test_fraction", 0.2)), **data_options
    )
    x_shard, y_shard = dataset.shard(rank, world_size)
    batches = make_batches(x_shard.to(device), y_shard.to(device), data_options, batch_size, seed=seed, rank=rank)
    x_test, y_test = dataset.x_test.to(device), dataset.y_test.to(device)

    # Model: built from each rank's seed, then made identical by rank 0's broadcast.
    model_cfg = group_options(cfg, "model")
    net = build_model(
        model_cfg.pop("name"), dataset.in_shape, dataset.num_classes, **model_cfg, **dataset.model_options()
    ).to(device)
    if rank == 0:  # rank 0 writes the events; importing them before this collective keeps step 1 unaffected
        preload_tensorboard()
    _broadcast_from_rank0(net)

    # Ranks' layout: whole replicas (ddp), or an HSDP mesh whose replicas the policy averages (hsdp).
    layout = build_layout(
        str(cfg.get("parallel", "ddp")),
        int(cfg.get("shard_size", 1)),
        world_size,
        device,
        float(cfg.get("dist_timeout_s", 300.0)),
    )
    policy = build_policy(
        group_options(cfg, "averaging"),
        device=device,
        mesh=layout.mesh,
        rank=layout.mesh.get_local_rank("replicate") if layout.sharded else rank,
        world_size=layout.replicas,
    )
    meter: ConsensusMeter | None = None
    gpu = GpuMetrics(device, float(cfg.get("telemetry_interval_s", 0.0)))
    writer: MetricsWriter | None = None
    progress: Progress | None = None
    try:
        model = policy.wrap(net)
        consensus_every = int(cfg.get("consensus_every", 0))
        if consensus_every:  # its own group, created after the policy's on every rank
            meter = ConsensusMeter(
                datetime.timedelta(seconds=float(cfg.get("dist_timeout_s", 300.0))), mesh=layout.mesh
            )
        optimizer = build_optimizer(group_options(cfg, "optim"), net.parameters())
        imbalance = build_imbalance(group_options(cfg, "imbalance"), rank, world_size)

        fingerprint = _fingerprint(cfg, layout)

        def save(step: int) -> None:
            if writer is not None:
                totals.elapsed_s = writer.elapsed_s
            state = {
                "step": step,
                "world_size": world_size,
                "model": local_state(net.state_dict()),  # shards under hsdp
                "optimizer": local_state(optimizer.state_dict()),
                "data": batches.state_dict(),
                "rng": capture_rng_state(),
                "policy_state": policy.state_dict(),
                "counters": dataclasses.asdict(totals),
            }
            save_checkpoint(run_dir, step, state, fingerprint=fingerprint)

        # Resume when asked, and always in an attempt that torchrun restarted (--max-restarts N): it continues
        # from the newest complete checkpoint, or from step 0 when the failed attempt completed none.
        restarts = launch.restart_count()
        totals, start_step, resume_from = _Totals(), 0, None
        if cfg.resume or restarts > 0:
            resumed = resume_checkpoint(
                run_dir, fingerprint, allow_changed=RESETTABLE if cfg.get("resume_policy_change", False) else ()
            )
            if resumed is not None:
                resume_from, state, changed = resumed
                totals, start_step = _restore(state, net, optimizer, batches, policy, changed, rank, run_dir, layout)
                if not layout.sharded and isinstance(policy, (AllreducePolicy, ModelAveragingPolicy)):  # DDP only
                    _rebuild_ddp_buckets(model, x_test[:1])
            elif rank == 0:
                why = "resume=true" if cfg.resume else f"restart {restarts} of this job"
                log.warning("%s but %s holds no complete checkpoint; starting from step 0", why, run_dir)
        else:
            ensure_no_history(run_dir)
        if rank == 0:
            log.info(
                "training %s on %s, %d rank(s)%s, device %s, policy %s, steps %d..%d, run dir %s",
                cfg.model.name,
                dataset.name,
                world_size,
                f" (hsdp: {layout.replicas} replicas x {layout.shard_size} shards)" if layout.sharded else "",
                device,
                policy.name,
                start_step,
                steps,
                run_dir,
            )

        # The loop.
        clock = _GradReadyClock(net.parameters())
        loss_fn = TokenCrossEntropy() if dataset.token_targets else nn.CrossEntropyLoss()
        log_every, eval_every, ckpt_every = int(cfg.log_every), int(cfg.eval_every), int(cfg.checkpoint_every)
        window: list[dict[str, float]] = []
        compute_s = 0.0
        model.train()
        roll_call = RollCall(rank, world_size, report_s=float(cfg.get("failure_report_s", 3.0)))
        # Rank 0 also writes metrics.csv and TensorBoard events; closed (flushed) in the finally below.
        writer = MetricsWriter(
            run_dir,
            rank,
            keep_through=start_step,
            elapsed_s=totals.elapsed_s,
            with_csv=rank == 0,
            with_tensorboard=rank == 0,
        )
        progress = Progress(
            total=steps,
            initial=start_step,
            every=progress_every(cfg.get("progress_every"), steps),
            samples_per_step=batch_size * world_size if isinstance(batches, BatchIterator) else 0,
            enabled=rank == 0 and bool(cfg.get("progress", True)),
        )
        averaging_cfg = group_options(cfg, "averaging")
        guard = TrainingGuard(
            policy.name,
            steps,
            validated_staleness=averaging_cfg.get("validated_staleness"),
            remedy=policy.remedy,
            start_step=start_step,
            chance_loss=math.log(dataset.num_classes),
        )
        first_step = time.perf_counter()
        with roll_call.watching():
            for step in range(start_step, steps):
                done = step + 1
                roll_call.begin(step)
                timings = _timed_step(
                    model, next(batches), loss_fn, optimizer, policy, imbalance, clock, step, compute_s
                )
                compute_s = timings["compute_s"]
                totals.add(timings)
                window.append(timings)

                extra: dict[str, Any] = {}
                if meter is not None and done % consensus_every == 0:
                    extra["consensus"] = meter.measure(net.parameters())
                if eval_every and done % eval_every == 0 and done < steps:
                    extra["test_accuracy"], extra["test_loss"] = evaluate(net, x_test, y_test, rank, world_size)
                record: dict[str, Any] | None = None
                if done % log_every == 0 or done == steps or extra:
                    record = _window_record(window) | _policy_fields(policy) | extra | gpu.fields()
                    writer.write(done, **record)
                    window = []
                if ckpt_every and done % ckpt_every == 0 and done < steps:
                    save(done)
                progress.update(done, record)
                warning = guard.observe(done, timings["loss"], record)
                if warning is not None and rank == 0:
                    log.warning("guard: %s", warning)
                if step_callback is not None:
                    step_callback(done, timings)
        progress.close()
        clock.remove()
        phases = (first_step - started, time.perf_counter() - first_step)  # start-up, training

        # The end: save the training state as it is (a later resume with more steps continues this
        # exact trajectory), then let the policy produce the model to keep, evaluate and summarise it.
        # Collectives too: the roll call names a rank that froze or died here as well.
        roll_call.begin(FINAL)
        with roll_call.watching():
            if start_step < steps or resume_from is None:
                save(steps)
            trained_stats = policy.stats()
            policy.finalize(model, optimizer)
            test_accuracy, test_loss = evaluate(net, x_test, y_test, rank, world_size)
            writer.add_scalars(steps, {"test_accuracy": test_accuracy, "test_loss": test_loss})
        summary = _summary(
            cfg,
            policy,
            trained_stats,
            imbalance,
            totals,
            world_size,
            test_accuracy,
            test_loss,
            run_dir,
            started,
            phases,
            layout,
        )
        summary["resumed_from"] = resume_from
        summary["restarts"] = launch.restart_count()
        if dataset.token_targets:  # a language model: its loss in bits per byte, and which corpus it was
            summary["test_bits_per_byte"] = bits_per_byte(test_loss)
            summary["data_digest"] = dataset.digest
        before = len(guard.warnings)
        warnings = guard.finish(
            staleness=summary["staleness"],
            staleness_max=summary["staleness_max"],
            test_accuracy=test_accuracy,
            num_classes=dataset.num_classes,
            steps=steps,
        )
        summary["guard"] = TrainingGuard.summary_field(warnings)
        final_state = full_model_state(net) if layout.sharded else net.state_dict()  # collective under hsdp
        if rank == 0:
            for line in warnings[before:]:
                log.warning("guard: %s", line)
            torch.save(final_state, run_dir / "model.pt")
            write_summary(run_dir, summary)
            log.info(
                "test accuracy %.4f, %.0f samples/s, mean wait %.2f ms/step, wall %.1f s (start-up %.1f s, "
                "training %.1f s) -> %s",
                test_accuracy,
                summary["samples_per_s"],
                1e3 * summary["mean_wait_s"],
                summary["wall_s"],
                summary["startup_s"],
                summary["train_s"],
                run_dir,
            )
        return summary
    finally:
        try:  # the metrics first: a failing run leaves complete files even if a close below raises
            if progress is not None:
                progress.close()
            if writer is not None:
                writer.close()
        finally:
            gpu.close()
            if meter is not None:
                meter.close()
            policy.close()


def _fingerprint(cfg: DictConfig, layout: Layout) -> dict[str, Any]:
    """What a checkpoint records of its run and a resume must match (``averaging`` may be allowed to change)."""
    plain = {group: group_options(cfg, group) for group in ("model", "optim", "averaging", "data")}
    plain |= {"batch_size": int(cfg.batch_size), "seed": int(cfg.seed)}
    plain |= {"parallel": layout.parallel, "shard_size": layout.shard_size}
    return json.loads(json.dumps(plain, sort_keys=True))  # as meta.json gives it back: lists, sorted keys


def _restore(
    state: dict[str, Any],
    net: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: BatchIterator | TokenBatchIterator,
    policy: Policy,
    changed: list[str],
    rank: int,
    run_dir: Path,
    layout: Layout,
) -> tuple[_Totals, int]:
    """Load this rank's checkpointed state into the (already wrapped) module, optimizer, data and policy.

    Every rank loads its own shard (replicas and optimizer state may differ between ranks), into the
    module the wrapper shares -- after the wrapper's own broadcast from rank 0. Under ``parallel=hsdp`` the
    checkpoint holds this rank's parameter and optimizer shards, copied back into the ``DTensor``s
    (:mod:`wagma.app.parallel`). With ``averaging`` in ``changed`` (``resume_policy_change=true``) the policy keeps
    its fresh state.
    """
    try:
        if layout.sharded:
            load_local_model_state(net, state["model"])
            load_local_optimizer_state(optimizer, state["optimizer"])
        else:
            net.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0]
        raise CheckpointError(f"the checkpoint in {run_dir} does not fit this model or optimizer: {first}") from None
    batches.load_state_dict(state["data"])
    if "averaging" in changed:
        if rank == 0:
            log.warning(
                "resume_policy_change=true: the averaging policy changed; its state starts fresh "
                "(round counters, residuals, momentum); model, optimizer, data order and RNG are restored"
            )
    else:
        policy.load_state_dict(state["policy_state"])
    restore_rng_state(state["rng"])
    return _restored_totals(state["counters"], batches), int(state["step"])


def _restored_totals(counters: dict[str, Any], batches: BatchIterator | TokenBatchIterator) -> _Totals:
    """A checkpoint's counters as :class:`_Totals`. Checkpoints from before samples were counted (they lack
    ``samples``) could only batch by sample count, so their steps carried ``batch_size`` examples each."""
    counters = dict(counters)
    if "samples" not in counters:
        if not isinstance(batches, BatchIterator):
            raise CheckpointError(
                "the checkpoint predates counted samples and so cannot have batched by tokens; "
                "resume it with data.batching=samples"
            )
        counters["samples"] = int(counters["steps"]) * batches.batch_size
    return _Totals(**counters)


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


def _timed_step(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    loss_fn: nn.Module,
    optimizer: torch.optim.Optimizer,
    policy: Policy,
    imbalance: Imbalance,
    clock: _GradReadyClock,
    step: int,
    last_compute_s: float,
) -> dict[str, float]:
    """One training step, with the time split described in the module docstring."""
    t0 = time.perf_counter()
    imbalance_s = imbalance(step, last_compute_s)
    t1 = time.perf_counter()
    xb, yb = batch
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model(xb), yb)
    clock.last_ready = 0.0
    loss.backward()  # DDP (and a policy's comm hook) reduce gradients in here
    t2 = time.perf_counter()
    policy.before_step(optimizer, step)
    t3 = time.perf_counter()
    optimizer.step()
    t4 = time.perf_counter()
    policy.after_step(optimizer, step)
    loss_value = loss.item()
    t5 = time.perf_counter()
    grads_ready = clock.last_ready if t1 < clock.last_ready <= t2 else t2
    return {
        "loss": loss_value,
        "samples": len(yb),
        "tokens": int(xb.numel()) if xb.dtype == torch.int64 else 0,  # padded tokens of a token batch
        "step_s": t5 - t0,
        "compute_s": (grads_ready - t1) + (t4 - t3),
        "wait_s": (t2 - grads_ready) + (t3 - t2) + (t5 - t4),
        "imbalance_s": imbalance_s,
    }


class TokenCrossEntropy(nn.Module):
    """The loss of token targets (``data=torch_source``): mean cross-entropy over every real next token."""

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return token_cross_entropy(logits, target)


@torch.no_grad()
def evaluate(
    net: nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int, world_size: int, batch_size: int = 1024
) -> tuple[float, float]:
    """Accuracy and mean cross-entropy of ``net`` on ``(x, y)``; collective over the default group.

    Rank r scores examples r, r + P, ... with its own model and the counts are summed, so with identical
    replicas this is the exact test accuracy, computed P times faster. Every rank runs the same number of
    forward passes (the last may be empty): a sharded model's forward all-gathers inside its replica. With token
    targets (``y`` of shape ``(N, L)``) both are per real next token: the next-byte accuracy and the loss in nats
    per byte, over batches of at most 8,192 tokens' worth of rows.
    """
    was_training = net.training
    net.eval()
    tokens = y.dim() == 2
    if tokens:  # rows x heads x L x L attention weights and rows x L x vocab logits stay small
        batch_size = max(1, min(batch_size, 8192 // max(1, y.shape[1])))
    xs, ys = x[rank::world_size], y[rank::world_size]
    correct = torch.zeros((), dtype=torch.float64, device=x.device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=x.device)
    count = torch.zeros((), dtype=torch.float64, device=x.device)
    for i in range(0, -(-len(x) // world_size), batch_size):  # the largest rank's share, on every rank
        logits = net(xs[i : i + batch_size])
        target = ys[i : i + batch_size]
        if tokens:
            real = target != 0
            correct += ((logits.argmax(dim=-1) == target) & real).sum()
            loss_sum += token_cross_entropy(logits, target, reduction="sum").double()
            count += real.sum()
        else:
            correct += (logits.argmax(dim=1) == target).sum()
            loss_sum += nn.functional.cross_entropy(logits, target, reduction="sum").double()
            count += len(target)
    totals = torch.stack([correct, loss_sum, count])
    dist.all_reduce(totals)
    net.train(was_training)
    total = max(1.0, float(totals[2]))
    return float(totals[0]) / total, float(totals[1]) / total


def _resolve_run_dir(cfg: DictConfig) -> Path:
    if cfg.get("run_dir"):
        path = Path(str(cfg.run_dir))
    else:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            raise ConfigError(
                "run_dir is not set and Hydra is not running: set run_dir=<directory shared by all ranks>"
            )
        path = Path(HydraConfig.get().runtime.output_dir)
    path.mkdir(parents=True, exist_ok=True)
    return path


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


class _GradReadyClock:
    """Remembers when the last parameter gradient of a backward pass was accumulated."""

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        self.last_ready = 0.0
        self._handles = [p.register_post_accumulate_grad_hook(self._mark) for p in params if p.requires_grad]

    def _mark(self, _param: torch.Tensor) -> None:
        self.last_ready = time.perf_counter()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _window_record(window: list[dict[str, float]]) -> dict[str, Any]:
    """Means over the steps since the last record, and this rank's throughput over them."""
    n = len(window)
    record = {key: sum(t[key] for t in window) / n for key in window[0]}
    record["samples_per_s"] = record["samples"] / record["step_s"] if record["step_s"] > 0 else None
    record["steps_in_record"] = n
    return record


def _policy_fields(policy: Policy) -> dict[str, Any]:
    stats = dict(policy.stats())
    return {"reductions": stats.pop("global_reductions", 0), "staleness": stats.pop("staleness", 0), **stats}


def _summary(
    cfg: DictConfig,
    policy: Policy,
    trained_stats: dict[str, Any],
    imbalance: Imbalance,
    totals: _Totals,
    world_size: int,
    test_accuracy: float,
    test_loss: float,
    run_dir: Path,
    started: float,
    phases: tuple[float, float],
    layout: Layout,
) -> dict[str, Any]:
    """Rank totals gathered on every rank, reduced to the run's numbers.

    ``global_reductions`` and ``local_reductions`` count the reductions of the training steps (rank 0's
    ``trained_stats``, taken before ``policy.finalize``); ``staleness`` (the run's one staleness figure)
    and ``fresh_fraction`` are means over the ranks, ``staleness_max`` the largest staleness of any rank;
    ``policy_stats`` is rank 0's final account, finalize's own reduction included.

    Time, this rank's clock, this attempt: ``startup_s`` from :func:`train`'s start to the first step
    (config check, process group, data, model, policy, resume), ``train_s`` from the first step to the end
    of the last (evaluations and checkpoints in between included), ``finish_s`` the rest (final
    checkpoint, ``finalize``, final evaluation, gathering); ``wall_s`` is their sum. ``step_time_s`` is
    the slowest rank's sum of step times over the whole run (resumes included), ``samples_per_s``'s base.
    """
    per_rank: list[dict[str, Any]] = [{} for _ in range(world_size)]
    dist.all_gather_object(per_rank, dataclasses.asdict(totals) | {"policy": trained_stats})
    steps_run = max(1, max(t["steps"] for t in per_rank))
    slowest_s = max(t["train_s"] for t in per_rank)
    mean_compute_s = sum(t["compute_s"] for t in per_rank) / (world_size * steps_run)
    stats = policy.stats()
    wall_s = time.perf_counter() - started
    return {
        "policy": policy.name,
        "world_size": world_size,
        "steps": int(cfg.steps),
        "test_accuracy": test_accuracy,
        "test_loss": test_loss,
        "samples_per_s": sum(t["samples"] for t in per_rank) / slowest_s if slowest_s > 0 else None,
        "mean_wait_s": sum(t["wait_s"] for t in per_rank) / (world_size * steps_run),
        "mean_step_s": sum(t["train_s"] for t in per_rank) / (world_size * steps_run),
        "mean_compute_s": mean_compute_s,
        "mean_imbalance_s": sum(t["imbalance_s"] for t in per_rank) / (world_size * steps_run),
        "expected_mean_delay_s": imbalance.expected_mean_delay_s(mean_compute_s),
        "expected_max_delay_s": imbalance.expected_max_delay_s(mean_compute_s),
        "global_reductions": trained_stats.get("global_reductions", 0),
        "local_reductions": trained_stats.get("local_reductions", 0),
        "staleness": sum(float(t["policy"].get("staleness", 0.0)) for t in per_rank) / world_size,
        "staleness_max": max(int(t["policy"].get("staleness_max", 0)) for t in per_rank),
        "fresh_fraction": sum(float(t["policy"].get("fresh_fraction", 1.0)) for t in per_rank) / world_size,
        "policy_stats": stats,
        "step_time_s": slowest_s,
        "startup_s": phases[0],
        "train_s": phases[1],
        "finish_s": wall_s - phases[0] - phases[1],
        "wall_s": wall_s,
        "dataset": str(cfg.data.name),
        "model": str(cfg.model.name),
        "optimizer": str(cfg.optim.name),
        "imbalance": str(cfg.imbalance.name),
        "batch_size": int(cfg.batch_size),
        "seed": int(cfg.seed),
        "run_dir": str(run_dir),
        "rank_cpus": float(cfg.get("rank_cpus") or 0.0),  # the per-rank CPU quota the run had (0: none)
        "rank_net": rate_name(cfg.get("rank_net")),  # every rank's link rate, e.g. "200mbit" (None: loopback)
        "parallel": layout.parallel,  # ddp, or hsdp: shard_size ranks hold one replica's shards
        "shard_size": layout.shard_size,
    }
