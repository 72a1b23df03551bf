"""Time to solution on the emulated cluster: allreduce first, then every other policy capped at its time.

Issue 50's campaign, one (rate, seed) at a time: every rank a device (``rank_cpus``) on a link of its own
(``rank_net``), the long task (``experiment=torch_source_lm``), each policy stopped at the target
(``stop_at_loss``) instead of its last step. Allreduce runs first; every other policy is capped at ``--cap`` times
allreduce's time to the target (``stop_after_s``): a run past the cap has lost the comparison, and how far it got
(its loss at the cap) is recorded. Every run may take up to ``--max-steps`` steps (the experiment's 2,000 are
allreduce's calibration, not a limit: a policy that steps faster but learns less per step needs more of them).
Each run is a ``python train.py -m`` job of its own (``OUT/RATE/pP/seedS/POLICY``; ``--nproc P`` ranks, each
with a quota of ``--rank-cpus``, by default this machine's cores / P); the table is built by
:func:`benchmarks.tune.pick` from the jobs' curves, so the time to the target is the training seconds
(evaluations included) at the first evaluation at or below it.

    python benchmarks/cluster_tts.py --rate 40mbit --seed 0 --policies allreduce wagma adpsgd \\
        --target 2.974 --out-dir /tmp/cluster --record benchmarks/results/cluster/tts_40mbit.json

A policy's extra overrides follow its name after a colon (``wagma:averaging.group_size=4``). Runs already done
(their ``job.json``) are kept: rerunning the command continues the campaign.

An allreduce run at the heavy rate takes about an hour; ``--base RECORD`` takes it (the cap's base and the table's
first row) from an earlier record of the same rate, seed, target and world instead of running it again. It first
reruns the base's first ``--check-steps`` steps here (one more, so that the check's evaluation is a periodic
one, its time included as in the base) and stops, saying by how much, unless this machine takes the
same training seconds to them (within ``--check-tolerance``) and reaches the same test loss (within 0.01 bits per
byte): the check and both machines are in the new record. Beside the record, a plot of every run's
test loss against training seconds with the target (``RECORD.png``); ``--plot-only RECORD`` redraws it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout without installing

from benchmarks.calibrate import curve_in_unit  # noqa: E402
from benchmarks.machine import load_average, machine_info  # noqa: E402
from benchmarks.tune import pick  # noqa: E402
from wagma.app.sweep import collect  # noqa: E402

__all__ = ["main", "plot", "run_command"]

#: What every run of the campaign shares besides its policy, world, rate, seed and caps.
#: ``eval_model=mean``: a policy's time to the target is its mean model's (what it would keep if it stopped there).
BASE = ("experiment=torch_source_lm", "eval_every=100", "eval_model=mean", "progress_every=100")


def run_command(
    policy: str,
    rate: str,
    seed: int,
    target: float,
    cap_s: float | None,
    sweep: Path,
    max_steps: int = 6000,
    nproc: int = 8,
    rank_cpus: float = 0.25,
) -> list[str]:
    """The ``python train.py -m`` command of one policy's run (``policy`` may carry ``:override,...``)."""
    name, _, extra = policy.partition(":")
    argv = [sys.executable, "train.py", "-m", *BASE, f"nproc={nproc}", f"rank_cpus={rank_cpus:g}"]
    argv += [f"steps={max_steps}", f"rank_net={rate}", f"averaging={name}"]
    argv.append(f"seed={seed}")
    argv += [o for o in extra.split(",") if o] + [f"stop_at_loss={target}"]
    if cap_s is not None:
        argv.append(f"stop_after_s={math.ceil(cap_s)}")
    return [*argv, f"hydra.sweep.dir={sweep}"]


def _run(argv: list[str], sweep: Path) -> None:
    if collect(sweep):
        print(f"# kept: {sweep}", flush=True)
        return
    print(shlex.join(argv), flush=True)
    started = time.monotonic()
    subprocess.run(argv, cwd=ROOT, check=True)
    print(f"# {sweep.name}: {time.monotonic() - started:.0f} s", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--plot-only", type=Path, default=None, metavar="RECORD", help="redraw RECORD's plot, run nothing"
    )
    parser.add_argument("--rate", help="every rank's link, e.g. 40mbit (required unless --plot-only)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--policies",
        nargs="+",
        default=["allreduce", "wagma", "adpsgd"],
        help="allreduce first, with its overrides if tuned (allreduce:optim.lr=0.002)",
    )
    parser.add_argument("--target", type=float, help="test loss in bits per byte (calibrate.py; required)")
    parser.add_argument("--cap", type=float, default=1.25, help="other policies' time limit / allreduce's time")
    parser.add_argument("--max-steps", type=int, default=6000, help="every run's steps (the stops end it sooner)")
    parser.add_argument("--nproc", type=int, default=8, help="ranks of every run (P)")
    parser.add_argument(
        "--rank-cpus", type=float, default=None, help="every rank's CPU quota (default: this machine's cores / P)"
    )
    parser.add_argument("--out-dir", type=Path, help="the runs go to OUT/RATE/pP/seedS/POLICY (required)")
    parser.add_argument("--record", type=Path, default=None, help="write the table and the commands here (JSON)")
    parser.add_argument(
        "--base", type=Path, default=None, metavar="RECORD", help="allreduce's run from RECORD (module docstring)"
    )
    parser.add_argument("--check-steps", type=int, default=100, help="--base: steps rerun to compare the machines")
    parser.add_argument(
        "--check-tolerance", type=float, default=0.05, help="--base: largest |seconds here / RECORD's - 1|"
    )
    args = parser.parse_args(argv)
    if args.plot_only is not None:
        print(plot(args.plot_only))
        return 0
    missing = [f"--{k.replace('_', '-')}" for k in ("rate", "target", "out_dir") if getattr(args, k) is None]
    if missing:
        raise SystemExit(f"cluster_tts.py: expected {', '.join(missing)} (or --plot-only RECORD), found none")
    if args.base is None and args.policies[0].partition(":")[0] != "allreduce":
        raise SystemExit(
            "cluster_tts.py: --policies: expected allreduce first (the cap's base; tuned: allreduce:optim.lr=...), "
            f"found {args.policies}"
        )
    if not args.cap > 0:
        raise SystemExit(f"cluster_tts.py: --cap: expected a number > 0, found {args.cap}")
    if args.nproc < 2:
        raise SystemExit(f"cluster_tts.py: --nproc: expected at least 2 ranks, found {args.nproc}")
    if args.rank_cpus is None:
        args.rank_cpus = (os.cpu_count() or 1) / args.nproc
    base_dir = _base_dir(args)
    machine = machine_info(ROOT)
    sweeps = [base_dir / policy.replace(":", "_").replace("=", "-").replace(",", "_") for policy in args.policies]
    commands, cap_s, base = [], None, None
    if args.base is not None:
        base = _base(args, base_dir)
        cap_s = args.cap * base["run"]["seconds"]
    for policy, sweep in zip(args.policies, sweeps):
        command = run_command(
            policy, args.rate, args.seed, args.target, cap_s, sweep, args.max_steps, args.nproc, args.rank_cpus
        )
        commands.append(shlex.join(["python", *command[1:]]))
        _run(command, sweep)
        if cap_s is None:
            allreduce = pick([sweep], args.target)["allreduce"]["chosen"]
            if allreduce["seconds"] is None:
                raise SystemExit(f"cluster_tts.py: allreduce did not reach {args.target} ({allreduce['dir']})")
            cap_s = args.cap * allreduce["seconds"]
    table = ([] if base is None else [base["run"]]) + _table(sweeps, args)
    for row in table:
        row["ratio"] = None if row["seconds"] is None else row["seconds"] / table[0]["seconds"]
    print(_markdown(table))
    if args.record is not None:
        record = {"rate": args.rate, "seed": args.seed, "target": args.target, "cap": args.cap}
        record |= {"nproc": args.nproc, "rank_cpus": args.rank_cpus, "machine": machine}
        record["load_at_end"] = load_average()
        if base is not None:
            record["base"] = {k: v for k, v in base.items() if k != "run"}
        record |= {"commands": commands, "runs": table}
        args.record.parent.mkdir(parents=True, exist_ok=True)
        args.record.write_text(json.dumps(record, indent=1) + "\n")
        print(plot(args.record))
    return 0


def _base_dir(args: argparse.Namespace) -> Path:
    """Where the campaign's runs go: ``OUT/RATE/pP/seedS``, one sweep directory per policy below it."""
    return args.out_dir / args.rate / f"p{args.nproc}" / f"seed{args.seed}"


def _at_step(curve: list[list[float]], step: int, what: str, where: Path) -> list[float]:
    """The point of ``curve`` (step, seconds, loss, accuracy) evaluated at ``step``; else stop, naming the steps."""
    at = next((c for c in curve if c[0] == step), None)
    if at is None:
        raise SystemExit(
            f"cluster_tts.py: {what}: expected an evaluation at step {step} in {where}, "
            f"found steps {[c[0] for c in curve]}"
        )
    return at


def _base(args: argparse.Namespace, base_dir: Path) -> dict[str, Any]:
    """``--base``: RECORD's allreduce run, once a rerun of its first ``--check-steps`` steps here matched it."""
    record = json.loads(args.base.read_text())
    wanted = {"rate": args.rate, "seed": args.seed, "target": args.target, "nproc": args.nproc}
    wanted["rank_cpus"] = args.rank_cpus
    differ = [f"{k}: {record.get(k)!r} there, {v!r} here" for k, v in wanted.items() if record.get(k) != v]
    if differ:
        raise SystemExit(f"cluster_tts.py: --base {args.base}: expected the same campaign; {'; '.join(differ)}")
    run = record["runs"][0]
    if not run["run"].startswith("allreduce") or run["seconds"] is None:
        raise SystemExit(
            f"cluster_tts.py: --base {args.base}: expected its first run to be allreduce at the target, "
            f"found {run['run']} at {run['seconds']}"
        )
    at = _at_step(run["curve"], args.check_steps, "--check-steps", args.base)
    keep = [o for o in run["overrides"] if o.split("=", 1)[0] not in {"steps", "stop_at_loss", "stop_after_s"}]
    sweep = base_dir / f"base_check_{args.check_steps}"
    # one step past the check, so that its evaluation is a periodic one as in RECORD's run, whose time
    # includes the evaluation; a run's final evaluation comes after its last step's time and would be faster
    steps = f"steps={args.check_steps + 1}"
    argv = [sys.executable, "train.py", "-m", *keep, steps, f"hydra.sweep.dir={sweep}"]
    _run(argv, sweep)
    # _table stops at a failed run, naming its directory
    here = _at_step(_table([sweep], args)[0]["curve"], args.check_steps, "--base check", sweep)
    check = {
        "command": shlex.join(["python", *argv[1:]]),
        "steps": args.check_steps,
        "seconds": here[1],
        "base_seconds": at[1],
        "ratio": here[1] / at[1],
        "test_loss": here[2],
        "base_test_loss": at[2],
    }
    print(
        f"# --base check: step {args.check_steps} at {check['seconds']} s here, {at[1]} s in {args.base} "
        f"(x{check['ratio']:.3f}); test loss {check['test_loss']} here, {at[2]} there",
        flush=True,
    )
    if abs(check["ratio"] - 1) > args.check_tolerance or abs(here[2] - at[2]) > 0.01:
        raise SystemExit(
            f"cluster_tts.py: --base {args.base}: expected this machine to match its allreduce run, found step "
            f"{args.check_steps} at {check['seconds']} s against {at[1]} s (x{check['ratio']:.3f}, tolerance "
            f"{args.check_tolerance}) and test loss {check['test_loss']} against {at[2]}; run allreduce here instead"
        )
    return {"record": str(args.base), "machine": record["machine"], "commands": record["commands"][:1]} | {
        "check": check,
        "run": run,
    }


def plot(record_path: Path) -> Path:
    """Every run's test loss against training seconds, and the target, beside the record (``.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    record = json.loads(record_path.read_text())
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in record["runs"]:
        seconds = "not reached" if run["seconds"] is None else f"{run['seconds']:.0f} s"
        ax.plot(
            [c[1] for c in run["curve"]], [c[2] for c in run["curve"]], marker=".", label=f"{run['run']} ({seconds})"
        )
    ax.axhline(record["target"], color="grey", linestyle="--", label=f"target {record['target']}")
    ax.set(xlabel="training seconds", ylabel="test loss (bits per byte)")
    world = f"P = {record.get('nproc', 8)}, {record.get('rank_cpus', 0.25):g} core a rank"  # older records: P = 8
    ax.set_title(f"{world}, {record['rate']} links, seed {record['seed']}")
    ax.legend()
    fig.tight_layout()
    out = record_path.with_suffix(".png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _table(sweeps: list[Path], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per run: its time to the target (None: not reached by the cap), steps, and its
    curve (step, training seconds, test loss in bits per byte, accuracy at each evaluation)."""
    rows = []
    base_dir = _base_dir(args)
    for sweep in sweeps:
        (entry,) = pick([sweep], args.target).values()
        job = entry["chosen"]
        summary = json.loads((Path(job["dir"]) / "summary.json").read_text())
        rows.append(
            {
                "run": sweep.relative_to(base_dir).as_posix(),  # reference/wagma_overlap: its folder kept
                "overrides": job["overrides"],
                "seconds": job["seconds"],
                "steps": summary["steps"],
                "stopped": summary["stopped"],
                "final_loss": job["final_loss"],
                "samples_per_s": summary["samples_per_s"],
                "mean_wait_s": summary["mean_wait_s"],
                "dir": job["dir"],
                "curve": [
                    [p["step"], round(p["elapsed_s"], 1), round(p["test_loss"], 4), round(p["test_accuracy"], 4)]
                    for p in curve_in_unit(Path(job["dir"]), summary)[0]
                ],
            }
        )
    return rows


def _markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| run | time to target (s) | x allreduce | steps | final loss (bits/byte) | samples/s | wait ms/step |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        seconds = "not reached" if r["seconds"] is None else f"{r['seconds']:.0f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(
            f"| {r['run']} | {seconds} | {ratio} | {r['steps']} | {r['final_loss']:.3f} | "
            f"{r['samples_per_s']:.1f} | {1e3 * r['mean_wait_s']:.0f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
