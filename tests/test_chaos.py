"""The chaos harness (benchmarks/chaos.py): its plan, how it reads a job's output, and one real fault run."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import chaos  # noqa: E402


def test_the_plan_covers_every_combination_before_repeating_and_is_reproducible():
    combos = len(chaos.POLICIES) * len(chaos.WORLDS) * len(chaos.FAULTS)
    specs = chaos.plan(combos + 5, seed=3)
    assert specs == chaos.plan(combos + 5, seed=3)
    assert {(s.policy, s.world_size, s.fault) for s in specs[:combos]} == {
        (p, w, f) for p in chaos.POLICIES for w in chaos.WORLDS for f in chaos.FAULTS
    }
    assert all(0 <= s.victim < s.world_size and 0.3 <= s.at_s <= 2.5 for s in specs)
    assert {s.restart for s in specs} == set(chaos.RESTARTS)


def _spec(fault: str, victim: int) -> chaos.Spec:
    return dataclasses.replace(chaos.plan(1, 0)[0], fault=fault, victim=victim, world_size=4)


def test_a_frozen_rank_counts_as_named_only_when_a_survivor_says_it_did_not_arrive():
    said = "RuntimeError: step 5 failed on rank 0: rank(s) [2] did not arrive at step 5 -- they sent no report"
    assert chaos.named(said, _spec("SIGSTOP", 2))
    assert not chaos.named(said, _spec("SIGSTOP", 5)) and not chaos.named(said, _spec("SIGSTOP", 0))
    engine = ("round 6: rank(s) [1] of group (0, 1) did not arrive: rank 1 last seen in round 5; "
              "furthest behind: rank(s) [3]: rank 3 last seen in round 4")
    assert chaos.named(engine, _spec("SIGSTOP", 3)) and chaos.named(engine, _spec("SIGSTOP", 1))
    assert not chaos.named(engine, _spec("SIGSTOP", 0)) and not chaos.named(engine, _spec("SIGSTOP", 6))
    gossip = "TimeoutError: SGPAverager: round 7: no model arrived from rank 3 within 5 s; rank 3 is slow, hung or gone"
    assert chaos.named(gossip, _spec("SIGSTOP", 3)) and not chaos.named(gossip, _spec("SIGSTOP", 1))
    handed = "ADPSGDAverager (progress thread): exchange 4: could not hand its model to rank 1 within 5 s"
    assert chaos.named(handed, _spec("SIGSTOP", 1)) and not chaos.named(handed, _spec("SIGSTOP", 2))
    # torchrun's report of the survivor that raised first names that survivor, not the frozen rank.
    blamed = "  rank      : 2 (local_rank: 2)\n  exitcode  : 1 (pid: 9730)"
    assert not chaos.named(blamed, _spec("SIGSTOP", 2))


def test_a_dead_rank_is_named_by_torchruns_record_of_its_signal():
    agent = "E1123 api.py:1002] failed (exitcode: -9) local_rank: 2 (pid: 9713) of binary: python"
    assert chaos.named(agent, _spec("SIGKILL", 2))
    assert not chaos.named(agent, _spec("SIGKILL", 3))
    report = "[1]:\n  rank      : 3 (local_rank: 3)\n  exitcode  : -15 (pid: 97)  (SIGTERM)\n"
    assert chaos.named(report, _spec("SIGTERM", 3))
    survivor = "[1]:\n  rank      : 3 (local_rank: 3)\n  exitcode  : 1 (pid: 97)\n"
    assert not chaos.named(survivor, _spec("SIGTERM", 3))


def test_a_relaunch_that_finished_the_run_counts_as_resumed_even_from_step_0():
    struck = 1000.0
    # Struck before the first complete checkpoint: the relaunch trained from step 0 and finished (run 17).
    assert chaos.came_back({"steps": 60, "resumed_from": None}, struck + 30, struck, 60) == (True, 0)
    assert chaos.came_back({"steps": 60, "resumed_from": 20}, struck + 30, struck, 60) == (True, 20)
    # Not resumed: no summary, a summary of fewer steps, or one the first launch wrote before the fault.
    assert chaos.came_back(None, None, struck, 60) == (False, None)
    assert chaos.came_back({"steps": 40, "resumed_from": 20}, struck + 30, struck, 60) == (False, None)
    assert chaos.came_back({"steps": 60, "resumed_from": None}, struck - 1, struck, 60) == (False, None)
    records = [{"index": i, "policy": "wagma", "world_size": 8, "fault": "SIGKILL", "victim": 1, "at_s": 1.0,
                "timeout_s": 5.0, "hung": False, "max_survivor_s": 1.0, "named_rank": True, "resumed": True,
                "resumed_from": start, "bitwise": None} for i, start in enumerate((0, 20))]
    summary = chaos.markdown(records, "cmd")
    assert "| run resumed to completion after the fault | 2 of 2 (1 from step 0" in summary
    assert "Runs that missed a target" not in summary


def test_a_fault_after_the_summary_was_written_is_not_a_fault_run():
    # Seed 3's first run: a wagma rank SIGSTOPped 0.3 s after rank 0 wrote the summary (the rank was in its
    # teardown); the survivors exited 0 and the launcher blamed the harness's final SIGKILL.
    struck = 1000.0
    assert chaos.finished_before(struck - 0.3, struck)
    assert not chaos.finished_before(None, struck)
    assert not chaos.finished_before(struck + 5, struck)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_killed_allreduce_rank_is_survived_named_and_resumed_to_the_uninterrupted_model(tmp_path):
    spec = chaos.Spec(index=0, policy="allreduce", world_size=2, fault="SIGKILL", victim=1, at_s=1.0,
                      checkpoint_every=5, restart="resume", steps=60)
    record = chaos.run_one(spec, tmp_path, timeout_s=5.0)
    assert "error" not in record, record
    assert not record["hung"] and record["max_survivor_s"] <= 2 * 5.0, record
    assert record["named_rank"], record
    assert record["resumed"] and 0 < record["resumed_from"] < 60, record
    assert record["bitwise"] is True, record


def test_campaigns_run_side_by_side_merge_into_one_record_list_and_summary(tmp_path):
    def record(index: int, fault: str, **changes: object) -> dict:
        return {"index": index, "policy": "wagma", "world_size": 4, "fault": fault, "victim": 1, "at_s": 1.0,
                "timeout_s": 5.0, "hung": False, "max_survivor_s": 1.0, "named_rank": True, "resumed": True,
                "bitwise": None, **changes}

    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "all.json"
    a.write_text(json.dumps([record(0, "SIGKILL"), record(1, "SIGSTOP", max_survivor_s=12.0)]))
    b.write_text(json.dumps([record(0, "SIGSTOP", named_rank=False)]))
    assert chaos.main(["--merge", str(a), str(b), "--out", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert [(r["campaign"], r["index"]) for r in merged] == [(str(a), 0), (str(a), 1), (str(b), 0)]
    summary = (tmp_path / "all.md").read_text()
    assert "| every survivor ends within 2 x timeout | 2 of 3 runs |" in summary
    assert "| faulty rank named, SIGSTOP runs | 1 of 2 |" in summary


def test_a_campaign_finds_reference_configs_as_the_other_benchmarks_do():
    spec = chaos.plan(1, 0)[0]  # benchmarks.presets.averaging_option, tested in test_benchmarks with candidates too
    for policy, option in (("allreduce", "allreduce"), ("eager_solo", "reference/eager_solo"),
                           ("wagma_ahead_conserve", "wagma_ahead_conserve")):
        assert f"averaging={option}" in chaos.overrides(dataclasses.replace(spec, policy=policy), 5.0)
