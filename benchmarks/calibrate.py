"""The target of a time-to-solution campaign, picked from an allreduce run before the campaign (and said so).

    python train.py experiment=torch_source_lm averaging=allreduce nproc=8 run_dir=RUN          # the calibration
    python train.py experiment=torch_source_lm averaging=allreduce nproc=8 run_dir=RUN resume=true steps=3000
    python benchmarks/calibrate.py RUN --at 2000 --out benchmarks/results/cluster/calibration.json

Reads rank 0's periodic evaluations (``metrics_rank0.jsonl``) and the final one from the summary of a finished
``train.py`` run and prints its learning curve: test loss (in bits per byte for a language model, in nats otherwise)
and test accuracy against steps and training seconds. The target is the loss the run reached at step ``--at``
(``--slack`` above it: a policy that ends within it has reached it); ``still_improving`` says whether the run's last
evaluation is lower than the one at ``--at``, i.e. whether allreduce still gets better past the target, as a task
where throughput decides must. Writes the curve and the target to ``--out`` (JSON) with the command and the machine.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout without installing

from benchmarks.machine import machine_info  # noqa: E402
from wagma.app.metrics import read_metrics  # noqa: E402

__all__ = ["curve", "curve_in_unit", "main", "target"]


def curve(run_dir: Path, summary: dict[str, Any]) -> list[dict[str, float]]:
    """Rank 0's evaluations in step order, then the final one (the summary's, at the last record's
    ``elapsed_s``): ``step``, ``elapsed_s``, ``test_loss``, ``test_accuracy``."""
    records = read_metrics(run_dir, 0)
    points = {
        int(r["step"]): {
            "step": int(r["step"]),
            "elapsed_s": float(r["elapsed_s"]),
            "test_loss": float(r["test_loss"]),
            "test_accuracy": float(r["test_accuracy"]),
        }
        for r in records
        if r.get("test_loss") is not None
    }
    last = int(summary["steps"])
    points[last] = {
        "step": last,
        "elapsed_s": float(records[-1]["elapsed_s"]) if records else float(summary["train_s"]),
        "test_loss": float(summary["test_loss"]),
        "test_accuracy": float(summary["test_accuracy"]),
    }
    return [points[s] for s in sorted(points)]


def curve_in_unit(run_dir: Path, summary: dict[str, Any]) -> tuple[list[dict[str, float]], str]:
    """:func:`curve`, its test loss in bits per byte for a language model (the summary has ``test_bits_per_byte``),
    else in nats; and that unit."""
    points = curve(run_dir, summary)
    if "test_bits_per_byte" not in summary:
        return points, "nats"
    return [pt | {"test_loss": pt["test_loss"] / math.log(2)} for pt in points], "bits/byte"


def target(points: Sequence[dict[str, float]], at: int, slack: float) -> dict[str, Any]:
    """The target from the evaluation at step ``at`` (module docstring).

    Raises:
        ValueError: no evaluation at ``at``.
    """
    at_point = next((p for p in points if p["step"] == at), None)
    if at_point is None:
        raise ValueError(f"no evaluation at step {at}; evaluated at {[int(p['step']) for p in points]}")
    last = points[-1]
    return {
        "at_step": at,
        "loss_at_step": at_point["test_loss"],
        "target_loss": at_point["test_loss"] + slack,
        "slack": slack,
        "last_step": int(last["step"]),
        "last_loss": last["test_loss"],
        "still_improving": last["step"] > at and last["test_loss"] < at_point["test_loss"],
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description="a campaign's target from an allreduce run's learning curve")
    p.add_argument("run_dir", type=Path, help="a finished train.py run (its metrics_rank0.jsonl and summary.json)")
    p.add_argument("--at", type=int, required=True, help="the step whose test loss sets the target")
    p.add_argument("--slack", type=float, default=0.0, help="added to that loss (in the curve's unit)")
    p.add_argument("--out", type=Path, default=None, help="write the curve and the target here (JSON)")
    args = p.parse_args(argv)
    summary = json.loads((args.run_dir / "summary.json").read_text())
    points, unit = curve_in_unit(args.run_dir, summary)
    try:
        chosen = target(points, args.at, args.slack)
    except ValueError as err:
        p.error(str(err))
    for pt in points:
        print(
            f"step {pt['step']:>6}  {pt['elapsed_s']:8.1f} s  test loss {pt['test_loss']:.4f} {unit}  "
            f"accuracy {100 * pt['test_accuracy']:.2f} %"
        )
    print(
        f"target: {chosen['target_loss']:.4f} {unit} (step {args.at}: {chosen['loss_at_step']:.4f}, slack "
        f"{args.slack:g}); at step {chosen['last_step']}: {chosen['last_loss']:.4f}, "
        f"{'still improving' if chosen['still_improving'] else 'NOT improving'} past step {args.at}"
    )
    result = {
        "run": {k: summary.get(k) for k in ("policy", "world_size", "dataset", "model", "steps", "data_digest")},
        "unit": unit,
        "curve": points,
        "target": chosen,
    }
    if args.out is not None:
        command = "python benchmarks/calibrate.py " + " ".join(sys.argv[1:] if argv is None else argv)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {"command": command, "machine": machine_info(ROOT)} | result
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
