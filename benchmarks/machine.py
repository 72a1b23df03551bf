"""What a benchmark result needs to be interpreted later: the machine, the software and the checkout."""

from __future__ import annotations

import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["RESULTS", "git_commit", "load_average", "machine_info", "scheduler_slice_s", "usable_cores"]


#: Where the benchmarks write what they measure: a change there is a result, not a change of the code that ran.
RESULTS = "benchmarks/results"


def git_commit(repo: Path) -> str | None:
    """HEAD of the checkout at ``repo``, with ``+dirty`` when tracked files other than the results
    (:data:`RESULTS`, which a benchmark writing into them changes as it runs) differ from it; None outside git."""
    try:
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            [
                "git",
                "-C",
                str(repo),
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ".",
                f":(exclude){RESULTS}",
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (the machine may be shared), or None where unsupported."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def usable_cores() -> int:
    """The cores this process (and the processes it forks) may run on: its CPU affinity where the OS has one."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _spin(duration_s: float, gap_s: float, out: Any) -> None:
    """Read the clock in a loop for ``duration_s``; put the lengths of the stretches it ran without a gap longer than
    ``gap_s`` (being descheduled), the first and last left out as cut by the start and the end."""
    runs, t0 = [], time.perf_counter()
    start = last = t0
    while last - t0 < duration_s:
        now = time.perf_counter()
        if now - last > gap_s:
            runs.append(last - start)
            start = now
        last = now
    out.put(runs[1:])


def scheduler_slice_s(processes: int | None = None, duration_s: float = 1.0, gap_s: float = 50e-6) -> float:
    """How long the OS scheduler lets a CPU-bound thread run before it switches, measured: ``processes`` (default
    4 per usable core) processes spin for ``duration_s`` at once, and the median of their uninterrupted stretches
    is returned (seconds). The simulator time-slices shared cores with it (``benchmarks.simulate``, ``slice_s``).

    Raises:
        RuntimeError: no process was ever descheduled (fewer processes than cores, or a duration too short).
    """
    usable = usable_cores()
    count = processes if processes is not None else 4 * usable
    ctx = mp.get_context("fork" if sys.platform != "win32" else "spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_spin, args=(duration_s, gap_s, out), daemon=True) for _ in range(count)]
    for proc in procs:
        proc.start()
    runs = [r for _ in procs for r in out.get(timeout=duration_s + 60.0)]
    for proc in procs:
        proc.join(timeout=10.0)
    if not runs:
        raise RuntimeError(
            f"scheduler_slice_s: {count} spinning processes on {usable} cores were never descheduled "
            f"in {duration_s} s; expected more processes than cores"
        )
    return statistics.median(runs)


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def machine_info(repo: Path) -> dict[str, Any]:
    """CPU count and model, platform, Python and torch versions, git commit and the current load."""
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable_cores(),
        "cpu_model": _cpu_model(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "git_commit": git_commit(repo),
        "load_average_start": load_average(),
    }
