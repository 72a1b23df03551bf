"""One tuning budget for every policy: plan the sweeps, then pick each policy's setting by time to the target.

A comparison of policies is fair only if each was tuned with the same budget. Here every policy gets its
learning rate from x0.5 / x1 / x2 of the experiment's, crossed with up to two knobs of its own at two values each
(:data:`KNOBS`): at most 12 runs a policy, on one seed; the setting that reaches the target first is then
measured on other seeds. Both steps run ``python train.py -m`` (Hydra's multirun: any launcher, one job per
setting); this script writes the commands and reads what the jobs left.

    python benchmarks/tune.py plan --policies allreduce wagma local_sgd --seed 0 --out-dir /tmp/tune \\
        -- experiment=torch_source_lm nproc=8 rank_cpus=0.25 rank_net=200mbit eval_model=mean
    # run the printed commands (one sweep per policy), then:
    python benchmarks/tune.py pick /tmp/tune/* --target 2.974 --measure-seeds 1 2 3 \\
        --out benchmarks/results/cluster/tuning.json

``pick`` reads every job of the sweeps (``job.json``, ``summary.json`` and rank 0's evaluations, as
:func:`benchmarks.calibrate.curve` does) and, per policy (the job's ``averaging=`` override), chooses the job
that reached the target in the least training time; when none of a policy's jobs reached it, the one with the
lowest final test loss (marked ``reached: false``). The target is a test loss (bits per byte for a language
model, else nats), or with ``--accuracy`` a test accuracy to reach. It prints a table of every job, writes the
choices with the measuring command of each policy, and fails on a failed job (a budget that lost runs is not
the same budget).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout without installing

from benchmarks.calibrate import curve_in_unit  # noqa: E402
from wagma.app.sweep import collect  # noqa: E402

__all__ = ["KNOBS", "LR_FACTORS", "main", "pick", "plan", "time_to_target"]

#: The learning rate's share of every budget: factors of the experiment's ``optim.lr``.
LR_FACTORS = (0.5, 1.0, 2.0)

#: Each policy's own knobs (at most two, two values each; the config's default among them where it has one).
KNOBS: dict[str, dict[str, tuple[Any, ...]]] = {
    "allreduce": {},
    "local_sgd": {"averaging.period": (4, 16)},
    "hierarchical": {"averaging.local_period": (2, 4), "averaging.global_period": (16, 32)},
    "hierarchical_momentum": {"averaging.momentum": (0.5, 0.7), "averaging.global_period": (16, 32)},
    "wagma": {"averaging.group_size": (2, 4), "averaging.sync_period": (10, 20)},
    "wagma_relaxed": {"averaging.group_size": (2, 4), "averaging.sync_period": (10, 20)},
    "wagma_ahead_conserve": {"averaging.group_size": (2, 4), "averaging.sync_period": (10, 20)},
    "eager_solo_overlap_lookahead_local": {"averaging.sync_period": (16, 32)},
    "dpsgd": {"averaging.topology": ("ring", "exponential")},
    "sgp": {"averaging.warmup_steps": (0, 100)},
    "osgp": {"averaging.warmup_steps": (0, 100)},
    "adpsgd": {"averaging.warmup_steps": (0, 100)},
}


def _fail(name: str, expected: str, found: object) -> SystemExit:
    return SystemExit(f"tune.py: {name}: expected {expected}, found {found}")


def plan(policies: Sequence[str], lr: float, seed: int, out_dir: Path, base: Sequence[str]) -> list[str]:
    """One ``python train.py -m`` command per policy: its budget (:data:`LR_FACTORS` x :data:`KNOBS`) on ``seed``."""
    commands = []
    for policy in policies:
        if policy not in KNOBS:
            raise _fail("policy", f"one of {sorted(KNOBS)}", repr(policy))
        sweep = [f"optim.lr={','.join(f'{lr * f:g}' for f in LR_FACTORS)}"]
        sweep += [f"{key}={','.join(str(v) for v in values)}" for key, values in KNOBS[policy].items()]
        where = f"hydra.sweep.dir={out_dir / policy}"
        argv = ["python", "train.py", "-m", *base, f"averaging={policy}", *sweep, f"seed={seed}", where]
        commands.append(shlex.join(argv))
    return commands


def budget(policy: str) -> int:
    """The number of runs :func:`plan` gives ``policy``."""
    return len(LR_FACTORS) * math.prod(len(v) for v in KNOBS[policy].values())


def _override(overrides: Sequence[str], key: str) -> str | None:
    found = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+") == key]
    return found[-1] if found else None


def time_to_target(points: Sequence[dict[str, float]], target: float, accuracy: bool) -> float | None:
    """Training seconds at the first evaluation at or past ``target`` (loss at or below; accuracy at or above)."""
    for point in points:
        if (point["test_accuracy"] >= target) if accuracy else (point["test_loss"] <= target):
            return point["elapsed_s"]
    return None


def _job(row: dict[str, Any], target: float, accuracy: bool) -> dict[str, Any]:
    """One row of :func:`wagma.app.sweep.collect` as the pick sees it: policy, setting, time to ``target``, finals."""
    directory, overrides = Path(row["dir"]), list(row.get("overrides", []))
    policy = _override(overrides, "averaging")
    if row.get("exit") != 0:
        raise SystemExit(f"tune.py: job {directory} failed (exit {row.get('exit')}): {row.get('error')}")
    if policy is None:
        raise _fail(f"{directory}/job.json overrides", "an averaging=POLICY override", overrides)
    points, _unit = curve_in_unit(directory, row["summary"])  # bits per byte for a language model, as calibrated
    setting = [o for o in overrides if o.split("=", 1)[0] in {"optim.lr", *KNOBS.get(policy, {})}]
    return {
        "policy": policy,
        "setting": setting,
        "overrides": overrides,
        "dir": str(directory),
        "seconds": time_to_target(points, target, accuracy),
        "final_loss": points[-1]["test_loss"],
        "final_accuracy": points[-1]["test_accuracy"],
    }


def pick(sweeps: Sequence[Path], target: float, accuracy: bool = False) -> dict[str, dict[str, Any]]:
    """Per policy, every job of ``sweeps`` and the chosen one (module docstring)."""
    jobs = [_job(row, target, accuracy) for sweep in sweeps for row in collect(sweep)]
    if not jobs:
        raise _fail("sweep directories", "jobs (DIR/*/job.json)", f"none in {[str(s) for s in sweeps]}")
    chosen: dict[str, dict[str, Any]] = {}
    for policy, group in itertools.groupby(sorted(jobs, key=lambda j: j["policy"]), key=lambda j: j["policy"]):
        runs = list(group)
        reached = [j for j in runs if j["seconds"] is not None]
        if reached:
            best = min(reached, key=lambda j: j["seconds"])
        else:
            best = (
                max(runs, key=lambda j: j["final_accuracy"]) if accuracy else min(runs, key=lambda j: j["final_loss"])
            )
        chosen[policy] = {"chosen": best, "reached": bool(reached), "jobs": runs}
    return chosen


def _print(chosen: dict[str, dict[str, Any]]) -> None:
    print("| policy | setting | time to target (s) | final loss | final accuracy | chosen |")
    print("|---|---|---:|---:|---:|---|")
    for policy, entry in chosen.items():
        for job in sorted(entry["jobs"], key=lambda j: (j["seconds"] is None, j["seconds"] or 0.0)):
            seconds = "not reached" if job["seconds"] is None else f"{job['seconds']:.1f}"
            mark = "**yes**" if job is entry["chosen"] else ""
            print(
                f"| {policy} | {' '.join(job['setting'])} | {seconds} | {job['final_loss']:.4f} | "
                f"{100 * job['final_accuracy']:.2f} % | {mark} |"
            )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_plan = sub.add_parser("plan", help="print one tuning sweep per policy")
    p_plan.add_argument("--policies", nargs="+", default=sorted(KNOBS))
    p_plan.add_argument("--lr", type=float, default=None, help="the experiment's learning rate (default: composed)")
    p_plan.add_argument("--seed", type=int, default=0, help="the tuning seed (measure on others)")
    p_plan.add_argument("--out-dir", type=Path, required=True, help="one sweep directory per policy below this")
    p_plan.add_argument("base", nargs="*", help="train.py overrides every run shares (after --)")
    p_pick = sub.add_parser("pick", help="choose each policy's setting from finished sweeps")
    p_pick.add_argument("sweeps", nargs="+", type=Path)
    p_pick.add_argument("--target", type=float, required=True, help="test loss to reach (or accuracy: --accuracy)")
    p_pick.add_argument("--accuracy", action="store_true", help="the target is a test accuracy in [0, 1]")
    p_pick.add_argument("--measure-seeds", type=int, nargs="+", default=[1, 2, 3])
    p_pick.add_argument("--out", type=Path, default=None, help="write the choices and commands here (JSON)")
    args = parser.parse_args(argv)
    if args.command == "plan":
        lr = args.lr if args.lr is not None else _composed_lr(args.base)
        for policy, command in zip(args.policies, plan(args.policies, lr, args.seed, args.out_dir, args.base)):
            print(f"# {policy}: {budget(policy)} runs\n{command}")
        return 0
    chosen = pick(args.sweeps, args.target, args.accuracy)
    _print(chosen)
    seeds = ",".join(str(s) for s in args.measure_seeds)
    for policy, entry in chosen.items():
        keep = [o for o in entry["chosen"]["overrides"] if not o.startswith(("seed=", "hydra."))]
        entry["measure"] = shlex.join(["python", "train.py", "-m", *keep, f"seed={seeds}"])
        print(f"# {policy}{'' if entry['reached'] else ' (no run reached the target)'}\n{entry['measure']}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        command = "python benchmarks/tune.py " + shlex.join(sys.argv[1:] if argv is None else list(argv))
        record = {"command": command, "target": args.target, "accuracy": args.accuracy, "policies": chosen}
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


def _composed_lr(base: Sequence[str]) -> float:
    """``optim.lr`` of the application's config composed with ``base``."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        cfg = compose("config", overrides=[o for o in base if not o.startswith("hydra.")])
    return float(cfg.optim.lr)


if __name__ == "__main__":
    sys.exit(main())
