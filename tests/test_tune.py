"""benchmarks/tune.py: one budget per policy, and the choice by time to the target, on sweeps made by hand."""

from __future__ import annotations

import itertools
import json
import math
import shlex
from pathlib import Path

import pytest

from benchmarks import tune


def _job(sweep: Path, num: int, overrides: list[str], curve: list[tuple[float, float, float]], exit: int = 0) -> None:
    """A finished job as ``python train.py -m`` leaves it: evaluations (seconds, loss, accuracy), the last final."""
    directory = sweep / str(num)
    directory.mkdir(parents=True)
    (directory / "job.json").write_text(json.dumps({"num": num, "overrides": overrides, "exit": exit, "error": None}))
    steps = [100 * (i + 1) for i in range(len(curve))]
    records = [
        {"step": s, "elapsed_s": t, "test_loss": loss, "test_accuracy": acc} for s, (t, loss, acc) in zip(steps, curve)
    ]
    (directory / "metrics_rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    t, loss, acc = curve[-1]
    summary = {"steps": steps[-1], "train_s": t, "test_loss": loss, "test_accuracy": acc}
    (directory / "summary.json").write_text(json.dumps(summary))


def test_every_policy_gets_the_learning_rate_factors_and_at_most_two_knobs_of_two_values(tmp_path):
    assert all(len(knobs) <= 2 and all(len(v) == 2 for v in knobs.values()) for knobs in tune.KNOBS.values())
    assert max(tune.budget(p) for p in tune.KNOBS) == 12 and tune.budget("allreduce") == 3
    (wagma,) = tune.plan(["wagma"], 0.001, 0, tmp_path, ["experiment=torch_source_lm", "nproc=8"])
    argv = shlex.split(wagma)
    assert argv[:4] == ["python", "train.py", "-m", "experiment=torch_source_lm"]
    assert "optim.lr=0.0005,0.001,0.002" in argv and "averaging.group_size=2,4" in argv
    assert "averaging.sync_period=10,20" in argv and "seed=0" in argv
    assert f"hydra.sweep.dir={tmp_path / 'wagma'}" in argv
    with pytest.raises(SystemExit, match=r"policy: expected one of \[.*\], found 'gossip'"):
        tune.plan(["gossip"], 0.001, 0, tmp_path, [])


def test_the_learning_rate_is_the_composed_experiments(tmp_path):
    assert tune._composed_lr(["experiment=torch_source_lm"]) == pytest.approx(1e-3)


def test_pick_chooses_the_first_to_the_target_else_the_lowest_final_loss(tmp_path, capsys):
    a, b = tmp_path / "allreduce", tmp_path / "wagma"
    _job(a, 0, ["averaging=allreduce", "optim.lr=0.1", "seed=0"], [(10, 3.0, 0.3), (20, 2.5, 0.5), (30, 2.2, 0.6)])
    _job(a, 1, ["averaging=allreduce", "optim.lr=0.2", "seed=0"], [(10, 2.9, 0.3), (20, 2.4, 0.5), (30, 2.3, 0.6)])
    _job(a, 2, ["averaging=allreduce", "optim.lr=0.05", "seed=0"], [(10, 3.1, 0.3), (20, 2.9, 0.5), (30, 2.6, 0.6)])
    wagma = ["averaging=wagma", "optim.lr=0.1", "averaging.group_size=4", "seed=0", "nproc=8"]
    _job(b, 0, wagma, [(10, 3.0, 0.3), (20, 2.8, 0.4)])
    _job(b, 1, [*wagma[:2], "averaging.group_size=2", *wagma[3:]], [(10, 3.0, 0.3), (20, 2.7, 0.4)])
    chosen = tune.pick([a, b], target=2.45)
    assert chosen["allreduce"]["reached"] and chosen["allreduce"]["chosen"]["setting"] == ["optim.lr=0.2"]
    assert chosen["allreduce"]["chosen"]["seconds"] == 20
    # no wagma run reached 2.45: the lowest final loss, said so
    assert not chosen["wagma"]["reached"]
    assert chosen["wagma"]["chosen"]["setting"] == ["optim.lr=0.1", "averaging.group_size=2"]
    by_accuracy = tune.pick([a], target=0.55, accuracy=True)["allreduce"]["chosen"]
    assert by_accuracy["seconds"] == 30 and by_accuracy["setting"] == ["optim.lr=0.1"]  # the first at 30 s

    out = tmp_path / "tuning.json"
    tune.main(["pick", str(a), str(b), "--target", "2.45", "--measure-seeds", "1", "2", "--out", str(out)])
    record = json.loads(out.read_text())
    measure = shlex.split(record["policies"]["wagma"]["measure"])
    assert measure[:3] == ["python", "train.py", "-m"] and measure[-1] == "seed=1,2"
    assert "averaging.group_size=2" in measure and "nproc=8" in measure and "seed=0" not in measure
    printed = capsys.readouterr().out
    assert "| wagma | optim.lr=0.1 averaging.group_size=4 | not reached |" in printed
    assert "# wagma (no run reached the target)" in printed


def test_pick_refuses_a_budget_that_lost_a_run(tmp_path):
    sweep = tmp_path / "sgp"
    _job(sweep, 0, ["averaging=sgp", "optim.lr=0.1"], [(10, 3.0, 0.3)])
    _job(sweep, 1, ["averaging=sgp", "optim.lr=0.2"], [(10, 3.0, 0.3)], exit=1)
    with pytest.raises(SystemExit, match=r"job .*sgp/1 failed \(exit 1\)"):
        tune.pick([sweep], target=2.0)
    with pytest.raises(SystemExit, match=r"expected jobs \(DIR/\*/job.json\), found none"):
        tune.pick([tmp_path / "empty"], target=2.0)


def test_a_language_models_losses_are_compared_in_bits_per_byte(tmp_path):
    sweep = tmp_path / "allreduce"
    nats = 2.0 * math.log(2)  # 2 bits per byte
    _job(sweep, 0, ["averaging=allreduce", "optim.lr=0.001"], [(10, 3 * nats, 0.3), (20, nats, 0.4)])
    summary_path = sweep / "0" / "summary.json"
    summary_path.write_text(json.dumps(json.loads(summary_path.read_text()) | {"test_bits_per_byte": 2.0}))
    assert tune.pick([sweep], target=2.0)["allreduce"]["chosen"]["seconds"] == 20


@pytest.mark.parametrize("policy", sorted(tune.KNOBS))
def test_every_setting_of_the_budget_is_a_valid_config(policy):
    from hydra import compose, initialize_config_dir

    from wagma.app.config import validate_config

    knobs = tune.KNOBS[policy]
    with initialize_config_dir(config_dir=str(tune.ROOT / "configs"), version_base=None):
        for values in itertools.product(*knobs.values()):
            overrides = [f"averaging={policy}", *(f"{k}={v}" for k, v in zip(knobs, values))]
            cfg = compose("config", overrides=["experiment=torch_source_lm", *overrides])
            validate_config(cfg, 8)  # raises ConfigError naming what is wrong
            for key, value in zip(knobs, values):
                assert str(cfg.averaging[key.split(".", 1)[1]]) == str(value), (policy, key)
