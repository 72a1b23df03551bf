"""Processes as Linux's ``/proc`` shows them: start times and process trees (no torch import: cheap to load).

Used by :mod:`wagma.app.launch` (one start time for every rank and restart of a torchrun job) and by the
fault tests (every process of a run, to stop it and to check none is left). Elsewhere than Linux the functions
answer "unknown" (None, or an empty list). :func:`sigterm_exits` lets a launcher's cleanup run on SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

__all__ = ["descendants", "process_start_time", "sigterm_exits", "start_ticks"]

_PROC = Path("/proc")


def _stat_fields(pid: int) -> list[str] | None:
    """Fields 3.. of ``/proc/<pid>/stat`` (after ``pid (comm)``, whose name may hold spaces); None if gone."""
    try:
        return (_PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (with the pid, it names one process for good)."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None  # field 22, starttime


def process_start_time(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch, 10 ms resolution); None if unknown."""
    ticks = start_ticks(pid)
    try:
        boot = next(line for line in (_PROC / "stat").read_text().splitlines() if line.startswith("btime "))
    except (OSError, StopIteration):
        return None
    return None if ticks is None else int(boot.split()[1]) + ticks / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> dict[int, int]:
    """The processes below ``pid`` (children, their children, ...) as ``{pid: start ticks}``."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in _PROC.iterdir() if _PROC.is_dir() else ():
        if entry.name.isdigit() and (fields := _stat_fields(int(entry.name))) is not None:
            children.setdefault(int(fields[1]), []).append((int(entry.name), int(fields[19])))
    found: dict[int, int] = {}
    todo = list(children.get(pid, []))
    while todo:
        child, ticks = todo.pop()
        found[child] = ticks
        todo.extend(children.get(child, []))
    return found


@contextlib.contextmanager
def sigterm_exits() -> Iterator[None]:
    """Within: a SIGTERM to this process raises ``SystemExit(143)`` instead of ending it at once.

    So a launcher's own cleanup (stopping its ranks) and the ``finally`` blocks around it (removing the ranks'
    cgroups, :func:`wagma.app.quota.quota_job`; their networks, :func:`wagma.app.network.network_job`) run instead
    of the process vanishing. Only where SIGTERM still has its default handler, on the main thread; nested uses
    leave it to the outermost. The previous handler is put back after.
    """
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def _stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
