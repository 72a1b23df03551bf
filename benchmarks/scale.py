"""Scale by simulation: validate :mod:`benchmarks.simulate` against the real runs, then extrapolate to 1,024 ranks.

1. **Validation.** For every record of ``regime.json`` (:mod:`benchmarks.regime`) the simulated ms/step
   (the simulator replayed on that run's own recorded traces, with the collectives calibrated in that world
   and the ranks sharing the machine's cores) is set beside the measured one; the target is agreement
   within 10 %. Beside it, the same run simulated as if every rank had its own cores (the wall-clock trace
   and an idle world's wall-clock network): what the shared-cores model adds.
2. **Extrapolation** to P = 64 ... 1,024 in the WAGMA paper's setting (docs/design.md §4): ResNet-50, 25.6 M
   parameters (102.4 MB of fp32 gradients or weights), forward + backward ``--compute-s`` (0.35 s, the
   middle of the quoted 0.3-0.4 s) on every rank, Cray Aries (``--bandwidth-GBps`` 10 GB/s injection,
   ``--alpha-us`` 3 µs latency), each step random ranks drawn with a shared seed sleep 320 ms: 2 ranks
   whatever P (``k2``, the reference scripts' count) and P/32 ranks (``frac``, the same 2-of-64 fraction).
   WAGMA with S = 8, τ = 10 as in the paper; the other policies with ``configs/averaging/`` defaults, the
   decentralized baselines (D-PSGD on a ring, SGP, OSGP, AD-PSGD) included: their messages carry the model, each
   ``alpha + n / bw`` on its sender's link (shared by the messages it sends at once).
   A round's activation costs ``2 alpha ceil(log2 P)`` (a tree broadcast).

Usage::

    python benchmarks/scale.py                                   # -> benchmarks/results/simulation.{json,md}, plots
    python benchmarks/scale.py --worlds 64 128 --steps 33 --out /tmp/sim   # a quick look

Outputs: ``simulation.json`` (``records``: policy, world_size, scenario, simulated_ms always,
measured_ms where a real run exists, ratios; ``validation``: status and worst error; ``setting``),
``simulation.md``, ``simulation_scale.png`` and, with validation records, ``simulation_vs_measured.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from benchmarks import results_io  # noqa: E402
from benchmarks.machine import machine_info  # noqa: E402
from benchmarks.presets import averaging_option  # noqa: E402
from benchmarks.simulate import Network, simulate  # noqa: E402
from wagma.app.imbalance import RandomK  # noqa: E402

__all__ = ["main", "paper_policies", "paper_records", "validation_records"]

POLICIES: tuple[str, ...] = (
    "allreduce",
    "local_sgd",
    "hierarchical",
    "wagma",
    "eager_solo",
    "eager_majority",
    "dpsgd",
    "sgp",
    "osgp",
    "adpsgd",
)
DECENTRALIZED: tuple[str, ...] = ("dpsgd", "sgp", "osgp", "adpsgd")
"""The decentralized baselines a claim may be measured against (a claim's ``versus``)."""
CLAIMS: tuple[dict[str, Any], ...] = (
    {
        "policy": "wagma",
        "claim": 2.1,
        "what": "WAGMA-SGD throughput over the best decentralized baseline at 1,024 GPUs "
        "(deep RL, DD-PPO on Habitat; that baseline already preempts the slowest ~40 % of workers)",
        "world_size": 1024,
        "versus": list(DECENTRALIZED),
    },
    {
        "policy": "eager_solo",
        "claim": 1.29,
        "what": "eager-SGD over synchronous SGD, ResNet-50 / ImageNet",
        "world_size": 64,
    },
    {"policy": "eager_solo", "claim": 1.27, "what": "eager-SGD over synchronous SGD, LSTM / UCF101", "world_size": 64},
)
TOLERANCE = 0.10


def paper_policies(configs: Path = ROOT / "configs") -> dict[str, dict[str, Any]]:
    """The policies' ``averaging`` options from ``configs/averaging/`` (seed 0); WAGMA with S = 8, τ = 10."""
    out = {}
    for name in POLICIES:
        option = averaging_option(name, configs)  # eager_solo is a reference, not shipped: reference/eager_solo
        options = OmegaConf.to_container(OmegaConf.load(configs / "averaging" / f"{option}.yaml"), resolve=False)
        assert isinstance(options, dict)
        options = {k: (0 if k == "seed" else v) for k, v in options.items()}
        out[name] = options
    out["wagma"] |= {"group_size": 8, "sync_period": 10, "schedule": "auto"}
    return out


def _delays(world: int, k: int, steps: int, delay_s: float, seed: int) -> np.ndarray:
    """The ``(P, steps)`` delays of :class:`wagma.app.imbalance.RandomK` (the library's own shared-seed draw)."""
    draw = RandomK(0, world, k=k, delay_s=delay_s, seed=seed)
    d = np.zeros((world, steps))
    for s in range(steps):
        d[sorted(draw.delayed_ranks(s)), s] = delay_s
    return d


def paper_records(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Simulated ms/step of every policy at every P of ``args.worlds`` in the paper's setting."""
    policies = paper_policies()
    nbytes = 4.0 * args.params
    records = []
    for variant in ("k2", "frac"):
        for world in args.worlds:
            k = 2 if variant == "k2" else max(1, world // 32)
            delays = _delays(world, k, args.steps, args.delay_s, args.seed)
            alpha = args.alpha_us * 1e-6
            net = Network(alpha, args.bandwidth_GBps * 1e9, 2 * alpha * math.ceil(math.log2(world)))
            ideal_ms = 1e3 * (args.compute_s + float(delays.mean()))
            ddp_ms = None
            for name in args.policies:
                t0 = time.perf_counter()
                ms = simulate(policies[name], args.compute_s + delays, network=net, nbytes=nbytes).ms_per_step
                ddp_ms = ms if name == "allreduce" else ddp_ms
                records.append(
                    {
                        "source": "paper_setting",
                        "scenario": f"random_{variant}",
                        "delayed_ranks": k,
                        "policy": name,
                        "world_size": world,
                        "params": args.params,
                        "compute_ms": 1e3 * args.compute_s,
                        "simulated_ms": ms,
                        "measured_ms": None,
                        "ideal_ms": ideal_ms,
                        "x_allreduce": ddp_ms / ms if ddp_ms else None,
                        "x_ideal": ideal_ms / ms,
                        "sim_seconds": time.perf_counter() - t0,
                    }
                )
                rec = records[-1]
                print(
                    f"paper random_{variant:<4} P={world:<5} {name:<15} {ms:7.1f} ms/step  "
                    f"x allreduce {rec['x_allreduce'] or float('nan'):.2f}  [{rec['sim_seconds']:.1f} s]",
                    flush=True,
                )
    return records


def validation_records(regime: dict[str, Any]) -> list[dict[str, Any]]:
    """Measured vs simulated ms/step for every successful record of a ``regime.json``."""
    out = []
    for r in regime.get("records", []):
        if r.get("status") != "ok":
            continue
        error = r["simulated_ms"] / r["ms_per_step"] - 1.0
        own = r.get("simulated_own_cores_ms")
        out.append(
            {
                "source": "validation",
                "scenario": r["scenario"],
                "policy": r["policy"],
                "world_size": r["world_size"],
                "params": r["params"],
                "compute_ms": r["compute_ms"],
                "measured_ms": r["ms_per_step"],
                "simulated_ms": r["simulated_ms"],
                "relative_error": error,
                "within_tolerance": abs(error) <= TOLERANCE,
                # The model of ranks with cores of their own on the same run, for comparison (absent in older records).
                "cores": r.get("cores"),
                "simulated_own_cores_ms": own,
                "own_cores_error": None if own is None else own / r["ms_per_step"] - 1.0,
                "cpu_ms": r.get("cpu_ms"),
                "modeled_cpu_ms": r.get("modeled_cpu_ms"),
            }
        )
    return out


def _validation_status(
    records: list[dict[str, Any]], regime_path: Path, regime: dict[str, Any] | None
) -> dict[str, Any]:
    full = regime_path.resolve()
    shown = full.relative_to(ROOT) if full.is_relative_to(ROOT) else regime_path
    if not records:
        return {
            "status": f"pending: no measured records in {shown} yet; run benchmarks/regime_campaign.sh on a "
            "quiet machine, then this script",
            "tolerance": TOLERANCE,
        }
    worst = max(records, key=lambda r: abs(r["relative_error"]))
    inside = sum(r["within_tolerance"] for r in records)
    own = [r["own_cores_error"] for r in records if r.get("own_cores_error") is not None]
    extra = (
        f" (as if every rank had its own cores: {sum(abs(e) <= TOLERANCE for e in own)} of {len(own)})" if own else ""
    )
    return {
        "status": f"{inside} of {len(records)} within ±{TOLERANCE:.0%}{extra}",
        "tolerance": TOLERANCE,
        "worst": {k: worst[k] for k in ("scenario", "policy", "world_size", "relative_error")},
        "regime": str(shown),
        "regime_commands": [i["command"] for i in (regime or {}).get("invocations", [])],
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Validate the simulator against regime.json, extrapolate to 1,024 ranks")
    p.add_argument(
        "--regime",
        type=Path,
        default=ROOT / "benchmarks/results/regime/regime.json.xz",
        help="the measured campaign (regime.json or regime.json.xz)",
    )
    p.add_argument("--worlds", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--steps", type=int, default=66, help="simulated steps (6 WAGMA periods, 2 eager periods)")
    p.add_argument("--params", type=int, default=25_600_000, help="ResNet-50: 25.6 M")
    p.add_argument("--compute-s", type=float, default=0.35, help="forward + backward per step (0.3-0.4 s)")
    p.add_argument("--delay-s", type=float, default=0.32, help="the injected delay (320 ms)")
    p.add_argument("--alpha-us", type=float, default=3.0, help="network latency (Aries: a few µs)")
    p.add_argument("--bandwidth-GBps", type=float, default=10.0, help="injection bandwidth per node (Aries ~10 GB/s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/simulation")
    p.add_argument(
        "--validate-only",
        action="store_true",
        help="only redo the validation; keep the paper-setting records of --out's simulation.json",
    )
    args = p.parse_args(argv)
    if args.steps < 1 or min(args.worlds) < 2 or args.compute_s <= 0:
        p.error("need --steps >= 1, worlds >= 2, --compute-s > 0")
    args.policies = ["allreduce"] + [q for q in args.policies if q != "allreduce"]
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Write ``simulation.json``, ``simulation.md`` and the plots; return the JSON's contents."""
    args = parse_args(argv)
    started = time.perf_counter()
    regime = results_io.load(args.regime) if args.regime.exists() else None
    validation = validation_records(regime or {})
    setting = {
        k: getattr(args, k)
        for k in ("worlds", "steps", "params", "compute_s", "delay_s", "alpha_us", "bandwidth_GBps", "seed")
    } | {"policies": paper_policies()}
    previous = args.out / "simulation.json"
    if args.validate_only and previous.exists():  # keep the extrapolation already there (and its setting)
        old = json.loads(previous.read_text(encoding="utf-8"))
        paper = [r for r in old["records"] if r["source"] == "paper_setting"]
        setting = old["setting"] | {"paper_records_from": old["command"]}
    else:
        paper = paper_records(args)
    records = validation + paper
    result = {
        "command": "python " + shlex.join([sys.argv[0], *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine_info(ROOT),
        "setting": setting,
        "validation": _validation_status(validation, args.regime, regime),
        "claims": list(CLAIMS),
        "records": records,
        "duration_s": time.perf_counter() - started,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "simulation.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    from benchmarks import scale_report  # matplotlib only when reporting

    scale_report.write_all(args.out, result)
    print(f"validation: {result['validation']['status']}; done in {result['duration_s']:.0f} s -> {args.out}")
    return result


if __name__ == "__main__":
    main()
