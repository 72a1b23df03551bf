"""Per-rank CPU quotas (wagma.app.quota): the cap measured for real, cleanup after a normal end and after a kill."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from wagma.app.config import ConfigError, validate_config
from wagma.app.quota import (
    RankQuota,
    cgroup_root,
    check_rank_cpus,
    job_name,
    remove_job_cgroups,
    remove_stale_cgroups,
)
from wagma.app.train import train
from wagma.testing import run_workers

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
_WHY = check_rank_cpus(0.25, 1)
needs_cgroups = pytest.mark.skipif(_WHY is not None, reason=f"no writable cgroup v1 cpu hierarchy: {_WHY}")


def test_check_rank_cpus_names_what_is_wrong_in_one_line():
    assert check_rank_cpus(None, 8) is None and check_rank_cpus(0, 8) is None
    expected = "rank_cpus: expected null, 0 (no quota) or a number of CPUs > 0, found "
    assert check_rank_cpus(-1, 2) == expected + "-1" and check_rank_cpus("half", 2) == expected + "'half'"
    too_many = check_rank_cpus(0.5, 8, usable_cores=2)
    assert too_many == (
        "rank_cpus=0.5 for 8 local rank(s) needs 4 CPUs, but this host has 2 usable core(s): use rank_cpus <= 0.25"
    )
    assert "\n" not in too_many


def test_check_rank_cpus_refuses_a_host_without_the_cgroup_v1_cpu_controller(tmp_path, monkeypatch):
    monkeypatch.setenv("WAGMA_CGROUP_ROOT", str(tmp_path))
    why = check_rank_cpus(0.25, 1, usable_cores=2)
    assert why.startswith(f"rank_cpus needs the cgroup v1 cpu controller at {tmp_path}")


def test_a_bad_quota_is_a_config_error_before_any_rank_starts():
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        cfg = compose("config", overrides=["rank_cpus=64"])
    with pytest.raises(ConfigError, match=r"rank_cpus=64 for 4 local rank\(s\) needs 256 CPUs"):
        validate_config(cfg, 4)


def _spin_in_quota(job: str, seconds: float, out) -> None:
    quota = RankQuota(0.25, job=job, rank=0)
    cpu0, t0 = time.process_time(), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        pass
    out.put((time.process_time() - cpu0) / (time.perf_counter() - t0))
    quota.leave()
    out.put(quota.path.exists())


@needs_cgroups
def test_a_rank_in_a_quota_gets_that_share_of_a_core_and_leaves_nothing_behind():
    job = f"test-{uuid.uuid4().hex[:8]}"
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_spin_in_quota, args=(job, 1.5, out))
    child.start()
    share, left = out.get(timeout=30), out.get(timeout=30)
    child.join(10)
    assert 0.15 <= share <= 0.32, share  # a busy loop capped at 0.25 CPU (uncapped it would take a whole core)
    assert left is False and not (cgroup_root() / "wagma" / job).exists()


def _join_and_wait(job: str, ready) -> None:
    RankQuota(0.5, job=job, rank=3)
    ready.set()
    time.sleep(60)


@needs_cgroups
def test_what_a_killed_rank_leaves_is_removed_by_the_launcher_cleanup():
    job = f"test-{uuid.uuid4().hex[:8]}"
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    child = ctx.Process(target=_join_and_wait, args=(job, ready))
    child.start()
    assert ready.wait(30)
    folder = cgroup_root() / "wagma" / job / "rank3"
    assert str(child.pid) in (folder / "cgroup.procs").read_text().split()
    assert (folder / "cpu.cfs_quota_us").read_text().strip() == "50000"
    os.kill(child.pid, signal.SIGKILL)
    child.join(10)
    assert folder.exists()  # a killed rank cannot clean up after itself
    removed = remove_job_cgroups(job)
    assert folder in removed and not folder.parent.exists()


def _train_noting_cgroup(rank: int, world_size: int, cfg) -> dict:
    seen = set()

    def note(done: int, _timings: dict) -> None:
        seen.update(
            line.split(":", 2)[2]
            for line in Path("/proc/self/cgroup").read_text().splitlines()
            if "cpu" in line.split(":", 2)[1].split(",")
        )

    summary = train(cfg, step_callback=note)
    return {"summary": summary, "seen": sorted(seen)}


@needs_cgroups
def test_train_runs_each_rank_in_its_own_quota_and_records_it(tmp_path):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        cfg = compose(
            "config",
            overrides=[
                "progress=false",
                "steps=20",
                "eval_every=0",
                "checkpoint_every=0",
                "averaging=allreduce",
                "rank_cpus=0.5",
            ],
        )
    cfg.run_dir = str(tmp_path)
    out = run_workers(_train_noting_cgroup, 2, cfg, timeout_s=120)
    job = job_name(tmp_path)
    assert [o["seen"] for o in out] == [[f"/wagma/{job}/rank0"], [f"/wagma/{job}/rank1"]]
    assert json.loads((tmp_path / "summary.json").read_text())["rank_cpus"] == 0.5
    assert not (cgroup_root() / "wagma" / job).exists()  # removed when train() ended


@needs_cgroups
def test_only_empty_and_old_job_cgroups_are_swept_as_stale():
    jobs = {name: cgroup_root() / "wagma" / f"test-{uuid.uuid4().hex[:8]}" for name in ("old", "young", "busy")}
    for folder in jobs.values():
        (folder / "rank0").mkdir(parents=True)
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    child = ctx.Process(target=_join_and_wait, args=(jobs["busy"].name, ready))
    child.start()
    try:
        assert ready.wait(30)
        for name in ("old", "busy"):
            os.utime(jobs[name], (time.time() - 600, time.time() - 600))
        removed = remove_stale_cgroups(min_age_s=60)
        assert jobs["old"] in removed and not jobs["old"].exists()
        assert jobs["young"].exists() and jobs["busy"].exists()  # starting now / a rank still in it
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        for folder in jobs.values():
            remove_job_cgroups(folder.name)


_LAUNCHER = textwrap.dedent("""
    import sys, time
    from wagma.app.quota import RankQuota, quota_job
    from wagma.testing import run_workers

    def rank(r, world, job):
        RankQuota(0.25, job=job, rank=r)
        time.sleep(120)

    with quota_job(sys.argv[1]):
        run_workers(rank, 2, sys.argv[1], timeout_s=150)
""")


@pytest.mark.slow  # 14 s: the quick suite's longest test (its 10-minute budget)
@needs_cgroups
def test_a_launcher_stopped_by_sigterm_stops_its_ranks_and_removes_their_cgroups():
    job = f"test-{uuid.uuid4().hex[:8]}"
    folder = cgroup_root() / "wagma" / job
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, job])
    pids: list[int] = []

    def ranks_in_cgroups() -> list[int]:
        files = [folder / f"rank{r}" / "cgroup.procs" for r in range(2)]
        return [int(pid) for f in files if f.is_file() for pid in f.read_text().split()]

    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(pids := ranks_in_cgroups()) < 2:
            time.sleep(0.2)
        assert len(pids) == 2, pids
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=30) == 128 + signal.SIGTERM
        assert not folder.exists()  # without quota_job the launcher vanished and the ranks' cgroups stayed
        for pid in pids:  # and its ranks were stopped, not orphaned
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        for pid in [launcher.pid, *pids]:  # on a failure, leave no orphaned rank sleeping
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        launcher.wait(10)
        deadline = time.monotonic() + 10  # killed orphans are zombies in their cgroups until init reaps them
        remove_job_cgroups(job)
        while folder.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
            remove_job_cgroups(job)
