"""Per-rank CPU quotas: every rank in a cpu cgroup of its own, so that ranks behave like devices.

Ranks that share a few cores lend each other their idle time: a rank waiting at a barrier hands its CPU to the
straggler, and imbalance of real compute partly vanishes. No cluster does that; a device that waits helps
nobody. With ``rank_cpus=c`` each rank runs in its own cgroup capped at ``c`` CPUs (cgroup v1's
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), whatever the other ranks do.

Layout: ``<root>/wagma/<job>/rank<R>``, ``root`` the cgroup v1 cpu hierarchy (``/sys/fs/cgroup/cpu``). A rank joins
its cgroup first thing in :func:`wagma.app.train.train` (every thread it starts later inherits it) and leaves it
when ``train`` ends, however it ends: it moves itself back to the cgroup it came from and removes its own. A rank
killed outright leaves an empty cgroup behind; :func:`remove_job_cgroups` (called by the launcher when the job
ends) removes what is left of a job, moving any process still in it back to the root first.

Writing these files needs root (or a delegated hierarchy). cgroup v2-only hosts are refused with a clear error.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

from wagma.app.procs import sigterm_exits
from wagma.checks import check_number, fail, is_number

__all__ = [
    "PERIOD_US",
    "QuotaError",
    "RankQuota",
    "check_rank_cpus",
    "cgroup_root",
    "job_name",
    "remove_job_cgroups",
    "remove_stale_cgroups",
    "quota_job",
]

#: The CFS period every quota is expressed in (100 ms, the kernel's default).
PERIOD_US = 100_000
_V1_ROOT = Path("/sys/fs/cgroup/cpu")


class QuotaError(RuntimeError):
    """A per-rank CPU quota cannot be set up here (no writable cgroup v1 cpu hierarchy)."""


def cgroup_root() -> Path:
    """The cgroup v1 cpu hierarchy to create the ranks' cgroups in (``WAGMA_CGROUP_ROOT`` overrides it)."""
    return Path(os.environ.get("WAGMA_CGROUP_ROOT", str(_V1_ROOT)))


def job_name(run_dir: str | os.PathLike[str]) -> str:
    """The job's cgroup folder name: the same on every rank of a run (derived from the shared run directory)."""
    return "job-" + hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]


def check_rank_cpus(cpus: object, local_ranks: int, usable_cores: int | None = None) -> str | None:
    """The one-line reason ``rank_cpus=cpus`` cannot run ``local_ranks`` ranks on this host, or None when it can.

    ``cpus`` must be null/0 (no quota) or a number > 0; the ranks' quotas together must fit the usable cores;
    the cgroup v1 cpu hierarchy must be writable.
    """
    if cpus is None or (is_number(cpus) and cpus == 0):
        return None
    if not is_number(cpus) or cpus < 0:
        return str(fail("rank_cpus", "null, 0 (no quota) or a number of CPUs > 0", cpus))
    cores = (
        usable_cores
        if usable_cores is not None
        else (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
    )
    if local_ranks * cpus > cores + 1e-9:
        return (
            f"rank_cpus={cpus:g} for {local_ranks} local rank(s) needs {local_ranks * cpus:g} CPUs, but this host "
            f"has {cores} usable core(s): use rank_cpus <= {cores / local_ranks:g}"
        )
    root = cgroup_root()
    if not (root / "cpu.cfs_quota_us").exists():
        return (
            f"rank_cpus needs the cgroup v1 cpu controller at {root} (cpu.cfs_quota_us), which this host does not "
            "have (cgroup v2-only hosts are not supported yet); run without rank_cpus"
        )
    if not os.access(root, os.W_OK):
        return f"rank_cpus needs write access to {root} (root, or a delegated cgroup); run as root or without rank_cpus"
    return None


def _own_cgroup(root: Path) -> Path:
    """The cgroup of the cpu hierarchy this process is in now (from /proc/self/cgroup), as a folder under ``root``."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "cpu" in controllers.split(","):
                return root / path.lstrip("/")
    except OSError:
        pass
    return root


class RankQuota:
    """This process in ``<root>/wagma/<job>/rank<rank>``, capped at ``cpus`` CPUs, until :meth:`leave`.

    Args:
        cpus: the cap, in CPUs (0.25: a quarter of one core over every 100 ms period).
        job: the job's folder (:func:`job_name`), the same on every rank.
        rank: this rank.
        root: the cgroup v1 cpu hierarchy (default :func:`cgroup_root`).

    Raises:
        QuotaError: the cgroup cannot be created or joined (the message names the file and the error).
    """

    def __init__(self, cpus: float, *, job: str, rank: int, root: Path | None = None) -> None:
        self.cpus = check_number("cpus", cpus, 0, above=True)
        self.root = cgroup_root() if root is None else root
        self.path = self.root / "wagma" / job / f"rank{rank}"
        self._home = _own_cgroup(self.root)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(max(1000, round(self.cpus * PERIOD_US))))
            (self.path / "cgroup.procs").write_text(str(os.getpid()))
        except OSError as exc:
            self._remove()
            raise QuotaError(f"rank {rank}: could not put this process in a CPU quota at {self.path}: {exc}") from None
        self.joined = True

    def leave(self) -> None:
        """Move this process back to the cgroup it came from and remove its quota's cgroup (and the job's folder
        once it is empty); idempotent, never raises."""
        if not getattr(self, "joined", False):
            return
        self.joined = False
        for home in (self._home, self.root):
            try:
                (home / "cgroup.procs").write_text(str(os.getpid()))
                break
            except OSError:
                continue
        self._remove()

    def _remove(self) -> None:
        for folder in (self.path, self.path.parent, self.path.parent.parent):
            try:
                folder.rmdir()
            except OSError:  # another rank is still in it, or it was gone
                break

    def __enter__(self) -> RankQuota:
        return self

    def __exit__(self, *exc: object) -> None:
        self.leave()


def remove_job_cgroups(job: str, root: Path | None = None) -> list[Path]:
    """Remove what is left of ``job``'s cgroups (after a rank was killed), moving any process still in one back to
    the root first. Returns the folders removed; a folder that cannot be removed is left (never raises)."""
    root = cgroup_root() if root is None else root
    folder = root / "wagma" / job
    removed: list[Path] = []
    if not folder.is_dir():
        return removed
    for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
        try:
            for pid in (sub / "cgroup.procs").read_text().split():
                try:
                    (root / "cgroup.procs").write_text(pid)
                except OSError:
                    pass
            sub.rmdir()
            removed.append(sub)
        except OSError:
            continue
    try:
        folder.rmdir()
        removed.append(folder)
        (root / "wagma").rmdir()
    except OSError:
        pass
    return removed


def _empty(job_folder: Path) -> bool:
    """Whether no process is left in ``job_folder`` or any of its rank cgroups (unreadable counts as not empty)."""
    try:
        return all(
            not (sub / "cgroup.procs").read_text().split()
            for sub in [job_folder, *(p for p in job_folder.iterdir() if p.is_dir())]
        )
    except OSError:
        return False


def remove_stale_cgroups(min_age_s: float = 60.0, root: Path | None = None) -> list[Path]:
    """Remove the job cgroups that no process is in any more and that are older than ``min_age_s`` seconds.

    A launcher killed outright (SIGKILL, a lost terminal) cannot run its cleanup; the empty cgroups its ranks left
    are removed by the next quota'd job on the host, which calls this before it starts. A job that is starting has
    its ranks join their cgroups as they create them, so a cgroup both empty and a minute old belongs to no one.
    Returns the folders removed (never raises).
    """
    root = cgroup_root() if root is None else root
    base = root / "wagma"
    removed: list[Path] = []
    try:
        jobs = [p for p in base.iterdir() if p.is_dir()]
    except OSError:
        return removed
    now = time.time()
    for folder in jobs:
        try:
            young = now - folder.stat().st_mtime < min_age_s
        except OSError:
            continue
        if not young and _empty(folder):
            removed += remove_job_cgroups(folder.name, root)
    return removed


@contextlib.contextmanager
def quota_job(job: str, enabled: bool = True) -> Iterator[None]:
    """Wrap a launcher's start of a quota'd job (``job`` as its ranks name it): nothing is left behind.

    Before: removes the empty cgroups of jobs whose launcher was killed outright (:func:`remove_stale_cgroups`).
    During: a SIGTERM to this process (when it arrives with the default handler in place, on the main thread)
    raises ``SystemExit(143)`` (:func:`wagma.app.procs.sigterm_exits`), so that the launcher's own cleanup (stopping
    the ranks) and this one run instead of the process vanishing. After, however the job ended: removes what is left
    of ``job``'s cgroups.
    ``enabled=False`` (the job runs without quotas) does nothing.
    """
    if not enabled:
        yield
        return
    remove_stale_cgroups()
    try:
        with sigterm_exits():
            yield
    finally:
        remove_job_cgroups(job)
