"""What a run reports of itself: per-rank totals, the periodic metrics records' means, and ``summary.json``'s numbers.

:mod:`wagma.app.train` measures (every step's timings) and decides when to record; this module turns the
measurements into what is recorded: :class:`Totals` sums every step of a rank over the whole run (checkpointed, so
they survive a resume), :func:`window_record` averages the steps since the last metrics record, and
:func:`run_summary` gathers every rank's totals and reduces them to the run's numbers.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from omegaconf import DictConfig

from wagma.app.imbalance import Imbalance
from wagma.app.network import rate_burst, rate_name
from wagma.app.parallel import Layout
from wagma.app.policies import Policy

__all__ = ["Totals", "policy_fields", "run_summary", "window_record"]


@dataclasses.dataclass
class Totals:
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


def window_record(window: list[dict[str, float]]) -> dict[str, Any]:
    """Means over the steps since the last record, and this rank's throughput over them."""
    n = len(window)
    record: dict[str, Any] = {key: sum(t[key] for t in window) / n for key in window[0]}
    record["samples_per_s"] = record["samples"] / record["step_s"] if record["step_s"] > 0 else None
    record["steps_in_record"] = n
    return record


def policy_fields(policy: Policy) -> dict[str, Any]:
    """The policy's statistics as a metrics record carries them (``global_reductions`` as ``reductions``)."""
    stats = dict(policy.stats())
    return {"reductions": stats.pop("global_reductions", 0), "staleness": stats.pop("staleness", 0), **stats}


def run_summary(
    cfg: DictConfig,
    policy: Policy,
    trained_stats: dict[str, Any],
    imbalance: Imbalance,
    totals: Totals,
    test: tuple[float, float],
    run_dir: Path,
    started: float,
    phases: tuple[float, float],
    layout: Layout,
    steps: int,
) -> dict[str, Any]:
    """Rank totals gathered on every rank (collective), reduced to the run's numbers.

    ``test`` is the final ``(test_accuracy, test_loss)``; ``steps`` the run's last step (``cfg.steps``, or the one
    after which an evaluation stopped it). ``global_reductions`` and ``local_reductions`` count the
    reductions of the training steps (rank 0's ``trained_stats``, taken before ``policy.finalize``); ``staleness``
    (the run's one staleness figure) and ``fresh_fraction`` are means over the ranks, ``staleness_max`` the largest
    staleness of any rank; ``policy_stats`` is rank 0's final account, finalize's own reduction included.

    Time, this rank's clock, this attempt: ``startup_s`` from :func:`wagma.app.train.train`'s start to the first
    step (config check, process group, data, model, policy, resume), ``train_s`` from the first step to the end
    of the last (evaluations and checkpoints in between included), ``finish_s`` the rest (final
    checkpoint, ``finalize``, final evaluation, gathering); ``wall_s`` is their sum. ``step_time_s`` is
    the slowest rank's sum of step times over the whole run (resumes included), ``samples_per_s``'s base.
    """
    world_size = dist.get_world_size()
    per_rank: list[dict[str, Any]] = [{} for _ in range(world_size)]
    dist.all_gather_object(per_rank, dataclasses.asdict(totals) | {"policy": trained_stats})
    stats = policy.stats()
    wall_s = time.perf_counter() - started
    return {
        "policy": policy.name,
        "world_size": world_size,
        "steps": steps,
        "test_accuracy": test[0],
        "test_loss": test[1],
        **_time_means(per_rank, imbalance),
        **_averaging_counts(per_rank, trained_stats),
        "policy_stats": stats,
        "step_time_s": max(t["train_s"] for t in per_rank),
        "startup_s": phases[0],
        "train_s": phases[1],
        "finish_s": wall_s - phases[0] - phases[1],
        "wall_s": wall_s,
        **_run_fields(cfg, run_dir, layout),
    }


def _time_means(per_rank: list[dict[str, Any]], imbalance: Imbalance) -> dict[str, Any]:
    """Throughput over the slowest rank's step time, and per rank-and-step means of the time split."""
    world_size = len(per_rank)
    steps_run = max(1, max(t["steps"] for t in per_rank))
    slowest_s = max(t["train_s"] for t in per_rank)
    mean_compute_s = sum(t["compute_s"] for t in per_rank) / (world_size * steps_run)
    return {
        "samples_per_s": sum(t["samples"] for t in per_rank) / slowest_s if slowest_s > 0 else None,
        "mean_wait_s": sum(t["wait_s"] for t in per_rank) / (world_size * steps_run),
        "mean_step_s": sum(t["train_s"] for t in per_rank) / (world_size * steps_run),
        "mean_compute_s": mean_compute_s,
        "mean_imbalance_s": sum(t["imbalance_s"] for t in per_rank) / (world_size * steps_run),
        "expected_mean_delay_s": imbalance.expected_mean_delay_s(mean_compute_s),
        "expected_max_delay_s": imbalance.expected_max_delay_s(mean_compute_s),
    }


def _averaging_counts(per_rank: list[dict[str, Any]], trained_stats: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's reductions of the training steps, and the ranks' staleness and fresh fraction."""
    world_size = len(per_rank)
    return {
        "global_reductions": trained_stats.get("global_reductions", 0),
        "local_reductions": trained_stats.get("local_reductions", 0),
        "staleness": sum(float(t["policy"].get("staleness", 0.0)) for t in per_rank) / world_size,
        "staleness_max": max(int(t["policy"].get("staleness_max", 0)) for t in per_rank),
        "fresh_fraction": sum(float(t["policy"].get("fresh_fraction", 1.0)) for t in per_rank) / world_size,
    }


def _run_fields(cfg: DictConfig, run_dir: Path, layout: Layout) -> dict[str, Any]:
    """What the run was: its data, model, optimizer, imbalance, batch, seed, directory and placement."""
    return {
        "dataset": str(cfg.data.name),
        "model": str(cfg.model.name),
        "optimizer": str(cfg.optim.name),
        "imbalance": str(cfg.imbalance.name),
        "batch_size": int(cfg.batch_size),
        "seed": int(cfg.seed),
        "run_dir": str(run_dir),
        "rank_cpus": float(cfg.get("rank_cpus") or 0.0),  # the per-rank CPU quota the run had (0: none)
        "rank_net": rate_name(cfg.get("rank_net")),  # every rank's link rate, e.g. "200mbit" (None: loopback)
        "rank_net_burst": rate_burst(cfg.get("rank_net")),  # its shaper's bucket in bytes (None: loopback)
        "parallel": layout.parallel,  # ddp, or hsdp: shard_size ranks hold one replica's shards
        "shard_size": layout.shard_size,
    }
