"""The end of a sweep (``python train.py -m ...``): a comparison table, ``sweep.json`` and plots.

:class:`SweepReport` is a Hydra callback (``hydra.callbacks.sweep_report`` in ``configs/config.yaml``). When a
multirun ends, it reads the ``job.json`` every job left in its directory (:mod:`wagma.app.run`) and the
job's ``summary.json``, prints a table (policy, test accuracy, throughput, time waited per step, global and
local reductions, wall time), writes all of it to ``<sweep dir>/sweep.json``, and draws
``accuracy_vs_time.png`` (test accuracy against the wall time of the training steps, one line per job) and
``throughput.png`` (samples/s per job) into the sweep directory; without matplotlib the plots are skipped
with one line. It works with every Hydra launcher, the SLURM one included, because it reads files, not
the jobs' return values. If a job failed, the sweep exits with status 1 after the report.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from wagma.app.deps import missing_dependency

__all__ = ["SweepReport", "collect", "format_table", "plot"]

#: The file each job of ``python train.py [-m]`` leaves in its directory (written by :mod:`wagma.app.run`).
JOB_FILE = "job.json"


def collect(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """One row per job of the sweep in ``sweep_dir``: ``job`` (label), ``overrides``, ``exit``, ``error``,
    ``summary``, ``dir``.

    Jobs are ordered by their number; a job's label is its number and the overrides that vary between jobs. A
    job's directory is found at any depth: Hydra names it after its overrides and keeps their slashes, so a job
    with ``averaging=reference/wagma_overlap`` lies in ``0_averaging=reference/wagma_overlap,...``.
    """
    jobs = []
    for path in Path(sweep_dir).rglob(JOB_FILE):
        record = json.loads(path.read_text())
        summary_path = path.parent / "summary.json"
        summary = json.loads(summary_path.read_text()) if record.get("exit") == 0 and summary_path.is_file() else None
        jobs.append(record | {"summary": summary, "dir": str(path.parent)})
    jobs.sort(key=lambda r: int(r.get("num", 0)))
    counts: dict[str, set[str]] = {}
    for job in jobs:
        for override in job.get("overrides", []):
            key, _, value = override.partition("=")
            counts.setdefault(key, set()).add(value)
    varying = {k for k, values in counts.items() if len(values) > 1 or len(jobs) == 1}
    for job in jobs:
        shown = [o for o in job.get("overrides", []) if o.partition("=")[0] in varying]
        job["job"] = f"{job.get('num', 0)}_" + (",".join(shown) or "defaults")
    return jobs


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A plain-text table of sweep results (``rows``: ``{"job": label, "exit": status, "summary": ...}``)."""
    header = ("job", "policy", "acc %", "samples/s", "wait ms/step", "global red.", "local red.", "wall s")
    lines = [header]
    for row in rows:
        s = row.get("summary")
        if s is None:
            lines.append((str(row["job"]), f"failed (exit status {row['exit']})", "", "", "", "", "", ""))
            continue
        lines.append(
            (
                str(row["job"]),
                str(s["policy"]),
                f"{100 * float(s['test_accuracy']):.2f}",
                f"{float(s['samples_per_s'] or 0.0):,.0f}",
                f"{1e3 * float(s['mean_wait_s'] or 0.0):.2f}",
                str(s["global_reductions"]),
                str(s.get("local_reductions", 0)),
                f"{float(s['wall_s']):.1f}",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def _accuracy_curve(row: Mapping[str, Any]) -> tuple[list[float], list[float]]:
    """(seconds of training, test accuracy) of one job: rank 0's periodic evaluations, then the final one.

    A record's time is its wall-clock ``time`` stamp relative to the start of the first step when records
    carry one, else the sum of ``step_s`` over the steps so far; the final evaluation sits at the last
    record's time (the summary's ``wall_s`` when there are no records).
    """
    summary = row["summary"]
    times, accuracies = [], []
    now = None
    path = Path(row["dir"]) / "metrics_rank0.jsonl"
    if path.is_file():
        elapsed, last_step, origin = 0.0, 0, None
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a killed rank
            step = int(rec.get("step", last_step))
            elapsed += float(rec.get("step_s") or 0.0) * max(step - last_step, 0)
            last_step = step
            stamp = rec.get("time")
            if isinstance(stamp, (int, float)):
                origin = float(stamp) - elapsed if origin is None else origin
                now = float(stamp) - origin
            else:
                now = elapsed
            if rec.get("test_accuracy") is not None:
                times.append(now)
                accuracies.append(100 * float(rec["test_accuracy"]))
    times.append(now if now is not None else float(summary["wall_s"]))
    accuracies.append(100 * float(summary["test_accuracy"]))
    return times, accuracies


def plot(rows: Sequence[Mapping[str, Any]], out_dir: str | Path) -> list[Path]:
    """Draw ``accuracy_vs_time.png`` and ``throughput.png`` of the finished jobs into ``out_dir``.

    Raises:
        ModuleNotFoundError: without matplotlib.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if r.get("summary") is not None]
    out = Path(out_dir)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in done:
        times, accuracies = _accuracy_curve(row)
        ax.plot(times, accuracies, marker="o", label=row["job"])
    ax.set_xlabel("training wall time (s)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("accuracy vs wall time")
    ax.grid(alpha=0.3)
    if done:
        ax.legend(fontsize="small")
    fig.tight_layout()
    accuracy_png = out / "accuracy_vs_time.png"
    fig.savefig(accuracy_png, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 0.5 * max(len(done), 2) + 1.5))
    labels = [f"{r['job']} ({r['summary']['policy']})" for r in done]
    ax.barh(labels, [float(r["summary"]["samples_per_s"] or 0.0) for r in done])
    ax.invert_yaxis()
    ax.set_xlabel("throughput (samples/s)")
    ax.set_title("throughput per job")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    throughput_png = out / "throughput.png"
    fig.savefig(throughput_png, dpi=120)
    plt.close(fig)
    return [accuracy_png, throughput_png]


def report(sweep_dir: str | Path) -> int:
    """Print the table of the sweep in ``sweep_dir``, write ``sweep.json`` and the plots; 1 if a job failed."""
    out = Path(sweep_dir)
    rows = collect(out)
    if not rows:
        print(f"wagma sweep: no job left a {JOB_FILE} in {out}", file=sys.stderr)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(rows, indent=2) + "\n")
    print("\n" + format_table(rows), flush=True)
    try:
        pngs = plot(rows, out)
        print(f"\nsweep results: {out / 'sweep.json'}; plots: {', '.join(str(p) for p in pngs)}", flush=True)
    except ImportError as exc:
        message = missing_dependency(exc, "the sweep's plots")
        if message is None:
            raise
        print(f"\nsweep results: {out / 'sweep.json'}; plots skipped: {message}", flush=True)
    return 0 if all(r.get("summary") is not None for r in rows) else 1


try:
    from hydra.experimental.callback import Callback
except ImportError:  # wagma.app needs Hydra anyway (train.py says so); keep this module importable without it
    Callback = object  # type: ignore[assignment,misc]


class SweepReport(Callback):
    """Hydra callback: :func:`report` on the sweep directory when a multirun ends (exit status 1 if a job failed)."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        code = report(config.hydra.sweep.dir)
        if code:
            sys.exit(code)
