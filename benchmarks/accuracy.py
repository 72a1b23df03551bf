"""Test accuracy at equal samples against DDP, on several datasets and seeds (issue 13 point 4).

For every (dataset, seed) it runs :mod:`benchmarks.run` once (every policy on the same data, model, seed and
injected imbalance, DDP first), then sets each policy's final test accuracy, taken at the same sample budget,
beside DDP's. The question it answers: does a policy that waits less still learn as well per sample?

Usage::

    python benchmarks/accuracy.py                      # digits and mnist, seeds 0 and 1 -> benchmarks/results/accuracy/
    python benchmarks/accuracy.py --datasets digits --seeds 0 --steps 60 --out /tmp/acc   # a quick look

Outputs in ``--out``: ``accuracy.json`` (``records``: dataset, seed, policy, final_accuracy, gap_points = DDP's
accuracy minus the policy's, in percentage points, samples; ``summary``: per policy the largest gap over datasets
and seeds; ``invocations``: every run.py command) and ``accuracy.md``. run.py's own outputs (its tables, plots and
per-run metrics) go to ``--work``, which is not committed.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout without installing

from benchmarks import run  # noqa: E402
from benchmarks.machine import machine_info  # noqa: E402
from benchmarks.scenarios import BASELINE  # noqa: E402

__all__ = ["main", "summarize"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Final test accuracy at equal samples, each policy against DDP")
    p.add_argument("--datasets", nargs="+", default=["digits", "mnist"], help="configs/data/ names")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--policies", nargs="+", default=["allreduce", "wagma", "wagma_relaxed", "wagma_relaxed_overlap"],
                   help="configs/averaging/ names (DDP is always run)")
    p.add_argument("--scenario", default="random_k1", help="benchmarks/scenarios.py name")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32, help="examples per rank and step")
    p.add_argument("--delay-s", type=float, default=0.02, help="the scenario's delay unit d")
    p.add_argument("--tolerance", type=float, default=1.0, help="the largest acceptable gap to DDP, in points")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/accuracy")
    p.add_argument("--work", type=Path, default=Path("/tmp/wagma-accuracy"), help="run.py's outputs (not committed)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or args.world < 2 or args.delay_s < 0 or args.tolerance < 0:
        p.error("need --steps >= 1, --batch-size >= 1, --world >= 2, --delay-s >= 0, --tolerance >= 0")
    args.policies = [BASELINE] + [q for q in dict.fromkeys(args.policies) if q != BASELINE]
    return args


def summarize(records: list[dict[str, Any]], tolerance: float) -> dict[str, dict[str, Any]]:
    """Per policy: the largest gap to DDP (points; positive: DDP was better), where, and whether it is within
    ``tolerance``. A policy with a failed run (no accuracy) is reported as such, never as within tolerance."""
    out: dict[str, dict[str, Any]] = {}
    for policy in dict.fromkeys(r["policy"] for r in records if r["policy"] != BASELINE):
        mine = [r for r in records if r["policy"] == policy]
        missing = [f"{r['dataset']}/seed {r['seed']}" for r in mine if r["gap_points"] is None]
        gaps = [r for r in mine if r["gap_points"] is not None]
        worst = max(gaps, key=lambda r: r["gap_points"], default=None)
        out[policy] = {
            "runs": len(mine), "missing": missing,
            "max_gap_points": None if worst is None else worst["gap_points"],
            "where": None if worst is None else f"{worst['dataset']}/seed {worst['seed']}",
            "within_tolerance": not missing and worst is not None and worst["gap_points"] <= tolerance,
        }
    return out


def _markdown(result: dict[str, Any]) -> str:
    s = result["settings"]
    lines = [
        "# Test accuracy at equal samples, against DDP",
        "",
        f"Command: `{result['command']}` (commit `{result['machine'].get('git_commit', '?')}`), {result['duration_s']:.0f} s.",
        "",
        f"{s['world']} gloo CPU ranks, {s['steps']} steps of batch {s['batch_size']} per rank ({s['samples']:,} samples), "
        f"`{s['scenario']}` with d = {1e3 * s['delay_s']:g} ms; each (dataset, seed) is one `benchmarks/run.py` "
        "invocation, every policy on the same data, model, seed and delays. Gap = DDP's accuracy minus the policy's "
        "(points; negative: the policy was better).",
        "",
        "| dataset | seed | policy | final accuracy | gap to DDP (points) |",
        "|---|---:|---|---:|---:|",
    ]
    for r in result["records"]:
        acc = "failed" if r["final_accuracy"] is None else f"{100 * r['final_accuracy']:.2f} %"
        gap = "" if r["policy"] == BASELINE else ("n/a" if r["gap_points"] is None else f"{r['gap_points']:+.2f}")
        lines.append(f"| {r['dataset']} | {r['seed']} | {r['policy']} | {acc} | {gap} |")
    lines += ["", f"Largest gap per policy (tolerance {s['tolerance']:g} point):", ""]
    for policy, v in result["summary"].items():
        if v["max_gap_points"] is None:
            lines.append(f"- {policy}: no accuracy (failed runs: {', '.join(v['missing'])})")
            continue
        verdict = "within" if v["within_tolerance"] else "NOT within"
        missing = f"; failed runs: {', '.join(v['missing'])}" if v["missing"] else ""
        lines.append(f"- {policy}: {v['max_gap_points']:+.2f} ({v['where']}), {verdict} tolerance{missing}")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run every (dataset, seed), write ``accuracy.json`` and ``accuracy.md``; return the JSON's contents."""
    args = parse_args(argv)
    started = time.perf_counter()
    records: list[dict[str, Any]] = []
    invocations: list[str] = []
    for dataset in args.datasets:
        for seed in args.seeds:
            run_argv = [
                "--world", str(args.world), "--policies", *args.policies, "--scenarios", args.scenario,
                "--dataset", dataset, "--seed", str(seed), "--steps", str(args.steps), "--batch-size", str(args.batch_size),
                "--step-s", str(args.delay_s), "--delay-s", str(args.delay_s),
                "--out", str(args.work / f"{dataset}_seed{seed}"),
            ]
            invocations.append("python benchmarks/run.py " + shlex.join(run_argv))
            print(f"== {dataset}, seed {seed}", flush=True)
            result = run.main(run_argv)
            found = {r["policy"]: r for r in result["records"] if r["scenario"] == args.scenario}
            ddp = found.get(BASELINE, {}).get("final_accuracy")
            for policy in args.policies:
                acc = found.get(policy, {}).get("final_accuracy")
                gap = None if acc is None or ddp is None else 100.0 * (ddp - acc)
                records.append({"dataset": dataset, "seed": seed, "policy": policy, "final_accuracy": acc,
                                "gap_points": gap, "scenario": args.scenario, "world_size": args.world})
    out = {
        "command": "python " + shlex.join([sys.argv[0], *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine_info(ROOT),
        "settings": {"world": args.world, "steps": args.steps, "batch_size": args.batch_size,
                     "samples": args.steps * args.batch_size * args.world,
                     "scenario": args.scenario, "delay_s": args.delay_s, "tolerance": args.tolerance,
                     "datasets": args.datasets, "seeds": args.seeds, "policies": args.policies},
        "invocations": invocations, "records": records, "summary": summarize(records, args.tolerance),
        "duration_s": time.perf_counter() - started,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "accuracy.json").write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    (args.out / "accuracy.md").write_text(_markdown(out), encoding="utf-8")
    for policy, v in out["summary"].items():
        print(f"{policy:<24} largest gap to DDP {v['max_gap_points'] if v['max_gap_points'] is not None else 'n/a'} "
              f"points ({v['where']}); within {args.tolerance:g}: {v['within_tolerance']}", flush=True)
    print(f"done in {out['duration_s']:.0f} s -> {args.out}")
    return out


if __name__ == "__main__":
    main()
