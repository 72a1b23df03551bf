"""benchmarks/own_vs_mean.py: each rank's checkpointed model and their mean, scored on the test set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from benchmarks import own_vs_mean
from wagma.app.train import train
from wagma.testing import run_workers

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _worker(rank: int, world_size: int, cfg: DictConfig) -> dict:
    return train(cfg)


def test_the_mean_of_the_checkpointed_models_is_what_the_final_sync_kept(tmp_path):
    """Local SGD that averages only at the end: the final evaluation scores the ranks' mean, which the script must
    rebuild from the last checkpoint (saved before the final mean); the ranks' own models differ from it."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        cfg = compose(
            "config",
            overrides=["progress=false", "averaging=local_sgd", "averaging.period=1000", "steps=30", "eval_every=0"],
        )
    cfg.run_dir = str(tmp_path)
    run_workers(_worker, 2, cfg, timeout_s=120)
    (tmp_path / ".hydra").mkdir()
    OmegaConf.save(cfg, tmp_path / ".hydra" / "config.yaml")
    out = tmp_path / "scores.json"
    assert own_vs_mean.main([str(tmp_path), "--step", "30", "--out", str(out)]) == 0
    scores = json.loads(out.read_text())
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert scores["loss_unit"] == "nats" and len(scores["own"]) == 2
    assert scores["mean"]["test_loss"] == pytest.approx(summary["test_loss"], rel=1e-5)
    assert scores["mean"]["test_accuracy"] == pytest.approx(summary["test_accuracy"])
    assert scores["own"][0]["test_loss"] != scores["own"][1]["test_loss"] != scores["mean"]["test_loss"]
    with pytest.raises(SystemExit, match=r"expected rank\*\.pt in .*step_00000031, found none"):
        own_vs_mean.main([str(tmp_path), "--step", "31"])
