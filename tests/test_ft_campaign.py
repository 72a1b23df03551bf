"""``benchmarks/ft_campaign.py``: the fault schedule, its argument checks, and one tiny run per mode of the real thing.

The slow test runs the campaign tool as a user would (a subprocess): P = 4, one fault forced 2 s after the first
step, modes ``none``, ``live`` and ``restart``; it checks the records a working harness must write: the kill
happened, the live victim came back into the quorum and was named, the restart job resumed from a checkpoint,
nothing hung, and every run has its accuracy and the Markdown summary its rows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.ft_campaign import (  # noqa: E402
    _recovered,
    check,
    draw_faults,
    kept_for,
    main_parser,
    planned,
    survivor_exits,
)
from benchmarks.ft_campaign_report import with_goodput  # noqa: E402


def test_every_mode_of_a_seed_gets_the_same_draws_and_the_first_fault_can_be_forced():
    faults = draw_faults(7, 30.0, 300.0, None, 1000)
    assert faults == draw_faults(7, 30.0, 300.0, None, 1000) and faults != draw_faults(8, 30.0, 300.0, None, 1000)
    assert all(0 < a[0] < b[0] <= 300 for a, b in zip(faults, faults[1:])) and 3 <= len(faults) <= 30
    assert all(0 <= u < 1 for _, u in faults)
    forced = draw_faults(7, 30.0, 300.0, 2.0, 1)
    assert forced == [[2.0, faults[0][1]]]  # the victim's draw is the seed's; only the time is forced
    assert draw_faults(7, 30.0, -1.0, None, 1000) == []  # the fault-free modes


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--replicas", "1"], "--replicas: expected an integer >= 2, found 1"),
        (["--steps", "30"], "--steps: expected a positive multiple of 4, found 30"),
        (["--mtbf-s", "30", "0"], r"--mtbf-s: expected numbers > 0, found \[30.0, 0.0\]"),
    ],
)
def test_a_bad_argument_is_one_line(tmp_path, argv, message):
    args = main_parser().parse_args([*argv, "--out", str(tmp_path / "c.jsonl")])
    with pytest.raises(SystemExit, match=message):
        check(args)


def test_goodput_and_the_accuracy_gap_are_against_the_same_seeds_reference():
    base = {"replicas": 4, "mtbf_s": 30.0, "steps": 400, "faults": []}
    records = [
        base | {"seed": 0, "mode": "none", "wall_s": 10.0, "test_accuracy": 0.95},
        base | {"seed": 0, "mode": "live", "wall_s": 12.5, "test_accuracy": 0.94},
        base | {"seed": 1, "mode": "live", "wall_s": 12.5, "test_accuracy": 0.94},  # no reference
        base | {"seed": 0, "mode": "restart", "wall_s": 20.0, "test_accuracy": 0.96},  # falls back to none
    ]
    out = with_goodput(records)
    assert [r["goodput"] for r in out] == [1.0, 0.8, None, 0.5]
    assert [r["accuracy_gap"] for r in out] == [0.0, -0.01, None, 0.01]


def test_one_fault_free_reference_serves_every_mtbf():
    base = {"replicas": 4, "steps": 400, "faults": [], "seed": 0}
    records = [
        base | {"mtbf_s": 30.0, "mode": "none", "wall_s": 10.0, "test_accuracy": 0.95},  # an older file's reference
        base | {"mtbf_s": None, "mode": "restart_none", "wall_s": 8.0, "test_accuracy": 0.95},
        base | {"mtbf_s": 60.0, "mode": "live", "wall_s": 12.5, "test_accuracy": 0.94},
        base | {"mtbf_s": 30.0, "mode": "restart", "wall_s": 16.0, "test_accuracy": 0.96},
        base | {"mtbf_s": 60.0, "mode": "restart", "steps": 800, "wall_s": 16.0, "test_accuracy": 0.96},  # other steps
    ]
    assert [r["goodput"] for r in with_goodput(records)] == [1.0, 1.0, 0.8, 0.5, None]


def test_the_plan_runs_each_reference_once_and_each_faulted_mode_at_every_mtbf(tmp_path):
    args = main_parser().parse_args(["--mtbf-s", "30", "60", "--seeds", "0", "1", "--out", str(tmp_path / "c.jsonl")])
    todo = planned(args, [])
    assert todo[:6] == [
        (0, "none", None), (0, "live", 30.0), (0, "live", 60.0),
        (0, "restart_none", None), (0, "restart", 30.0), (0, "restart", 60.0),
    ]  # fmt: skip
    assert len(todo) == 12 and todo[6:] == [(1, mode, mtbf) for _, mode, mtbf in todo[:6]]
    held = [{"replicas": 4, "steps": 2000, "seed": 0, "mode": "none", "mtbf_s": 30.0}]  # a reference of any rate
    held += [{"replicas": 4, "steps": 2000, "seed": 0, "mode": "live", "mtbf_s": 60.0}]
    held += [{"replicas": 4, "steps": 1000, "seed": 1, "mode": "none", "mtbf_s": None}]  # other steps: not this run
    assert planned(args, held) == [t for t in todo if t not in [(0, "none", None), (0, "live", 60.0)]]


def test_a_live_fault_loses_a_survivor_the_rounds_it_discarded_not_their_sum(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "ft").mkdir(parents=True)
    lives = {"1": [{"started": 0.0, "joined": 1.0}, {"started": 10.5, "joined": 14.0}]}
    (run_dir / "replicas.json").write_text(json.dumps({"replicas": lives}))
    rounds = {0: ["group", "discarded", "sync"], 1: [], 2: ["discarded", "group", "group"], 3: ["discarded", "sync"]}
    for q, kinds in rounds.items():  # rounds after the kill at 10 s, before the victim is back at 14 s
        lines = [{"event": "round", "kind": k, "time": 11.0 + i} for i, k in enumerate(kinds)]
        lines.append({"event": "round", "kind": "discarded", "time": 20.0})  # after it was back: not this fault's
        (run_dir / "ft" / f"replica{q}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (tmp_path / "train.out").write_text("replica 1 (pid 77, life 1) was killed by SIGKILL; starting it again\n")
    job = types.SimpleNamespace(out_path=tmp_path / "train.out", live=True, run_dir=run_dir, p=4)
    job._log = lambda q: run_dir / "ft" / f"replica{q}.jsonl"
    fault = {"at": 10.0, "victim": 1, "pid": 77}
    _recovered(job, fault)
    assert fault["discarded"] == {"0": 1, "2": 1, "3": 1} and fault["lost"] == 1  # one round each, not three
    assert fault["recovery_s"] == 4.0 and fault["named"]


def test_a_run_that_missed_the_one_round_target_keeps_its_logs_to_be_read():
    ok = {"hung": False, "exit": 0, "faults": [{"victim": 6, "lost": 1}, {"victim": 2, "lost": 0}]}
    assert kept_for(ok, live=True) is None  # removed
    over = ok | {"faults": [{"victim": 6, "lost": 2}]}
    assert kept_for(over, live=True) == "a survivor lost 2 rounds at the fault on replica 6"
    assert kept_for(over | {"faults": [{"victim": 6, "lost": 14}]}, live=False) is None  # restart: a lower bound
    assert kept_for(ok | {"hung": True}, live=True) == "hung"
    assert kept_for(ok | {"exit": 1}, live=False) == "exit status 1"


def test_a_survivor_that_failed_is_recorded_and_its_run_kept():
    # replica 1's first life was the harness's kill (pid 11); replica 2's first life failed on its own (status 1)
    lives = {
        "2": [{"pid": 20, "exit": 1, "ended": 112.5}, {"pid": 21, "exit": 0, "ended": 190.0}],
        "1": [{"pid": 11, "exit": -9, "ended": 104.7}, {"pid": 12, "exit": 0, "ended": 190.0}],
        "0": [{"pid": 10, "exit": 0, "ended": 190.0}],
    }
    failed = survivor_exits(lives, [{"pid": 11}], start=100.0)
    assert failed == [{"replica": 2, "life": 1, "exit": 1, "ended_s": 12.5}]
    record = {"hung": False, "exit": 0, "faults": [{"victim": 1, "lost": 1}], "survivor_exits": failed}
    assert kept_for(record, live=True) == "1 survivor life(s) failed, the first replica 2's with status 1"
    assert kept_for(record | {"survivor_exits": []}, live=True) is None
    assert survivor_exits({"0": [{"pid": 10}]}, [], start=None) == []  # still running at the end: no exit yet


@pytest.mark.slow  # about 3 min on a loaded 2-core machine: three jobs of four processes, two with a kill
@pytest.mark.timeout(600)
def test_one_tiny_run_per_mode_kills_recovers_and_records(tmp_path):
    out = tmp_path / "campaign.jsonl"
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(ROOT / "benchmarks" / "ft_campaign.py"), "--replicas", "4", "--steps", "400"]
    command += ["--step-s", "0.03", "--first-fault-s", "2", "--max-faults", "1", "--checkpoint-every", "10"]
    command += ["--modes", "none", "live", "restart", "--limit-s", "240", "--out", str(out)]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=560)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    records = {r["mode"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(records) == ["live", "none", "restart"]
    for mode, r in records.items():
        assert not r["hung"] and r["exit"] == 0 and r["wall_s"] > 0, (mode, r)
        assert r["test_accuracy"] > 0.8, (mode, r["test_accuracy"])
    assert records["none"]["faults"] == [] and records["none"]["scheduled"] == 0
    (live,) = records["live"]["faults"]  # the kill happened, on a replica in the quorum
    assert live["named"], live  # the launcher's warning names the replica and pid
    assert live["recovery_s"] is not None and 0 < live["recovery_s"] < 60, live  # back in the quorum
    assert live["lost"] <= 1 and live["lost"] == max(live["discarded"].values()), live
    (restart,) = records["restart"]["faults"]
    assert restart["named"], restart  # the launcher's line at the restart names the killed rank's pid
    assert restart["recovery_s"] is not None and restart["recovery_s"] > 0, restart  # rank 0 trained again
    assert records["restart"]["resumed_from"] is not None, records["restart"]  # from a checkpoint
    assert records["restart"]["resumed_from"] >= restart["checkpoint"] > 0
    summary = out.with_suffix(".md").read_text()
    assert "| 4 | 30 | live | 1 | 0 | 1 | 1/1 | 1/1 |" in summary, summary
    assert "| 4 | 30 | restart | 1 | 0 | 1 |" in summary, summary
    print(done.stdout)
