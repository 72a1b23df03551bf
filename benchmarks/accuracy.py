"""Test accuracy at equal samples against DDP, over a grid of workloads, worlds, scenarios, quotas and seeds.

For every cell of the grid -- a workload (dataset and model), a world size P, an imbalance scenario, a per-rank
CPU quota (``--rank-cpus``, 0: none), a per-rank link rate (``--rank-net``, 0: loopback) -- and every seed it runs
:mod:`benchmarks.run` once: every policy on the same data, model, seed and injected imbalance, DDP first. Per cell
and policy it takes the median over the seeds of the final test accuracy and sets it beside DDP's median: the gap
in points. The question it answers: does a policy that waits less still learn as well per sample, everywhere it
ships? A policy passes when its gap is at most ``--tolerance`` in every cell and none of its runs failed. Records
carry ``rank_cpus`` and ``rank_net``; an older record without them ran without a quota, on loopback.

Usage::

    python benchmarks/accuracy.py                     # the default grid -> benchmarks/results/accuracy/
    python benchmarks/accuracy.py --workloads digits:mlp --worlds 4 --scenarios random_k1 --seeds 0 \\
        --steps 60 --out /tmp/acc                    # a quick look

The grid is long (hours): ``accuracy.json`` is rewritten after every run.py invocation, and ``--resume``
skips the (cell, seed) invocations it already holds, so an interrupted grid continues where it stopped;
with ``--retry-failed`` it runs those in which DDP or a policy failed again.
Outputs in ``--out``: ``accuracy.json.xz`` (xz-compressed JSON, :func:`benchmarks.results_io.load` reads it; an
older plain ``accuracy.json`` is read and converted) (``records``: one per cell, seed and policy with its final
accuracy, the gap to DDP of that seed, throughput, staleness and fresh fraction; ``cells``: per cell and policy the
medians; ``summary``: per policy the worst median gap and whether every cell is within tolerance;
``invocations``: every run.py command) and ``accuracy.md``. run.py's own outputs (tables, plots, per-run
metrics) go to ``--work``, which is not committed.

The delay unit d is fixed (``--delay-s``, 20 ms by default: about a quarter of a P = 8 MNIST/CNN step on the
2-core VM) rather than measured, so every cell's scenario means the same sleeps whatever its world size.
Evaluations are collective and re-synchronise the ranks, as do consensus measurements: the grid evaluates
every ``--eval-every`` steps (100 by default, the application's default) and measures no consensus, so that
staleness builds up as it does in a user's run.
"""

from __future__ import annotations

import argparse
import math
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout without installing

from benchmarks import results_io, run  # noqa: E402
from benchmarks.machine import machine_info  # noqa: E402
from benchmarks.presets import averaging_option  # noqa: E402
from benchmarks.scenarios import BASELINE, SCENARIOS  # noqa: E402
from wagma.app.network import check_rank_net, rate_name  # noqa: E402

__all__ = ["cell_key", "main", "parse_args", "pivot", "summarize", "summarize_cells", "validated_staleness"]

DEFAULT_POLICIES = (
    "allreduce",
    "local_sgd",
    "hierarchical",
    "hierarchical_momentum",
    "wagma",
    "wagma_relaxed",
    "wagma_relaxed_overlap",
    "eager_solo",
    "eager_majority",
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Final test accuracy at equal samples, each policy against DDP, over a grid"
    )
    p.add_argument(
        "--workloads",
        nargs="+",
        default=["mnist:cnn"],
        metavar="DATASET:MODEL",
        help="configs/data and configs/model names, e.g. mnist:cnn digits:mlp",
    )
    p.add_argument("--worlds", type=int, nargs="+", default=[8, 16], help="world sizes P")
    p.add_argument(
        "--scenarios",
        nargs="+",
        default=["random_k1", "random_k2", "persistent", "heavy_tail"],
        choices=SCENARIOS,
        help="benchmarks/scenarios.py names",
    )
    p.add_argument(
        "--rank-cpus",
        type=float,
        nargs="+",
        default=[0.0],
        help="per-rank CPU quotas to run each cell with (0: none; see the app's rank_cpus)",
    )
    p.add_argument(
        "--rank-net",
        nargs="+",
        default=["0"],
        help="per-rank link rates to run each cell with, e.g. 200mbit (0: loopback; see the app's rank_net)",
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument(
        "--policies", nargs="+", default=list(DEFAULT_POLICIES), help="configs/averaging/ names (DDP is always run)"
    )
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=32, help="examples per rank and step")
    p.add_argument("--delay-s", type=float, default=0.02, help="the scenarios' delay unit d")
    p.add_argument("--eval-every", type=int, default=100, help="steps between (collective) test evaluations")
    p.add_argument("--tolerance", type=float, default=1.0, help="the largest acceptable median gap to DDP, in points")
    p.add_argument(
        "--target",
        type=float,
        default=None,
        help="time to solution: a target test accuracy in (0, 1]; adds each policy's training time and "
        "samples to reach it (medians over the seeds) and the accuracy-against-time plot",
    )
    p.add_argument(
        "--set",
        dest="extra",
        action="append",
        default=[],
        metavar="OVERRIDE",
        help="extra Hydra override for every run (repeatable)",
    )
    p.add_argument("--resume", action="store_true", help="keep the records in --out's accuracy.json, run the rest")
    p.add_argument(
        "--retry-failed",
        action="store_true",
        help="with --resume: run again every (cell, seed) invocation in which DDP or a policy failed "
        "(its records are replaced)",
    )
    p.add_argument("--report-only", action="store_true", help="rewrite accuracy.json/md from its records, run nothing")
    p.add_argument(
        "--allow-dirty",
        action="store_true",
        help="run from a tree whose code differs from its commit (records then name COMMIT+dirty); "
        "without it the grid refuses to start, so that every result names the code that produced it",
    )
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/accuracy")
    p.add_argument("--work", type=Path, default=Path("/tmp/wagma-accuracy"), help="run.py's outputs (not committed)")
    args = p.parse_args(argv)
    if (
        args.steps < 1
        or args.batch_size < 1
        or min(args.worlds) < 2
        or args.delay_s < 0
        or args.tolerance < 0
        or args.eval_every < 0
        or min(args.rank_cpus) < 0
        or not (args.target is None or 0 < args.target <= 1)
    ):
        p.error(
            "need --steps >= 1, --batch-size >= 1, --worlds >= 2, --delay-s >= 0, --tolerance >= 0, "
            "--eval-every >= 0, --rank-cpus >= 0, --target in (0, 1]"
        )
    try:
        args.rank_net = list(dict.fromkeys(rate_name(r) or "" for r in args.rank_net))  # "": loopback
    except ValueError as exc:
        p.error(f"--rank-net: {exc}")
    if args.retry_failed and not args.resume:
        p.error("--retry-failed: expected it with --resume (it reruns the failed invocations of the saved grid)")
    workloads = []
    for w in args.workloads:
        dataset, sep, model = w.partition(":")
        if not sep or not dataset or not model:
            p.error(f"--workloads: expected DATASET:MODEL such as mnist:cnn, found {w!r}")
        workloads.append((dataset, model))
    args.workloads = workloads
    args.policies = [BASELINE] + [q for q in dict.fromkeys(args.policies) if q != BASELINE]
    return args


def cell_key(r: dict[str, Any]) -> tuple[str, str, int, str, float, str]:
    """The grid cell of a record: (dataset, model, world_size, scenario, rank_cpus, rank_net); a record without
    ``rank_cpus`` had no quota (0.0), one without ``rank_net`` ran on loopback (``""``)."""
    return (
        r["dataset"],
        r["model"],
        int(r["world_size"]),
        r["scenario"],
        float(r.get("rank_cpus") or 0.0),
        str(r.get("rank_net") or ""),
    )


def _cell_name(key: tuple[str, str, int, str, float, str]) -> str:
    dataset, model, world, scenario, cpus, net = key
    name = f"{dataset}/{model} P={world} {scenario}"
    return name + (f" quota {cpus:g}" if cpus else "") + (f" net {net}" if net else "")


def accuracy_at(curve: list[dict[str, float]] | None, time_s: float) -> float | None:
    """The test accuracy a run had reached ``time_s`` seconds into training: its last evaluation at or before then
    (None without a curve or before its first evaluation)."""
    if not curve:
        return None
    reached = [p["accuracy"] for p in curve if p.get("accuracy") is not None and p["time_s"] <= time_s + 1e-9]
    return reached[-1] if reached else None


def to_target(
    curve: list[dict[str, float]] | None, target: float, world: int, batch_size: int
) -> tuple[float | None, float | None]:
    """(training seconds, samples) at the first evaluation of ``curve`` at or above ``target``; Nones when it never
    got there. Samples as the curve counted them (batches by tokens vary), else step x P x batch size."""
    for point in curve or []:
        if point.get("accuracy") is not None and point["accuracy"] >= target:
            return point["time_s"], point.get("samples", point["step"] * world * batch_size)
    return None, None


def _median_reached(values: list[float | None]) -> float | None:
    """The median with a run that never reached the target counted as slower than all: None when half or more
    of the runs never reached it."""
    ranked = sorted(values, key=lambda v: math.inf if v is None else v)
    if not ranked:
        return None
    mid = ranked[(len(ranked) - 1) // 2 : len(ranked) // 2 + 1]
    return None if any(v is None for v in mid) else statistics.median(mid)


def equal_time_accuracies(records: list[dict[str, Any]]) -> None:
    """Store in every record its ``equal_time_s``, the training time of the first policy of its (cell, seed)
    invocation to finish (every policy there had run that long), and its ``equal_time_accuracy`` then."""
    groups: dict[tuple[Any, int], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((cell_key(r), r["seed"]), []).append(r)
    for members in groups.values():
        ends = [r["accuracy_curve"][-1]["time_s"] for r in members if r.get("accuracy_curve")]
        equal_s = min(ends) if ends else None
        for r in members:
            r["equal_time_s"] = equal_s
            r["equal_time_accuracy"] = None if equal_s is None else accuracy_at(r.get("accuracy_curve"), equal_s)


def summarize_cells(
    records: list[dict[str, Any]], target: float | None = None, batch_size: int | None = None
) -> list[dict[str, Any]]:
    """Per cell and policy: the median final accuracy over the seeds beside DDP's, and the gap of the medians;
    with a ``target``, the median training time and samples to reach it (:func:`to_target`), and the time's ratio
    to DDP's.

    A policy's failed run (no accuracy) is counted in ``missing`` and its median is over the seeds that ran.
    """
    out: list[dict[str, Any]] = []
    equal_time_accuracies(records)  # stored with the records, beside their curves
    if target is not None:
        for r in records:
            r["time_to_target_s"], r["samples_to_target"] = to_target(
                r.get("accuracy_curve"), target, int(r["world_size"]), int(batch_size or 0)
            )
    for key in dict.fromkeys(cell_key(r) for r in records):
        mine = [r for r in records if cell_key(r) == key]
        ddp = [r["final_accuracy"] for r in mine if r["policy"] == BASELINE and r["final_accuracy"] is not None]
        ddp_median = statistics.median(ddp) if ddp else None
        ddp_eq = [
            r["equal_time_accuracy"]
            for r in mine
            if r["policy"] == BASELINE and r.get("equal_time_accuracy") is not None
        ]
        ddp_eq_median = statistics.median(ddp_eq) if ddp_eq else None
        ddp_tts = _median_reached([r.get("time_to_target_s") for r in mine if r["policy"] == BASELINE])
        for policy in dict.fromkeys(r["policy"] for r in mine):
            runs = [r for r in mine if r["policy"] == policy]
            accs = [r["final_accuracy"] for r in runs if r["final_accuracy"] is not None]
            median = statistics.median(accs) if accs else None

            def med(field: str) -> float | None:
                vals = [r[field] for r in runs if r.get(field) is not None]  # noqa: B023 - called in this iteration only
                return statistics.median(vals) if vals else None

            out.append(
                {
                    "cell": _cell_name(key),
                    "dataset": key[0],
                    "model": key[1],
                    "world_size": key[2],
                    "scenario": key[3],
                    "rank_cpus": key[4],
                    "rank_net": key[5] or None,
                    "policy": policy,
                    "seeds": sorted(r["seed"] for r in runs),
                    "missing": sorted(r["seed"] for r in runs if r["final_accuracy"] is None),
                    "median_accuracy": median,
                    "ddp_median_accuracy": ddp_median,
                    "gap_points": None if median is None or ddp_median is None else _points(ddp_median - median),
                    "median_samples_per_s": med("samples_per_s"),
                    "median_ddp_ratio": med("ddp_ratio"),
                    "median_staleness": med("staleness"),
                    "max_run_staleness": max(
                        (r["staleness"] for r in runs if r.get("staleness") is not None), default=None
                    ),
                    "min_run_staleness": min(
                        (r["staleness"] for r in runs if r.get("staleness") is not None), default=None
                    ),
                    "max_staleness": max(
                        (r["staleness_max"] for r in runs if r.get("staleness_max") is not None), default=None
                    ),
                    "median_fresh_fraction": med("fresh_fraction"),
                    "median_equal_time_accuracy": (eq := med("equal_time_accuracy")),
                    "equal_time_gap_points": None
                    if eq is None or ddp_eq_median is None
                    else _points(ddp_eq_median - eq),
                    "median_equal_time_s": med("equal_time_s"),
                    "median_compute_max_over_median": med("compute_max_over_median"),
                    "median_compute_cv": med("compute_cv"),
                }
                | (
                    {}
                    if target is None
                    else {
                        "target": target,
                        "reached": sum(r.get("time_to_target_s") is not None for r in runs),
                        "median_time_to_target_s": (tts := _median_reached([r.get("time_to_target_s") for r in runs])),
                        "median_samples_to_target": _median_reached([r.get("samples_to_target") for r in runs]),
                        "time_to_target_x_ddp": None if tts is None or not ddp_tts else tts / ddp_tts,
                    }
                )
            )
    return out


def _points(difference: float) -> float:
    """An accuracy difference in points, rounded to 1e-6 point: accuracies are counts over a test set, so what
    lies below that is float noise (0.964 - 0.954 is 1.0000000000000009 points, and 1.00 is within 1 point)."""
    return round(100.0 * difference, 6)


def validated_staleness(cells: list[dict[str, Any]], tolerance: float) -> float | None:
    """The ``validated_staleness`` a preset's config should carry from these cells of its own.

    1.1 x the largest run-mean staleness among the cells where it held its accuracy (gap <= ``tolerance``), rounded
    up to 0.05, but never at or above the lowest run-mean staleness of a run in a cell where it lost it: a preset is
    not validated at a staleness it lost accuracy at (the bound then stays below that run's, rounded down to 0.05,
    and held cells at or above it do not count). 0.0 when it lost accuracy and held it at no lower staleness: no
    staleness is validated, and the guard warns on every stale run. None when it reports no staleness.
    """
    lost = [
        c.get("min_run_staleness", c.get("max_run_staleness"))
        for c in cells
        if c["gap_points"] is not None and c["gap_points"] > tolerance
    ]
    lost = [s for s in lost if s is not None]
    held = [
        c["max_run_staleness"]
        for c in cells
        if c["gap_points"] is not None and c["gap_points"] <= tolerance and c.get("max_run_staleness")
    ]
    if not lost:
        return math.ceil(1.1 * max(held) / 0.05 - 1e-9) * 0.05 if held else None
    below = min(lost)
    held = [h for h in held if h < below]
    cap = max(0.0, math.ceil(below / 0.05 - 1e-9) * 0.05 - 0.05)  # the largest multiple of 0.05 below it
    return min(cap, math.ceil(1.1 * max(held) / 0.05 - 1e-9) * 0.05) if held else 0.0


def summarize(cells: list[dict[str, Any]], tolerance: float) -> dict[str, dict[str, Any]]:
    """Per policy: the largest median gap to DDP over the cells (positive: DDP was better), where, whether every
    cell is within ``tolerance``, and the :func:`validated_staleness` its preset should carry.

    The grid is every cell DDP ran, with DDP's seeds. A policy is within tolerance only where it has a gap in every
    one of them, for every seed: a failed run, a seed it did not run (``missing``) or a cell it never ran
    (``absent``) is reported as such, never as within tolerance.
    """
    grid = {c["cell"]: c["seeds"] for c in cells if c["policy"] == BASELINE}
    out: dict[str, dict[str, Any]] = {}
    for policy in dict.fromkeys(c["policy"] for c in cells if c["policy"] != BASELINE):
        mine = [c for c in cells if c["policy"] == policy]
        missing = [f"{c['cell']}/seed {s}" for c in mine for s in c["missing"]]
        missing += [
            f"{c['cell']}/seed {s} (not run)" for c in mine for s in grid.get(c["cell"], []) if s not in c["seeds"]
        ]
        gaps = [c for c in mine if c["gap_points"] is not None]
        missing += [c["cell"] for c in mine if c["gap_points"] is None and not c["missing"]]
        absent = [cell for cell in grid if cell not in {c["cell"] for c in mine}]
        worst = max(gaps, key=lambda c: c["gap_points"], default=None)
        out[policy] = {
            "cells": len(mine),
            "grid_cells": len(grid),
            "missing": missing,
            "absent": absent,
            "max_gap_points": None if worst is None else worst["gap_points"],
            "where": None if worst is None else worst["cell"],
            "within_tolerance": not missing
            and not absent
            and worst is not None
            and len(gaps) == len(mine)
            and worst["gap_points"] <= tolerance,
            "validated_staleness": (None if (v := validated_staleness(mine, tolerance)) is None else round(v, 2)),
        }
    return out


def _num(value: float | None, fmt: str, scale: float = 1.0) -> str:
    return "–" if value is None else format(scale * value, fmt)


def _markdown(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [
        "# Test accuracy at equal samples, against DDP",
        "",
        "Commands (one grid, resumed; each record keeps the commit its invocation ran):",
        "",
        *[f"    {c}" for c in result["commands"]],
        "",
        f"{result['duration_s'] / 60:.0f} min of runs on {result['machine'].get('cpus_usable', '?')} usable cores "
        f"(commit at the last write: `{result['machine'].get('git_commit', '?')}`).",
        "",
        f"gloo CPU ranks, {s['steps']} steps of batch {s['batch_size']} per rank (P x {s['steps'] * s['batch_size']:,} "
        f"samples), delay unit d = {1e3 * s['delay_s']:g} ms, test evaluations every {s['eval_every']} steps. "
        "Each (cell, seed) is one `benchmarks/run.py` invocation, every policy on the same data, model, seed and "
        "delays. Accuracy: the median over the seeds of the final test accuracy; gap = DDP's median minus the "
        "policy's (points; negative: the policy was better); x DDP: median samples/s ratio to DDP in the same "
        "invocation; staleness: median of the runs' mean (max over the runs) as the policy reports it; fresh: "
        "median fresh fraction. "
        "At equal time: each run's test accuracy at its last evaluation within the training time of the invocation's "
        "first policy to finish (median over the seeds; gap to DDP's at that time), where the records carry "
        "accuracy curves.",
        "",
        "At a glance: per policy and cell, the median gap to DDP (points) / median samples/s x DDP (DDP's row: its",
        "median accuracy):",
        "",
        pivot(result["cells"]),
        "",
        "Every cell:",
        "",
        "| cell | policy | seeds | accuracy | gap | x DDP | staleness (max) | fresh | at equal time (gap) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in result["cells"]:
        seeds = ",".join(str(x) for x in c["seeds"]) + (f" (failed: {c['missing']})" if c["missing"] else "")
        gap = "" if c["policy"] == BASELINE else _num(c["gap_points"], "+.2f")
        stale = "–" if c["median_staleness"] is None else f"{c['median_staleness']:.2f} ({c['max_staleness']})"
        eq = c.get("median_equal_time_accuracy")
        eq_text = (
            "–"
            if eq is None
            else f"{100 * eq:.2f}"
            + (
                ""
                if c["policy"] == BASELINE or c.get("equal_time_gap_points") is None
                else f" ({c['equal_time_gap_points']:+.2f})"
            )
        )
        lines.append(
            f"| {c['cell']} | {c['policy']} | {seeds} | {_num(c['median_accuracy'], '.2f', 100)} | {gap} | "
            f"{_num(c['median_ddp_ratio'], '.2f')} | {stale} | {_num(c['median_fresh_fraction'], '.2f')} | {eq_text} |"
        )
    if s.get("target") is not None:
        lines += [
            "",
            f"Time to solution: training time (the slowest rank's summed step times, evaluations excluded) "
            f"and samples until the first evaluation at or above {100 * s['target']:g} % test accuracy; medians "
            "over the seeds, a run that never got there counted as slowest ('–': half or more never did); "
            "x DDP: the median time over DDP's. compute max/median: per step, the slowest rank's own compute "
            "(forward, backward, optimizer step; no waiting) over the median rank's, averaged over the steps "
            "after the fifth; CV: the coefficient of variation of every (rank, step) compute time.",
            "",
            "| cell | policy | reached | time to target (s) | x DDP | samples to target | final accuracy | "
            "at equal time | samples/s x DDP | compute max/median (CV) |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for c in result["cells"]:
            eq = c.get("median_equal_time_accuracy")
            lines.append(
                f"| {c['cell']} | {c['policy']} | {c.get('reached', 0)}/{len(c['seeds'])} | "
                f"{_num(c.get('median_time_to_target_s'), '.1f')} | {_num(c.get('time_to_target_x_ddp'), '.2f')} | "
                f"{_num(c.get('median_samples_to_target'), ',.0f')} | {_num(c['median_accuracy'], '.2f', 100)} | "
                f"{_num(eq, '.2f', 100)} | {_num(c['median_ddp_ratio'], '.2f')} | "
                f"{_num(c.get('median_compute_max_over_median'), '.2f')} ({_num(c.get('median_compute_cv'), '.2f')}) |"
            )
    lines += [
        "",
        "Staleness of every contribution (rounds; WAGMA: group rounds, eager-SGD: gradient rounds), summed over "
        "the seeds whose records carry a histogram:",
        "",
        staleness_distribution(result["records"]),
    ]
    lines += ["", f"Largest median gap per policy over the cells (tolerance {s['tolerance']:g} point):", ""]
    for policy, v in result["summary"].items():
        if v["max_gap_points"] is None:
            lines.append(f"- {policy}: no accuracy (failed runs: {', '.join(v['missing'])})")
            continue
        verdict = "within" if v["within_tolerance"] else "NOT within"
        missing = f"; failed or incomplete: {', '.join(v['missing'])}" if v["missing"] else ""
        if v.get("absent"):
            missing += f"; never ran {len(v['absent'])} of the grid's {v['grid_cells']} cells: {', '.join(v['absent'])}"
        bound = "" if v.get("validated_staleness") is None else f"; validated_staleness {v['validated_staleness']:g}"
        lines.append(f"- {policy}: {v['max_gap_points']:+.2f} ({v['where']}), {verdict} tolerance{missing}{bound}")
    return "\n".join(lines) + "\n"


def pivot(cells: list[dict[str, Any]]) -> str:
    """A Markdown table, one row per policy and one column per cell: the median gap to DDP (points) / median
    samples/s x DDP, in the same runs (DDP's row: its median accuracy)."""
    names = list(dict.fromkeys(c["cell"] for c in cells))
    lines = ["| policy | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for policy in dict.fromkeys(c["policy"] for c in cells):
        row = []
        for name in names:
            c = next((c for c in cells if c["cell"] == name and c["policy"] == policy), None)
            if c is None:
                row.append("")
            elif policy == BASELINE:
                row.append(f"{_num(c['median_accuracy'], '.2f', 100)} %")
            else:
                row.append(f"{_num(c['gap_points'], '+.2f')} / {_num(c['median_ddp_ratio'], '.2f')}x")
        lines.append(f"| {policy} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def staleness_distribution(records: list[dict[str, Any]]) -> str:
    """A Markdown table of the staleness of every contribution, per cell and policy, summed over the seeds whose
    records carry a histogram: the share of contributions 0, 1, 2, 3 and >= 4 rounds old, the mean and the max
    (policies whose contributions were all fresh are left out)."""
    rows: dict[tuple[str, str], dict[int, int]] = {}
    seeds: dict[tuple[str, str], set[int]] = {}
    for r in records:
        hist = r.get("staleness_hist") or {}
        if not sum(hist.values()):
            continue
        key = (_cell_name(cell_key(r)), r["policy"])
        total = rows.setdefault(key, {})
        for k, v in hist.items():
            total[int(k)] = total.get(int(k), 0) + int(v)
        seeds.setdefault(key, set()).add(int(r["seed"]))
    lines = ["| cell | policy | seeds | 0 | 1 | 2 | 3 | >= 4 | mean | max |", "|---|---|---:|" + "---:|" * 7]
    for (cell, policy), hist in rows.items():
        if max(hist) == 0:
            continue  # only fresh contributions: a synchronous policy
        n = sum(hist.values())
        share = [hist.get(k, 0) / n for k in range(4)] + [sum(v for k, v in hist.items() if k >= 4) / n]
        mean = sum(k * v for k, v in hist.items()) / n
        lines.append(
            f"| {cell} | {policy} | {','.join(map(str, sorted(seeds[(cell, policy)])))} | "
            + " | ".join(f"{100 * x:.0f} %" for x in share)
            + f" | {mean:.2f} | {max(hist)} |"
        )
    return "\n".join(lines)


def _failed(record: dict[str, Any]) -> bool:
    """Whether ``record``'s run failed (not skipped): its status says so, or, in records written before they kept
    a status, it is DDP's without an accuracy (DDP is never skipped)."""
    if "status" in record:
        return record["status"] == "failed"
    return record["policy"] == BASELINE and record["final_accuracy"] is None


def _record(result: dict[str, Any], policy: str, scenario: str) -> dict[str, Any] | None:
    return next((r for r in result["records"] if r["scenario"] == scenario and r["policy"] == policy), None)


def _staleness(rec: dict[str, Any] | None) -> tuple[float | None, int | None]:
    hist = (rec or {}).get("staleness_hist") or {}
    count = sum(hist.values())
    if not count:
        return None, None
    return sum(int(k) * v for k, v in hist.items()) / count, max(int(k) for k in hist)


def plot(cells: list[dict[str, Any]], tolerance: float, path: Path) -> bool:
    """Scatter of every (policy, cell): samples/s x allreduce against the gap to allreduce, one colour per policy.

    Returns False (and draws nothing) without matplotlib.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("accuracy: matplotlib is not installed (pip install -e '.[bench]'), so no plot", flush=True)
        return False
    fig, ax = plt.subplots(figsize=(9.0, 4.2))
    policies = [p for p in dict.fromkeys(c["policy"] for c in cells) if p != BASELINE]
    for i, policy in enumerate(policies):
        pts = [
            (c["median_ddp_ratio"], c["gap_points"])
            for c in cells
            if c["policy"] == policy and c["median_ddp_ratio"] is not None and c["gap_points"] is not None
        ]
        if pts:
            option = averaging_option(policy, ROOT / "configs")  # reference/ or candidate/: not shipped
            shipped = "/" not in option
            ax.scatter(
                *zip(*pts),
                label=policy if shipped else f"{policy} ({option.split('/')[0]}, not shipped)",
                marker="o" if shipped else "x",
                color=f"C{i % 10}",
                s=28,
            )
    ax.axhline(tolerance, color="grey", linestyle="--", linewidth=1)
    ax.text(
        ax.get_xlim()[0],
        tolerance,
        f" shipping bound: {tolerance:g} point below allreduce",
        va="bottom",
        fontsize=8,
        color="grey",
    )
    ax.axhline(0.0, color="black", linewidth=0.6)
    ax.axvline(1.0, color="black", linewidth=0.6)
    ax.invert_yaxis()  # better accuracy up
    ax.set_xlabel("samples/s x allreduce (same runs)")
    ax.set_ylabel("points below allreduce (median of seeds)")
    ax.set_title(
        f"Accuracy grid: {len(dict.fromkeys(c['cell'] for c in cells))} cells, each point one policy in one cell",
        fontsize=10,
    )
    if ax.get_legend_handles_labels()[0]:  # none while every gap is missing (DDP failed in every seed so far)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    results_io.save_plot(fig, path)
    plt.close(fig)
    return True


def plot_curves(records: list[dict[str, Any]], target: float, path: Path) -> bool:
    """Test accuracy against training time, one panel per cell, one curve per policy: at each evaluation the median
    over the seeds of the accuracy and of the time; the target as a line. False (nothing drawn) without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("accuracy: matplotlib is not installed (pip install -e '.[bench]'), so no plot", flush=True)
        return False
    cells = list(dict.fromkeys(cell_key(r) for r in records))
    fig, axes = plt.subplots(1, len(cells), figsize=(6.0 * len(cells), 4.2), squeeze=False)
    for ax, key in zip(axes[0], cells):
        mine = [r for r in records if cell_key(r) == key and r.get("accuracy_curve")]
        for i, policy in enumerate(dict.fromkeys(r["policy"] for r in mine)):
            curves = [r["accuracy_curve"] for r in mine if r["policy"] == policy]
            n = min(len(c) for c in curves)
            t = [statistics.median(c[j]["time_s"] for c in curves) for j in range(n)]
            a = [100 * statistics.median(c[j]["accuracy"] for c in curves) for j in range(n)]
            ax.plot(t, a, marker=".", color=f"C{i % 10}", label=policy, linewidth=2.2 if policy == BASELINE else 1.2)
        ax.axhline(100 * target, color="grey", linestyle="--", linewidth=1)
        ax.set_title(_cell_name(key), fontsize=10)
        ax.set_xlabel("training time (s, slowest rank)")
        ax.set_ylabel("test accuracy (%), median of seeds")
        ax.set_ylim(max(0.0, 100 * target - 30), 100 * min(1.0, target + 0.1))
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    results_io.save_plot(fig, path)
    plt.close(fig)
    return True


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run every (cell, seed) not yet recorded, write ``accuracy.json``, ``accuracy.md`` and ``accuracy_grid.png``;
    return the JSON's contents."""
    args = parse_args(argv)
    started = time.perf_counter()
    command = "python " + shlex.join(["benchmarks/accuracy.py", *(sys.argv[1:] if argv is None else argv)])
    found = results_io.find(args.out, "accuracy.json")  # accuracy.json.xz, or an older plain accuracy.json
    saved = args.out / "accuracy.json.xz"
    records: list[dict[str, Any]] = []
    invocations: list[str] = []
    commands: list[str] = []
    earlier_s = 0.0
    old: dict[str, Any] = {}
    if (args.resume or args.report_only) and found.exists():
        old = results_io.load(found)
        records, invocations, earlier_s = old["records"], old["invocations"], float(old.get("duration_s", 0.0))
        commands = old.get("commands", [old["command"]] if "command" in old else [])
    if not args.report_only and command not in commands:
        commands.append(command)
    if args.retry_failed and not args.report_only:
        failed = {(cell_key(r), r["seed"]) for r in records if _failed(r)}
        records = [r for r in records if (cell_key(r), r["seed"]) not in failed]
        for key, seed in sorted(failed):
            print(f"== retrying {_cell_name(key)}, seed {seed}: a run of it failed", flush=True)
    done = {(cell_key(r), r["seed"]) for r in records}
    settings = {
        "steps": args.steps,
        "batch_size": args.batch_size,
        "delay_s": args.delay_s,
        "eval_every": args.eval_every,
        "tolerance": args.tolerance,
        "policies": args.policies,
        "extra_overrides": args.extra,
        "target": args.target,
    }
    machine = machine_info(ROOT)
    commit = machine.get("git_commit")
    if not args.report_only and not args.allow_dirty and (commit is None or commit.endswith("+dirty")):
        raise SystemExit(
            f"benchmarks/accuracy.py: expected a checkout whose code is committed, found "
            f"{'no git commit' if commit is None else commit} (git status names the changes; results may differ): "
            "commit first, or pass --allow-dirty to record it as is"
        )
    if args.report_only and old:
        settings = old["settings"] | ({"target": args.target} if args.target is not None else {})  # the grid's own
        machine = old.get("machine", machine)  # the machine that ran the records, not the one redrawing the report

    def write() -> dict[str, Any]:
        cells = summarize_cells(records, settings.get("target"), settings["batch_size"])
        out = {
            "commands": commands,
            "machine": machine,
            "settings": settings,
            "invocations": list(dict.fromkeys(invocations)),  # a retried invocation is the same command: once
            "records": records,
            "cells": cells,
            "summary": summarize(cells, args.tolerance),
            "duration_s": earlier_s + (0.0 if args.report_only else time.perf_counter() - started),
        }
        args.out.mkdir(parents=True, exist_ok=True)
        results_io.dump(saved, out)
        if found != saved and found.exists():
            found.unlink()  # converted to the compressed file
        (args.out / "accuracy.md").write_text(_markdown(out), encoding="utf-8")
        plot(cells, args.tolerance, args.out / "accuracy_grid.png")
        if settings.get("target") is not None:
            plot_curves(records, settings["target"], args.out / "accuracy_vs_time.png")
        return out

    out = write() if records else {}
    if args.report_only:
        return out
    grid = [
        (w, p, s, q, net, seed)
        for w in args.workloads
        for p in args.worlds
        for s in args.scenarios
        for q in args.rank_cpus
        for net in args.rank_net
        for seed in args.seeds
    ]
    for rate in {net for *_, net, _ in grid if net}:  # one line before the grid, not a failed cell per invocation
        if (problem := check_rank_net(rate, max(args.worlds), max(args.worlds))) is not None:
            raise SystemExit(f"benchmarks/accuracy.py: {problem}")
    for n, ((dataset, model), world, scenario, cpus, net, seed) in enumerate(grid, 1):
        key = (dataset, model, world, scenario, float(cpus), net)
        if (key, seed) in done:
            continue
        extra = [*args.extra, *([f"rank_cpus={cpus:g}"] if cpus else []), *([f"rank_net={net}"] if net else [])]
        run_argv = [
            "--world",
            str(world),
            "--policies",
            *args.policies,
            "--scenarios",
            scenario,
            "--dataset",
            dataset,
            "--model",
            model,
            "--seed",
            str(seed),
            "--steps",
            str(args.steps),
            "--batch-size",
            str(args.batch_size),
            "--step-s",
            str(args.delay_s),
            "--delay-s",
            str(args.delay_s),
            "--eval-every",
            str(args.eval_every),
            "--consensus-every",
            "0",
            *[a for o in extra for a in ("--set", o)],
            "--out",
            str(args.work / f"{dataset}_{model}_P{world}_{scenario}_q{cpus:g}{f'_n{net}' if net else ''}_seed{seed}"),
        ]
        invocations.append("python benchmarks/run.py " + shlex.join(run_argv))
        print(f"== [{n}/{len(grid)}] {_cell_name(key)}, seed {seed}", flush=True)
        commit = machine_info(ROOT).get("git_commit")  # the code this invocation runs (a long grid spans commits)
        result = run.main(run_argv)
        ddp = (_record(result, BASELINE, scenario) or {}).get("final_accuracy")
        for policy in args.policies:
            rec = _record(result, policy, scenario)
            acc = (rec or {}).get("final_accuracy")
            stats = (rec or {}).get("policy_stats") or {}
            mean_stale, max_stale = _staleness(rec)
            records.append(
                {
                    "dataset": dataset,
                    "model": model,
                    "world_size": world,
                    "scenario": scenario,
                    "rank_cpus": cpus,
                    "rank_net": net or None,
                    "seed": seed,
                    "policy": policy,
                    "final_accuracy": acc,
                    "gap_points": None if acc is None or ddp is None else _points(ddp - acc),
                    "samples_per_s": (rec or {}).get("samples_per_s"),
                    "ddp_ratio": (rec or {}).get("ddp_ratio"),
                    "staleness": mean_stale,
                    "staleness_max": max_stale,
                    "fresh_fraction": stats.get("fresh_fraction"),
                    "staleness_hist": (rec or {}).get("staleness_hist"),
                    "commit": commit,
                    "accuracy_curve": (rec or {}).get("accuracy_curve"),
                    "guard": (rec or {}).get("guard"),
                    "loss_curve": (rec or {}).get("loss_curve"),
                    "compute_max_over_median": (rec or {}).get("compute_max_over_median"),
                    "compute_cv": (rec or {}).get("compute_cv"),
                    "reason": (rec or {}).get("reason"),
                    "status": (rec or {}).get("status", "missing"),
                }
            )
        out = write()
    if not out:
        out = write()
    for policy, v in out["summary"].items():
        print(
            f"{policy:<24} largest median gap to DDP {_num(v['max_gap_points'], '+.2f')} points ({v['where']}); "
            f"within {args.tolerance:g}: {v['within_tolerance']}",
            flush=True,
        )
    print(f"done in {time.perf_counter() - started:.0f} s -> {args.out}")
    return out


if __name__ == "__main__":
    main()
