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
   (:mod:`wagma.app.progress`); evaluate every ``eval_every`` steps -- and stop after an evaluation that
   reached ``stop_at_loss`` / ``stop_at_accuracy`` or came ``stop_after_s`` training seconds in
   (:func:`_stop_reason`); measure the consensus distance every ``consensus_every`` steps
   (:mod:`wagma.app.consensus`, recorded as ``consensus``); checkpoint every ``checkpoint_every`` steps; on a CUDA
   device, records also carry ``gpu_*`` telemetry sampled every ``telemetry_interval_s``
   (:class:`wagma.telemetry.GpuMetrics`);
6. checkpoint the final training state, ``policy.finalize``, evaluate on the test split, and have rank 0
   write ``summary.json`` (with the time split ``startup_s`` / ``train_s`` / ``finish_s``, see
   :func:`wagma.app.report.run_summary`) and ``model.pt`` (the finalized model's state dict). The metrics files are
   closed in a ``finally``, so a failing run leaves them complete.

When a step fails (one of its collectives -- averaging, evaluation, consensus, checkpoint -- timed out,
a peer died), every rank that sees it raises a ``RuntimeError`` naming the ranks that did not arrive at
that step (:mod:`wagma.app.roll_call`; ``failure_report_s`` bounds the wait for the other ranks' reports).

Each step is timed, its time split into ``imbalance_s``, ``compute_s`` and ``wait_s`` as :mod:`wagma.app.step`
describes; :mod:`wagma.app.report` turns the timings into the metrics records and the run's summary.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn

from wagma.app import launch
from wagma.app.assembly import Run, prepare, set_up
from wagma.app.checkpoint import capture_rng_state, save_checkpoint
from wagma.app.config import ConfigError, group_options, validate_config
from wagma.app.data import BatchIterator
from wagma.app.ft_options import ft_enabled
from wagma.app.guard import TrainingGuard
from wagma.app.metrics import MetricsWriter, write_summary
from wagma.app.network import RankNetwork, rate_name
from wagma.app.network import current as current_network
from wagma.app.parallel import full_model_state, local_state
from wagma.app.progress import Progress, progress_every
from wagma.app.quota import RankQuota, job_name
from wagma.app.report import policy_fields, run_summary, window_record
from wagma.app.roll_call import FINAL, RollCall
from wagma.app.source_text import bits_per_byte
from wagma.app.step import GradReadyClock, TokenCrossEntropy, evaluate, mean_model, timed_step

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
    if ft_enabled(cfg):
        raise ConfigError(
            "ft=torchft: start the job with `python train.py ft=torchft replicas=N`, whose launcher starts the "
            "lighthouse and the replica groups (or run train.py under torchrun, one replica group each); "
            "train() does not train replica groups"
        )
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
class _Loop:
    """What the step loop and the finish use besides the run: the roll call, the records and the guard."""

    clock: GradReadyClock
    roll_call: RollCall
    writer: MetricsWriter
    progress: Progress
    guard: TrainingGuard
    log_every: int
    eval_every: int
    checkpoint_every: int
    consensus_every: int
    end_step: int  # the last step: ``steps``, or the one after which an evaluation stopped the run
    stopped: str | None = None  # why the run stopped before ``steps`` (:func:`_stop_reason`)
    mean_net: nn.Module | None = None  # ``eval_model=mean``: the copy that holds the ranks' mean model


def _train(
    cfg: DictConfig, ctx: launch.DistContext, run_dir: Path, started: float, step_callback: StepCallback | None
) -> dict[str, Any]:
    """One rank's run in its process group: set up, resume, the step loop, the final sync and the summary.

    ``started`` is when :func:`train` began (the summary's ``startup_s`` counts from it). What was opened is
    closed at the end whatever happens (:meth:`Run.close`).
    """
    run = set_up(cfg, ctx, run_dir)
    try:
        prepare(run)
        _log_start(run)
        loop = _open_loop(run)
        first_step = time.perf_counter()
        _run_steps(run, loop, step_callback)
        loop.progress.close()
        loop.clock.remove()
        phases = (first_step - started, time.perf_counter() - first_step)  # start-up, training
        trained_stats, test = _final_sync(run, loop)
        return _finish(run, loop, trained_stats, test, started, phases)
    finally:
        run.close()


def _log_start(run: Run) -> None:
    """Rank 0 says what it trains, where and how."""
    if run.ctx.rank != 0:
        return
    layout = run.layout
    log.info(
        "training %s on %s, %d rank(s)%s, device %s, policy %s, steps %d..%d, run dir %s",
        run.cfg.model.name,
        run.dataset.name,
        run.ctx.world_size,
        f" (hsdp: {layout.replicas} replicas x {layout.shard_size} shards)" if layout.sharded else "",
        run.ctx.device,
        run.policy.name,
        run.start_step,
        int(run.cfg.steps),
        run.run_dir,
    )


def _open_loop(run: Run) -> _Loop:
    """The gradient clock, the roll call, the metrics writer (rank 0 also writes ``metrics.csv`` and TensorBoard
    events), the progress display and the guard, for the steps from ``run.start_step`` on."""
    cfg, rank, world_size = run.cfg, run.ctx.rank, run.ctx.world_size
    steps = int(cfg.steps)
    clock = GradReadyClock(run.net.parameters())
    run.model.train()
    roll_call = RollCall(rank, world_size, report_s=float(cfg.get("failure_report_s", 3.0)))
    on_0 = rank == 0
    run.writer = MetricsWriter(
        run.run_dir,
        rank,
        keep_through=run.start_step,
        elapsed_s=run.totals.elapsed_s,
        with_csv=on_0,
        with_tensorboard=on_0,
    )
    run.progress = Progress(
        total=steps,
        initial=run.start_step,
        every=progress_every(cfg.get("progress_every"), steps),
        samples_per_step=int(cfg.batch_size) * world_size if isinstance(run.batches, BatchIterator) else 0,
        enabled=on_0 and bool(cfg.get("progress", True)),
    )
    guard = TrainingGuard(
        run.policy.name,
        steps,
        validated_staleness=group_options(cfg, "averaging").get("validated_staleness"),
        remedy=run.policy.remedy,
        start_step=run.start_step,
        chance_loss=math.log(run.dataset.num_classes),
    )
    every = (int(cfg.log_every), int(cfg.eval_every), int(cfg.checkpoint_every), int(cfg.get("consensus_every", 0)))
    return _Loop(clock, roll_call, run.writer, run.progress, guard, *every, end_step=steps)


def _run_steps(run: Run, loop: _Loop, step_callback: StepCallback | None) -> None:
    """The training steps from ``run.start_step`` on, under the roll call: each timed, its record written every
    ``log_every`` steps, at the last and whenever it measured more (:func:`_measure`), then the checkpoint (every
    ``checkpoint_every`` steps but the last), the progress, the guard and the ``step_callback``."""
    steps = int(run.cfg.steps)
    loss_fn = TokenCrossEntropy() if run.dataset.token_targets else nn.CrossEntropyLoss()
    window: list[dict[str, float]] = []
    compute_s = 0.0
    with loop.roll_call.watching():
        for step in range(run.start_step, steps):
            done = step + 1
            loop.roll_call.begin(step)
            timings = timed_step(
                run.model,
                next(run.batches),
                loss_fn,
                run.optimizer,
                run.policy,
                run.imbalance,
                loop.clock,
                step,
                compute_s,
            )
            compute_s = timings["compute_s"]
            run.totals.add(timings)
            window.append(timings)
            extra = _measure(run, loop, done)
            loop.stopped = _stop_reason(run, loop, extra) if "test_loss" in extra else None
            record: dict[str, Any] | None = None
            if done % loop.log_every == 0 or done == steps or extra:
                record = window_record(window) | policy_fields(run.policy) | extra | run.gpu.fields()
                loop.writer.write(done, **record)
                window = []
            if loop.checkpoint_every and done % loop.checkpoint_every == 0 and done < steps and not loop.stopped:
                _save(run, done)  # (a stopping run saves this step in the final sync)
            loop.progress.update(done, record)
            warning = loop.guard.observe(done, timings["loss"], record)
            if warning is not None and run.ctx.rank == 0:
                log.warning("guard: %s", warning)
            if step_callback is not None:
                step_callback(done, timings)
            if loop.stopped:
                loop.end_step = done
                if run.ctx.rank == 0:
                    log.info("stopping after step %d of %d: %s", done, steps, loop.stopped)
                break


def _stop_reason(run: Run, loop: _Loop, extra: dict[str, Any]) -> str | None:
    """Why the run stops after this evaluation (``extra``'s): ``stop_at_loss`` reached (bits per byte for a
    language model, else nats), ``stop_at_accuracy`` reached, or ``stop_after_s`` training seconds spent; None to
    go on. Every rank decides alike: the evaluation is collective, and the time is the slowest rank's (a MAX
    allreduce, only when ``stop_after_s`` is set)."""
    cfg = run.cfg
    loss = bits_per_byte(extra["test_loss"]) if run.dataset.token_targets else extra["test_loss"]
    unit = "bits per byte" if run.dataset.token_targets else "nats"
    if cfg.get("stop_at_loss") is not None and loss <= float(cfg.stop_at_loss):
        return f"test loss {loss:.4f} {unit} <= stop_at_loss={cfg.stop_at_loss}"
    if cfg.get("stop_at_accuracy") is not None and extra["test_accuracy"] >= float(cfg.stop_at_accuracy):
        return f"test accuracy {extra['test_accuracy']:.4f} >= stop_at_accuracy={cfg.stop_at_accuracy}"
    if cfg.get("stop_after_s") is not None:
        spent = torch.tensor([loop.writer.elapsed_s], dtype=torch.float64, device=run.ctx.device)
        dist.all_reduce(spent, op=dist.ReduceOp.MAX)
        if float(spent) >= float(cfg.stop_after_s):
            return f"{float(spent):.1f} s of training >= stop_after_s={cfg.stop_after_s}"
    return None


def _measure(run: Run, loop: _Loop, done: int) -> dict[str, Any]:
    """What step ``done`` measures besides its timings: the consensus distance every ``consensus_every`` steps,
    the test accuracy and loss every ``eval_every`` steps but the last (the final sync evaluates that one): of each
    rank's own model, or with ``eval_model=mean`` of the ranks' mean (what a final sync would keep now)."""
    extra: dict[str, Any] = {}
    if run.meter is not None and done % loop.consensus_every == 0:
        extra["consensus"] = run.meter.measure(run.net.parameters())
    if loop.eval_every and done % loop.eval_every == 0 and done < int(run.cfg.steps):
        net = run.net
        if run.cfg.get("eval_model", "local") == "mean":  # the model a final sync would keep now
            net = loop.mean_net = mean_model(run.net, loop.mean_net)
        extra["test_accuracy"], extra["test_loss"] = evaluate(net, *run.test, run.ctx.rank, run.ctx.world_size)
    return extra


def _save(run: Run, step: int) -> None:
    """Checkpoint this rank's training state after ``step`` steps (its shards under ``parallel=hsdp``)."""
    if run.writer is not None:
        run.totals.elapsed_s = run.writer.elapsed_s
    state = {
        "step": step,
        "world_size": run.ctx.world_size,
        "model": local_state(run.net.state_dict()),  # shards under hsdp
        "optimizer": local_state(run.optimizer.state_dict()),
        "data": run.batches.state_dict(),
        "rng": capture_rng_state(),
        "policy_state": run.policy.state_dict(),
        "counters": dataclasses.asdict(run.totals),
    }
    save_checkpoint(run.run_dir, step, state, fingerprint=run.fingerprint)


def _final_sync(run: Run, loop: _Loop) -> tuple[dict[str, Any], tuple[float, float]]:
    """Save the training state as it is (a later resume with more steps continues this exact trajectory), then let
    the policy produce the model to keep and evaluate it; collectives too, so the roll call names a rank that froze
    or died here as well. Returns the policy's statistics of the training steps and the test accuracy and loss."""
    steps = loop.end_step
    loop.roll_call.begin(FINAL)
    with loop.roll_call.watching():
        if run.start_step < steps or run.resume_from is None:
            _save(run, steps)
        trained_stats = run.policy.stats()
        run.policy.finalize(run.model, run.optimizer)
        test_accuracy, test_loss = evaluate(run.net, *run.test, run.ctx.rank, run.ctx.world_size)
        loop.writer.add_scalars(steps, {"test_accuracy": test_accuracy, "test_loss": test_loss})
    return trained_stats, (test_accuracy, test_loss)


def _finish(
    run: Run,
    loop: _Loop,
    trained_stats: dict[str, Any],
    test: tuple[float, float],
    started: float,
    phases: tuple[float, float],
) -> dict[str, Any]:
    """The run's summary (gathered from every rank) with the guard's verdict; rank 0 writes it and ``model.pt``."""
    cfg = run.cfg
    summary = run_summary(
        cfg,
        run.policy,
        trained_stats,
        run.imbalance,
        run.totals,
        test,
        run.run_dir,
        started,
        phases,
        run.layout,
        steps=loop.end_step,
    )
    summary["stopped"] = loop.stopped
    summary["resumed_from"] = run.resume_from
    summary["restarts"] = launch.restart_count()
    if run.dataset.token_targets:  # a language model: its loss in bits per byte, and which corpus it was
        summary["test_bits_per_byte"] = bits_per_byte(test[1])
        summary["data_digest"] = run.dataset.digest
    before = len(loop.guard.warnings)
    warnings = loop.guard.finish(
        staleness=summary["staleness"],
        staleness_max=summary["staleness_max"],
        test_accuracy=test[0],
        num_classes=run.dataset.num_classes,
        steps=loop.end_step,
    )
    summary["guard"] = TrainingGuard.summary_field(warnings)
    final_state = full_model_state(run.net) if run.layout.sharded else run.net.state_dict()  # collective under hsdp
    if run.ctx.rank == 0:
        for line in warnings[before:]:
            log.warning("guard: %s", line)
        torch.save(final_state, run.run_dir / "model.pt")
        write_summary(run.run_dir, summary)
        log.info(
            "test accuracy %.4f, %.0f samples/s, mean wait %.2f ms/step, wall %.1f s (start-up %.1f s, "
            "training %.1f s) -> %s",
            test[0],
            summary["samples_per_s"],
            1e3 * summary["mean_wait_s"],
            summary["wall_s"],
            summary["startup_s"],
            summary["train_s"],
            run.run_dir,
        )
    return summary


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
