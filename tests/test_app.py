"""The training application: configs, models, metrics, the policy seam, train() end to end, resume, torchrun."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from wagma.app.checkpoint import latest_step
from wagma.app.config import ConfigError, build_optimizer, group_options, validate_config
from wagma.app.data import DATASET_INFO, load_dataset
from wagma.app.imbalance import build_imbalance
from wagma.app.launch import hydra_rank_overrides
from wagma.app.metrics import SUMMARY_KEYS, read_csv, read_metrics, write_summary
from wagma.app.models import build_model
from wagma.app.policies import AllreducePolicy, Policy, build_policy
from wagma.app.step import mean_model
from wagma.app.train import train
from wagma.testing import WorkerError, run_workers, run_workers_outcomes

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
GROUPS = ("data", "model", "optim", "imbalance", "averaging")


def _compose(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        return compose("config", overrides=list(overrides))


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


# --- configs ---------------------------------------------------------------------------------------


def test_root_config_picks_one_option_per_group_and_has_the_top_level_keys():
    cfg = _compose()
    assert {g: cfg[g].name for g in GROUPS} == {
        "data": "digits",
        "model": "mlp",
        "optim": "sgd",
        "imbalance": "none",
        "averaging": "wagma",
    }
    for key in ("steps", "batch_size", "seed", "checkpoint_every", "resume", "eval_every", "log_every"):
        assert key in cfg
    assert cfg.device == "auto"
    assert set(_options("imbalance")) == {"none", "random_k", "persistent", "heavy_tail"}
    assert set(_options("model")) == {"mlp", "cnn", "transformer", "byte_lm"}
    assert set(_options("data")) == {"digits", "mnist", "sequences", "torch_source"}
    assert set(_options("optim")) == {"sgd", "adam"}
    assert set(_options("averaging")) == {  # the shipped presets; configs/averaging/reference/ holds eager_solo
        "allreduce",
        "local_sgd",
        "hierarchical",
        "hierarchical_momentum",
        "wagma",
        "wagma_relaxed",
        "wagma_ahead_conserve",
        "eager_solo_overlap_lookahead_local",
        "dpsgd",
        "sgp",
        "osgp",
        "adpsgd",
    }
    assert cfg.consensus_every == 0 and cfg.telemetry_interval_s > 0
    assert cfg.eval_every > 0 and cfg.progress and cfg.progress_every is None  # periodic evaluation by default


# Every averaging option and experiment preset is composed, validated and built in tests/test_policies.py.
# data=mnist loads MNIST (5 s): in the slow phase.
@pytest.mark.parametrize(
    "group,option",
    [
        pytest.param(g, o, marks=pytest.mark.slow) if (g, o) == ("data", "mnist") else (g, o)
        for g in GROUPS
        for o in _options(g)
        if g != "averaging"
    ],
)
def test_every_config_option_composes_validates_and_builds(group, option):
    # Token data and its model come as a pair (each alone is refused: test_data_and_model_must_match).
    pair = {
        "sequences": "model=transformer",
        "transformer": "data=sequences",
        "torch_source": "model=byte_lm",
        "byte_lm": "data=torch_source",
    }.get(option)
    cfg = _compose(f"{group}={option}", *([pair] if pair else []))
    assert cfg[group].name == option
    validate_config(cfg, 4)
    data = group_options(cfg, "data")
    ds = load_dataset(data.pop("name"), seed=cfg.seed, test_fraction=data.pop("test_fraction"), **data)
    model_cfg = group_options(cfg, "model")
    model = build_model(model_cfg.pop("name"), ds.in_shape, ds.num_classes, **model_cfg, **ds.model_options())
    per_position = (ds.in_shape[0],) if ds.token_targets else ()  # a language model: logits at every position
    assert model(ds.x_test[:5]).shape == (5, *per_position, ds.num_classes)
    assert isinstance(build_optimizer(group_options(cfg, "optim"), model.parameters()), torch.optim.Optimizer)
    for rank in range(4):
        assert build_imbalance(group_options(cfg, "imbalance"), rank, 4).delay_s(0, 0.001) >= 0.0
    policy = build_policy(group_options(cfg, "averaging"), rank=0, world_size=4, device=torch.device("cpu"))
    assert isinstance(policy, Policy) and policy.name == cfg.averaging.name


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["data.name=cifar10"], "unknown dataset 'cifar10'; known datasets: digits, mnist"),
        (["model.name=resnet"], "unknown model 'resnet'; known models: byte_lm, cnn, mlp"),
        (
            ["averaging.name=gossip"],
            "unknown averaging policy 'gossip'; known policies: adpsgd, allreduce, dpsgd, eager_majority",
        ),
        (["optim.name=lamb"], "unknown optimizer 'lamb'"),
        (["checkpoint_every=-5"], "checkpoint_every: expected an integer >= 0, found -5"),
        (["eval_every=-1", "steps=0"], r"(?s)steps: expected .*eval_every: expected "),
        (["averaging.sync_period=-2"], "averaging.sync_period: expected a number >= 0, found -2"),
        (["averaging.group_size=3"], "averaging.group_size: expected a positive divisor of the world size 4, found 3"),
        (
            ["imbalance=random_k", "imbalance.k=5"],
            r"imbalance.k: expected 0 <= k <= the world size 4 \(random_k\), found 5",
        ),
        (["batch_size=400"], "exceeds the 359 training examples each of 4 ranks holds"),
        (["device=tpu"], "device: expected one of 'auto', 'cpu', 'cuda', found 'tpu'"),
        (["telemetry_interval_s=-1"], r"telemetry_interval_s: expected a finite number >= 0, found -1 \(0: off\)"),
        (["resume_policy_change=2"], "resume_policy_change: expected True or False, found 2"),
        (["stop_at_loss=-1"], r"stop_at_loss: expected a finite number > 0, found -1 \(null: off\)"),
        (["stop_at_accuracy=1.5"], r"stop_at_accuracy: expected a finite number > 0 and <= 1, found 1.5 \(null: off\)"),
        (["stop_after_s=abc"], r"stop_after_s: expected a finite number > 0, found 'abc' \(null: off\)"),
        (["stop_at_loss=0.5", "eval_every=0"], r"stop_at_loss: needs eval_every >= 1 .*found eval_every=0"),
        (["eval_model=average"], r"eval_model: expected one of 'local', 'mean', found 'average'"),
        (
            ["eval_model=mean", "parallel=hsdp", "shard_size=2"],
            r"eval_model=mean: expected whole replicas \(parallel=ddp\), found parallel=hsdp",
        ),
    ],
)
def test_bad_configs_fail_validation_with_a_clear_message(overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate_config(_compose(*overrides), 4)


# A value of the wrong type is named, with what was expected and what was found -- not Python's
# "could not convert string to float: 'abc'". The expected type is the one the shipped configs give the key.
@pytest.mark.parametrize(
    "overrides,problems",
    [
        (["optim.lr=abc"], ["optim.lr: expected a finite number > 0, found 'abc'"]),
        (["optim=adam", "optim.betas=[a,b]"], ["optim.betas: expected a list of floats, found ['a', 'b']"]),
        (["optim.nesterov=maybe"], ["optim.nesterov: expected true or false, found 'maybe'"]),  # passed before
        (["optim.lr=null"], ["optim.lr: expected a finite number > 0, found None"]),
        (
            ["data.test_fraction=abc"],
            ["data.test_fraction: expected a finite number > 0 and < 1, found 'abc'"],
        ),  # a traceback before
        (["model.hidden=[abc]"], ["model.hidden: expected a list of integers, found ['abc']"]),
        (["model=cnn", "model.hidden=abc"], ["model.hidden: expected an integer >= 1, found 'abc'"]),
        (["imbalance=random_k", "imbalance.k=two"], ["imbalance.k: expected an integer, found 'two'"]),
        (
            ["imbalance=heavy_tail", "imbalance.max_s=abc"],
            ["imbalance.max_s: expected None or a finite number >= 0, found 'abc'"],
        ),
        (
            ["imbalance=persistent", "imbalance.base_s=abc"],  # null in its preset: the injector says it
            ["imbalance.base_s: expected None or a finite number >= 0, found 'abc'"],
        ),
        (["averaging.group_size=two"], ["averaging.group_size: expected an integer, found 'two'"]),
        (["seed=abc"], ["seed: expected an integer, found 'abc'"]),  # unchecked before: the ranks failed
        (["dist_timeout_s=abc"], ["dist_timeout_s: expected an integer, found 'abc'"]),
        # a key a check already names keeps its message, next to the type problems of the others
        (
            ["steps=0", "optim.lr=abc", "optim.momentum=x"],
            [
                "steps: expected an integer >= 1, found 0",
                "optim.lr: expected a finite number > 0, found 'abc'",
                "optim.momentum: expected a float, found 'x'",
            ],
        ),
        (["resume=maybe"], ["resume: expected True or False, found 'maybe'"]),
    ],
)
def test_a_value_of_the_wrong_type_names_its_key_what_was_expected_and_what_was_found(overrides, problems):
    with pytest.raises(ConfigError) as info:
        validate_config(_compose(*overrides), 4)
    assert info.value.problems == problems
    assert info.value.one_line() == "invalid configuration: " + "; ".join(problems)


@pytest.mark.parametrize(
    "overrides",
    [
        ["rank_cpus=0.5"],  # an integer in its preset, but a float is a number of CPUs
        ["optim.lr=1"],  # an integer where a float is expected
        ["averaging.validated_staleness=null", "averaging.max_lead=null"],  # null: the policy's check allows it
        ["imbalance=persistent", "imbalance.base_s=0.01"],
        ["averaging.schedule=[[[0,1],[2,3]],[[0,2],[1,3]]]"],  # a string in its preset: anything goes to its check
    ],
)
def test_a_value_of_another_type_than_the_presets_that_its_check_accepts_passes(overrides):
    validate_config(_compose(*overrides), 4)


# --- models, metrics, policy ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mlp", "cnn"])
@pytest.mark.parametrize("dataset", ["digits", "mnist"])
def test_models_work_on_both_input_sizes(name, dataset):
    _, in_shape, classes = DATASET_INFO[dataset]
    model = build_model(name, in_shape, classes)
    assert model(torch.randn(3, *in_shape)).shape == (3, classes)
    if name == "mlp":
        assert build_model("mlp", in_shape, classes, hidden=[32, 16])(torch.randn(2, *in_shape)).shape == (2, classes)


def test_unknown_model_and_bad_arguments_raise_value_error():
    with pytest.raises(ValueError, match="known models: byte_lm, cnn, mlp"):
        build_model("vit", (1, 8, 8), 10)
    with pytest.raises(ValueError, match="bad arguments for model 'mlp'"):
        build_model("mlp", (1, 8, 8), 10, depth=3)


def test_summary_needs_its_keys(tmp_path):
    with pytest.raises(ValueError, match="summary lacks"):
        write_summary(tmp_path, {"policy": "allreduce"})
    path = write_summary(tmp_path, {k: 1 for k in SUMMARY_KEYS} | {"extra": float("inf")})
    assert json.loads(path.read_text())["extra"] is None


def test_policy_defaults_are_no_ops_and_allreduce_counts_reductions():
    base = Policy()
    model = torch.nn.Linear(2, 2)
    assert base.wrap(model) is model and base.state_dict() == {} and base.stats() == {}
    policy = AllreducePolicy(device=torch.device("cpu"))
    for step in range(3):
        policy.after_step(None, step)  # type: ignore[arg-type]
    # bytes_sent counts what wrap()'s DDP model hands to allreduce per step: nothing here, none was wrapped
    assert policy.stats() == {"global_reductions": 3, "bytes_sent": 0, "staleness": 0}
    restored = AllreducePolicy(device=torch.device("cpu"))
    restored.load_state_dict(policy.state_dict())
    assert restored.global_reductions == 3
    restored.load_state_dict({"global_reductions": 2})  # a checkpoint from before bytes were counted
    assert restored.global_reductions == 2 and restored.bytes_sent == 0
    with pytest.raises(
        ValueError, match="known policies: adpsgd, allreduce, dpsgd, eager_majority, eager_solo, hierarchical"
    ):
        build_policy({"name": "gossip"}, rank=0, world_size=4, device=torch.device("cpu"))


# --- train() on forked ranks ---------------------------------------------------------------------


def _cfg(run_dir: Path, *overrides: str) -> DictConfig:
    # The app's plumbing is tested with plain DDP on any world size; policies have tests of their own.
    cfg = _compose("progress=false", "averaging=allreduce", *overrides)
    cfg.run_dir = str(run_dir)
    return cfg


def _train_worker(rank: int, world_size: int, cfg: DictConfig, kill_at: int | None = None) -> dict:
    def stop(done: int, timings: dict) -> None:
        if done == kill_at:
            os._exit(9)  # like a SIGKILL: no cleanup, no final checkpoint

    return train(cfg, step_callback=stop if kill_at is not None else None)


def test_train_end_to_end_on_three_ranks(tmp_path):
    cfg = _cfg(tmp_path, "steps=90", "eval_every=30", "log_every=2", "checkpoint_every=40")
    summaries = run_workers(_train_worker, 3, cfg, timeout_s=120)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(SUMMARY_KEYS) <= set(summary)
    assert summary["policy"] == "allreduce" and summary["world_size"] == 3 and summary["steps"] == 90
    assert summary["global_reductions"] == 90 and summary["test_accuracy"] >= 0.9
    assert summary["samples_per_s"] > 0 and summary["mean_wait_s"] >= 0 and summary["wall_s"] > 0
    assert 0 < summary["train_s"] < summary["wall_s"] and 0 < summary["startup_s"] < summary["wall_s"]
    assert all(s["test_accuracy"] == summary["test_accuracy"] for s in summaries)
    for rank in range(3):
        records = read_metrics(tmp_path, rank)
        assert [r["step"] for r in records] == list(range(2, 91, 2))  # every log_every steps, evals included
        assert {"loss", "samples_per_s", "wait_s", "reductions", "staleness", "compute_s"} <= set(records[0])
        assert [r["step"] for r in records if "test_accuracy" in r] == [30, 60]
        assert records[-1]["reductions"] == 90 and records[-1]["loss"] < records[0]["loss"]
    # The two newest complete checkpoints are kept, nothing partial; replicas identical under allreduce.
    ckpt = tmp_path / "checkpoints"
    assert latest_step(tmp_path) == 90 and sorted(p.name for p in ckpt.iterdir()) == ["step_00000080", "step_00000090"]
    states = [torch.load(ckpt / "step_00000090" / f"rank{r}.pt", weights_only=True) for r in range(3)]
    assert all(s["step"] == 90 and s["policy_state"]["global_reductions"] == 90 for s in states)
    sent = {s["policy_state"]["bytes_sent"] for s in states}  # the same gradient bytes every step, on every rank
    assert len(sent) == 1 and min(sent) > 0 and min(sent) % 90 == 0
    for name, tensor in states[0]["model"].items():
        assert all(torch.equal(tensor, s["model"][name]) for s in states[1:])
    final = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(torch.equal(final[k], states[0]["model"][k]) for k in final)


@pytest.mark.parametrize("policy", ["allreduce", "wagma"])
def test_a_run_stops_after_the_first_evaluation_that_reached_its_target_on_every_rank(tmp_path, policy):
    cfg = _cfg(tmp_path, f"averaging={policy}", "steps=400", "eval_every=10", "stop_at_accuracy=0.85")
    summaries = run_workers(_train_worker, 2, cfg, timeout_s=120)
    summary = json.loads((tmp_path / "summary.json").read_text())
    stop = summary["steps"]
    assert 10 <= stop < 400 and stop % 10 == 0 and all(s["steps"] == stop for s in summaries)
    assert summary["stopped"].startswith("test accuracy 0.") and "stop_at_accuracy=0.85" in summary["stopped"]
    for rank in range(2):
        records = read_metrics(tmp_path, rank)
        assert records[-1]["step"] == stop  # no step after the stop, on either rank
        evals = [r["test_accuracy"] for r in records if "test_accuracy" in r]
        assert evals[-1] >= 0.85 and all(a < 0.85 for a in evals[:-1])  # the first evaluation that reached it
    assert latest_step(tmp_path) == stop  # the final checkpoint is the stop's step: resume goes on from there


def _mean_model_worker(rank: int, world_size: int) -> list[float]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    with torch.no_grad():
        net[0].weight.fill_(float(rank))
        net[1].running_mean.fill_(2.0 * rank)
    scratch = mean_model(net)
    again = mean_model(net, scratch)
    assert again is scratch and scratch is not net
    assert float(net[0].weight[0, 0]) == rank and int(scratch[1].num_batches_tracked) == 0  # its own untouched
    return [float(scratch[0].weight[1, 1]), float(scratch[1].running_mean[2]), scratch[0].bias.sum().item()]


def test_mean_model_is_the_ranks_mean_in_a_copy_and_leaves_each_model_alone():
    torch.manual_seed(0)
    bias = torch.nn.Linear(2, 3).bias.sum().item()  # every rank built the same, then changed the weights
    results = run_workers(_mean_model_worker, 3, timeout_s=60)
    assert all(r[0] == pytest.approx(1.0) and r[1] == pytest.approx(2.0) for r in results)  # (0 + 1 + 2) / 3
    assert all(r[2] == pytest.approx(bias) for r in results)


def test_eval_model_mean_scores_the_ranks_mean_and_leaves_training_alone(tmp_path):
    """Local SGD that never averages before the end: each rank's model differs from the others and from their mean,
    so the two evaluations differ; the evaluation itself must not change what is trained."""
    loss = {}
    for how in ("local", "mean"):
        run_dir = tmp_path / how
        cfg = _cfg(run_dir, "averaging=local_sgd", "averaging.period=1000", "steps=40", "eval_every=20")
        cfg.eval_model = how
        run_workers(_train_worker, 2, cfg, timeout_s=120)
        evals = [r["test_loss"] for r in read_metrics(run_dir, 0) if "test_loss" in r]
        summary = json.loads((run_dir / "summary.json").read_text())
        loss[how] = (evals, summary["test_loss"])
    (local_evals, local_final), (mean_evals, mean_final) = loss["local"], loss["mean"]
    assert len(local_evals) == len(mean_evals) == 1 and local_evals != mean_evals
    assert local_final == mean_final  # the same training, the same final mean model


def test_a_run_stops_after_the_first_evaluation_past_its_time_limit(tmp_path):
    cfg = _cfg(tmp_path, "steps=1000", "eval_every=20", "stop_after_s=1", "stop_at_loss=1e-9")
    summaries = run_workers(_train_worker, 2, cfg, timeout_s=120)
    summary = json.loads((tmp_path / "summary.json").read_text())
    stop = summary["steps"]
    assert stop < 1000 and all(s["steps"] == stop for s in summaries)
    spent = float(re.fullmatch(r"([0-9.]+) s of training >= stop_after_s=1", summary["stopped"]).group(1))
    assert spent >= 1
    for rank in range(2):
        records = read_metrics(tmp_path, rank)
        evals = [r["elapsed_s"] for r in records if "test_accuracy" in r]
        assert records[-1]["step"] == stop
        # The check reads the slowest rank's clock; a record is written just after it (0.3 s: a rank descheduled in
        # between on a busy machine). An evaluation well past the limit did not go by.
        assert all(t < 1 + 0.3 for t in evals[:-1]), evals


def test_a_run_without_a_stop_runs_all_its_steps(tmp_path):
    run_workers(_train_worker, 2, _cfg(tmp_path, "steps=30", "eval_every=10"), timeout_s=120)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["stopped"] is None


# P >= 3: gloo sums in an order set by DDP's bucket layout, which changes after DDP's first iteration.
# 3 and 4 ranks (6 s each) in the slow phase; 2 ranks here.
@pytest.mark.parametrize(
    "world_size", [2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)]
)
def test_kill_and_resume_gives_the_same_model_as_an_uninterrupted_run(tmp_path, world_size):
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    common = ("steps=40", "checkpoint_every=10", "imbalance=none", "model=cnn")
    run_workers(_train_worker, world_size, _cfg(straight, *common), timeout_s=120)

    outcomes = run_workers_outcomes(_train_worker, world_size, _cfg(broken, *common), 25, timeout_s=120)
    assert not any(o.ok for o in outcomes)  # killed after step 25 ...
    assert latest_step(broken) == 20  # ... its last checkpoint: step 20
    assert not (broken / "summary.json").exists()

    summaries = run_workers(_train_worker, world_size, _cfg(broken, *common, "resume=true"), timeout_s=120)
    assert summaries[0]["resumed_from"] == 20
    a = torch.load(straight / "model.pt", weights_only=True)
    b = torch.load(broken / "model.pt", weights_only=True)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    for rank in range(world_size):
        sa = torch.load(straight / "checkpoints/step_00000040" / f"rank{rank}.pt", weights_only=True)
        sb = torch.load(broken / "checkpoints/step_00000040" / f"rank{rank}.pt", weights_only=True)
        assert sa["data"] == sb["data"] and sa["policy_state"] == sb["policy_state"]  # bytes_sent resumes too
        assert sa["policy_state"]["global_reductions"] == 40
        for k, v in sa["optimizer"]["state"].items():
            assert torch.equal(v["momentum_buffer"], sb["optimizer"]["state"][k]["momentum_buffer"])
        # The steps the killed run did after its checkpoint are recorded once; the clocks go on.
        records = read_metrics(broken, rank)
        assert [r["step"] for r in records] == list(range(1, 41))
        assert [r["time"] for r in records] == sorted(r["time"] for r in records)
        assert records[20]["elapsed_s"] > records[19]["elapsed_s"]  # continued from the checkpoint's, not 0
    assert [int(r["step"]) for r in read_csv(broken)] == list(range(1, 41))
    acc = EventAccumulator(str(broken / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 41))  # the killed run's 21..25 purged
    assert json.loads((straight / "summary.json").read_text())["test_accuracy"] == summaries[0]["test_accuracy"]


def test_bad_config_fails_on_every_rank_before_training(tmp_path):
    cfg = _cfg(tmp_path, "+averaging.group_size=2", "checkpoint_every=-1")
    outcomes = run_workers_outcomes(_train_worker, 3, cfg)
    assert [o.ok for o in outcomes] == [False] * 3
    for o in outcomes:
        assert "ConfigError: invalid configuration" in o.error
        assert "averaging.group_size: expected a positive divisor of the world size 3, found 2" in o.error
    assert list(tmp_path.iterdir()) == []  # nothing written: it failed before training


def test_wait_is_measured_on_the_ranks_that_wait(tmp_path):
    # Rank 1 sleeps 40 ms before every step; rank 0 finishes its compute first and waits in backward().
    cfg = _cfg(tmp_path, "steps=12", "imbalance=persistent", "imbalance.ranks=[1]", "imbalance.base_s=0.04")
    run_workers(_train_worker, 2, cfg)
    fast, slow = (read_metrics(tmp_path, r)[2:] for r in range(2))  # skip DDP's first iterations
    mean = lambda records, key: sum(r[key] for r in records) / len(records)  # noqa: E731
    assert mean(slow, "imbalance_s") >= 0.04 and mean(fast, "imbalance_s") == 0.0
    assert mean(fast, "wait_s") - mean(slow, "wait_s") > 0.025
    assert mean(fast, "compute_s") > 0 and mean(fast, "wait_s") < mean(fast, "step_s")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["expected_mean_delay_s"] == pytest.approx(0.02) and summary["expected_max_delay_s"] == pytest.approx(
        0.04
    )


def test_device_cuda_without_gpus_fails_on_every_rank(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    outcomes = run_workers_outcomes(_train_worker, 2, _cfg(tmp_path, "device=cuda"))
    assert all(
        not o.ok and "device=cuda was requested but at least one rank has no CUDA GPU" in o.error for o in outcomes
    )


def test_hydra_rank_overrides_keep_other_ranks_from_writing_hydra_files():
    assert hydra_rank_overrides(["steps=3"], 0) == []
    assert hydra_rank_overrides(["steps=3"], 2) == ["hydra.output_subdir=null", "hydra/job_logging=stdout"]
    assert hydra_rank_overrides(["hydra/job_logging=none"], 1) == ["hydra.output_subdir=null"]


def test_train_without_run_dir_outside_hydra_fails_clearly():
    with pytest.raises(WorkerError, match="run_dir is not set and Hydra is not running"):
        run_workers(_train_worker, 1, _compose("progress=false", "averaging=allreduce"))


# --- the real thing: torchrun + Hydra ------------------------------------------------------------


def _torchrun(cwd: Path, *overrides: str, nproc: int = 2) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(ROOT / "train.py"),
        "progress=false",
        "averaging=allreduce",
        *overrides,
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=150)


@pytest.mark.slow
def test_torchrun_writes_one_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    proc = _torchrun(tmp_path, "steps=40", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing else, e.g. no outputs/
    names = sorted(p.name for p in run_dir.iterdir())
    assert names == [
        ".hydra",
        "checkpoints",
        "metrics.csv",
        "metrics_rank0.jsonl",
        "metrics_rank1.jsonl",
        "model.pt",
        "summary.json",
        "tensorboard",
        "train.log",
    ]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 40 and summary["test_accuracy"] > 0.8
    assert "training mlp on digits, 2 rank(s)" in (run_dir / "train.log").read_text()


@pytest.mark.slow
def test_torchrun_default_run_dir_is_shared_by_all_ranks(tmp_path):
    proc = _torchrun(tmp_path, "steps=20", nproc=3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dirs = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir()]
    assert len(run_dirs) == 1, run_dirs
    assert {p.name for p in run_dirs[0].glob("metrics_rank*.jsonl")} == {f"metrics_rank{r}.jsonl" for r in range(3)}
    assert (run_dirs[0] / "summary.json").exists() and (run_dirs[0] / ".hydra" / "config.yaml").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "override,message,code",
    [
        (
            "+averaging.group_size=3",
            "averaging.group_size: expected a positive divisor of the world size 2, found 3",
            2,
        ),
        ("data=cifar", "data=cifar: no such option in configs/data/", 2),  # one line, before Hydra composes
    ],
)
def test_torchrun_bad_config_is_reported_once(tmp_path, override, message, code):
    proc = _torchrun(tmp_path, override, f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert output.count(message) == 1, output[-3000:]
    assert f"exitcode: {code}" in output or f"exitcode  : {code}" in output
    assert not (tmp_path / "run" / "checkpoints").exists()
