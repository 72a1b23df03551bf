"""``ft=torchft``: the config group and its checks."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from wagma.app.config import ConfigError, validate_config

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
        (["ft.lighthouse=host:29510"], "ft.lighthouse: expected null (start one) or an address http://host:port"),
        (["parallel=hsdp", "shard_size=2"], "parallel: expected 'ddp', found 'hsdp'"),
        (["resume=true"], "resume: expected False, found True"),
    ],
)
def test_a_bad_ft_config_is_named_before_anything_starts(overrides, message):
    cfg = _cfg("ft=torchft", "replicas=3", "steps=40", *overrides)
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, int(cfg.replicas))
    assert any(p.startswith(message) for p in err.value.problems), err.value.problems


def test_ft_none_is_the_application_as_before_and_torchft_leaves_averaging_alone():
    validate_config(_cfg(), 4)  # the default: ft=none
    with pytest.raises(ConfigError, match="group_size"):
        validate_config(_cfg("replicas=3"), 3)  # ft=none checks wagma's group_size 2 against 3 ranks
    validate_config(_cfg("ft=torchft", "replicas=3", "steps=40"), 3)  # the ft group sets the averaging


def test_train_under_torchrun_refuses_ft_in_one_line(tmp_path):
    from wagma.app.train import train

    with pytest.raises(ConfigError, match="python train.py ft=torchft replicas=N"):
        train(_cfg("ft=torchft", f"run_dir={tmp_path}"))
