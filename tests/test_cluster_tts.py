"""benchmarks/cluster_tts.py: allreduce first, every other policy capped at its time, on runs made by hand."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from benchmarks import cluster_tts


def _fake_run(curves: dict[str, list[tuple[float, float]]], seen: list[list[str]]):
    """Stands in for a training run: records the command and leaves the job a sweep of one would."""

    def run(argv: list[str], sweep: Path) -> None:
        seen.append(argv)
        name = sweep.name
        overrides = [a for a in argv[3:] if not a.startswith("hydra.")]
        # Hydra's job directory: its number and overrides, slashes kept (averaging=reference/x nests it)
        directory = sweep / ("0_" + ",".join(sorted(o for o in overrides if o.startswith("averaging="))))
        directory.mkdir(parents=True)
        (directory / "job.json").write_text(json.dumps({"num": 0, "overrides": overrides, "exit": 0}))
        records = [
            {"step": 100 * (i + 1), "elapsed_s": t, "test_loss": x, "test_accuracy": 0.5}
            for i, (t, x) in enumerate(curves[name])
        ]
        (directory / "metrics_rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        t, loss = curves[name][-1]
        summary = {
            "steps": 100 * len(records),
            "train_s": t,
            "test_loss": loss,
            "test_accuracy": 0.5,
            "stopped": "why",
            "samples_per_s": 10.0,
            "mean_wait_s": 0.1,
        }
        (directory / "summary.json").write_text(json.dumps(summary))

    return run


def test_others_are_capped_at_allreduces_time_and_compared_with_it(tmp_path, monkeypatch, capsys):
    curves = {"allreduce": [(10, 3.0), (20, 2.5)], "wagma": [(8, 2.9), (16, 2.4)], "adpsgd": [(12, 2.8), (25, 2.7)]}
    seen: list[list[str]] = []
    monkeypatch.setattr(cluster_tts, "_run", _fake_run(curves, seen))
    record = tmp_path / "tts.json"
    argv = ["--rate", "40mbit", "--target", "2.5", "--out-dir", str(tmp_path), "--record", str(record)]
    assert cluster_tts.main([*argv, "--policies", "allreduce", "wagma", "adpsgd", "--cap", "1.25"]) == 0
    assert "stop_at_loss=2.5" in seen[0] and not any(a.startswith("stop_after_s") for a in seen[0])
    assert all("stop_after_s=25" in run and "rank_net=40mbit" in run and "nproc=8" in run for run in seen[1:])
    rows = {r["run"]: r for r in json.loads(record.read_text())["runs"]}
    assert rows["allreduce"]["seconds"] == 20 and rows["wagma"]["ratio"] == pytest.approx(0.8)
    assert rows["adpsgd"]["seconds"] is None and rows["adpsgd"]["final_loss"] == 2.7
    assert rows["wagma"]["curve"] == [[100, 8, 2.9, 0.5], [200, 16, 2.4, 0.5]]
    assert "| adpsgd | not reached | - | 200 | 2.700 |" in capsys.readouterr().out
    assert shlex.split(json.loads(record.read_text())["commands"][1])[:3] == ["python", "train.py", "-m"]
    png = record.with_suffix(".png")
    assert png.stat().st_size > 0 and png.read_bytes()[:4] == b"\x89PNG"
    png.unlink()
    assert cluster_tts.main(["--plot-only", str(record)]) == 0 and png.is_file()


def test_a_larger_world_shares_the_machines_cores_and_has_a_directory_of_its_own(tmp_path, monkeypatch):
    curves = {"allreduce": [(10, 3.0), (20, 2.5)], "wagma": [(8, 2.9), (16, 2.4)]}
    seen: list[list[str]] = []
    monkeypatch.setattr(cluster_tts, "_run", _fake_run(curves, seen))
    monkeypatch.setattr(cluster_tts.os, "cpu_count", lambda: 2)
    record = tmp_path / "tts16.json"
    argv = ["--rate", "70mbit", "--target", "2.5", "--out-dir", str(tmp_path), "--record", str(record)]
    assert cluster_tts.main([*argv, "--policies", "allreduce", "wagma", "--nproc", "16"]) == 0
    assert all("nproc=16" in run and "rank_cpus=0.125" in run for run in seen)
    assert all(run[-1].startswith(f"hydra.sweep.dir={tmp_path / '70mbit' / 'p16' / 'seed0'}") for run in seen)
    saved = json.loads(record.read_text())
    assert (saved["nproc"], saved["rank_cpus"]) == (16, 0.125)
    with pytest.raises(SystemExit, match=r"--nproc: expected at least 2 ranks, found 1"):
        cluster_tts.main([*argv, "--nproc", "1"])


def test_a_policys_overrides_follow_its_name_and_allreduce_comes_first(tmp_path):
    argv = cluster_tts.run_command("wagma:averaging.group_size=4,optim.lr=0.002", "40mbit", 1, 2.9, 99.2, tmp_path)
    assert "averaging=wagma" in argv and "averaging.group_size=4" in argv and "optim.lr=0.002" in argv
    assert "seed=1" in argv and "stop_after_s=100" in argv and "steps=6000" in argv
    with pytest.raises(SystemExit, match=r"expected --rate, --target \(or --plot-only RECORD\), found none"):
        cluster_tts.main(["--out-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"--policies: expected allreduce first"):
        cluster_tts.main(["--rate", "40mbit", "--target", "2.5", "--out-dir", str(tmp_path), "--policies", "wagma"])


def test_a_tuned_allreduce_can_be_the_caps_base(tmp_path, monkeypatch):
    curves = {"allreduce_optim.lr-0.002": [(10, 3.0), (16, 2.5)], "wagma_optim.lr-0.002": [(8, 2.9), (17, 2.6)]}
    seen: list[list[str]] = []
    monkeypatch.setattr(cluster_tts, "_run", _fake_run(curves, seen))
    argv = ["--rate", "70mbit", "--target", "2.5", "--out-dir", str(tmp_path), "--cap", "1.0"]
    assert cluster_tts.main([*argv, "--policies", "allreduce:optim.lr=0.002", "wagma:optim.lr=0.002"]) == 0
    assert "optim.lr=0.002" in seen[0] and not any(a.startswith("stop_after_s") for a in seen[0])
    assert "stop_after_s=16" in seen[1]
    with pytest.raises(SystemExit, match=r"expected allreduce first .* found \['allreduce_x'"):
        cluster_tts.main([*argv, "--policies", "allreduce_x", "wagma"])


def test_a_base_record_stands_in_for_allreduce_once_this_machine_matches_it(tmp_path, monkeypatch, capsys):
    curves = {"allreduce": [(10, 3.0), (20, 2.5)], "adpsgd": [(7, 2.8), (14, 2.4)]}
    seen: list[list[str]] = []
    monkeypatch.setattr(cluster_tts, "_run", _fake_run(curves, seen))
    base = tmp_path / "base.json"
    argv = ["--rate", "17mbit", "--seed", "1", "--target", "2.5", "--out-dir", str(tmp_path / "a"), "--cap", "1.0"]
    assert cluster_tts.main([*argv, "--policies", "allreduce", "--record", str(base)]) == 0
    # the check's first 100 steps take 10.4 s here against the base's 10 s: within 5 %, the same loss
    curves |= {"base_check_100": [(10.4, 3.0)], "adpsgd": [(7, 2.8), (14, 2.4)]}
    seen.clear()
    record = tmp_path / "tts.json"
    argv[argv.index("--out-dir") + 1] = str(tmp_path / "b")
    assert cluster_tts.main([*argv, "--base", str(base), "--policies", "adpsgd", "--record", str(record)]) == 0
    check, run = seen
    # one step past the check: its evaluation at step 100 is then a periodic one, timed as the base's was
    assert "steps=101" in check and "averaging=allreduce" in check and not any("stop_" in a for a in check)
    assert "stop_after_s=20" in run and "averaging=adpsgd" in run
    saved = json.loads(record.read_text())
    assert [r["run"] for r in saved["runs"]] == ["allreduce", "adpsgd"]
    assert saved["runs"][1]["ratio"] == pytest.approx(0.7) and saved["base"]["check"]["ratio"] == pytest.approx(1.04)
    assert saved["base"]["record"] == str(base) and "x1.040" in capsys.readouterr().out
    # a slower machine, another loss, another campaign: each stops before any policy runs
    for i, (check_curve, match) in enumerate(
        (
            ([(11, 3.0)], r"found step 100 at 11.0 s against 10.0 s \(x1.100, tolerance 0.05\)"),
            ([(10, 3.1)], r"and test loss 3.1 against 3.0; run allreduce here instead"),
        )
    ):
        curves["base_check_100"] = check_curve
        seen.clear()
        argv[argv.index("--out-dir") + 1] = str(tmp_path / f"c{i}")
        with pytest.raises(SystemExit, match=match):
            cluster_tts.main([*argv, "--base", str(base), "--policies", "adpsgd"])
        assert len(seen) == 1
    # a check run that ended before its last step (stopped early): named, not a traceback
    curves["base_check_200"] = [(10, 3.0)]
    argv[argv.index("--out-dir") + 1] = str(tmp_path / "d")
    with pytest.raises(SystemExit, match=r"expected an evaluation at step 200 in .*_200, found steps \[100\]"):
        cluster_tts.main([*argv, "--base", str(base), "--check-steps", "200", "--policies", "adpsgd"])
    with pytest.raises(SystemExit, match=r"expected the same campaign; seed: 1 there, 2 here"):
        cluster_tts.main([*argv[:3], "2", *argv[4:], "--base", str(base), "--policies", "adpsgd"])


def test_a_policy_in_a_config_subfolder_is_found_kept_and_named_with_its_folder(tmp_path, monkeypatch):
    # Hydra names the job "0_averaging=reference/wagma_overlap,...": its directory lies one level deeper
    curves = {"allreduce": [(10, 3.0), (20, 2.5)], "wagma_overlap_optim.lr-0.004": [(6, 2.8), (12, 2.4)]}
    seen: list[list[str]] = []
    monkeypatch.setattr(cluster_tts, "_run", _fake_run(curves, seen))
    record = tmp_path / "tts.json"
    argv = ["--rate", "17mbit", "--target", "2.5", "--out-dir", str(tmp_path), "--record", str(record), "--cap", "0.8"]
    policies = ["--policies", "allreduce", "reference/wagma_overlap:optim.lr=0.004"]
    assert cluster_tts.main([*argv, *policies]) == 0
    assert "averaging=reference/wagma_overlap" in seen[1] and "stop_after_s=16" in seen[1]
    rows = json.loads(record.read_text())["runs"]
    assert [r["run"] for r in rows] == ["allreduce", "reference/wagma_overlap_optim.lr-0.004"]
    assert rows[1]["seconds"] == 12 and rows[1]["ratio"] == pytest.approx(0.6)
    # rerunning the command keeps both runs (the real _run finds their job.json) and rewrites the same table
    monkeypatch.undo()
    run = cluster_tts.subprocess.run

    def must_not_train(argv: list[str], **kwargs: Any) -> Any:
        assert "train.py" not in argv, f"ran a kept run again: {argv}"
        return run(argv, **kwargs)

    monkeypatch.setattr(cluster_tts.subprocess, "run", must_not_train)
    assert cluster_tts.main([*argv, *policies]) == 0
    assert json.loads(record.read_text())["runs"] == rows
