"""wagma.integrations.torchft: group averaging across torchft's live replicas; a round is applied whole or not at all.

The unit tests drive :class:`ReplicaAverager` with a stand-in manager (what torchft decides is given); the slow test
runs the real thing: a lighthouse, four replica processes, one killed with SIGKILL mid-training and started again.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from wagma.schedule import GroupSchedule

torchft_module = pytest.importorskip("wagma.integrations.torchft", reason="torchft is not installed")
ReplicaAverager = torchft_module.ReplicaAverager
ReplicaProcessGroup = torchft_module.ReplicaProcessGroup

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "torchft_wagma.py"


class _Work:
    def __init__(self, action: Any = None) -> None:
        self.action = action

    def wait(self) -> bool:
        if self.action is not None:
            self.action()
        return True


class _Manager:
    """What torchft decides, given: the quorum, this replica's place in it, and whether the round commits."""

    def __init__(self, members: int, rank: int | None, commit: bool = True, step: int = 0) -> None:
        self.members, self.rank, self.commit, self.step = members, rank, commit, step
        self.errors: list[Exception] = []
        self.quorums = 0

    def start_quorum(self) -> None:
        self.quorums += 1

    def current_step(self) -> int:
        return self.step

    def num_participants(self) -> int:
        return self.members

    def participating_rank(self) -> int | None:
        return self.rank

    def is_participating(self) -> bool:
        return self.rank is not None

    def allreduce(self, tensor: torch.Tensor) -> _Work:
        return _Work(lambda: tensor.mul_(0.5))  # stands for the quorum's mean

    def errored(self) -> Exception | None:
        return self.errors[0] if self.errors else None

    def report_error(self, exc: Exception) -> None:
        self.errors.append(exc)

    def should_commit(self) -> bool:
        ok = self.commit and not self.errors
        if ok:
            self.step += 1
        return ok


class _Group:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.calls = 0

    def allreduce(self, tensors: list[torch.Tensor]) -> _Work:
        self.calls += 1

        def run() -> None:
            if self.fail:
                raise RuntimeError("Connection closed by peer [127.0.0.1]:4242")
            tensors[0].mul_(3.0)  # stands for the sum over a group of three equal models

        return _Work(run)


def _averager(manager: _Manager, group: _Group, monkeypatch: pytest.MonkeyPatch, **options: Any) -> Any:
    param = torch.nn.Parameter(torch.full((4,), 2.0))
    averager = ReplicaAverager([param], **options)
    pg = ReplicaProcessGroup()
    seen: list[tuple[tuple[int, ...], int]] = []

    def member_group(members: tuple[int, ...], rank: int) -> _Group:
        seen.append((members, rank))
        return group

    def member_group_allreduce(members: tuple[int, ...], rank: int, tensor: torch.Tensor) -> None:
        member_group(members, rank).allreduce([tensor]).wait()

    monkeypatch.setattr(pg, "member_group_allreduce", member_group_allreduce)
    averager.attach(manager, pg)
    averager.seen = seen
    return averager


def test_group_round_averages_in_the_schedules_group_of_the_quorum(monkeypatch):
    manager, group = _Manager(members=5, rank=4, step=1), _Group()
    averager = _averager(manager, group, monkeypatch, group_size=2, sync_period=4)
    assert averager.step().kind == "group"
    expected = GroupSchedule.for_members(5, 2).group_of(4, 1)
    assert averager.seen == [(expected, 4)] and len(expected) == 3
    assert torch.equal(averager.params[0].detach(), torch.full((4,), 2.0))  # (3 * 2) / 3
    assert manager.step == 2 and averager.committed == 1


def test_sync_round_uses_the_quorums_mean_and_period_counts_steps(monkeypatch):
    manager, group = _Manager(members=4, rank=0, step=3), _Group()
    averager = _averager(manager, group, monkeypatch, group_size=2, sync_period=4, period=2)
    assert averager.step().kind == "none" and manager.quorums == 0  # between rounds: no quorum, no traffic
    assert averager.step().kind == "sync"
    assert group.calls == 0 and torch.equal(averager.params[0].detach(), torch.full((4,), 1.0))


def test_a_round_a_member_failed_is_rolled_back_whole(monkeypatch):
    # The group allreduce fails mid-round (a peer died): the error goes to torchft, which makes should_commit false;
    # the parameters are those from before the round, bit for bit, and the round does not advance.
    manager, group = _Manager(members=4, rank=1, step=0), _Group(fail=True)
    averager = _averager(manager, group, monkeypatch, group_size=2, sync_period=4)
    before = averager.params[0].detach().clone()
    report = averager.step()
    assert report.kind == "discarded" and not report.kept
    assert len(manager.errors) == 1 and "Connection closed" in str(manager.errors[0])
    assert torch.equal(averager.params[0].detach(), before) and manager.step == 0
    assert (averager.committed, averager.discarded) == (0, 1)


def test_a_round_another_replica_failed_is_rolled_back_too(monkeypatch):
    # This replica's own group succeeded, but torchft says a member of the quorum failed: nothing is applied.
    manager, group = _Manager(members=4, rank=1, commit=False), _Group()
    averager = _averager(manager, group, monkeypatch, group_size=2, sync_period=4)
    before = averager.params[0].detach().clone()
    assert averager.step().kind == "discarded" and group.calls == 1
    assert torch.equal(averager.params[0].detach(), before)


def test_a_healing_replica_sits_out_group_rounds(monkeypatch):
    manager, group = _Manager(members=4, rank=None), _Group()
    averager = _averager(manager, group, monkeypatch, group_size=2, sync_period=4)
    report = averager.step()
    assert report.kind == "group" and group.calls == 0 and report.share is None


def test_each_round_hands_every_participant_the_next_share_by_rank(monkeypatch):
    manager = _Manager(members=3, rank=1)
    averager = _averager(manager, _Group(), monkeypatch, group_size=3, sync_period=0)
    joined = averager.join()
    assert (joined.round, joined.trained_share, joined.kept, joined.share) == (0, None, False, 1)
    assert averager.local_steps == 0  # joining is not a step
    manager.rank = 2  # the next quorum places this replica third
    report = averager.step()
    assert (report.round, report.members, report.trained_share, report.kept, report.share) == (1, 3, 1, True, 5)


def test_a_replica_that_heals_in_a_round_does_not_keep_its_period(monkeypatch):
    # torchft loads a peer's state inside start_quorum: the shares count comes from the peer and what this replica
    # trained since its last round is gone, so its share is reported as not kept.
    manager = _Manager(members=2, rank=0)
    averager = _averager(manager, _Group(), monkeypatch, group_size=2, sync_period=0)
    averager.join()
    peer = {"local_steps": 7, "committed": 9, "discarded": 0, "shares_assigned": 18}
    monkeypatch.setattr(manager, "start_quorum", lambda: averager.load_state_dict(peer))
    report = averager.step()
    assert report.trained_share == 0 and not report.kept and report.share == 18
    assert averager.shares_assigned == 20 and averager.local_steps == 7


def test_state_dict_round_trip_and_bad_input(monkeypatch):
    averager = _averager(_Manager(members=2, rank=0), _Group(), monkeypatch, group_size=2, sync_period=2)
    averager.step()
    other = ReplicaAverager([torch.zeros(1)], group_size=2)
    other.load_state_dict(averager.state_dict())
    assert other.state_dict() == {"local_steps": 1, "committed": 1, "discarded": 0, "shares_assigned": 2}
    with pytest.raises(ValueError, match=r"missing \['discarded', 'shares_assigned'\]"):
        other.load_state_dict({"local_steps": 1, "committed": 0})
    with pytest.raises(ValueError, match=r"^group_size: expected an integer >= 2, found 0$"):
        ReplicaAverager([torch.zeros(1)], group_size=0)
    with pytest.raises(ValueError, match="params: expected at least one tensor"):
        ReplicaAverager([])
    with pytest.raises(RuntimeError, match=r"attach\(manager, process_group\)"):
        ReplicaAverager([torch.zeros(1)]).step()
    with pytest.raises(TypeError, match="ReplicaProcessGroup"):
        ReplicaAverager([torch.zeros(1)]).attach(_Manager(2, 0), object())


# ---------------------------------------------------------------------------------------------------------------
# The real thing: a lighthouse, four replica processes, one killed mid-training and started again.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return [line for line in lines if not line.get("final")]


def _final_losses(paths: list[Path]) -> list[float]:
    lines = [json.loads(line) for path in paths for line in path.read_text().splitlines() if line.endswith("}")]
    return [line["test_loss"] for line in lines if line.get("final")]


def _replica(
    index: int, port: int, lighthouse: str, rounds: int, log: Path, out: Path, *extra: str
) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RUST_LOG": "warn"}
    command = [sys.executable, str(EXAMPLE), "--replica", str(index), "--store-port", str(port)]
    command += ["--lighthouse", lighthouse, "--rounds", str(rounds), "--log", str(log), "--timeout-s", "10", *extra]
    return subprocess.Popen(command, stdout=out.open("ab"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def _wait_for(condition: Any, what: str, deadline: float) -> None:
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.slow  # about 20 s each: five processes, a real SIGKILL and a restart that heals from a peer
@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", ["from_outside", "mid_group_round", "mid_sync_round"])
def test_survivors_go_on_and_a_killed_replica_heals_from_a_peer(tmp_path, fault):
    # from_outside: the test kills the victim once it has averaged 20 rounds with the others, wherever it is (in a
    # round or between two; torchft's heartbeat finds it gone). mid_group_round / mid_sync_round: the victim kills
    # itself inside round 30 (a group round) or 31 (a sync round), after the quorum formed, before its allreduce:
    # the replicas whose allreduce held it must discard that round (its group partner; in a sync round, everyone).
    binary = shutil.which("torchft_lighthouse") or str(Path(sys.executable).parent / "torchft_lighthouse")
    lighthouse_port, rounds, victim = _free_port(), 240, 2
    lighthouse = subprocess.Popen(
        [binary, "--bind", f"[::]:{lighthouse_port}", "--min_replicas", "2", "--join_timeout_ms", "500",
         "--heartbeat_timeout_ms", "1000"],
        stdout=(tmp_path / "lighthouse.log").open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    address = f"http://127.0.0.1:{lighthouse_port}"
    ports = [_free_port() for _ in range(4)]
    logs = [tmp_path / f"replica{r}.jsonl" for r in range(4)]
    outs = [tmp_path / f"replica{r}.out" for r in range(4)]
    die_in = {"mid_group_round": 30, "mid_sync_round": 31}.get(fault)
    dying = ("--die-in-round", str(die_in)) if die_in is not None else ()
    procs = [
        _replica(r, ports[r], address, rounds, logs[r], outs[r], *(dying if r == victim else ())) for r in range(4)
    ]
    try:
        deadline = time.monotonic() + 120
        if fault == "from_outside":
            _wait_for(lambda: len(_records(logs[victim])) >= 20, outs[victim].read_text()[-2000:], deadline)
            procs[victim].send_signal(signal.SIGKILL)
        _wait_for(lambda: procs[victim].poll() is not None, "the victim did not die", deadline)
        assert procs[victim].returncode == -signal.SIGKILL, outs[victim].read_text()[-2000:]
        killed_at, killed_round = time.time(), _records(logs[victim])[-1]["committed"]
        time.sleep(1.0)
        procs[victim] = _replica(victim, ports[victim], address, rounds, logs[victim], outs[victim])
        for r, proc in enumerate(procs):
            assert proc.wait(timeout=180) == 0, outs[r].read_text()[-3000:]
    finally:
        for proc in [*procs, lighthouse]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    records = [_records(log) for log in logs]
    # Every replica ends at the last round, a sync round, with the same model.
    assert {r[-1]["committed"] for r in records} == {rounds} and {r[-1]["kind"] for r in records} == {"sync"}
    assert len({r[-1]["checksum"] for r in records}) == 1
    losses = _final_losses(logs)
    assert len(losses) == 4 and len(set(losses)) == 1 and losses[0] < 0.05, losses  # one model, and it learned
    for index in (0, 1, 3):  # the survivors
        mine = records[index]
        after = [x for x in mine if x["time"] > killed_at]
        # They went on without the victim (quorums of three), lost at most one round to the fault ...
        assert any(x["members"] == 3 for x in after), f"replica {index} never ran a round without the victim"
        assert sum(x["kind"] == "discarded" for x in mine) <= 1
        committed = [x["round"] for x in mine if x["kind"] != "discarded"]
        assert committed == sorted(set(committed)), f"replica {index} repeated a round: {committed}"
        # a replica that discarded a round heals from a peer at the next quorum: it skips that one round
        assert len(range(committed[0], rounds)) - len(committed) <= 1, f"replica {index} lost more than a round"
    if die_in is not None:  # the round the victim died in was discarded by the replicas its allreduce held
        assert killed_round == die_in  # records count rounds committed: die_in of them before round die_in began
        discarded = [index for index in (0, 1, 3) if any(x["kind"] == "discarded" for x in records[index])]
        if fault == "mid_sync_round":
            assert discarded == [0, 1, 3]
        else:  # groups of two in a quorum of four: the victim's one partner
            assert len(discarded) == 1
    # ... and the victim came back into the quorum within 30 s, healed at the job's round, not from the start.
    back = [x for x in records[victim] if x["time"] > killed_at]
    assert back and back[0]["round"] > killed_round, (killed_round, back[:1])  # its join: a round of the job's
    # No share of the data was trained on twice into the job's state. The fault lost at most the victim's two (the
    # one it was training on, the one the round it died in still handed it) and, for each survivor whose allreduce
    # held the victim, the one it discarded -- and, for its group partner, the period it then healed over.
    kept = [x["trained_share"] for r in records for x in r if x["kept"]]
    assert len(kept) == len(set(kept))
    lost = set(range(max(kept) + 1)) - set(kept)
    assert len(lost) <= {"from_outside": 5, "mid_group_round": 4, "mid_sync_round": 5}[fault], sorted(lost)
    assert back[0]["time"] - killed_at < 30.0
    assert any(x["members"] == 4 for x in back)
