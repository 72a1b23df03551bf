"""Per-rank networks (wagma.app.network): ranks in namespaces of their own, transfers at the rate, nothing left."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import wagma.app.network as network
from wagma.app.config import ConfigError, validate_config
from wagma.app.network import (
    RATE_FORMS,
    NetworkError,
    RankNetwork,
    bridge_name,
    check_rank_net,
    mac_address,
    namespace_name,
    network_job,
    parse_rate,
    rate_burst,
    rate_name,
    remove_job_networks,
    remove_stale_networks,
    tbf_burst,
    veth_name,
    worker_setup,
)
from wagma.app.procs import descendants
from wagma.app.quota import cgroup_root, check_rank_cpus, job_name
from wagma.app.train import train
from wagma.testing import run_workers, run_workers_outcomes

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
_WHY = check_rank_net("200mbit", 2, 2)
needs_net = pytest.mark.skipif(_WHY is not None, reason=f"cannot make rank networks here: {_WHY}")


def leftovers(job: str) -> list[str]:
    """What exists of ``job``'s networks: its namespaces, veths and bridge."""
    tag = bridge_name(job)[3:]
    names = [n for n in (os.listdir("/run/netns") if os.path.isdir("/run/netns") else []) if f"-{tag}-" in n]
    return names + [n for n in os.listdir("/sys/class/net") if n.startswith((f"wgv{tag}", f"wgb{tag}"))]


def _proc(pid: int, name: str) -> bytes:
    """``/proc/<pid>/<name>``, or b"" once the process has ended (it may end between listing and reading)."""
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return b""


def _kill_unless_reaper(pid: int) -> None:
    """SIGKILL ``pid`` unless it is one of network.py's reapers (or has ended already)."""
    cmdline = _proc(pid, "cmdline")
    if cmdline and b"network.py" not in cmdline:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def wait_gone(job: str, seconds: float = 20.0) -> list[str]:
    """``job``'s leftovers once they are gone or ``seconds`` have passed (reapers work in the background)."""
    deadline = time.monotonic() + seconds
    while (left := leftovers(job)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_a_rate_is_a_number_and_kbit_mbit_or_gbit():
    assert parse_rate("200mbit") == 200_000_000 and parse_rate("1gbit") == 10**9 and parse_rate("500kbit") == 500_000
    assert parse_rate("1.5Gbit") == 1_500_000_000 and rate_name("1.5Gbit") == "1.5gbit"
    assert parse_rate(None) is None and parse_rate(0) is None and rate_name("") is None
    for bad in ("200mb", "fast", "200", 200, "-1mbit", "0mbit", True):
        with pytest.raises(ValueError) as info:
            parse_rate(bad)
        assert str(info.value) == f"rank_net: expected null (no network) or a rate: {RATE_FORMS}, found {bad!r}"
    assert tbf_burst(200_000_000) == 250_000  # 10 ms of the rate
    assert tbf_burst(17_000_000) == tbf_burst(1_000_000) == 64 * 1024  # the floor: 10 ms of 17mbit is 21 KB
    assert rate_burst("200mbit") == 250_000 and rate_burst("17mbit") == 64 * 1024 and rate_burst(None) is None


def test_names_fit_linux_interface_names():
    job = job_name("/tmp/some/run")
    assert len(veth_name(job, 252)) <= 15 and len(bridge_name(job)) <= 15
    assert namespace_name(job, 3).endswith("-r3") and veth_name(job, 3).endswith("r3")


def test_check_rank_net_names_what_is_wrong_in_one_line():
    assert check_rank_net(None, 8) is None and check_rank_net(0, 8) is None
    assert check_rank_net("200mb", 2) == (
        "rank_net: expected null (no network) or a rate: a number and kbit, mbit or gbit, "
        "e.g. 500kbit, 100mbit, 1gbit, found '200mb'"
    )
    assert check_rank_net("1kbit", 2) == (
        "rank_net: expected at least 8kbit, found '1kbit'; a rank could not send one packet a second"
    )
    assert check_rank_net("200mbit", 2, 4) == (
        "rank_net=200mbit puts the ranks of one host on a network of their own, but this job spans more than one host "
        "(2 local of 4 ranks): run a multi-node job without rank_net"
    )
    assert check_rank_net("200mbit", 300, 300) == (
        "rank_net=200mbit: expected at most 253 ranks on a host (one /24), found 300"
    )
    assert "on CUDA devices they send through NCCL" in check_rank_net("200mbit", 2, 2, device="cuda")
    for line in (check_rank_net("x", 2), check_rank_net("1gbit", 2, 4)):
        assert "\n" not in line


@pytest.fixture
def fresh_host_check():
    network._host_problem.cache_clear()
    yield
    network._host_problem.cache_clear()


def test_check_rank_net_names_a_missing_tool(monkeypatch, fresh_host_check):
    monkeypatch.setattr(network.shutil, "which", lambda tool: None if tool == "tc" else f"/usr/sbin/{tool}")
    assert check_rank_net("200mbit", 2, 2) == (
        "rank_net needs the tc command(s) of iproute2, which this host does not have on PATH: install iproute2 or "
        "run without rank_net"
    )


def test_check_rank_net_names_a_user_without_root(monkeypatch, fresh_host_check):
    monkeypatch.setattr(network.os, "geteuid", lambda: 1000)
    assert check_rank_net("200mbit", 2, 2) == (
        "rank_net needs root (CAP_NET_ADMIN) to create network namespaces, veths and a bridge, and this process runs "
        "as uid 1000: run as root or without rank_net"
    )


@needs_net
def test_check_rank_net_names_a_host_without_tbf(monkeypatch, fresh_host_check):
    real = network._run

    def no_tbf(argv, stdin=None):
        if argv[0] == "tc" and "tbf" in argv:
            raise network.NetworkError(
                f"{' '.join(argv)}: Error: Specified qdisc kind is unknown.", "Error: Specified qdisc kind is unknown."
            )
        return real(argv, stdin)

    monkeypatch.setattr(network, "_run", no_tbf)
    assert check_rank_net("200mbit", 2, 2) == (
        "rank_net: the tbf qdisc could not be made (Error: Specified qdisc kind is unknown.); this host cannot shape "
        "a rank's link: run without rank_net"
    )
    assert not [n for n in os.listdir("/sys/class/net") if n.startswith("wgt")]  # the trial's links are gone


def test_a_bad_rate_is_a_config_error_before_any_rank_starts():
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        cfg = compose("config", overrides=["rank_net=200mb"])
    with pytest.raises(ConfigError, match=r"rank_net: expected null \(no network\) or a rate: .*, found '200mb'"):
        validate_config(cfg, 4)


def test_a_multi_node_job_is_a_config_error(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        cfg = compose("config", overrides=["rank_net=200mbit", "device=cpu"])
    with pytest.raises(ConfigError, match=r"this job spans more than one host \(2 local of 4 ranks\)"):
        validate_config(cfg, 4)


def _where(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    threads = {os.stat(f"/proc/self/task/{tid}/ns/net").st_ino for tid in os.listdir("/proc/self/task")}
    data = torch.full((4,), float(rank))
    dist.all_reduce(data)
    return {
        "netns": os.stat("/proc/thread-self/ns/net").st_ino,
        "threads": threads,
        "sum": float(data[0]),
        "ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
        "rate": network.current().rate,
    }


@needs_net
def test_forked_ranks_run_in_namespaces_of_their_own_and_their_reapers_remove_them():
    job = f"test-{uuid.uuid4().hex[:8]}"
    out = run_workers(_where, 2, timeout_s=60, setup=worker_setup("200mbit", job))
    home = os.stat("/proc/thread-self/ns/net").st_ino
    assert len({o["netns"] for o in out} | {home}) == 3  # two namespaces, neither the test's
    assert all(o["threads"] == {o["netns"]} for o in out)  # every thread of the rank, gloo's included
    assert [o["sum"] for o in out] == [1.0, 1.0] and {o["ifname"] for o in out} == {"wagma0"}
    assert {o["rate"] for o in out} == {"200mbit"}
    assert wait_gone(job) == []  # the ranks ended with os._exit: their reapers removed everything


@needs_net
def test_a_transfer_takes_the_time_the_rate_gives_it():
    from benchmarks.rank_net import time_transfers

    records = time_transfers("100mbit", 2, [1.0], reps=3)
    by_kind = {r["kind"]: r for r in records}
    assert {r["burst_bytes"] for r in records} == {tbf_burst(100_000_000)}  # the shaper each record ran with
    assert by_kind["pair"]["model_s"] == pytest.approx(0.08) and by_kind["allreduce"]["model_s"] == pytest.approx(0.08)
    for r in records:  # generous bounds: the emulation is within 10 % on a loaded host; a loopback would be ~0.05x
        assert 0.7 <= r["ratio"] <= 2.0, records


def _send_and_leave(rank: int, world: int) -> float:
    import torch
    import torch.distributed as dist

    data = torch.ones(1_000_000)  # 4 MB: 320 ms at 100 Mbit/s
    if rank == 0:
        dist.send(data, 1)  # done once the kernel has the bytes: rank 0 ends while most of them are on its wire
        return 0.0
    t0 = time.perf_counter()
    dist.recv(data, 0)
    return time.perf_counter() - t0


@needs_net
def test_a_rank_that_ends_while_its_last_message_is_on_the_wire_does_not_cut_it_off():
    job = f"test-{uuid.uuid4().hex[:8]}"
    out = run_workers(_send_and_leave, 2, timeout_s=60, collective_timeout_s=15, setup=worker_setup("100mbit", job))
    assert 0.2 < out[1] < 2.0, out  # received in about 320 ms; cut off, rank 1 would time out
    assert wait_gone(job) == []


def _make_and_wait(job: str, rank: int, ready) -> None:
    net = RankNetwork("100mbit", job=job, rank=rank)
    ready.put(net._reaper.pid)
    time.sleep(60)


@needs_net
def test_a_killed_rank_is_removed_by_its_reaper_and_a_killed_reaper_by_the_sweep():
    job = f"test-{uuid.uuid4().hex[:8]}"
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Queue()
    ranks = [ctx.Process(target=_make_and_wait, args=(job, r, ready)) for r in range(3)]
    try:
        reapers = []
        for rank in ranks:
            rank.start()
            reapers.append(ready.get(timeout=60))
        assert len(leftovers(job)) == 3 + 3 + 1  # namespaces, veths, the bridge
        os.kill(ranks[0].pid, signal.SIGKILL)  # its reaper removes its namespace and veth
        os.kill(reapers[1], signal.SIGKILL)  # no reaper: a stale namespace once the rank dies
        os.kill(ranks[1].pid, signal.SIGKILL)
        for rank in ranks[:2]:
            rank.join(10)
        deadline = time.monotonic() + 20
        while namespace_name(job, 0) in leftovers(job) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sorted(leftovers(job)) == sorted(
            [namespace_name(job, 1), namespace_name(job, 2), veth_name(job, 1), veth_name(job, 2), bridge_name(job)]
        )
        removed = remove_stale_networks()
        assert namespace_name(job, 1) in removed and veth_name(job, 1) in removed
        assert namespace_name(job, 2) in leftovers(job)  # rank 2 is alive: not stale
    finally:
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank.pid, signal.SIGKILL)
            rank.join(10)
    assert wait_gone(job) == []  # rank 2's reaper


def _try_to_make(job: str, wait_s: float, out) -> None:
    started = time.monotonic()
    try:
        net = RankNetwork("100mbit", job=job, rank=0, wait_s=wait_s)
    except NetworkError as err:
        out.put(("error", str(err), time.monotonic() - started))
        return
    out.put(("made", net.namespace, time.monotonic() - started))
    net.leave()


@needs_net
def test_a_rank_whose_namespace_is_still_in_use_waits_for_it_up_to_wait_s():
    job = f"test-{uuid.uuid4().hex[:8]}"
    ctx = multiprocessing.get_context("fork")
    ready, out = ctx.Queue(), ctx.Queue()
    holder = ctx.Process(target=_make_and_wait, args=(job, 0, ready))  # a previous life, still in rank 0's namespace
    try:
        holder.start()
        ready.get(timeout=60)
        refused = ctx.Process(target=_try_to_make, args=(job, 0.5, out))
        refused.start()
        kind, message, waited = out.get(timeout=30)
        assert kind == "error" and waited >= 0.5, (kind, message, waited)
        assert message == (
            f"rank 0: network namespace {namespace_name(job, 0)} is in use by another process after 0.5 s "
            "(another job with the same run directory?)"
        )
        patient = ctx.Process(target=_try_to_make, args=(job, 30.0, out))
        patient.start()
        time.sleep(1.0)
        os.kill(holder.pid, signal.SIGKILL)  # its reaper removes the namespace; the patient one then makes it anew
        kind, made, waited = out.get(timeout=60)
        assert (kind, made) == ("made", namespace_name(job, 0)) and waited >= 1.0, (kind, made, waited)
        for proc in (refused, patient):
            proc.join(30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(holder.pid, signal.SIGKILL)
        holder.join(10)
    assert wait_gone(job) == []


def test_hardware_addresses_are_fixed_by_job_and_rank():
    assert mac_address("job-a", 0) == mac_address("job-a", 0) != mac_address("job-a", 1)
    assert mac_address("job-a", 0) != mac_address("job-b", 0)
    tag = bridge_name("job-a")[3:]
    assert mac_address("job-a", 12) == f"02:{tag[0:2]}:{tag[2:4]}:{tag[4:6]}:{tag[6:8]}:0c"  # locally administered
    assert mac_address("job-a").endswith(":ff")  # the bridge's: no rank's
    with pytest.raises(ValueError, match=r"rank: expected a local rank in \[0, 252\], found 253"):
        mac_address("job-a", 253)


def _listen_and_wait(job: str, rank: int, ready) -> None:
    net = RankNetwork("1gbit", job=job, rank=rank)
    server = socket.create_server((str(net.address.ip), 0))
    ready.put(server.getsockname()[1])
    server.settimeout(60)
    with contextlib.suppress(OSError):
        while True:
            server.accept()[0].close()


def _link(namespace: str | None, name: str) -> dict:
    argv = ["ip", *(["-n", namespace] if namespace else []), "-j", "addr", "show", "dev", name]
    return json.loads(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)[0]


def _connect_s(namespace: str, host: str, port: int) -> float:
    """Seconds until a TCP connection from inside ``namespace`` to ``host:port`` succeeds (tries for 20 s)."""
    code = (
        "import socket, sys, time\n"
        "t0 = time.monotonic()\n"
        "while time.monotonic() - t0 < 20:\n"
        "    try:\n"
        "        socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close(); break\n"
        "    except OSError:\n"
        "        time.sleep(0.1)\n"
        "print(time.monotonic() - t0)\n"
    )
    argv = ["ip", "netns", "exec", namespace, sys.executable, "-c", code, host, str(port)]
    return float(subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60).stdout)


@needs_net
def test_a_rank_started_again_is_reached_at_once_by_its_peers_and_they_still_reach_the_gateway():
    # A rank started again takes its last life's address; had it a new hardware address, a peer that only sends to it
    # (and, when the dead rank's veth held the bridge's lowest port address, to the gateway: a bridge takes that one)
    # would have its frames dropped until its neighbour entry aged out (30 s and more): long enough to stall the peers
    # of a healed torchft replica in its quorum.
    job = f"test-{uuid.uuid4().hex[:8]}"
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Queue()
    ranks = {r: ctx.Process(target=_listen_and_wait, args=(job, r, ready)) for r in range(3)}
    gateway = None
    try:
        ports = {}
        for r, rank in ranks.items():
            rank.start()
            ports[r] = ready.get(timeout=60)
        bridge = _link(None, bridge_name(job))
        assert bridge["address"] == mac_address(job)
        gateway = socket.create_server((bridge["addr_info"][0]["local"], 0))
        gateway.settimeout(60)
        # the victim: the rank whose veth has the lowest address (a bridge with none of its own would take that one)
        victim = min(ranks, key=lambda r: _link(None, veth_name(job, r))["address"])
        peer = next(r for r in ranks if r != victim)
        inner = {r: _link(namespace_name(job, r), "wagma0") for r in ranks}
        assert all(inner[r]["address"] == mac_address(job, r) for r in ranks)
        host = inner[victim]["addr_info"][0]["local"]
        gateway_at = gateway.getsockname()
        assert _connect_s(namespace_name(job, peer), host, ports[victim]) < 1  # the peer's entries: now known
        assert _connect_s(namespace_name(job, peer), *gateway_at) < 1
        os.kill(ranks[victim].pid, signal.SIGKILL)
        ranks[victim].join(10)
        deadline = time.monotonic() + 20
        while namespace_name(job, victim) in leftovers(job) and time.monotonic() < deadline:
            time.sleep(0.1)  # its reaper removes it; the next life makes it again
        ranks[victim] = ctx.Process(target=_listen_and_wait, args=(job, victim, ready))
        ranks[victim].start()
        port = ready.get(timeout=60)
        assert _link(None, bridge_name(job))["address"] == mac_address(job)  # the gateway kept its address
        assert _link(namespace_name(job, victim), "wagma0")["address"] == mac_address(job, victim)
        assert _connect_s(namespace_name(job, peer), *gateway_at) < 3
        assert _connect_s(namespace_name(job, peer), host, port) < 3  # with a new address: about 30 s
    finally:
        if gateway is not None:
            gateway.close()
        for rank in ranks.values():
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(rank.pid, signal.SIGKILL)
            rank.join(10)
    assert wait_gone(job) == []


@needs_net
def test_network_job_removes_what_is_left_of_its_job():
    job = f"test-{uuid.uuid4().hex[:8]}"
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Queue()
    rank = ctx.Process(target=_make_and_wait, args=(job, 0, ready))
    try:
        with network_job(job):
            rank.start()
            ready.get(timeout=60)
            assert len(leftovers(job)) == 3
        assert leftovers(job) == []  # whoever is still in them
    finally:
        os.kill(rank.pid, signal.SIGKILL)
        rank.join(10)
    assert remove_job_networks(job) == []


def _train_noting_netns(rank: int, world_size: int, cfg) -> dict:
    seen = set()

    def note(done: int, _timings: dict) -> None:
        seen.add(os.stat("/proc/thread-self/ns/net").st_ino)

    summary = train(cfg, step_callback=note)
    return {"summary": summary, "seen": sorted(seen)}


def _quick_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        return compose(
            "config",
            overrides=[
                "progress=false",
                "steps=6",
                "eval_every=0",
                "checkpoint_every=0",
                "averaging=allreduce",
                "device=cpu",
                *overrides,
            ],
        )


@needs_net
def test_train_runs_each_rank_on_its_network_and_records_the_rate(tmp_path):
    cfg = _quick_cfg("rank_net=200mbit")
    cfg.run_dir = str(tmp_path)
    job = job_name(tmp_path)
    with network_job(job):
        out = run_workers(_train_noting_netns, 2, cfg, timeout_s=120, setup=worker_setup("200mbit", job))
    assert len({n for o in out for n in o["seen"]}) == 2 and all(len(o["seen"]) == 1 for o in out)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rank_net"] == "200mbit" and summary["rank_net_burst"] == tbf_burst(200_000_000)
    assert leftovers(job) == []


def _train(rank: int, world_size: int, cfg) -> dict:
    return train(cfg)


def test_train_refuses_rank_net_when_the_process_group_came_first(tmp_path):
    cfg = _quick_cfg("rank_net=200mbit")
    cfg.run_dir = str(tmp_path)
    if _WHY is not None:
        pytest.skip(f"cannot make rank networks here: {_WHY}")  # validate_config would refuse first
    outcomes = run_workers_outcomes(_train, 2, cfg, timeout_s=120)
    assert not any(o.ok for o in outcomes)
    assert (
        "rank_net=200mbit: the process group was made before train() could put this rank on its network"
        in outcomes[0].error
    )


# Whole launches: python train.py (the elastic launcher in the process) and torchrun.


def _launch(tmp_path: Path, *overrides: str, torchrun: int = 0) -> subprocess.Popen:
    head = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={torchrun}"]
        if torchrun
        else [sys.executable]
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR")
    return subprocess.Popen(
        [
            *head,
            str(ROOT / "train.py"),
            "progress=false",
            "eval_every=0",
            "checkpoint_every=0",
            "device=cpu",
            "averaging=allreduce",
            f"run_dir={tmp_path}",
            f"hydra.run.dir={tmp_path}/hydra",
            *overrides,
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _cgroups_left(job: str) -> bool:
    return (cgroup_root() / "wagma" / job).exists()


@pytest.mark.slow  # a whole python train.py job
@needs_net
def test_python_train_py_with_rank_net_and_rank_cpus_leaves_nothing(tmp_path):
    quota = check_rank_cpus(0.5, 2) is None
    proc = _launch(tmp_path, "nproc=2", "steps=10", "rank_net=200mbit", *(["rank_cpus=0.5"] if quota else []))
    output, _ = proc.communicate(timeout=170)
    assert proc.returncode == 0, output
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rank_net"] == "200mbit" and summary["rank_cpus"] == (0.5 if quota else 0.0)
    job = job_name(tmp_path)
    assert leftovers(job) == [] and not _cgroups_left(job)


@pytest.mark.slow  # a torchrun job
@needs_net
def test_torchrun_ranks_make_their_own_networks_and_leave_nothing(tmp_path):
    proc = _launch(tmp_path, "steps=6", "rank_net=500mbit", torchrun=3)
    output, _ = proc.communicate(timeout=170)
    assert proc.returncode == 0, output
    assert json.loads((tmp_path / "summary.json").read_text())["rank_net"] == "500mbit"
    assert wait_gone(job_name(tmp_path)) == []  # torchrun runs no wagma cleanup: the ranks' own


def _ranks_on_network(job: str, count: int, seconds: float = 120.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if sum(n.startswith(f"wagma-{bridge_name(job)[3:]}-") for n in os.listdir("/run/netns")) >= count:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow  # a python train.py job, stopped
@needs_net
def test_a_launcher_stopped_by_sigterm_leaves_no_network_and_no_cgroup(tmp_path):
    quota = check_rank_cpus(0.5, 2) is None
    proc = _launch(tmp_path, "nproc=2", "steps=100000", "rank_net=200mbit", *(["rank_cpus=0.5"] if quota else []))
    job = job_name(tmp_path)
    try:
        assert _ranks_on_network(job, 2), proc.stdout.read() if proc.poll() is not None else "no namespaces"
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        assert leftovers(job) == [] and not _cgroups_left(job)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@pytest.mark.slow  # a python train.py job, one of its ranks killed
@needs_net
def test_a_killed_rank_fails_the_job_and_leaves_no_network_and_no_cgroup(tmp_path):
    quota = check_rank_cpus(0.5, 2) is None
    proc = _launch(tmp_path, "nproc=2", "steps=100000", "rank_net=200mbit", *(["rank_cpus=0.5"] if quota else []))
    job = job_name(tmp_path)
    try:
        assert _ranks_on_network(job, 2), proc.stdout.read() if proc.poll() is not None else "no namespaces"
        time.sleep(1.0)
        # the rank's own environ is its spawn's; its reaper's, started from it, has RANK: the rank is its parent
        reaper = next(
            pid
            for pid in descendants(proc.pid)
            if b"RANK=1\0" in _proc(pid, "environ") and b"network.py" in _proc(pid, "cmdline")
        )
        os.kill(int(Path(f"/proc/{reaper}/stat").read_text().rsplit(")", 1)[1].split()[1]), signal.SIGKILL)
        output, _ = proc.communicate(timeout=90)
        assert proc.returncode != 0 and "rank 1 failed: Signal 9 (SIGKILL)" in output, output
        assert leftovers(job) == [] and not _cgroups_left(job)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@pytest.mark.slow  # a python train.py job, killed
@needs_net
def test_a_killed_launcher_leaves_nothing_once_its_ranks_end(tmp_path):
    proc = _launch(tmp_path, "nproc=2", "steps=100000", "rank_net=200mbit")
    job = job_name(tmp_path)
    ranks: dict[int, int] = {}
    try:
        assert _ranks_on_network(job, 2), proc.stdout.read() if proc.poll() is not None else "no namespaces"
        deadline = time.monotonic() + 60  # a rank's namespace exists before its veth: wait for the whole set-up
        while len(leftovers(job)) < 5 and time.monotonic() < deadline:
            time.sleep(0.2)
        ranks = descendants(proc.pid)
        before = leftovers(job)
        assert len(before) == 5, before
        os.kill(proc.pid, signal.SIGKILL)  # no cleanup of its own: the orphaned ranks go on, or end on their own
        proc.wait(10)
        # An orphan may end at once (its output pipe is gone) and its reaper remove its part: nothing new appears.
        assert set(leftovers(job)) <= set(before)
        for pid in ranks:  # what an operator (or the ranks' own timeout) does to orphans
            _kill_unless_reaper(pid)
        assert wait_gone(job) == []  # their reapers
    finally:
        for pid in [proc.pid, *ranks]:
            _kill_unless_reaper(pid)
        remove_job_networks(job)


@pytest.mark.slow  # starts train.py
def test_python_train_py_stops_with_one_line_for_a_bad_rate(tmp_path):
    proc = _launch(tmp_path, "nproc=2", "rank_net=fast")
    output, _ = proc.communicate(timeout=170)
    assert proc.returncode == 2
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: invalid configuration: rank_net: expected null (no network) or a rate: a number and kbit, "
        "mbit or gbit, e.g. 500kbit, 100mbit, 1gbit, found 'fast'"
    ], output


# The benchmarks: run.py and accuracy.py (forked ranks), chaos.py (torchrun).


def test_the_accuracy_grid_runs_each_rate_as_a_cell_of_its_own(tmp_path, monkeypatch):
    from benchmarks import accuracy

    invocations = []

    def fake_run(argv):
        invocations.append(argv)
        return {
            "records": [
                {"scenario": "random_k1", "policy": p, "status": "ok", "final_accuracy": 0.9}
                for p in ("allreduce", "wagma")
            ]
        }

    monkeypatch.setattr(accuracy.run, "main", fake_run)
    monkeypatch.setattr(accuracy, "check_rank_net", lambda *args: None)  # the host's ability: tested above
    out = accuracy.main(
        [
            "--workloads",
            "digits:mlp",
            "--worlds",
            "2",
            "--scenarios",
            "random_k1",
            "--seeds",
            "0",
            "--policies",
            "wagma",
            "--rank-net",
            "0",
            "200Mbit",
            "--out",
            str(tmp_path / "acc"),
            "--work",
            str(tmp_path / "work"),
            "--allow-dirty",
        ]
    )
    assert ["rank_net=200mbit" in argv for argv in invocations] == [False, True]
    assert [r["rank_net"] for r in out["records"]] == [None, None, "200mbit", "200mbit"]
    cell = "digits/mlp P=2 random_k1"
    assert [c["cell"] for c in out["cells"]] == [cell, cell, f"{cell} net 200mbit", f"{cell} net 200mbit"]
    old = {"dataset": "digits", "model": "mlp", "world_size": 2, "scenario": "random_k1"}  # before rank_net existed
    assert accuracy._cell_name(accuracy.cell_key(old)) == "digits/mlp P=2 random_k1"


@needs_net
def test_the_regime_runs_every_rank_on_its_link_and_records_the_link_model(tmp_path, monkeypatch):
    from benchmarks import regime

    traces = regime._rank_traces

    def noting(rank, world_size, spec):  # runs in the forked rank, in its network
        (tmp_path / f"rank{rank}.netns").write_text(str(os.stat("/proc/thread-self/ns/net").st_ino))
        return traces(rank, world_size, spec)

    monkeypatch.setattr(regime, "_rank_traces", noting)
    argv = "--worlds 2 --scenarios none --policies allreduce --compute-ms 5 --steps 3 --warmup 2 --reps 1"
    result = regime.main(
        [*argv.split(), "--out", str(tmp_path), "--no-report", "--slice-ms", "4", "--rank-net", "1Gbit"]
    )
    (rec,) = result["records"]
    assert rec["status"] == "ok" and rec["rank_net"] == "1gbit", rec
    assert result["invocations"][0]["settings"]["rank_net"] == "1gbit"
    assert rec["simulated_link_ms"] > 0 and rec["x_link"] == rec["simulated_link_ms"] / rec["ms_per_step"]
    (rep,) = result["reps"]
    assert rep["link_network"]["bandwidth_Bps"] == 1e9 / 8  # the rate's, not a fit
    home = os.stat("/proc/thread-self/ns/net").st_ino
    spaces = {int((tmp_path / f"rank{r}.netns").read_text()) for r in range(2)}
    assert len(spaces) == 2 and home not in spaces
    assert leftovers(f"regime-net-{os.getpid()}") == []


def test_the_benchmarks_refuse_a_bad_rate_in_one_line(tmp_path, capsys):
    from benchmarks import accuracy, chaos, regime

    with pytest.raises(SystemExit):
        regime.parse_args(["--rank-net", "1OOmbit"])
    with pytest.raises(SystemExit):
        accuracy.parse_args(["--rank-net", "fast"])
    with pytest.raises(SystemExit):
        chaos.main(["--rank-net", "2OOmbit", "--out", str(tmp_path / "c.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(
        "--rank-net: rank_net: expected null (no network) or a rate: a number and kbit, mbit or "
        "gbit, e.g. 500kbit, 100mbit, 1gbit, found '2OOmbit'"
    )
    assert any(line.endswith("found 'fast'") for line in err)
    assert any(
        line.endswith(
            "--rank-net: rank_net: expected null (no network) or a rate: a number and kbit, mbit or "
            "gbit, e.g. 500kbit, 100mbit, 1gbit, found '1OOmbit'"
        )
        for line in err
    )


def test_chaos_runs_every_fault_on_the_rate_and_records_it(tmp_path, monkeypatch):
    import dataclasses

    from test_chaos import survived

    from benchmarks import chaos

    def fake_run_one(spec, root, timeout_s):
        assert f"rank_net={spec.rank_net}" in chaos.overrides(spec, timeout_s)
        return survived(spec, timeout_s)

    monkeypatch.setattr(chaos, "run_one", fake_run_one)
    monkeypatch.setattr(chaos, "check_rank_net", lambda *args: None)
    out = tmp_path / "c.json"
    assert (
        chaos.main(
            [
                "--runs",
                "2",
                "--policies",
                "wagma",
                "--worlds",
                "2",
                "--rank-net",
                "100mbit",
                "--workdir",
                str(tmp_path / "w"),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert [r["rank_net"] for r in json.loads(out.read_text())] == ["100mbit", "100mbit"]
    assert "Ranks' links (`rank_net`): 100mbit." in (tmp_path / "c.md").read_text()
    spec = chaos.plan(1, 0, rank_net="100mbit")[0]
    assert spec.config()[-1] == "100mbit" and dataclasses.replace(spec, rank_net=None).config()[-1] == spec.seed


@pytest.mark.slow  # two short trainings of forked ranks
@needs_net
def test_benchmarks_run_trains_on_the_rate_records_it_and_leaves_nothing(tmp_path):
    from benchmarks import run

    result = run.main(
        [
            "--world",
            "2",
            "--scenarios",
            "none",
            "--steps",
            "8",
            "--eval-every",
            "4",
            "--target",
            "0.5",
            "--policies",
            "allreduce",
            "--set",
            "rank_net=200mbit",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert result["settings"]["rank_net"] == "200mbit" and result["settings"]["rank_cpus"] == 0.0
    assert [(r["status"], r["rank_net"]) for r in result["records"]] == [("ok", "200mbit")]
    assert "each rank on its own 200mbit link (`rank_net`)" in (tmp_path / "out" / "results.md").read_text()
    run_dir = tmp_path / "out" / "runs" / "none" / "allreduce"
    assert json.loads((run_dir / "summary.json").read_text())["rank_net"] == "200mbit"
    assert leftovers(job_name(run_dir)) == []


@pytest.mark.slow  # a chaos run: torchrun, a SIGKILLed rank, a relaunch, a reference run
@pytest.mark.timeout(240)
@needs_net
def test_chaos_kills_a_rank_on_its_network_and_nothing_is_left(tmp_path):
    from benchmarks import chaos

    spec = chaos.Spec(
        index=0,
        policy="allreduce",
        world_size=2,
        fault="SIGKILL",
        victim=1,
        at_s=1.0,
        checkpoint_every=5,
        restart="resume",
        steps=60,
        rank_net="200mbit",
    )
    record = chaos.run_one(spec, tmp_path, timeout_s=5.0)
    assert "error" not in record, record
    assert not record["hung"] and record["named_rank"] and record["resumed"], record
    assert record["bitwise"] is True and record["rank_net"] == "200mbit", record
    for run_dir in [Path(record["run_dir"]), *(tmp_path / "reference").iterdir()]:
        assert json.loads((run_dir / "summary.json").read_text())["rank_net"] == "200mbit"
        assert wait_gone(job_name(run_dir)) == []
