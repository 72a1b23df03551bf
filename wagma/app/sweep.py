"""A sweep in one command: ``python -m wagma.app.sweep averaging=allreduce,local_sgd,wagma imbalance=random_k``.

Every override whose value holds top-level commas (``key=a,b,c``; commas inside ``[...]``, ``(...)``,
``{...}`` or quotes do not count) is a sweep axis; the sweep runs one torchrun job per combination of the
axes (their Cartesian product, first axis slowest), one after the other, each into
``OUT/<n>_<key>-<value>_.../``, and prints a table of the jobs' summaries: policy, test accuracy,
throughput, time waited per step, global and local reductions, wall time. ``OUT`` is
``multirun/<date>/<time>`` unless ``--out`` says otherwise; ``OUT/sweep.json`` keeps every job's
overrides, exit status and summary. A failed job is reported in the table and the sweep goes on; the
exit status is then 1.

Why not Hydra's ``-m``: under torchrun every rank runs Hydra, so ``torchrun train.py -m ...`` would run
all jobs inside the same ranks, one process group after another, and Hydra's launchers start no torchrun
per job. This script starts a fresh torchrun (fresh processes, fresh rendezvous) per job instead.
"""

from __future__ import annotations

import datetime
import itertools
import json
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from wagma.app.run import argument_parser, run, stopping_signal, torchrun_command

__all__ = ["expand", "format_table", "main", "split_top_level"]

_CLOSERS = {"[": "]", "(": ")", "{": "}"}


def split_top_level(value: str) -> list[str]:
    """Split ``value`` at commas outside brackets and quotes: ``"a,[1,2],b"`` -> ``["a", "[1,2]", "b"]``."""
    parts, depth, quote, start = [], [], "", 0
    for i, ch in enumerate(value):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in _CLOSERS:
            depth.append(_CLOSERS[ch])
        elif depth and ch == depth[-1]:
            depth.pop()
        elif ch == "," and not depth:
            parts.append(value[start:i])
            start = i + 1
    parts.append(value[start:])
    return parts


def expand(overrides: Sequence[str]) -> list[list[str]]:
    """The jobs of a sweep: one list of plain overrides per combination of the comma-valued ones.

    Raises:
        ValueError: for an empty value in a list (``averaging=a,,b``).
    """
    axes: list[list[str]] = []
    for override in overrides:
        key, sep, value = override.partition("=")
        values = split_top_level(value) if sep else [value]
        if sep and len(values) > 1:
            if any(not v.strip() for v in values):
                raise ValueError(f"sweep override {override!r} has an empty value between its commas")
            axes.append([f"{key}={v.strip()}" for v in values])
        else:
            axes.append([override])
    return [list(job) for job in itertools.product(*axes)]


def _job_name(index: int, job: Sequence[str], swept: set[str]) -> str:
    parts = [o for o in job if o.partition("=")[0] in swept] or ["job"]
    # Hydra's override grammar (hydra.run.dir=...) allows no '=' and few symbols in a path: keep it plain.
    label = re.sub(r"[^A-Za-z0-9._-]+", "_", "_".join(p.replace("=", "-") for p in parts))[:80]
    return f"{index:02d}_{label}"


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A plain-text table of sweep results (``rows``: ``{"job": label, "exit": status, "summary": ...}``)."""
    header = ("job", "policy", "acc %", "samples/s", "wait ms/step", "global red.", "local red.", "wall s")
    lines = [header]
    for row in rows:
        s = row.get("summary")
        if s is None:
            lines.append((str(row["job"]), f"failed (exit status {row['exit']})", "", "", "", "", "", ""))
            continue
        lines.append((
            str(row["job"]), str(s["policy"]), f"{100 * float(s['test_accuracy']):.2f}",
            f"{float(s['samples_per_s'] or 0.0):,.0f}", f"{1e3 * float(s['mean_wait_s'] or 0.0):.2f}",
            str(s["global_reductions"]), str(s.get("local_reductions", 0)), f"{float(s['wall_s']):.1f}",
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m wagma.app.sweep [--nproc N] [--out DIR] [--dry-run] [overrides...]``."""
    parser = argument_parser("wagma-sweep", "Run one torchrun job per combination of comma-separated override values.")
    parser.add_argument("--out", type=Path, default=None, help="sweep directory (default: multirun/<date>/<time>)")
    args = parser.parse_intermixed_args(argv)
    jobs = expand(args.overrides)
    swept = {o.partition("=")[0] for o in args.overrides if len(split_top_level(o.partition("=")[2])) > 1}
    now = datetime.datetime.now()
    out = args.out or Path("multirun") / now.strftime("%Y-%m-%d") / now.strftime("%H-%M-%S")
    names = [_job_name(i, job, swept) for i, job in enumerate(jobs)]
    if args.dry_run:
        for name, job in zip(names, jobs):
            print(" ".join(torchrun_command(job, out / name, args.nproc)))
        return 0
    rows: list[dict[str, Any]] = []
    for i, (name, job) in enumerate(zip(names, jobs)):
        print(f"[{i + 1}/{len(jobs)}] {' '.join(job) or '(defaults)'} -> {out / name}", flush=True)
        code, summary, _ = run(job, nproc=args.nproc, run_dir=out / name)
        rows.append({"job": name, "overrides": job, "exit": code, "summary": summary})
        out.mkdir(parents=True, exist_ok=True)
        (out / "sweep.json").write_text(json.dumps(rows, indent=2) + "\n")
        if (stopped := stopping_signal(code)) is not None:  # SIGTERM/Ctrl-C ends the sweep, not only this job
            print(f"wagma-sweep: stopped by {stopped.name} during {name}; results so far: {out / 'sweep.json'}",
                  file=sys.stderr)
            return code
    print("\n" + format_table(rows))
    print(f"\nsweep results: {out / 'sweep.json'}")
    return 0 if all(r["summary"] is not None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
