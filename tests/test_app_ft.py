"""``ft=torchft``: the config group and its checks, a share's batches, and live recovery under ``python train.py``.

The slow test runs the real thing: ``python train.py ft=torchft replicas=3``, whose launcher starts a lighthouse and
three replica processes; the test SIGKILLs one from outside mid-run (its pid from ``replicas.json``), the launcher
starts it again, it heals from a live peer, and the job ends with every replica holding the same model.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from wagma.app.config import ConfigError, validate_config
from wagma.app.data import BatchIterator
from wagma.app.network import check_rank_net, namespace_name
from wagma.app.procs import descendants
from wagma.app.quota import cgroup_root, check_rank_cpus, job_name

ROOT = Path(__file__).resolve().parents[1]


def _cfg(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["replicas=1"], "replicas: expected at least ft.min_replicas (2), found 1; the quorum could never form"),
        (["replicas=0"], "replicas: expected an integer >= 1, found 0"),
        (["steps=30"], "steps: expected a multiple of ft.period x ft.sync_period (4), found 30"),
        (["ft.period=2", "steps=12"], "steps: expected a multiple of ft.period x ft.sync_period (8), found 12"),
        (["ft.group_size=1"], "ft.group_size: expected an integer >= 2, found 1"),
        (["ft.sync_period=0"], "ft.sync_period: expected an integer >= 1, found 0"),
        (["ft.max_restarts=-1"], "ft.max_restarts: expected an integer >= 0, found -1"),
        (["ft.timeout_s=0"], "ft.timeout_s: expected a finite number > 0, found 0"),
        (["ft.quorum_timeout_s=0"], "ft.quorum_timeout_s: expected a finite number > 0, found 0"),
        (
            ["ft.quorum_timeout_s=5"],
            "ft.quorum_timeout_s: expected at least ft.timeout_s (10), found 5; a replica that times out waiting for a "
            "quorum fails, so the quorum must outwait a collective",
        ),
        (["ft.lighthouse=host:29510"], "ft.lighthouse: expected null (start one) or an address http://host:port"),
        (["parallel=hsdp", "shard_size=2"], "parallel: expected 'ddp', found 'hsdp'"),
        (["resume=true"], "resume: expected False, found True"),
        (["ft.nproc=0"], "ft.nproc: expected an integer >= 1, found 0"),
        (
            ["rank_net=1gbit", "ft.lighthouse=http://node0:29510"],
            "rank_net: expected null with a running lighthouse (ft.lighthouse), found '1gbit'; here "
            "ft.lighthouse='http://node0:29510'",
        ),
        (
            ["rank_net=1gbit", "replicas=2", "ft.nproc=127"],
            "rank_net=1gbit: expected at most 253 ranks on a host (one /24), found 254 (replicas x ft.nproc = 254",
        ),
    ],
)
def test_a_bad_ft_config_is_named_before_anything_starts(overrides, message):
    cfg = _cfg("ft=torchft", "replicas=3", "steps=40", *overrides)
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, int(cfg.replicas))
    assert any(p.startswith(message) for p in err.value.problems), err.value.problems


def test_rank_cpus_counts_every_rank_of_every_replica_group():
    cpus = len(os.sched_getaffinity(0)) / 5  # three replica processes would fit, six ranks do not
    cfg = _cfg("ft=torchft", "replicas=3", "steps=40", "ft.nproc=2", f"rank_cpus={cpus}")
    with pytest.raises(ConfigError, match=r"for 6 local rank\(s\) needs .* \(replicas x ft.nproc = 6 processes\)"):
        validate_config(cfg, 3)


def test_ft_none_is_the_application_as_before_and_torchft_leaves_averaging_alone():
    validate_config(_cfg(), 4)  # the default: ft=none
    with pytest.raises(ConfigError, match="group_size"):
        validate_config(_cfg("replicas=3"), 3)  # ft=none checks wagma's group_size 2 against 3 ranks
    validate_config(_cfg("ft=torchft", "replicas=3", "steps=40"), 3)  # the ft group sets the averaging


def test_train_under_torchrun_refuses_ft_in_one_line(tmp_path):
    from wagma.app.train import train

    with pytest.raises(ConfigError, match="python train.py ft=torchft replicas=N"):
        train(_cfg("ft=torchft", f"run_dir={tmp_path}"))


def test_under_torchrun_a_replica_group_needs_the_lighthouse_address():
    from wagma.app.ft_torchrun import train_replica_group

    with pytest.raises(ConfigError, match="ft.lighthouse: expected the address of a running lighthouse under torchrun"):
        train_replica_group(_cfg("ft=torchft"))


def test_a_missing_torchft_is_one_line_naming_the_extra():
    from wagma.app import deps, run

    assert "torchft" in run._needed_modules(_cfg("ft=torchft")) and "torchft" not in run._needed_modules(_cfg())
    exc = ModuleNotFoundError("No module named 'torchft'", name="torchft")
    expected = "train.py needs torchft (module 'torchft' is missing): pip install 'wagma[torchft]'"
    assert deps.missing_dependency(exc, "train.py") == expected


def test_batch_at_is_the_endless_sequence_by_number():
    x, y = torch.arange(20.0).reshape(10, 2), torch.arange(10)
    sequence = BatchIterator(x, y, 3, seed=5, rank=0)
    expected = [next(sequence) for _ in range(8)]  # 3 batches per epoch: two epochs and more
    numbered = BatchIterator(x, y, 3, seed=5, rank=0)
    for index in (7, 0, 4, 3, 6, 1):
        assert torch.equal(numbered.batch_at(index)[1], expected[index][1])
    assert torch.equal(next(numbered)[1], expected[2][1])  # it continues after the batch it gave last


# --- the real thing -----------------------------------------------------------------------------------------------


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _kill_when_averaged(
    run_dir: Path,
    victim: int,
    rounds: int,
    proc: subprocess.Popen,
    limit_s: float,
    rank: int = 0,
    members: int = 1,
) -> int:
    """SIGKILL replica ``victim`` (its group's rank ``rank``) once it has run ``rounds`` rounds with at least
    ``members`` replicas in the quorum; returns the pid."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and proc.poll() is None:
        records = [r for r in _records(run_dir / "ft" / f"replica{victim}.jsonl") if r["event"] == "round"]
        records = [r for r in records if r["members"] >= members]
        if len(records) >= rounds:
            pid = records[-1]["pid"]  # rank 0 records
            (life,) = json.loads((run_dir / "replicas.json").read_text())["replicas"][str(victim)]
            if rank:  # another rank of the group: a child of the group's torchrun, as rank 0 is
                ranks = [p for p in descendants(life["pid"]) if b"wagma.app.ft_replica" in _cmdline(p)]
                assert pid in ranks and len(ranks) == 2, ranks
                pid = next(p for p in ranks if p != pid)
            else:
                assert life["pid"] == pid
            os.kill(pid, signal.SIGKILL)
            return pid
        time.sleep(0.05)
    raise AssertionError(f"replica {victim} did not run {rounds} rounds in time: {proc.poll()}")


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _logs(tmp_path: Path, chars: int = 3000) -> str:
    """What a failed ft run left: the launcher's output and, per replica, the end of its output and its last records
    (which wait a stalled replica sat in is told by its torchft lines)."""
    parts = [(tmp_path / "train.out").read_text()[-chars:]]
    for out in sorted((tmp_path / "run" / "ft").glob("replica*.out")):
        parts.append(f"--- {out.name} ---\n" + out.read_text(errors="replace")[-chars // 2 :])
        records = out.with_suffix(".jsonl")
        if records.exists():
            parts.append(f"--- {records.name} (last 3) ---\n" + "\n".join(records.read_text().splitlines()[-3:]))
    return "\n".join(parts)


def _train_py(tmp_path: Path, *overrides: str) -> subprocess.Popen:
    """``python train.py ft=torchft OVERRIDES`` into ``tmp_path / "run"``, its output in ``tmp_path / "train.out"``."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env |= {"PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    env.setdefault("RUST_LOG", "info")  # quorums, heals, commits: what _logs shows of a failure
    command = [sys.executable, str(ROOT / "train.py"), "ft=torchft", "eval_every=0", "progress=false"]
    command += [f"run_dir={tmp_path / 'run'}", f"hydra.run.dir={tmp_path / 'hydra'}", *overrides]
    with (tmp_path / "train.out").open("wb") as out:
        return subprocess.Popen(command, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)


@pytest.mark.slow  # about 15 s: three processes
@pytest.mark.timeout(180)
def test_rank_cpus_puts_every_replica_process_in_a_quota_of_its_own(tmp_path):
    if check_rank_cpus(0.5, 2) is not None:
        pytest.skip(f"no CPU quotas here: {check_rank_cpus(0.5, 2)}")
    proc = _train_py(tmp_path, "replicas=2", "rank_cpus=0.5", "steps=40")
    assert proc.wait(timeout=150) == 0, (tmp_path / "train.out").read_text()[-3000:]
    job = job_name(tmp_path / "run")
    for r in range(2):
        starts = [x for x in _records(tmp_path / "run" / "ft" / f"replica{r}.jsonl") if x["event"] == "start"]
        assert [x["cpu_cgroup"] for x in starts] == [f"/wagma/{job}/rank{r}"]
    assert not (cgroup_root() / "wagma" / job).exists()  # removed at the end


@pytest.mark.slow  # about 60 s on a loaded 2-core machine: four processes start, one is killed and started again
@pytest.mark.timeout(240)
def test_python_train_py_recovers_a_killed_replica_live(tmp_path):
    run_dir, victim, steps = tmp_path / "run", 1, 1200
    # every replica sleeps 20 ms a step (imbalance random_k with k = all three): the job outlasts a restart
    delays = ["imbalance=random_k", "imbalance.k=3", "imbalance.delay_s=0.02"]
    proc = _train_py(tmp_path, "replicas=3", f"steps={steps}", *delays, "log_every=50")
    try:
        killed = _kill_when_averaged(run_dir, victim, 20, proc, limit_s=120)
        assert proc.wait(timeout=180) == 0, _logs(tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
    lives = json.loads((run_dir / "replicas.json").read_text())["replicas"]
    first, second = lives[str(victim)]
    assert first["pid"] == killed and first["exit"] == -signal.SIGKILL
    assert second["healed"] and second["exit"] == 0  # started again, healed from a peer, trained to the end
    assert all(len(lives[str(r)]) == 1 and lives[str(r)][0]["exit"] == 0 for r in (0, 2))
    logs = {r: [x for x in _records(run_dir / "ft" / f"replica{r}.jsonl") if x["event"] == "round"] for r in range(3)}
    down = [x for r in (0, 2) for x in logs[r] if first["ended"] < x["time"] < second["joined"]]
    without = {x["committed"] for x in down if x["members"] == 2 and x["kind"] != "discarded"}
    assert len(without) >= 10, "the survivors did not go on, two of them, while the victim was down"
    for r in range(3):  # everyone took part in the last round, a sync round
        assert (logs[r][-1]["kind"], logs[r][-1]["committed"]) == ("sync", steps), r
    kept = [x["trained_share"] for r in range(3) for x in logs[r] if x["kept"]]
    assert len(kept) == len(set(kept)), "a share was trained on twice"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ft"]["finished"] == [0, 1, 2] and summary["ft"]["lives"] == {"0": 1, "1": 2, "2": 1}
    assert len(set(summary["ft"]["checksums"].values())) == 1  # the same model on every replica after the sync
    assert summary["test_accuracy"] > 0.9, summary["test_accuracy"]
    assert 0 < summary["startup_s"] < summary["wall_s"] and summary["train_s"] > 10  # the first round splits them
    assert (run_dir / "metrics_rank0.jsonl").exists()
    print(f"back in the quorum {second['joined'] - first['ended']:.1f} s after the kill; "
          f"accuracy {summary['test_accuracy']:.4f}; wall {summary['wall_s']:.1f} s")  # fmt: skip


@pytest.mark.slow  # about 60 s on a loaded 2-core machine: three replicas on their own links, one killed
@pytest.mark.timeout(240)
def test_on_the_emulated_network_a_killed_replica_rejoins_over_its_link_and_nothing_is_left(tmp_path):
    if (problem := check_rank_net("1gbit", 3)) is not None:
        pytest.skip(f"no emulated network here: {problem}")
    run_dir, victim, steps = tmp_path / "run", 2, 800
    delays = ["imbalance=random_k", "imbalance.k=3", "imbalance.delay_s=0.02"]
    proc = _train_py(tmp_path, "replicas=3", "rank_net=1gbit", f"steps={steps}", *delays, "log_every=50")
    try:
        _kill_when_averaged(run_dir, victim, 20, proc, limit_s=120)
        assert proc.wait(timeout=180) == 0, _logs(tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
    job = job_name(run_dir)
    starts = {r: [x for x in _records(run_dir / "ft" / f"replica{r}.jsonl") if x["event"] == "start"] for r in range(3)}
    for r in range(3):  # every life in the replica's own namespace, reached at its own address (198.18.0.0/15)
        assert {x["netns"] for x in starts[r]} == {namespace_name(job, r)}, starts[r]
        assert all(x["host"].startswith("198.1") for x in starts[r]), starts[r]
    assert len(starts[victim]) == 2  # started again in its namespace, once the dead life's was gone
    lives = json.loads((run_dir / "replicas.json").read_text())["replicas"]
    assert lives[str(victim)][1]["healed"] and lives[str(victim)][1]["exit"] == 0  # healed over the links
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rank_net"] == "1gbit" and summary["rank_net_burst"] == 1_250_000  # 10 ms of 1 Gbit/s
    assert summary["ft"]["finished"] == [0, 1, 2]
    assert len(set(summary["ft"]["checksums"].values())) == 1
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert namespace_name(job, 0)[:-3] not in namespaces  # every namespace removed at the end (veths with them)


@pytest.mark.slow  # about 15 s: two launches of one machine share a lighthouse, as two nodes would
@pytest.mark.timeout(180)
def test_the_multi_node_form_two_launches_share_one_lighthouse(tmp_path):
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=3, join_timeout_ms=500, heartbeat_timeout_ms=1000)
    address = "http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1]
    try:
        nodes = {"a": ("replicas=2", "ft.first_replica=0"), "b": ("replicas=1", "ft.first_replica=2")}
        procs = {}
        for node, ids in nodes.items():
            (tmp_path / node).mkdir()
            procs[node] = _train_py(tmp_path / node, *ids, f"ft.lighthouse={address}", "ft.min_replicas=3", "steps=40")
        for node, proc in procs.items():
            assert proc.wait(timeout=150) == 0, (tmp_path / node / "train.out").read_text()[-3000:]
    finally:
        lighthouse.shutdown()
    summaries = {node: json.loads((tmp_path / node / "run" / "summary.json").read_text()) for node in nodes}
    assert summaries["a"]["ft"]["finished"] == [0, 1] and summaries["b"]["ft"]["finished"] == [2]
    checksums = {c for s in summaries.values() for c in s["ft"]["checksums"].values()}
    assert len(checksums) == 1  # one job: the three replicas averaged together and ended on the same model
    for node in nodes:  # no lighthouse of its own
        assert json.loads((tmp_path / node / "run" / "replicas.json").read_text())["lighthouse"] == address


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"  # a zombie of a dead parent


@pytest.mark.slow  # about 40 s: two processes start, one is stopped for 15 s on its way
@pytest.mark.timeout(180)
def test_a_peer_stopped_while_starting_makes_the_others_wait_for_the_quorum_not_fail(tmp_path):
    # ft.timeout_s=3 is a collective's deadline; the quorum's (ft.quorum_timeout_s=60) outwaits replica 1, stopped
    # (SIGSTOP) for 15 s as soon as it starts. Replica 0 waits for a quorum of two all that time and must not fail:
    # with one deadline for both (torchft raises when a quorum times out) it died and was started again.
    run_dir = tmp_path / "run"
    proc = _train_py(tmp_path, "replicas=2", "steps=40", "ft.timeout_s=3")
    try:
        deadline, pid = time.monotonic() + 60, None
        while pid is None and time.monotonic() < deadline and proc.poll() is None:
            # replica 0's start writes the file before replica 1 has a life: its list is empty then
            with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
                pid = json.loads((run_dir / "replicas.json").read_text())["replicas"]["1"][0]["pid"]
            time.sleep(0.01)
        assert pid is not None, (tmp_path / "train.out").read_text()[-2000:]
        os.kill(pid, signal.SIGSTOP)
        time.sleep(15)
        os.kill(pid, signal.SIGCONT)
        assert proc.wait(timeout=120) == 0, (tmp_path / "train.out").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    lives = json.loads((run_dir / "replicas.json").read_text())["replicas"]
    assert all(len(lives[r]) == 1 and lives[r][0]["exit"] == 0 for r in ("0", "1")), lives
    joined = {r: lives[r][0]["joined"] for r in ("0", "1")}
    assert joined["0"] - lives["1"][0]["started"] > 15, "replica 0 did not have to wait for replica 1"


@pytest.mark.slow  # about 10 s: the replicas start, none can join in time
@pytest.mark.timeout(120)
def test_a_replica_that_does_not_join_in_time_fails_the_run_named_and_nothing_is_left(tmp_path):
    proc = _train_py(tmp_path, "replicas=2", "steps=40", "ft.rejoin_s=1")  # importing torch alone takes longer
    assert proc.wait(timeout=100) == 1
    out = (tmp_path / "train.out").read_text()
    assert "did not join a round within ft.rejoin_s=1 s of its start" in out and "replica 0 (pid" in out, out[-2000:]
    lives = json.loads((tmp_path / "run" / "replicas.json").read_text())["replicas"]
    assert all(_gone(life["pid"]) for r in lives.values() for life in r)  # the launcher stopped them


@pytest.mark.slow  # about 25 s: three processes start, one is killed and may not be started again
@pytest.mark.timeout(180)
def test_a_replica_past_its_restarts_fails_the_run_named(tmp_path):
    delays = ["imbalance=random_k", "imbalance.k=3", "imbalance.delay_s=0.02"]
    proc = _train_py(tmp_path, "replicas=3", "steps=1200", *delays, "ft.max_restarts=0")
    try:
        _kill_when_averaged(tmp_path / "run", 2, 5, proc, limit_s=120)
        assert proc.wait(timeout=60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    out = (tmp_path / "train.out").read_text()
    assert "replica 2 was killed by SIGKILL and has used its ft.max_restarts=0 restart(s)" in out, out[-2000:]
    lives = json.loads((tmp_path / "run" / "replicas.json").read_text())["replicas"]
    assert len(lives["2"]) == 1 and all(_gone(life["pid"]) for r in lives.values() for life in r)


def _two_groups_of_two_one_rank_killed(tmp_path: Path, *overrides: str, delay_s: float = 0.02) -> Path:
    """``python train.py`` with two replica groups of two ranks (800 steps, two ranks a step ``delay_s`` late), rank 1
    of group 1 SIGKILLed once the two groups have averaged 20 rounds together; asserts the job then ended well, and
    returns its run directory."""
    run_dir = tmp_path / "run"
    delays = ["imbalance=random_k", "imbalance.k=2", f"imbalance.delay_s={delay_s}"]
    options = ["replicas=2", "ft.nproc=2", "ft.min_replicas=1", "steps=800", *delays, "log_every=50"]
    proc = _train_py(tmp_path, *options, *overrides)
    try:
        _kill_when_averaged(run_dir, 1, 20, proc, limit_s=150, rank=1, members=2)  # rank 1 of replica group 1
        assert proc.wait(timeout=200) == 0, _logs(tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
    return run_dir


def _timeline(run_dir: Path) -> str:
    """Every life of every replica: when it started, first ran a round, healed or not, ended; for a failure message."""
    lives = json.loads((run_dir / "replicas.json").read_text())["replicas"]
    t0 = min(life["started"] for rep in lives.values() for life in rep)
    lines = []
    for r, rep in sorted(lives.items()):
        for i, life in enumerate(rep):
            at = {k: f"{life[k] - t0:.1f}" for k in ("started", "joined", "ended") if isinstance(life.get(k), float)}
            lines.append(f"replica {r} life {i + 1}: {at} healed={life.get('healed')} exit={life.get('exit')}")
    return "\n".join(lines)


@pytest.mark.slow  # about 70 s: two replica groups of two ranks (torchrun each), a rank killed, its group restarted
@pytest.mark.timeout(300)
def test_a_replica_group_of_two_ranks_loses_a_rank_and_heals_as_a_group(tmp_path):
    run_dir = _two_groups_of_two_one_rank_killed(tmp_path, "eval_every=200")
    lives = json.loads((run_dir / "replicas.json").read_text())["replicas"]
    first, second = lives["1"]
    assert first["exit"] != 0 and second["healed"] and second["exit"] == 0  # torchrun ended the group; it healed
    assert len(lives["0"]) == 1 and lives["0"][0]["exit"] == 0
    alone = [x for x in _records(run_dir / "ft" / "replica0.jsonl") if x["event"] == "round"]
    down = {x["committed"] for x in alone if first["ended"] < x["time"] < second["joined"] and x["members"] == 1}
    assert len(down) >= 10, "the surviving group did not go on alone while the other was down"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ft"]["finished"] == [0, 1] and len(set(summary["ft"]["checksums"].values())) == 1
    assert summary["test_accuracy"] > 0.9, summary["test_accuracy"]
    evaluated = [x for x in _records(run_dir / "metrics_rank0.jsonl") if "test_accuracy" in x]
    assert len(evaluated) >= 4  # every 200 steps, a collective over the group's two ranks, and the final one
    print(f"group back in the quorum {second['joined'] - first['ended']:.1f} s after its rank died; "
          f"accuracy {summary['test_accuracy']:.4f}; wall {summary['wall_s']:.1f} s")  # fmt: skip


@pytest.mark.slow  # about 75 s: two replica groups of two ranks, each rank on a link of its own, a rank killed
@pytest.mark.timeout(300)
def test_on_the_emulated_network_every_rank_of_a_group_has_its_link_and_a_killed_group_heals(tmp_path):
    if (problem := check_rank_net("1gbit", 4)) is not None:
        pytest.skip(f"no emulated network here: {problem}")
    # 50 ms late steps: group 0 trains for about 50 s, so the killed group comes back (a restart and a namespace
    # of its own, about 10 s) while it still has rounds to heal from
    run_dir = _two_groups_of_two_one_rank_killed(tmp_path, "rank_net=1gbit", delay_s=0.05)
    job = job_name(run_dir)
    for r in range(2):  # every life's every rank in a namespace of its own, at its own address
        starts = [x for x in _records(run_dir / "ft" / f"replica{r}.jsonl") if x["event"] == "start"]
        assert len(starts) == (2 if r == 1 else 1), _timeline(run_dir)
        for start in starts:
            assert start["group_netns"] == [namespace_name(job, 2 * r + q) for q in range(2)], start
            assert len(set(start["group_hosts"])) == 2 and all(h.startswith("198.1") for h in start["group_hosts"])
    lives = json.loads((run_dir / "replicas.json").read_text())["replicas"]
    assert lives["1"][1]["healed"] and lives["1"][1]["exit"] == 0, _timeline(run_dir)  # it healed over the links
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rank_net"] == "1gbit" and summary["ft"]["finished"] == [0, 1]
    assert len(set(summary["ft"]["checksums"].values())) == 1
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert namespace_name(job, 0)[:-3] not in namespaces  # every namespace removed at the end


@pytest.mark.slow  # about 20 s: two replicas start and train, then the launcher gets SIGTERM
@pytest.mark.timeout(180)
def test_sigterm_to_the_launcher_stops_every_replica_and_the_lighthouse(tmp_path):
    delays = ["imbalance=random_k", "imbalance.k=2", "imbalance.delay_s=0.02"]
    proc = _train_py(tmp_path, "replicas=2", "steps=2000", *delays)
    try:
        deadline = time.monotonic() + 120
        while len(_records(tmp_path / "run" / "ft" / "replica1.jsonl")) < 10 and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    lives = json.loads((tmp_path / "run" / "replicas.json").read_text())["replicas"]
    assert all(life["exit"] == -signal.SIGKILL and _gone(life["pid"]) for r in lives.values() for life in r)
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.slow  # about 60 s: two torchruns of two ranks each, a rank killed, torchrun restarts its group
@pytest.mark.timeout(300)
def test_under_torchrun_each_torchrun_is_a_replica_group_that_torchrun_restarts(tmp_path):
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=500, heartbeat_timeout_ms=1000)
    address = "http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env |= {"PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    steps = 800
    procs = {}
    try:
        for r in range(2):
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
            command += ["--max-restarts=2", "--monitor-interval=0.1", str(ROOT / "train.py"), "ft=torchft"]
            command += [f"ft.lighthouse={address}", f"ft.first_replica={r}", "ft.min_replicas=1", f"steps={steps}"]
            command += ["imbalance=random_k", "imbalance.k=1", "imbalance.delay_s=0.02", "eval_every=0"]
            command += [f"run_dir={tmp_path / f'run{r}'}", f"hydra.run.dir={tmp_path / f'hydra{r}'}", "progress=false"]
            with (tmp_path / f"torchrun{r}.out").open("wb") as out:
                procs[r] = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
        log = tmp_path / "run1" / "ft" / "replica1.jsonl"
        deadline = time.monotonic() + 150
        while len([x for x in _records(log) if x["event"] == "round"]) < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        rank0 = _records(log)[-1]["pid"]
        ranks = [p for p in descendants(procs[1].pid) if b"train.py" in _cmdline(p)]
        assert rank0 in ranks and len(ranks) == 2, ranks
        killed_at = time.time()
        os.kill(next(p for p in ranks if p != rank0), signal.SIGKILL)  # rank 1 of replica group 1
        for r, proc in procs.items():
            assert proc.wait(timeout=200) == 0, (tmp_path / f"torchrun{r}.out").read_text()[-3000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        lighthouse.shutdown()
    records = {r: _records(tmp_path / f"run{r}" / "ft" / f"replica{r}.jsonl") for r in range(2)}
    back = [x for x in records[1] if x["event"] == "round" and x["life"] == 2]
    assert back and back[0]["heals"] >= 1 and back[-1]["committed"] == steps  # torchrun's attempt 1 healed
    alone = [x for x in records[0] if x["event"] == "round" and x["members"] == 1]
    down = {x["committed"] for x in alone if killed_at < x["time"] < back[0]["time"]}
    assert len(down) >= 10, "replica group 0 did not go on alone while group 1 was down"
    summaries = [json.loads((tmp_path / f"run{r}" / "summary.json").read_text()) for r in range(2)]
    assert summaries[1]["ft"]["lives"] == {"1": 2} and summaries[0]["ft"]["lives"] == {"0": 1}
    assert len({c for s in summaries for c in s["ft"]["checksums"].values()}) == 1
    assert summaries[0]["test_accuracy"] > 0.9, summaries[0]["test_accuracy"]
    assert all(s["startup_s"] > 0 and s["train_s"] > 0 for s in summaries)
    print(f"torchrun's group back in the quorum {back[0]['time'] - killed_at:.1f} s after its rank died; "
          f"accuracy {summaries[0]['test_accuracy']:.4f}")  # fmt: skip
