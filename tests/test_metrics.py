"""What people look at: JSON lines with timestamps, metrics.csv, TensorBoard events, the summary's times, progress."""

import io
import itertools
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_app import _cfg, _compose, _train_worker

from wagma.app.config import ConfigError
from wagma.app.metrics import CSV_COLUMNS, MetricsWriter, read_csv, read_metrics, tensorboard_tag
from wagma.app.progress import Progress, progress_every
from wagma.app.run import format_summary
from wagma.app.train import train
from wagma.testing import run_workers, run_workers_outcomes


def _scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of the run's TensorBoard events: ``{tag: [(step, value), ...]}``."""
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _same(csv_cell: str, value: object) -> bool:
    if value is None:
        return csv_cell == ""
    return math.isclose(float(csv_cell), float(value), rel_tol=1e-12, abs_tol=0.0)


# --- the writer on its own --------------------------------------------------------------------------


def test_metrics_writer_appends_and_truncates_for_resume(tmp_path):
    with MetricsWriter(tmp_path, 2) as w:
        for step in range(1, 6):
            w.write(step, loss=1.0 / step, wait_s=0.001, extra_field=[1, 2], bad=float("nan"))
    records = read_metrics(tmp_path, 2)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert {k: v for k, v in records[1].items() if k not in ("time", "elapsed_s")} == {
        "step": 2,
        "rank": 2,
        "loss": 0.5,
        "wait_s": 0.001,
        "extra_field": [1, 2],
        "bad": None,
    }
    with MetricsWriter(tmp_path, 2, keep_through=3) as w:  # resumed from the checkpoint of step 3
        w.write(4, loss=0.1)
    assert [r["step"] for r in read_metrics(tmp_path, 2)] == [1, 2, 3, 4]
    assert not (tmp_path / "metrics.csv").exists() and not (tmp_path / "tensorboard").exists()  # rank 0's job


def test_every_record_has_a_wall_clock_time_and_elapsed_training_seconds(tmp_path):
    before = time.time()
    with MetricsWriter(tmp_path, 0, elapsed_s=100.0) as w:  # a resumed run that had trained 100 s
        for step in range(1, 6):
            time.sleep(0.01)
            w.write(step, loss=1.0)
    after = time.time()
    records = read_metrics(tmp_path, 0)
    times = [r["time"] for r in records]
    elapsed = [r["elapsed_s"] for r in records]
    assert all(before <= t <= after for t in times) and times == sorted(times)
    assert all(b - a >= 0.009 for a, b in itertools.pairwise(elapsed))
    assert 100.0 < elapsed[0] < elapsed[-1] < 100.0 + (after - before) + 0.01
    with pytest.raises(ValueError, match=r"^elapsed_s: expected a finite number >= 0, found -1.0$"):
        MetricsWriter(tmp_path, 1, elapsed_s=-1.0)


def test_csv_has_a_fixed_header_matches_the_jsonl_and_is_truncated_on_resume(tmp_path):
    with MetricsWriter(tmp_path, 0, with_csv=True) as w:
        for step in range(1, 7):
            extra = {"test_accuracy": 0.5 + step / 100, "test_loss": 1.0 / step} if step % 3 == 0 else {}
            w.write(step, loss=1.0 / step, samples_per_s=1000.0 + step, staleness_hist={0: 3}, **extra)
    header = (tmp_path / "metrics.csv").read_text().splitlines()[0]
    assert header == ",".join(CSV_COLUMNS)
    rows, records = read_csv(tmp_path), read_metrics(tmp_path, 0)
    assert len(rows) == len(records) == 6
    for row, record in zip(rows, records):
        assert all(_same(row[col], record.get(col)) for col in CSV_COLUMNS), (row, record)
    assert [r["test_accuracy"] != "" for r in rows] == [False, False, True, False, False, True]

    with MetricsWriter(tmp_path, 0, keep_through=4, with_csv=True) as w:
        w.write(5, loss=0.01)
    rows = read_csv(tmp_path)
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5] and rows[-1]["loss"] == "0.01"
    assert (tmp_path / "metrics.csv").read_text().count("step,time") == 1  # one header


def test_tensorboard_events_hold_the_scalar_tags_and_a_resume_replaces_the_steps_after_its_checkpoint(tmp_path):
    with MetricsWriter(tmp_path, 0, keep_through=0, with_tensorboard=True) as w:
        for step in range(1, 11):
            w.write(
                step,
                loss=1.0,
                samples_per_s=500.0,
                wait_s=0.002,
                reductions=step,
                staleness=0.5,
                staleness_hist={0: 1},
                gpu_util_pct=30.0,
                steps_in_record=1,
            )
    with MetricsWriter(tmp_path, 0, keep_through=5, with_tensorboard=True) as w:  # resumed from step 5
        for step in range(6, 9):
            w.write(step, loss=2.0, samples_per_s=500.0, wait_s=0.002, reductions=step, staleness=0.5)
        w.add_scalars(8, {"test_accuracy": 0.9, "test_loss": 0.3, "step": 8})
    scalars = _scalars(tmp_path)
    assert {
        "train/loss",
        "train/samples_per_s",
        "train/wait_s",
        "policy/reductions",
        "policy/staleness",
        "train/elapsed_s",
        "gpu/util_pct",
        "eval/test_accuracy",
        "eval/test_loss",
    } == set(scalars)
    assert scalars["train/loss"] == [(s, 1.0) for s in range(1, 6)] + [(s, 2.0) for s in range(6, 9)]
    assert scalars["eval/test_accuracy"] == [(8, pytest.approx(0.9))]
    assert tensorboard_tag("consensus") == "eval/consensus" and tensorboard_tag("compute_s") == "train/compute_s"


def test_without_tensorboard_one_warning_and_the_metrics_go_on(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    with (
        caplog.at_level(logging.WARNING, logger="wagma.app.metrics"),
        MetricsWriter(tmp_path, 0, with_csv=True, with_tensorboard=True) as w,
    ):
        for step in range(1, 4):
            w.write(step, loss=1.0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "tensorboard is not installed" in warnings[0] and "wagma[app]" in warnings[0]
    assert "\n" not in warnings[0]
    assert len(read_metrics(tmp_path, 0)) == len(read_csv(tmp_path)) == 3
    assert not (tmp_path / "tensorboard").exists()


# --- progress ---------------------------------------------------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_line_every_n_steps_off_a_terminal_and_a_live_bar_on_one():
    lines = io.StringIO()
    progress = Progress(total=20, initial=0, every=5, samples_per_step=64, stream=lines)
    assert not progress.live
    for done in range(1, 21):
        progress.update(done, {"loss": 1.0 / done, "wait_s": 0.001} | ({"test_accuracy": 0.9} if done == 12 else {}))
    progress.close()
    out = lines.getvalue().splitlines()
    assert [line.split(" | ")[0] for line in out] == [f"train step {s}/20 ({5 * s}%)" for s in (5, 10, 15, 20)]
    assert "loss 0.2000" in out[0] and "samples/s" in out[0] and "ETA 0:00:00" in out[-1]
    assert "test accuracy" not in out[1] and "test accuracy 90.00 %" in out[2]
    assert "\r" not in lines.getvalue()

    terminal = _Terminal()
    bar = Progress(total=20, initial=10, every=5, samples_per_step=64, stream=terminal)
    assert bar.live
    for done in range(11, 21):
        bar.update(done, {"loss": 0.5, "wait_s": 0.001})
    bar.close()
    assert "\r" in terminal.getvalue() and "20/20" in terminal.getvalue() and "loss=0.500" in terminal.getvalue()

    quiet = io.StringIO()
    off = Progress(total=5, initial=0, every=1, samples_per_step=1, enabled=False, stream=quiet)
    for done in range(1, 6):
        off.update(done, {"loss": 1.0})
    assert quiet.getvalue() == ""


def test_progress_every_defaults_to_a_tenth_of_the_steps_and_refuses_bad_values():
    assert progress_every(None, 300) == 30 and progress_every(None, 4) == 1 and progress_every(7, 300) == 7
    for bad in (0, -3, 2.5, "10", True):
        expected = "an integer >= 1 (steps between progress lines) or null (a tenth of the steps)"
        message = f"invalid configuration:\n  - progress_every: expected {expected}, found {bad!r}"
        with pytest.raises(ConfigError) as info:
            progress_every(bad, 300)
        assert str(info.value) == message


# --- train() on forked ranks ------------------------------------------------------------------------


def test_a_default_run_evaluates_periodically_and_writes_csv_tensorboard_and_a_timed_summary(tmp_path):
    assert _compose().eval_every > 0  # periodic evaluation is on by default
    eval_every = int(_compose().eval_every)
    steps = eval_every + 20
    started = time.time()
    run_workers(_train_worker, 2, _cfg(tmp_path, f"steps={steps}", "log_every=5"), timeout_s=120)
    ended = time.time()

    records = read_metrics(tmp_path, 0)
    assert [r["step"] for r in records if "test_accuracy" in r] == [eval_every]
    for rank in range(2):
        rank_records = read_metrics(tmp_path, rank)
        times = [r["time"] for r in rank_records]
        elapsed = [r["elapsed_s"] for r in rank_records]
        assert times == sorted(times) and started <= times[0] and times[-1] <= ended
        assert elapsed == sorted(elapsed) and 0 < elapsed[0]

    rows = read_csv(tmp_path)
    assert len(rows) == len(records)
    for row, record in zip(rows, records):
        assert all(_same(row[col], record.get(col)) for col in CSV_COLUMNS), (row, record)

    scalars = _scalars(tmp_path)
    for tag in ("train/loss", "train/samples_per_s", "train/wait_s", "policy/staleness", "policy/reductions"):
        assert [s for s, _ in scalars[tag]] == [r["step"] for r in records], tag
    summary = json.loads((tmp_path / "summary.json").read_text())
    periodic = next(r["test_accuracy"] for r in records if "test_accuracy" in r)
    assert scalars["eval/test_accuracy"] == [
        (eval_every, pytest.approx(periodic)),
        (steps, pytest.approx(summary["test_accuracy"])),  # + the final one
    ]

    assert summary["startup_s"] > 0 and summary["train_s"] > 0 and summary["finish_s"] >= 0
    assert summary["startup_s"] + summary["train_s"] + summary["finish_s"] == pytest.approx(summary["wall_s"], abs=1e-9)
    assert summary["train_s"] >= records[-1]["elapsed_s"] - records[0]["elapsed_s"]
    assert summary["staleness"] == 0.0 and summary["staleness_max"] == 0  # allreduce: always fresh


def _train_with_stderr(rank: int, world_size: int, cfg, path: str, terminal: bool) -> dict:
    """train() with this rank's stderr going to ``path`` -- a file, or a file that says it is a terminal."""

    class _Tty(io.TextIOWrapper):
        def isatty(self) -> bool:
            return True

    raw = open(path, "wb")  # closed below
    sys.stderr = (
        _Tty(raw, encoding="utf-8", line_buffering=True) if terminal else io.TextIOWrapper(raw, line_buffering=True)
    )
    try:
        return train(cfg)
    finally:
        sys.stderr.flush()


@pytest.mark.parametrize("terminal", [False, True])
def test_progress_of_a_run_is_lines_in_a_log_file_and_a_bar_on_a_terminal(tmp_path, terminal):
    cfg = _cfg(tmp_path / "run", "progress=true", "steps=30", "progress_every=10")
    run_workers(_train_with_stderr, 2, cfg, str(tmp_path / "stderr"), terminal, timeout_s=120)
    out = (tmp_path / "stderr").read_bytes().decode()  # not read_text(): it turns \r into \n
    if terminal:
        assert "\r" in out and "30/30" in out and "step/s" in out
    else:
        steps = [line.split(" | ")[0] for line in out.splitlines() if line.startswith("train step")]
        assert steps == ["train step 10/30 (33%)", "train step 20/30 (66%)", "train step 30/30 (100%)"]
        assert "\r" not in out


def test_bad_progress_every_fails_on_every_rank_before_training(tmp_path):
    outcomes = run_workers_outcomes(_train_worker, 2, _cfg(tmp_path, "progress_every=0"))
    assert all(not o.ok and "progress_every: expected an integer >= 1 (steps between" in o.error for o in outcomes)
    assert list(tmp_path.iterdir()) == []


def _train_until_rank1_dies(rank: int, world_size: int, cfg) -> dict:
    def die(done: int, _timings: dict) -> None:
        if done == 25 and rank == 1:
            os._exit(9)  # a peer dies: no cleanup

    return train(cfg, step_callback=die)


def test_a_failing_run_leaves_complete_metrics_csv_and_tensorboard_files(tmp_path):
    # Rank 1 dies after step 25; rank 0's step 26 fails. 25 records: more than one flush (every 20) holds.
    cfg = _cfg(tmp_path, "steps=60", "checkpoint_every=0", "dist_timeout_s=20", "failure_report_s=1")
    outcomes = run_workers_outcomes(_train_until_rank1_dies, 2, cfg, timeout_s=120)
    assert not outcomes[0].ok and "did not arrive" in outcomes[0].error, outcomes[0].error
    steps = list(range(1, 26))
    assert [r["step"] for r in read_metrics(tmp_path, 0)] == steps
    assert [int(r["step"]) for r in read_csv(tmp_path)] == steps
    assert [s for s, _ in _scalars(tmp_path)["train/loss"]] == steps


def test_the_printed_summary_separates_start_up_from_training_and_shows_the_staleness():
    summary = {
        "policy": "wagma",
        "world_size": 4,
        "steps": 300,
        "test_accuracy": 0.97,
        "samples_per_s": 30000.0,
        "mean_wait_s": 0.0035,
        "mean_step_s": 0.0042,
        "global_reductions": 27,
        "local_reductions": 273,
        "staleness": 0.37,
        "staleness_max": 3,
        "startup_s": 2.25,
        "train_s": 2.5,
        "finish_s": 0.15,
        "wall_s": 4.9,
    }
    text = format_summary(summary)
    assert "mean staleness 0.37 rounds (max 3)" in text
    assert "wall time     4.9 s (start-up 2.2 s, training 2.5 s)" in text
