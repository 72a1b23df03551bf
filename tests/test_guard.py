"""The run-time guard (wagma.app.guard): closed-form loss curves, then real runs that stall and that run stale."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, open_dict

from wagma.app.guard import TrainingGuard
from wagma.app.run import format_summary
from wagma.app.train import train
from wagma.testing import run_workers

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _feed(guard: TrainingGuard, losses, stats=None) -> list[tuple[int, str]]:
    fired = []
    for step, loss in enumerate(losses, 1):
        line = guard.observe(step, loss, stats)
        if line is not None:
            fired.append((step, line))
    return fired


def test_a_run_that_learns_and_levels_off_raises_nothing():
    losses = [2.3 * math.exp(-i / 30) + 0.01 for i in range(400)]  # learns, then flat far below the start
    guard = TrainingGuard("wagma", 400, validated_staleness=2.0, remedy="x")
    assert _feed(guard, losses, {"staleness": 1.5, "staleness_max": 4}) == []
    assert guard.finish(staleness=1.9, test_accuracy=0.97, num_classes=10) == [] and guard.ok


def test_a_loss_that_never_drops_is_stalled_once_patience_runs_out():
    guard = TrainingGuard("eager_solo_overlap", 400, validated_staleness=1.0, remedy="averaging=eager_majority")
    fired = _feed(guard, [2.30 + 0.01 * ((i * 7) % 3) for i in range(400)], {"staleness": 0.5, "staleness_max": 2})
    assert len(fired) == 1, fired  # once, not every window
    step, line = fired[0]
    assert guard.window == 20 and guard.patience == 100 and step == 120  # first window at 20, +100 without progress
    assert line.startswith("eager_solo_overlap is not learning: the training loss")
    assert "staleness 0.50 rounds (max 2, validated up to 1)" in line and line.endswith(
        "; try averaging=eager_majority"
    )


def test_a_loss_that_rises_back_and_stays_is_flagged_once_patience_runs_out():
    losses = [2.3 - 0.02 * i for i in range(80)] + [2.2] * 60  # down to ~0.7, then back up for good
    guard = TrainingGuard("eager_solo", 400, window=10, patience=30)
    fired = _feed(guard, losses, {"staleness": 3.4, "staleness_max": 15})
    assert len(fired) == 1 and fired[0][0] == 110, fired  # three windows back up: 90, 100, 110
    assert "rose back to 2.2 and stayed there for 30 steps (best 0.81 at step 80, first 2.21)" in fired[0][1]


# Rank 0's training loss of allreduce and eager_majority on MNIST/CNN, P = 8, random_k1, seed 0, in windows of 20
# steps, copied from the metrics files of the runs behind benchmarks/results/accuracy/before_issue28 (those files
# stayed in the grid's work folder; its committed records keep accuracy curves, not losses, so these numbers live
# here only): both spike around step 50 and then learn (96.2 and 95.7 %). The test uses them as shapes.
ALLREDUCE = [2.29, 1.85, 2.39, 1.42, 0.78, 0.46, 0.29, 0.17, 0.18, 0.14, 0.16, 0.08, 0.07, 0.07, 0.06, 0.08, 0.03]
MAJORITY = [2.29, 1.99, 2.75, 1.93, 1.59, 1.64, 0.86, 0.51, 0.4, 0.29, 0.27, 0.23, 0.19, 0.15, 0.14, 0.17, 0.08]
# eager_solo_overlap in the same grid, copied the same way: it never learns (10.00 % at the end).
OVERLAP = [2.3, 2.22, 2.54, 2.31, 2.28, 2.23, 2.27, 2.36, 2.26, 1.91, 2.24, 2.38, 2.3, 2.22, 2.32, 2.04, 2.45, 2.29]


@pytest.mark.parametrize("curve,fires_at", [(ALLREDUCE, None), (MAJORITY, None), (OVERLAP, 140)])
def test_measured_loss_curves_early_spikes_are_not_a_stall_and_a_run_that_never_learns_is(curve, fires_at):
    guard = TrainingGuard("policy", 400, chance_loss=math.log(10))
    fired = _feed(guard, [value for value in curve for _ in range(20)])
    assert [step for step, _ in fired] == ([] if fires_at is None else [fires_at]), fired


def test_a_non_finite_loss_is_diverged_at_that_step():
    guard = TrainingGuard("allreduce", 100)
    fired = _feed(guard, [2.0, 1.9, float("nan"), float("inf")])
    assert [(s, line.split(":")[0]) for s, line in fired] == [(3, "allreduce diverged")]
    assert "no staleness reported" in fired[0][1]


def test_staleness_above_the_validated_bound_is_flagged_and_none_disables_the_check():
    stale = TrainingGuard("wagma", 200, validated_staleness=1.0)
    fired = _feed(stale, [1.0 / (i + 1) + 1e-3 for i in range(200)], {"staleness": 1.4, "staleness_max": 3})
    assert len(fired) == 1 and fired[0][0] == stale.patience == 50  # the early running mean is not judged
    assert fired[0][1] == (
        "wagma runs staler than validated: measured at step 50; staleness 1.40 rounds (max 3, validated up to 1)"
    )
    unchecked = TrainingGuard("wagma", 200, validated_staleness=None)
    assert _feed(unchecked, [1.0] * 50, {"staleness": 9.0}) == [] and unchecked.finish(staleness=9.0) == []
    at_end = TrainingGuard("wagma", 200, validated_staleness=1.0)
    assert at_end.finish(staleness=1.2, staleness_max=5) == [
        "wagma runs staler than validated: measured over the run; staleness 1.20 rounds (max 5, validated up to 1)"
    ]


def test_chance_accuracy_at_the_end_is_flagged():
    guard = TrainingGuard("eager_solo", 300)
    (line,) = guard.finish(test_accuracy=0.10, num_classes=10, steps=300)
    assert "final test accuracy 10.00 % is at chance level (10 % for 10 classes) after 300 steps" in line
    assert TrainingGuard.summary_field([line]) == {"ok": False, "warnings": [line]}


@pytest.mark.parametrize("bad", [-1, "high", True])
def test_bad_validated_staleness_is_a_value_error(bad):
    with pytest.raises(
        ValueError, match=rf"^validated_staleness: expected None or a finite number >= 0, found {bad!r}$"
    ):
        TrainingGuard("wagma", 10, validated_staleness=bad)


# --- real runs ----------------------------------------------------------------------------------------------


def _cfg(run_dir: Path, *overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        cfg = compose("config", overrides=["progress=false", "checkpoint_every=0", "eval_every=0", *overrides])
    cfg.run_dir = str(run_dir)
    return cfg


def _train_logging(rank: int, world_size: int, cfg: DictConfig) -> dict:
    """train() with the guard's log lines captured, each with the step it came at."""
    seen: list[tuple[int, str]] = []
    at = [0]

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("guard: "):
                seen.append((at[0], record.getMessage()))

    handler = Capture()
    logging.getLogger("wagma.app.train").addHandler(handler)
    try:
        summary = train(cfg, step_callback=lambda done, _t: at.__setitem__(0, done))
    finally:
        logging.getLogger("wagma.app.train").removeHandler(handler)
    return {"summary": summary, "seen": seen}


def test_a_run_that_really_stalls_is_named_while_it_runs_and_in_the_summary(tmp_path):
    # A learning rate far too high: the loss jumps to chance level at once and stays there. Without the guard this run
    # ends with exit status 0 and a normal-looking summary.
    cfg = _cfg(tmp_path, "averaging=allreduce", "optim.lr=20", "steps=200")
    out = run_workers(_train_logging, 2, cfg, timeout_s=120)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["test_accuracy"] < 0.2, summary
    assert summary["guard"]["ok"] is False and summary["guard"] == out[0]["summary"]["guard"]
    assert any("allreduce is not learning" in w or "allreduce diverged" in w for w in summary["guard"]["warnings"])
    steps_seen = [step for step, _ in out[0]["seen"]]
    assert steps_seen and steps_seen[0] < 200, out[0]["seen"]  # said while it ran, before the last step
    assert out[1]["seen"] == []  # rank 0 speaks for the run
    assert "warning       allreduce" in format_summary(summary)


def test_a_run_staler_than_its_preset_was_validated_for_is_named(tmp_path):
    # eager solo on 4 ranks: most gradients are a round late; a preset validated for fresh rounds only must say so.
    cfg = _cfg(tmp_path, "averaging=reference/eager_solo", "steps=60", "imbalance=random_k", "imbalance.delay_s=0.01")
    with open_dict(cfg):
        cfg.averaging.validated_staleness = 0.0
    out = run_workers(_train_logging, 4, cfg, timeout_s=120)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["staleness"] > 0
    stale = [w for w in summary["guard"]["warnings"] if "runs staler than validated" in w]
    assert len(stale) == 1 and stale[0].startswith(f"{summary['policy']} runs staler than validated")
    assert "validated up to 0" in stale[0] and "; try " in stale[0]
    assert any("runs staler than validated" in line for _, line in out[0]["seen"])
