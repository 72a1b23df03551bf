"""Turn one training run's directory (``metrics_rank*.jsonl`` + ``summary.json``) into a benchmark record.

Definitions (P ranks, B examples per rank and step, ``step_s`` a rank's measured step time, which covers
the injected sleep, compute, communication and waiting, but not evaluation, metrics or checkpoints):

- **training clock** at step s: ``max over ranks of sum(step_s of steps 1..s)`` -- when the slowest rank
  finished step s. Evaluation time is excluded (evaluations are collective, so they also re-synchronise
  the ranks; keep ``eval_every`` well above a policy's sync period).
- **throughput**: the run summary's ``samples_per_s`` = ``P * B * steps / (slowest rank's total step time)``,
  i.e. the same clock at the last step. Every rank runs the same number of steps, so a persistent
  straggler bounds it for every policy; ``aggregate_samples_per_s`` = ``sum over ranks of B * steps /
  (that rank's total step time)`` is the rate at which the ranks process samples while all are busy
  (what fast ranks gain by not waiting for a persistent straggler).
- **test accuracy over time**: the ``test_accuracy`` the loop records every ``eval_every`` steps (each rank
  scores its slice of the test set with *its own* replica, so for model-averaging policies this is the
  mean accuracy of the replicas), placed at the training clock of that step, plus the final accuracy
  (after the policy's ``finalize``, e.g. a global average) at the last step.
- **time to target**: the training clock of the first evaluation whose accuracy is >= the target (null
  when none is); resolution: ``eval_every`` steps.
- **wait**: ``wait_s`` per rank and step (the part of a step spent in communication that compute did not
  hide and in waiting for other ranks); the mean is the summary's, the 95th percentile is over all
  (rank, step) records.
- **bytes per rank**, **staleness histogram**, **consensus distance**: whatever the policy and the loop
  recorded (``bytes*`` stats, ``staleness_hist*`` stats or per-step ``staleness``, ``consensus``); null
  when absent.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from wagma.app.metrics import read_metrics

__all__ = ["accuracy_curve", "collect", "compute_spread", "samples_clock", "time_to_target", "training_clock"]


def _cumulative(
    records_by_rank: list[list[dict[str, Any]]], field: str, combine: Callable[[Iterable[float]], float]
) -> dict[int, float]:
    """Step -> ``combine`` over the ranks of each rank's running total of ``field`` x ``steps_in_record`` through
    that step (only steps every rank recorded)."""
    per_rank: list[dict[int, float]] = []
    for records in records_by_rank:
        total, clock = 0.0, {}
        for r in records:
            total += float(r[field]) * int(r.get("steps_in_record", 1))
            clock[int(r["step"])] = total
        per_rank.append(clock)
    common = set(per_rank[0]).intersection(*per_rank[1:]) if per_rank else set()
    return {s: combine(c[s] for c in per_rank) for s in sorted(common)}


def training_clock(records_by_rank: list[list[dict[str, Any]]]) -> dict[int, float]:
    """Step -> seconds the slowest rank had spent in steps 1..step (only steps every rank recorded)."""
    return _cumulative(records_by_rank, "step_s", max)


def compute_spread(records_by_rank: list[list[dict[str, Any]]], warmup: int = 5) -> dict[str, float | None]:
    """How unequal the ranks' own work per step is, waiting left out (``compute_s``: forward, backward, optimizer
    step), from per-step records after ``warmup`` steps: ``compute_max_over_median``, the mean over steps of the
    slowest rank's compute over the median rank's (what a synchronous step pays for its straggler), and
    ``compute_cv``, the coefficient of variation of all (rank, step) compute times. Nones without per-step
    records of every rank."""
    by_step: dict[int, list[float]] = {}
    for records in records_by_rank:
        for r in records:
            if int(r.get("steps_in_record", 1)) == 1 and int(r["step"]) > warmup and r.get("compute_s") is not None:
                by_step.setdefault(int(r["step"]), []).append(float(r["compute_s"]))
    rows = [v for v in by_step.values() if len(v) == len(records_by_rank) and np.median(v) > 0]
    if not rows:
        return {"compute_max_over_median": None, "compute_cv": None}
    values = np.concatenate(rows)
    return {
        "compute_max_over_median": float(np.mean([max(v) / np.median(v) for v in rows])),
        "compute_cv": float(values.std() / values.mean()),
    }


def samples_clock(records_by_rank: list[list[dict[str, Any]]]) -> dict[int, float]:
    """Step -> examples all ranks had trained on in steps 1..step (only steps every rank recorded, and only when
    the records count their samples: batches by tokens vary in size)."""
    if any(not records or any(r.get("samples") is None for r in records) for records in records_by_rank):
        return {}
    return _cumulative(records_by_rank, "samples", sum)


def accuracy_curve(
    records: list[dict[str, Any]],
    clock: dict[int, float],
    final_step: int,
    final_accuracy: float | None,
    samples: dict[int, float] | None = None,
) -> list[dict[str, float]]:
    """``[{step, time_s, accuracy}]`` (and ``samples``, where ``samples`` counts them: :func:`samples_clock`) from
    the periodic evaluations, then the final evaluation."""
    curve = [
        {"step": int(r["step"]), "time_s": clock[int(r["step"])], "accuracy": float(r["test_accuracy"])}
        for r in records
        if r.get("test_accuracy") is not None and int(r["step"]) in clock
    ]
    if final_accuracy is not None and final_step in clock:
        curve.append({"step": final_step, "time_s": clock[final_step], "accuracy": float(final_accuracy)})
    for point in curve:
        if samples and point["step"] in samples:
            point["samples"] = samples[point["step"]]
    return curve


def time_to_target(curve: list[dict[str, float]], target: float) -> tuple[float | None, int | None]:
    """(training-clock seconds, step) of the first point of ``curve`` at or above ``target``; Nones if none."""
    for point in curve:
        if point["accuracy"] >= target:
            return point["time_s"], int(point["step"])
    return None, None


def _hist_of(d: dict[str, Any]) -> dict[str, int] | None:
    """A ``staleness_hist``-like entry of ``d`` (a {staleness: count} dict or a list indexed by staleness)."""
    for key, value in d.items():
        if "staleness" in key and "hist" in key and value:  # an empty histogram: the policy had no async round
            if isinstance(value, dict):
                return {str(k): int(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return {str(i): int(v) for i, v in enumerate(value) if v}
    return None


def _staleness_histogram(stats: dict[str, Any], records_by_rank: list[list[dict[str, Any]]]) -> dict[str, int] | None:
    """Staleness -> count, summed over ranks: the policy's own histogram when it keeps one (the last record
    of every rank, else the summary's), otherwise the per-step ``staleness`` the loop recorded."""
    per_rank = [_hist_of(records[-1]) for records in records_by_rank if records]
    hists = [h for h in per_rank if h is not None] or ([h] if (h := _hist_of(stats)) is not None else [])
    if hists:
        total: Counter[str] = Counter()
        for h in hists:
            total.update(h)
        return {k: total[k] for k in sorted(total, key=lambda s: (len(s), s))}
    values = [r["staleness"] for records in records_by_rank for r in records if r.get("staleness") is not None]
    if not values:
        return None
    counts = Counter(int(round(float(v))) for v in values)
    return {str(k): counts[k] for k in sorted(counts)}


def _bytes_per_rank(records_by_rank: list[list[dict[str, Any]]], stats: dict[str, Any]) -> float | None:
    """Mean over ranks of the last recorded ``bytes_sent`` (or another ``bytes*`` counter)."""

    def pick(d: dict[str, Any]) -> float | None:
        for key in ("bytes_sent", "bytes_per_rank", "bytes"):
            if isinstance(d.get(key), (int, float)):
                return float(d[key])
        for key, value in d.items():
            if key.startswith("bytes") and isinstance(value, (int, float)):
                return float(value)
        return None

    last = [pick(records[-1]) for records in records_by_rank if records]
    last = [v for v in last if v is not None]
    if last:
        return float(np.mean(last))
    return pick(stats)


def collect(run_dir: Path, world_size: int, target: float) -> dict[str, Any]:
    """The benchmark's numbers for the finished run in ``run_dir`` (see the module docstring)."""
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    records_by_rank = [read_metrics(run_dir, rank) for rank in range(world_size)]
    clock = training_clock(records_by_rank)
    steps = int(summary["steps"])
    curve = accuracy_curve(
        records_by_rank[0], clock, steps, summary.get("test_accuracy"), samples_clock(records_by_rank)
    )
    ttt_s, ttt_step = time_to_target(curve, target)
    waits = [float(r["wait_s"]) for records in records_by_rank for r in records if r.get("wait_s") is not None]
    stats = dict(summary.get("policy_stats") or {})
    consensus = [
        {"step": int(r["step"]), "time_s": clock.get(int(r["step"])), "consensus": float(value)}
        for r in records_by_rank[0]
        if (value := r.get("consensus", r.get("consensus_distance"))) is not None
    ]
    batch = int(summary.get("batch_size", 0))
    per_rank_s = [sum(float(r["step_s"]) * int(r.get("steps_in_record", 1)) for r in recs) for recs in records_by_rank]
    return {
        "samples_per_s": summary.get("samples_per_s"),
        "aggregate_samples_per_s": sum(batch * steps / s for s in per_rank_s if s > 0) or None,
        "time_to_target_s": ttt_s,
        "time_to_target_step": ttt_step,
        "final_accuracy": summary.get("test_accuracy"),
        "final_loss": summary.get("test_loss"),
        "mean_wait_s": summary.get("mean_wait_s"),
        "p95_wait_s": float(np.percentile(waits, 95)) if waits else None,
        "mean_step_s": summary.get("mean_step_s"),
        "mean_compute_s": summary.get("mean_compute_s"),
        "mean_imbalance_s": summary.get("mean_imbalance_s"),
        "global_reductions": summary.get("global_reductions"),
        "bytes_per_rank": _bytes_per_rank(records_by_rank, stats),
        "staleness_hist": _staleness_histogram(stats, records_by_rank),
        "consensus": consensus or None,
        "final_consensus": consensus[-1]["consensus"] if consensus else None,
        "accuracy_curve": curve,
        **compute_spread(records_by_rank),
        "train_s": summary.get("step_time_s"),  # the slowest rank's summed step times
        "wall_s": summary.get("wall_s"),
        "policy_stats": stats,
    }
