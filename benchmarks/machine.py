"""What a benchmark result needs to be interpreted later: the machine, the software and the checkout."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["git_commit", "load_average", "machine_info"]


def git_commit(repo: Path) -> str | None:
    """HEAD of the checkout at ``repo``, with ``+dirty`` when tracked files differ from it; None outside git."""
    try:
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, check=True, timeout=10,
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
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "cpu_model": _cpu_model(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "git_commit": git_commit(repo),
        "load_average_start": load_average(),
    }
