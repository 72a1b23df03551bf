"""A bf16 (or fp16) wire beside float32: accuracy at equal samples and bytes per rank, policy by policy.

    python benchmarks/wire.py                                   # digits/MLP and MNIST/CNN, P = 8, 3 seeds
    python benchmarks/wire.py --workloads digits:mlp --seeds 0 --steps 60 --out /tmp/wire   # a quick look

For each wire type (``float32``, then ``--wire``) it runs :mod:`benchmarks.accuracy` over the same grid (workloads,
world, scenario, seeds, policies, DDP included) with ``averaging.wire_dtype`` set for every policy, so both sides
see the same data, models, seeds and injected imbalance. Per workload and policy it sets the median final test
accuracy over the seeds on the narrow wire beside float32's, and the bytes each rank handed to collectives
(``bytes_per_rank`` of :mod:`benchmarks.run`, the policies' ``bytes_sent``). The target: half the bytes,
accuracy within 0.5 points of float32 at equal samples on digits and MNIST.

Outputs in ``--out``: ``wire.json.xz`` (xz-compressed JSON: the settings, every run's record, the comparison;
:func:`benchmarks.results_io.load` reads it) and ``wire.md``; each side's accuracy.py outputs (its plot dropped) in
``--out/<wire>/``; run.py's own outputs in ``--work`` (not committed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from a checkout without installing

from benchmarks import accuracy  # noqa: E402
from benchmarks.results_io import dump, load  # noqa: E402

TARGET_POINTS = 0.5  # the target: accuracy within 0.5 points of float32 at equal samples


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", nargs="+", default=["digits:mlp", "mnist:cnn"], metavar="DATASET:MODEL")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--scenario", default="random_k1")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument(
        "--policies",
        nargs="+",
        default=["wagma", "local_sgd", "reference/eager_majority"],
        help="configs/averaging/ names (DDP, allreduce, is always run, on the same wire)",
    )
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--wire", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/wire")
    p.add_argument("--work", type=Path, default=Path("/tmp/wagma-wire"))
    p.add_argument("--report-only", action="store_true", help="rewrite wire.json/md from the outputs already there")
    return p.parse_args(argv)


def _run_fields(work: Path) -> dict[tuple[str, str, int], dict[str, float]]:
    """(workload, policy, seed) -> bytes per rank and final test loss, from every run.py results.json under ``work``."""
    out: dict[tuple[str, str, int], dict[str, float]] = {}
    for path in sorted(work.glob("*/results.json")):
        data = json.loads(path.read_text())
        settings = data["settings"]
        workload = f"{settings['dataset']}:{settings['model']}"
        for record in data["records"]:
            if record.get("status") == "ok" and record.get("bytes_per_rank") is not None:
                out[(workload, record["policy"], int(settings["seed"]))] = {
                    "bytes": float(record["bytes_per_rank"]),
                    "loss": float(record["final_loss"]),
                }
    return out


def _side(args: argparse.Namespace, wire: str) -> dict[str, Any]:
    """Run (unless ``--report-only``) and read one wire type's grid."""
    out, work = args.out / wire, args.work / wire
    if not args.report_only:
        accuracy.main(
            [
                "--workloads",
                *args.workloads,
                "--worlds",
                str(args.world),
                "--scenarios",
                args.scenario,
                "--seeds",
                *map(str, args.seeds),
                "--steps",
                str(args.steps),
                "--policies",
                *args.policies,
                "--set",
                f"averaging.wire_dtype={'null' if wire == 'float32' else wire}",
                "--out",
                str(out),
                "--work",
                str(work),
            ]
        )
        (out / "accuracy_grid.png").unlink(missing_ok=True)  # one cell per side: wire.md says it all, in less space
    data = load(out / "accuracy.json.xz")
    return {
        "records": data["records"],
        "runs": _run_fields(work),
        "commands": data.get("commands"),
        "machine": data.get("machine"),
    }


def compare(wide: dict[str, Any], narrow: dict[str, Any], wire: str) -> list[dict[str, Any]]:
    """Per workload and policy: median accuracies, their gap in points, median bytes per rank and their ratio."""
    rows = []
    keys = sorted({(f"{r['dataset']}:{r['model']}", r["policy"]) for r in wide["records"]})
    for workload, policy in keys:

        def pick(side: dict[str, Any]) -> tuple[list[float], list[float], list[float]]:
            acc, sent, loss = [], [], []
            for r in side["records"]:
                if (
                    f"{r['dataset']}:{r['model']}" == workload  # noqa: B023 - pick is called in this iteration only
                    and r["policy"] == policy  # noqa: B023 - as above
                    and r["final_accuracy"] is not None
                ):
                    acc.append(100.0 * r["final_accuracy"])
                    run = side["runs"].get((workload, policy, int(r["seed"])))  # noqa: B023 - as above
                    if run is not None:
                        sent.append(run["bytes"])
                        loss.append(run["loss"])
            return acc, sent, loss

        acc32, bytes32, loss32 = pick(wide)
        acc16, bytes16, loss16 = pick(narrow)
        row: dict[str, Any] = {
            "workload": workload,
            "policy": policy,
            "seeds_float32": len(acc32),
            f"seeds_{wire}": len(acc16),
        }
        if acc32 and acc16:
            row["accuracy_float32"] = statistics.median(acc32)
            row[f"accuracy_{wire}"] = statistics.median(acc16)
            row["gap_points"] = row["accuracy_float32"] - row[f"accuracy_{wire}"]
            row["within_target"] = row["gap_points"] <= TARGET_POINTS
        if bytes32 and bytes16:
            row["bytes_per_rank_float32"] = statistics.median(bytes32)
            row[f"bytes_per_rank_{wire}"] = statistics.median(bytes16)
            row["bytes_ratio"] = row[f"bytes_per_rank_{wire}"] / row["bytes_per_rank_float32"]
            row["test_loss_float32"] = statistics.median(loss32)
            row[f"test_loss_{wire}"] = statistics.median(loss16)
        rows.append(row)
    return rows


def write_report(args: argparse.Namespace, rows: list[dict[str, Any]], sides: dict[str, Any]) -> None:
    wire = args.wire
    lines = [
        f"# {wire} wire beside float32: accuracy at equal samples, bytes per rank",
        "",
        f"`{' '.join(['python benchmarks/wire.py', *(a for a in sys.argv[1:] if a != '--report-only')])}`",
        "",
        *_machine_lines(sides),
        f"P = {args.world}, scenario {args.scenario}, {args.steps} steps, seeds {args.seeds}; medians over the seeds; "
        f"gap = float32's accuracy - {wire}'s (target <= {TARGET_POINTS} points); bytes: what each rank handed to "
        "collectives over the run (median).",
        "",
        f"| workload | policy | float32 acc (%) | {wire} acc (%) | gap (points) | float32 / {wire} test loss | "
        f"float32 MB/rank | {wire} MB/rank | bytes ratio |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:

        def num(key: str, fmt: str, scale: float = 1.0) -> str:
            return format(r[key] / scale, fmt) if key in r else "–"  # noqa: B023 - called in this iteration only

        lines.append(
            f"| {r['workload']} | {r['policy']} | {num('accuracy_float32', '.2f')} | "
            f"{num(f'accuracy_{wire}', '.2f')} | "
            f"{num('gap_points', '+.2f')} | {num('test_loss_float32', '.4f')} / {num(f'test_loss_{wire}', '.4f')} | "
            f"{num('bytes_per_rank_float32', '.1f', 1e6)} | "
            f"{num(f'bytes_per_rank_{wire}', '.1f', 1e6)} | {num('bytes_ratio', '.3f')} |"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "wire.md").write_text("\n".join(lines) + "\n")
    payload = {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "target_points": TARGET_POINTS,
        "comparison": rows,
        "records": {side: data["records"] for side, data in sides.items()},
    }
    dump(args.out / "wire.json.xz", json.loads(json.dumps(payload, default=str)))
    print("\n".join(lines))


def _machine_lines(sides: dict[str, Any]) -> list[str]:
    """Where and at which commits the sides ran (from their accuracy.json), or nothing if unrecorded."""
    lines = []
    for wire, data in sides.items():
        machine = data.get("machine") or {}
        commits = sorted(
            {
                str(r["commit"])[:10] + ("+dirty" if "dirty" in str(r["commit"]) else "")
                for r in data["records"]
                if r.get("commit")
            }
        )
        if machine or commits:
            lines.append(
                f"{wire}: {machine.get('cpu_count', '?')} CPUs ({machine.get('cpu_model', '?')}), torch "
                f"{machine.get('torch', '?')}, commit(s) {', '.join(commits) or '?'}.  "
            )
    return [*lines, ""] if lines else []


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    sides = {wire: _side(args, wire) for wire in ("float32", args.wire)}
    rows = compare(sides["float32"], sides[args.wire], args.wire)
    write_report(args, rows, sides)
    return rows


if __name__ == "__main__":
    main()
