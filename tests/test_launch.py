"""Launching and failing for real: torchrun and ``python train.py`` with frozen and killed ranks, elastic restarts,
signals."""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import torch.distributed as dist
from hydra import compose, initialize_config_dir

from wagma.app import launch
from wagma.app import run as run_module
from wagma.app.metrics import MetricsWriter, read_metrics
from wagma.app.procs import descendants
from wagma.app.roll_call import RollCall
from wagma.app.train import train
from wagma.testing import run_workers, run_workers_outcomes

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def _start(cwd: Path, cmd: list[str], **kwargs: object) -> subprocess.Popen[str]:
    """Start ``cmd`` in ``cwd``, its output going to a file that :func:`_output` reads."""
    with open(cwd / "launcher.out", "w") as out:
        return subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=out, stderr=subprocess.STDOUT, text=True, **kwargs)


def _output(cwd: Path) -> str:
    return (cwd / "launcher.out").read_text(errors="replace")


def _torchrun(cwd: Path, *overrides: str, nproc: int, flags: tuple[str, ...] = ()) -> subprocess.Popen[str]:
    return _start(
        cwd,
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "--log-dir",
            str(cwd / "logs"),
            "--redirects",
            "3",
            *flags,
            str(ROOT / "train.py"),
            "progress=false",
            *overrides,
        ],
    )


def _wait_until(cond: Callable[[], object], timeout_s: float, what: str) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(f"waited {timeout_s} s for {what}")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _rank_pids(launcher: int, nproc: int) -> dict[int, int]:
    """``{rank: pid}`` of the training processes below ``launcher``, once all ``nproc`` run."""

    def ranks() -> dict[int, int]:
        found = {}
        for pid in descendants(launcher):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            rank = [e[5:] for e in environ if e.startswith(b"RANK=")]
            if rank and b"train.py" in cmdline:
                found[int(rank[0])] = pid
        return found if len(found) == nproc else {}

    return _wait_until(ranks, 60, f"{nproc} training processes")  # type: ignore[return-value]


def _kill_all(pids: Iterable[int]) -> None:
    """SIGKILL each of ``pids`` that still exists (one may exit between its listing and its kill)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _has_records(path: Path) -> bool:
    return path.exists() and path.stat().st_size > 0


def _rank_log(cwd: Path, rank: int) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted((cwd / "logs").glob(f"**/attempt_0/{rank}/*.log")))


# --- point 8: a frozen rank is named ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("policy,frozen", [("allreduce", 0), ("wagma", 2)])
def test_a_frozen_rank_is_named_by_every_survivor_and_in_torchruns_report(tmp_path, policy, frozen):
    run_dir = tmp_path / "run"
    timeouts = ("dist_timeout_s=8", "failure_report_s=2") + (("averaging.timeout_s=8",) if policy == "wagma" else ())
    proc = _torchrun(
        tmp_path,
        f"averaging={policy}",
        "steps=1000000",
        "checkpoint_every=0",
        *timeouts,
        f"hydra.run.dir={run_dir}",
        nproc=4,
    )
    try:
        pids = _rank_pids(proc.pid, 4)
        _wait_until(lambda: _has_records(run_dir / f"metrics_rank{frozen}.jsonl"), 90, "training to start")
        os.kill(pids[frozen], signal.SIGSTOP)
        stopped = time.monotonic()
        survivors = [r for r in pids if r != frozen]
        _wait_until(lambda: not any(_alive(pids[r]) for r in survivors), 60, "the survivors to fail")
        failed_after = time.monotonic() - stopped
        print(f"{policy}: the survivors of a SIGSTOP of rank {frozen} ended {failed_after:.1f} s later")
        # torchrun has seen the failures once it stops the rest; only then end the frozen rank (its SIGTERM
        # waits for a SIGCONT, torchrun's SIGKILL would come 30 s later).
        _wait_until(lambda: "closing signal SIGTERM" in _output(tmp_path), 30, "torchrun to stop the frozen rank")
    finally:
        _kill_all(descendants(proc.pid))
        proc.wait(timeout=60)
    assert proc.returncode != 0
    for rank in survivors:
        log = _rank_log(tmp_path, rank)
        assert f"rank(s) [{frozen}] did not arrive at step" in log, (rank, log[-3000:])
    report = _output(tmp_path)
    root_cause = report[report.index("Root Cause") :]
    assert f"rank(s) [{frozen}] did not arrive at step" in root_cause, report[-3000:]
    # The collective's timeout (8 s) plus the roll call (2 s) plus slack: no fixed extra wait on top, and no
    # teardown held by the broken group (that took about 7 s more before exit_at_once_on_failure).
    assert failed_after < 8 + 2 + 5, failed_after


def _roll_call_worker(rank: int, world_size: int, absent: int | None, report_s: float) -> tuple[str, float]:
    roll_call = RollCall(rank, world_size, report_s=report_s)
    roll_call.begin(4)
    if rank == absent:
        time.sleep(report_s + 1.0)  # frozen: never reports
        return "", 0.0
    roll_call.begin(5)
    started = time.monotonic()
    error = roll_call.failure(5, TimeoutError("allreduce timed out"))
    return (None if error is None else str(error)), time.monotonic() - started


def test_roll_call_names_the_rank_that_sent_no_report_and_its_last_step():
    results = run_workers(_roll_call_worker, 3, 1, 1.0)
    for rank in (0, 2):
        message, waited = results[rank]
        assert f"step 5 failed on rank {rank}: rank(s) [1] did not arrive at step 5" in message
        assert "rank 1 last began step 4" in message and "cause here: TimeoutError: allreduce timed out" in message
        assert 0.9 < waited < 3.0


def test_roll_call_does_not_wait_when_every_rank_reports():
    results = run_workers(_roll_call_worker, 3, None, 10.0)
    for message, waited in results:
        assert message is None and waited < 3.0  # nobody is missing: the caller re-raises its own error


def test_roll_call_rejects_a_negative_wait_and_an_unknown_step():
    with pytest.raises(ValueError, match="^report_s: expected a finite number >= 0, found -1.0$"):
        RollCall(0, 1, report_s=-1.0, store=dist.HashStore())
    with pytest.raises(ValueError, match="^step: expected an integer >= 0 or 'final', found 'end'$"):
        RollCall(0, 1, store=dist.HashStore()).begin("end")


def _train_freezing_in_checkpoint(rank: int, world_size: int, cfg: object) -> str:
    import wagma.app.train as train_module

    save = train_module.save_checkpoint

    def freeze_rank2(*args: object, **kwargs: object) -> None:
        if rank == 2:
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen between its step and the checkpoint's barrier
        save(*args, **kwargs)

    train_module.save_checkpoint = freeze_rank2
    try:
        train(cfg)
    except RuntimeError as err:
        return str(err)
    return "finished"


@pytest.mark.slow  # 26 s: a real SIGSTOP in a training world
def test_a_rank_frozen_before_a_checkpoint_is_named_too(tmp_path):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        cfg = compose(
            "config",
            overrides=[
                "averaging=allreduce",
                "steps=100",
                "progress=false",
                "checkpoint_every=10",
                "failure_report_s=1",
                f"run_dir={tmp_path / 'run'}",
            ],
        )
    outcomes = run_workers_outcomes(_train_freezing_in_checkpoint, 3, cfg, timeout_s=25, collective_timeout_s=4)
    assert not outcomes[2].ok  # frozen, then killed by the harness
    for rank in (0, 1):
        assert "rank(s) [2] did not arrive at step 9" in outcomes[rank].value, outcomes[rank]


def _train_freezing_in_final_phase(rank: int, world_size: int, cfg: object, where: str) -> str:
    import wagma.app.train as train_module

    original = getattr(train_module, where)

    def freeze_rank2(*args: object, **kwargs: object) -> object:
        if rank == 2:
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen for real, after the loop, before the final collective
        return original(*args, **kwargs)

    setattr(train_module, where, freeze_rank2)
    store = dist.distributed_c10d._get_default_store()
    store.set(f"pid/{rank}", str(os.getpid()))
    try:
        train(cfg)
    except RuntimeError as err:
        if rank == 0:  # the survivors have had their say: end the frozen rank, as an operator would
            os.kill(int(store.get("pid/2")), signal.SIGKILL)
        return str(err)
    return "finished"


@pytest.mark.slow  # 6.5 s each: a real SIGSTOP in a training world
@pytest.mark.parametrize("where", ["save_checkpoint", "evaluate"])
def test_a_rank_frozen_in_the_final_phase_is_named_too(tmp_path, where):
    # checkpoint_every=0 and eval_every=0: the final checkpoint and the test evaluation are the only calls.
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        cfg = compose(
            "config",
            overrides=[
                "averaging=allreduce",
                "steps=20",
                "progress=false",
                "checkpoint_every=0",
                "eval_every=0",
                "failure_report_s=1",
                f"run_dir={tmp_path / 'run'}",
            ],
        )
    outcomes = run_workers_outcomes(_train_freezing_in_final_phase, 3, cfg, where, timeout_s=60, collective_timeout_s=4)
    assert not outcomes[2].ok  # frozen, then killed by rank 0
    for rank in (0, 1):
        message = outcomes[rank].value
        assert outcomes[rank].ok and "rank(s) [2] did not arrive at the final phase" in message, outcomes[rank]
        assert "rank 2 last began the final phase" in message, message


# --- failure reporting adds no fixed wait ----------------------------------------------------------


@pytest.fixture
def torchrun_env(monkeypatch):
    """This process as rank 1 of 2 under torchrun, with a store of its own standing in for torchrun's."""
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    for key, value in {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(server.port),
        "TORCHELASTIC_RUN_ID": f"t{time.time_ns()}",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    return server


def _exit_under_reporting(code: int, *, composed: bool, wait_s: float) -> float:
    started = time.monotonic()
    with pytest.raises(SystemExit), launch.failures_reported_by_rank0(wait_s=wait_s):
        if composed:
            launch.release_stderr()
        raise SystemExit(code)
    return time.monotonic() - started


def test_a_failure_of_this_rank_alone_exits_at_once(torchrun_env):
    # A runtime failure (exit 1 after the task function started) is this rank's own: the old code
    # waited wait_s for rank 0 to report it, which never happens when rank 0 is the frozen one.
    assert _exit_under_reporting(1, composed=True, wait_s=5.0) < 1.0


def test_a_shared_failure_waits_for_rank0_at_most_wait_s(torchrun_env):
    assert 0.4 < _exit_under_reporting(launch.SHARED_FAILURE_EXIT_CODE, composed=True, wait_s=0.5) < 3.0
    torchrun_env.set(f"wagma/failure_reported/{os.environ['TORCHELASTIC_RUN_ID']}/0", "1")  # rank 0 reported
    assert _exit_under_reporting(1, composed=False, wait_s=5.0) < 1.0


@pytest.mark.parametrize("code", [pytest.param(0, marks=pytest.mark.slow), 3])
def test_a_failed_process_exits_without_teardown_after_flushing_its_report(tmp_path, code):
    script = (
        "import atexit, logging, sys\n"
        "from wagma.app import launch\n"
        "atexit.register(lambda: print('teardown ran', flush=True))\n"
        "logging.basicConfig(filename=sys.argv[1])\n"
        "with launch.exit_at_once_on_failure():\n"
        "    print('reported', end='')\n"
        "    logging.getLogger('x').error('logged')\n"
        f"    raise SystemExit({code})\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "log")], env=_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == code and proc.stdout.startswith("reported")
    assert ("teardown ran" in proc.stdout) == (code == 0)  # a failure skips the interpreter's teardown
    assert "logged" in (tmp_path / "log").read_text()


# --- point 9: elastic restarts ---------------------------------------------------------------------


@pytest.mark.slow
def test_max_restarts_resumes_a_job_that_lost_a_rank_and_finishes_its_steps(tmp_path):
    steps = 300
    proc = _torchrun(
        tmp_path,
        "averaging=allreduce",
        f"steps={steps}",
        "checkpoint_every=20",
        "imbalance=persistent",
        "imbalance.base_s=0.01",
        nproc=2,
        flags=("--max-restarts", "1"),
    )
    try:
        pids = _rank_pids(proc.pid, 2)
        latest = _wait_until(
            lambda: list(tmp_path.glob("outputs/*/*/checkpoints/step_*/meta.json")), 90, "a complete checkpoint"
        )
        os.kill(pids[1], signal.SIGKILL)
        proc.wait(timeout=150)
    finally:
        _kill_all(descendants(proc.pid))
    assert proc.returncode == 0, _output(tmp_path)[-3000:]
    run_dirs = [p for p in tmp_path.glob("outputs/*/*") if p.is_dir()]
    assert run_dirs == [latest[0].parents[2]]  # the restart found the same run directory
    summary = json.loads((run_dirs[0] / "summary.json").read_text())
    assert summary["steps"] == steps and summary["restarts"] == 1
    assert summary["resumed_from"] is not None and 20 <= summary["resumed_from"] < steps
    recorded = [r["step"] for r in read_metrics(run_dirs[0], 0)]
    assert recorded == list(range(1, steps + 1))  # each step once: the killed attempt's extra steps dropped
    assert (run_dirs[0] / "train.log").read_text().count("training mlp on digits") == 2


# --- point 10: signals and a vanished run directory ------------------------------------------------


def _train_py(cwd: Path, *overrides: str, **kwargs: object) -> subprocess.Popen[str]:
    """``python train.py`` (Hydra the parent, starting its own ranks) with ``overrides``."""
    return _start(cwd, [sys.executable, str(ROOT / "train.py"), *overrides, "progress=false"], **kwargs)


def _spawned_ranks(parent: int, nproc: int) -> list[int]:
    """The pids of the ``nproc`` ranks the elastic launcher spawned below ``parent``, once all run."""

    def ranks() -> list[int]:
        found = []
        for pid in descendants(parent):
            try:
                if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(pid)
            except OSError:
                continue
        return found if len(found) == nproc else []

    return _wait_until(ranks, 60, f"{nproc} spawned ranks")  # type: ignore[return-value]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_python_train_py_ends_every_rank(tmp_path, sig):
    run_dir = tmp_path / "run"
    proc = _train_py(
        tmp_path, "nproc=2", "averaging=allreduce", "steps=1000000", f"hydra.run.dir={run_dir}", start_new_session=True
    )
    try:
        _spawned_ranks(proc.pid, 2)
        _wait_until(lambda: _has_records(run_dir / "metrics_rank1.jsonl"), 90, "training to start")
        tree = descendants(proc.pid)
        assert len(tree) >= 2  # the two ranks (and multiprocessing's resource tracker)
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # Ctrl-C: the terminal signals the foreground process group
        else:
            os.kill(proc.pid, sig)  # kill PID
        signalled = time.monotonic()
        code = proc.wait(timeout=30)
        _wait_until(lambda: not any(_alive(pid) for pid in tree), 5, "every process of the run to end")
        print(f"{sig.name}: train.py and its {len(tree)} processes ended {time.monotonic() - signalled:.1f} s later")
    finally:
        _kill_all([proc.pid, *descendants(proc.pid)])
    assert code == 128 + sig, _output(tmp_path)[-3000:]
    assert f"wagma: stopped by {sig.name}; the ranks were ended" in _output(tmp_path)
    assert json.loads((run_dir / "job.json").read_text())["exit"] == 128 + sig


@pytest.mark.slow
def test_python_train_py_max_restarts_resumes_a_job_that_lost_a_rank(tmp_path):
    steps, run_dir = 300, tmp_path / "run"
    proc = _train_py(
        tmp_path,
        "nproc=2",
        "max_restarts=1",
        "averaging=allreduce",
        f"steps={steps}",
        "checkpoint_every=20",
        "imbalance=persistent",
        "imbalance.base_s=0.01",
        f"hydra.run.dir={run_dir}",
    )
    try:
        ranks = _spawned_ranks(proc.pid, 2)
        _wait_until(lambda: list(run_dir.glob("checkpoints/step_*/meta.json")), 90, "a complete checkpoint")
        victim = ranks[-1]
        os.kill(victim, signal.SIGKILL)
        proc.wait(timeout=150)
    finally:
        _kill_all(descendants(proc.pid))
    assert proc.returncode == 0, _output(tmp_path)[-3000:]
    # the restart names the rank that died, although the job then succeeded
    found = re.search(
        rf"wagma: (rank [01] \(pid {victim}\) was killed by SIGKILL; restarting every rank from the "
        r"newest complete checkpoint \(restart 1 of 1\))\n",
        _output(tmp_path),
    )
    assert found, _output(tmp_path)[-3000:]
    cause = found.group(1)
    assert f"restart 1     {cause}" in _output(tmp_path)  # and the summary repeats it
    assert json.loads((run_dir / "job.json").read_text())["restart_causes"] == [cause]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps and summary["restarts"] == 1
    assert summary["resumed_from"] is not None and 20 <= summary["resumed_from"] < steps
    assert [r["step"] for r in read_metrics(run_dir, 0)] == list(range(1, steps + 1))


def test_metrics_writer_raises_when_the_run_directory_is_deleted(tmp_path):
    run_dir = tmp_path / "run"
    writer = MetricsWriter(run_dir, 0, flush_every=2)
    writer.write(1, loss=1.0)
    writer.write(2, loss=0.5)
    os.remove(run_dir / "metrics_rank0.jsonl")
    run_dir.rmdir()
    writer.write(3, loss=0.4)
    with pytest.raises(RuntimeError, match=r"metrics_rank0.jsonl was deleted while rank 0 was writing it"):
        writer.write(4, loss=0.3)
    writer.close()  # reported once, not again


def _train_deleting_run_dir(rank: int, world_size: int, cfg: object) -> str:
    def delete_at_step_5(done: int, _timings: dict) -> None:
        if done == 5 and rank == 0:
            for path in Path(cfg.run_dir).glob("metrics_rank*.jsonl"):
                path.unlink()

    try:
        train(cfg, step_callback=delete_at_step_5)
    except RuntimeError as err:
        return str(err)
    return "finished"


def test_a_run_directory_deleted_mid_run_fails_every_rank_clearly(tmp_path):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        cfg = compose(
            "config",
            overrides=[
                "averaging=allreduce",
                "steps=60",
                "progress=false",
                "checkpoint_every=0",
                f"run_dir={tmp_path / 'run'}",
            ],
        )
    messages = [o.value for o in run_workers_outcomes(_train_deleting_run_dir, 2, cfg) if o.ok]
    assert len(messages) == 2 and all("was deleted while rank" in m for m in messages), messages


@pytest.mark.slow
def test_sigterm_stops_the_whole_sweep_not_only_its_current_job(tmp_path):
    out = tmp_path / "sweep"
    proc = _train_py(
        tmp_path, "-m", "nproc=2", "averaging=allreduce,local_sgd", "steps=1000000", f"hydra.sweep.dir={out}"
    )
    try:
        _wait_until(lambda: list(out.glob("*/metrics_rank1.jsonl")), 90, "the first job to train")
        tree = descendants(proc.pid)
        os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=30)
        _wait_until(lambda: not any(_alive(pid) for pid in tree), 5, "every process of the job to end")
    finally:
        _kill_all([proc.pid, *descendants(proc.pid)])
    assert code == 128 + signal.SIGTERM, _output(tmp_path)[-3000:]
    jobs = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert len(jobs) == 1 and jobs[0].startswith("0_averaging=allreduce")  # the second job never started
    assert json.loads((out / jobs[0] / "job.json").read_text())["exit"] == 128 + signal.SIGTERM
    assert "wagma: stopped by SIGTERM" in _output(tmp_path)


# --- start-up: every rank meets the others before the (short-timeout) process group is created ---------


def test_meet_returns_once_every_rank_arrived_and_names_the_ones_that_did_not():
    import threading

    store = dist.HashStore()
    late = threading.Timer(0.3, launch.meet, args=(store, 2, 3, 5.0))
    late.start()
    threading.Thread(target=launch.meet, args=(store, 1, 3, 5.0), daemon=True).start()
    started = time.monotonic()
    launch.meet(store, 0, 3, 5.0)  # returns when rank 2 arrives, 0.3 s later
    assert 0.25 < time.monotonic() - started < 3.0
    late.join()

    lonely = dist.HashStore()

    def rank0() -> None:
        with pytest.raises(TimeoutError):  # rank 0 gives up too
            launch.meet(lonely, 0, 3, 0.5)

    threading.Thread(target=rank0, daemon=True).start()
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] of 3 did not start within 1 s"):
        launch.meet(lonely, 2, 3, 0.6)


_LATE_START = """
import os, sys, time, torch, torch.distributed as dist
from wagma.app import launch
if os.environ["RANK"] == "0":
    time.sleep(float(sys.argv[1]))  # a rank slow to start (imports, a stalled store connect, load)
ctx = launch.init_distributed("cpu", timeout_s=2.0)
t = torch.ones(1)
dist.all_reduce(t)
print(f"rank {ctx.rank}: sum {int(t.item())}")
launch.shutdown(ctx)
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_rank_that_starts_late_does_not_fail_a_group_with_a_short_timeout(tmp_path):
    # Before the meeting, rank 1 created the group alone and gave up on rank 0 after the group's 2 s timeout.
    script = tmp_path / "late_start.py"
    script.write_text(_LATE_START)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script), "5"],
        capture_output=True,
        text=True,
        timeout=100,
        env=env | {"OMP_NUM_THREADS": "1"},
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "rank 0: sum 2" in proc.stdout and "rank 1: sum 2" in proc.stdout


def test_the_launch_config_fits_torch_versions_with_and_without_a_shutdown_timeout(monkeypatch):
    # torch 2.11 (the GPU machine's) has no LaunchConfig.shutdown_timeout; 2.13 has. Found on the first GPU run:
    # `python train.py` failed there with "unexpected keyword argument 'shutdown_timeout'".
    import dataclasses as dc

    from torch.distributed.launcher import api

    from wagma.app import run

    config = run._launch_config(2, 1)
    assert (config.nproc_per_node, config.max_restarts, config.start_method) == (2, 1, "spawn")
    if "shutdown_timeout" in {f.name for f in dc.fields(api.LaunchConfig)}:
        assert config.shutdown_timeout == int(run.STOP_GRACE_S)
    fields = [(f.name, f.type, f) for f in dc.fields(api.LaunchConfig) if f.name != "shutdown_timeout"]
    older = dc.make_dataclass(
        "LaunchConfig", [(n, t, dc.field(default=f.default, default_factory=f.default_factory)) for n, t, f in fields]
    )
    monkeypatch.setattr(api, "LaunchConfig", older)
    config = run._launch_config(3, 0)
    assert type(config) is older and config.nproc_per_node == 3


def _elastic_failure(rank: int, exitcode: int | None, error: Exception | None = None) -> None:
    """Log a worker's failure as torch.distributed.elastic's process context does (with its exception, if any)."""
    logger = logging.getLogger(run_module._FAILURE_LOGGER)
    args = (exitcode, rank, 4242, "rank_main", "spawn")
    fmt = "failed (exitcode: %s) local_rank: %s (pid: %s) of fn: %s (start_method: %s)"
    if error is None:
        logger.error(fmt, *args)
        return
    try:
        raise error
    except Exception:
        logger.exception(fmt, *args)


def _elastic_restart(left: int, most: int) -> None:
    logging.getLogger(run_module._RESTART_LOGGER).info(
        "[%s] Worker group %s. %s/%s attempts left; will restart worker group", "default", "FAILED", left, most
    )


def test_each_restart_of_every_rank_names_the_rank_that_failed_and_how(capsys, caplog):
    report = run_module._RestartReport(max_restarts=2)
    with caplog.at_level(logging.DEBUG), run_module._quiet_elastic_logs(report):
        _elastic_failure(3, -9)  # pid 4242
        _elastic_restart(2, 2)
        did_not_arrive = RuntimeError("rank 0: rank(s) [2] did not arrive at step 12 within 5 s\n")
        _elastic_failure(0, 1, did_not_arrive)
        _elastic_restart(1, 2)
    again = "restarting every rank from the newest complete checkpoint"
    assert report.restarts == [
        f"rank 3 (pid 4242) was killed by SIGKILL; {again} (restart 1 of 2)",
        f"rank 0 (pid 4242) failed: rank 0: rank(s) [2] did not arrive at step 12 within 5 s; {again} (restart 2 of 2)",
    ]
    assert capsys.readouterr().err.splitlines() == [f"wagma: {line}" for line in report.restarts]
    assert not caplog.records  # the agent's own records stay off the terminal (and out of Hydra's log)
    # afterwards the loggers are as they were: nothing of ours left on them
    for name in (run_module._FAILURE_LOGGER, run_module._RESTART_LOGGER):
        assert report not in logging.getLogger(name).handlers and logging.getLogger(name).propagate


def test_a_failure_without_a_restart_is_not_reported_as_one(capsys):
    report = run_module._RestartReport(max_restarts=0)
    with run_module._quiet_elastic_logs(report):
        _elastic_failure(1, 2)
    assert report.restarts == [] and capsys.readouterr().err == ""
    assert run_module._failure_line("rank 1 (pid 7)", "2", None) == "rank 1 (pid 7) failed (exit status 2)"
