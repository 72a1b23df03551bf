"""The training application on a sharded model: ``train.py parallel=hsdp shard_size=K``.

Four ranks = 2 replicas x 2 shards on digits / MLP. Config errors need no ranks; evaluation's forward passes, the
consensus distance and one run of WAGMA are quick; the other policies, resume exactness, the refused resumes and
the documented command line (``python train.py parallel=hsdp shard_size=2 averaging=wagma``) run in the slow phase.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import wagma.app.train as app_train
from wagma.app.checkpoint import latest_step
from wagma.app.config import ConfigError, validate_config
from wagma.app.metrics import read_metrics
from wagma.app.parallel import local_state
from wagma.app.policies import validate_hsdp
from wagma.testing import run_workers, run_workers_outcomes

pytest.importorskip("torch.distributed.fsdp")
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
HSDP = ("parallel=hsdp", "shard_size=2")
LOOKAHEAD = ("averaging=reference/eager_solo", "+averaging.late=lookahead", "+averaging.lookahead_rounds=2")


def _cfg(run_dir: Path | None, *overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        cfg = compose("config", overrides=["progress=false", *overrides])
    if run_dir is not None:
        cfg.run_dir = str(run_dir)
    return cfg


# --- config errors: one line each, before anything runs -------------------------------------------------------


@pytest.mark.parametrize(
    "overrides,match",
    [
        (
            ("parallel=hsdp", "shard_size=3"),
            "shard_size: expected a divisor of the world size 4 with parallel=hsdp, found 3",
        ),
        (("parallel=hsdp", "shard_size=1"), "shard_size: expected an integer >= 2 with parallel=hsdp .*, found 1"),
        (("parallel=ddp", "shard_size=2"), "shard_size: expected 1 with parallel=ddp .*, found 2; set parallel=hsdp"),
        (("parallel=fsdp",), "parallel: expected one of 'ddp', 'hsdp', found 'fsdp'"),
        (
            (*HSDP, "averaging=wagma", "averaging.group_size=4"),
            r"averaging.group_size: expected a positive divisor of the world size 2, found 4.*"
            r"\(parallel=hsdp: the policy averages "
            r"over the 2 replicas = 4 ranks / shard_size 2\)",
        ),
        (
            (*HSDP, "averaging=hierarchical", "averaging.local_group_size=4"),
            r"local_group_size 4 is larger than the world \(2 ranks\).*over the 2 replicas",
        ),
        (
            (*HSDP, "averaging=reference/eager_solo_overlap"),
            "averaging=eager_solo with averaging.overlap=true cannot run with parallel=hsdp .* use "
            "averaging=reference/eager_solo",
        ),
        (
            (*HSDP, "averaging=allreduce", "averaging.transport=shm"),
            "averaging=allreduce with averaging.transport=shm cannot run with parallel=hsdp .* expected "
            "averaging.transport=default",
        ),
    ],
)
def test_a_layout_or_policy_that_cannot_run_sharded_is_refused_in_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match) as info:
        validate_config(_cfg(None, *overrides), 4)
    assert len(info.value.problems) == 1 and "\n" not in info.value.problems[0]


def test_a_policy_without_a_sharded_form_is_refused_naming_it_and_what_to_use():
    with pytest.raises(
        ValueError,
        match="averaging=my_policy cannot run with parallel=hsdp: expected one of "
        "allreduce, local_sgd, .*; use one of those, or parallel=ddp",
    ):
        validate_hsdp({"name": "my_policy"})
    validate_config(_cfg(None, *HSDP, "averaging=wagma"), 4)  # the documented command line is valid
    validate_config(_cfg(None, "parallel=hsdp", "shard_size=4", "averaging=allreduce"), 4)  # one replica: FSDP alone


def test_an_hsdp_config_takes_the_look_ahead_and_its_rounds():
    # (the run itself: test_eager_sgd_under_hsdp_with_the_look_ahead_trains_and_checkpoints_the_anchor)
    validate_config(_cfg(None, *HSDP, *LOOKAHEAD), 4)
    with pytest.raises(ConfigError, match="averaging.lookahead_rounds: expected an integer >= 1, found 0"):
        validate_config(_cfg(None, *HSDP, *LOOKAHEAD[:2], "+averaging.lookahead_rounds=0"), 4)


# --- evaluation: the same number of forward passes on every rank ---------------------------------------------


def _forwards_worker(rank: int, world_size: int) -> int:
    calls = []
    net = torch.nn.Linear(3, 2)
    net.register_forward_hook(lambda *_: calls.append(1))
    x, y = torch.randn(5, 3), torch.tensor([0, 1, 0, 1, 0])  # rank 0 scores 3 examples, rank 1 two
    accuracy, _ = app_train.evaluate(net, x, y, rank, world_size, batch_size=2)
    assert 0.0 <= accuracy <= 1.0
    return len(calls)


def test_every_rank_runs_as_many_forward_passes_in_evaluation_as_the_rank_with_the_most_examples():
    # a sharded model's forward all-gathers inside its replica: one rank fewer would leave the other hanging
    assert run_workers(_forwards_worker, 2, collective_timeout_s=20) == [2, 2]


def _consensus_worker(rank: int, world_size: int) -> tuple[float, int]:
    from torch.distributed.device_mesh import init_device_mesh

    from wagma.app.consensus import ConsensusMeter
    from wagma.app.parallel import shard_model
    from wagma.averaging.tensors import local_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    net = shard_model(torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3)), mesh["shard"])
    with torch.no_grad():
        for p in net.parameters():
            local_tensor(p).fill_(float(rank + 1))  # replica r's shard j holds 2r + j + 1
    with ConsensusMeter(mesh=mesh) as meter:
        return meter.measure(net.parameters()), sum(p.numel() for p in net.parameters())


def test_the_consensus_distance_under_hsdp_is_between_the_replicas_whole_models():
    # shard j: replica 0 holds j + 1, replica 1 j + 3, their mean j + 2: every value is 1 away from the mean
    for distance, numel in run_workers(_consensus_worker, 4, collective_timeout_s=20):
        assert distance == pytest.approx(numel)  # (1/R) sum_r ||w_r - mean||^2 = numel


# --- training ------------------------------------------------------------------------------------------------


def _worker(rank: int, world_size: int, cfg: DictConfig, exit_after: int | None = None) -> dict[str, Any]:
    """``train(cfg)``; returns its summary and this rank's shards as ``train`` leaves them after ``finalize``
    (captured where it gathers ``model.pt``). ``exit_after``: every rank ends after that step like a SIGKILL."""
    shards: dict[str, torch.Tensor] = {}
    gather = app_train.full_model_state

    def capture(net: torch.nn.Module) -> dict[str, torch.Tensor]:
        shards.update(local_state(net.state_dict()))
        return gather(net)

    app_train.full_model_state = capture  # type: ignore[assignment]
    stop = None if exit_after is None else (lambda done, _: os._exit(9) if done == exit_after else None)
    summary = app_train.train(cfg, step_callback=stop)
    return {"summary": summary, "shards": shards}


def _replicas_identical(out: list[dict[str, Any]], shard_size: int = 2) -> bool:
    """Whether every rank holds exactly the shards of the same shard index in every other replica."""
    return all(
        torch.equal(out[r]["shards"][k], out[r % shard_size]["shards"][k])
        for r in range(len(out))
        for k in out[r]["shards"]
    )


def _check_run(out: list[dict[str, Any]], run_dir: Path, policy: str, accuracy: float) -> None:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["policy"] == policy and summary["parallel"] == "hsdp" and summary["shard_size"] == 2
    assert summary["test_accuracy"] >= accuracy, summary["test_accuracy"]
    assert all(o["summary"]["test_accuracy"] == summary["test_accuracy"] for o in out)  # one evaluation, every rank
    assert _replicas_identical(out), "replicas differ after the final synchronisation"
    held = [sum(t.numel() for t in out[r]["shards"].values()) for r in range(2)]  # replica 0's two ranks
    full = torch.load(run_dir / "model.pt", weights_only=True)  # gathered whole
    assert sum(t.numel() for t in full.values()) == sum(held) and 0 < held[1] <= held[0]
    states = [
        torch.load(run_dir / "checkpoints" / f"step_{summary['steps']:08d}" / f"rank{r}.pt", weights_only=True)
        for r in range(4)
    ]
    assert all(not any(type(t).__name__ == "DTensor" for t in s["model"].values()) for s in states)


@pytest.mark.slow  # a 4-rank training, 6 s
def test_wagma_under_hsdp_trains_on_digits_and_the_replicas_end_identical(tmp_path):
    out = run_workers(
        _worker,
        4,
        _cfg(tmp_path, *HSDP, "averaging=wagma", "steps=80", "eval_every=40", "consensus_every=20"),
        timeout_s=180,
    )
    _check_run(out, tmp_path, "wagma", 0.9)
    assert out[0]["summary"]["local_reductions"] > 0 and out[0]["summary"]["global_reductions"] > 0
    consensus = [r["consensus"] for r in read_metrics(tmp_path, 0) if "consensus" in r]
    assert len(consensus) == 4 and all(0.0 <= c < 1.0 for c in consensus), consensus  # replicas close, measured


@pytest.mark.slow  # 4-rank runs, about 10 s each
@pytest.mark.parametrize(
    "policy,name",
    [
        ("local_sgd", "local_sgd"),
        ("allreduce", "allreduce"),
        ("hierarchical_momentum", "hierarchical_momentum"),
        ("sgp", "sgp"),
        ("adpsgd", "adpsgd"),
        ("reference/eager_majority", "eager_majority"),
    ],
)
def test_every_kind_of_policy_trains_under_hsdp_with_identical_replicas_at_the_end(tmp_path, policy, name):
    extra = ("averaging.local_group_size=1",) if policy == "hierarchical_momentum" else ()
    out = run_workers(
        _worker, 4, _cfg(tmp_path, *HSDP, f"averaging={policy}", *extra, "steps=80", "eval_every=40"), timeout_s=180
    )
    _check_run(out, tmp_path, name, 0.85)


@pytest.mark.slow  # three 4-rank runs, one killed
@pytest.mark.parametrize("policy", ["local_sgd", "allreduce"])
def test_a_killed_hsdp_run_resumes_bitwise_as_the_uninterrupted_one(tmp_path, policy):
    common = (*HSDP, f"averaging={policy}", "optim.momentum=0.9", "steps=20", "checkpoint_every=10", "eval_every=0")
    straight = run_workers(_worker, 4, _cfg(tmp_path / "straight", *common), timeout_s=180)
    outcomes = run_workers_outcomes(_worker, 4, _cfg(tmp_path / "broken", *common), 13, timeout_s=180)
    assert all(o.exitcode == 9 for o in outcomes) and latest_step(tmp_path / "broken") == 10
    resumed = run_workers(_worker, 4, _cfg(tmp_path / "broken", *common, "resume=true"), timeout_s=180)
    assert resumed[0]["summary"]["resumed_from"] == 10
    for rank, (a, b) in enumerate(zip(straight, resumed)):
        assert all(torch.equal(a["shards"][k], b["shards"][k]) for k in a["shards"]), f"rank {rank}: shards differ"
    x, y = (torch.load(tmp_path / run / "model.pt", weights_only=True) for run in ("straight", "broken"))
    assert all(torch.equal(x[k], y[k]) for k in x)
    for rank in range(4):  # the optimizer's shards of momentum too
        sa, sb = (
            torch.load(tmp_path / run / "checkpoints/step_00000020" / f"rank{rank}.pt", weights_only=True)
            for run in ("straight", "broken")
        )
        for k, v in sa["optimizer"]["state"].items():
            assert torch.equal(v["momentum_buffer"], sb["optimizer"]["state"][k]["momentum_buffer"])


@pytest.mark.slow  # two 4-rank runs
def test_a_resume_with_another_layout_is_refused_with_the_checkpoints_one(tmp_path):
    run_workers(_worker, 4, _cfg(tmp_path, *HSDP, "averaging=local_sgd", "steps=4"), timeout_s=180)
    outcomes = run_workers_outcomes(
        _worker, 4, _cfg(tmp_path, "averaging=local_sgd", "steps=8", "resume=true"), timeout_s=180
    )
    assert not any(o.ok for o in outcomes)
    assert all(
        "was written with parallel=hsdp, this run has parallel=ddp; resume with the saved parallel" in o.error
        for o in outcomes
    )


@pytest.mark.slow  # two 4-rank runs
def test_eager_sgd_under_hsdp_resumes_with_the_hooks_rounds_and_residuals(tmp_path):
    common = (*HSDP, "averaging=reference/eager_solo", "checkpoint_every=3", "eval_every=0")
    run_workers(_worker, 4, _cfg(tmp_path, *common, "steps=6"), timeout_s=180)
    saved = torch.load(tmp_path / "checkpoints" / "step_00000006" / "rank0.pt", weights_only=True)
    hook = saved["policy_state"]["hook"]
    assert hook["iteration"] == 6 and hook["residual"] is not None  # the FSDP hook's state is in the checkpoint
    resumed = run_workers(_worker, 4, _cfg(tmp_path, *common, "steps=9", "resume=true"), timeout_s=180)
    assert resumed[0]["summary"]["resumed_from"] == 6 and resumed[0]["summary"]["steps"] == 9
    assert _replicas_identical(resumed), "replicas differ after the resumed run's flush"
    stats = resumed[0]["summary"]["policy_stats"]
    assert stats["iteration"] == 9 and stats["rounds"] == 9 - 2  # counted on from the checkpoint (2 warm-up steps)


@pytest.mark.slow  # a 4-rank run
def test_eager_sgd_under_hsdp_with_the_look_ahead_trains_and_checkpoints_the_anchor(tmp_path):
    # wrap() refused parallel=hsdp with averaging.late=lookahead before; now the FSDP hook runs it, attached at the
    # first step, and the checkpoint holds this rank's shards of the true weights
    out = run_workers(
        _worker, 4, _cfg(tmp_path, *HSDP, *LOOKAHEAD, "steps=6", "checkpoint_every=3", "eval_every=0"), timeout_s=180
    )
    assert _replicas_identical(out), "replicas differ after the flush"
    saved = torch.load(tmp_path / "checkpoints" / "step_00000003" / "rank0.pt", weights_only=True)
    hook = saved["policy_state"]["hook"]
    assert hook["anchor"] is not None and all(type(w) is torch.Tensor for w in hook["anchor"])
    shards = list(saved["model"].values())  # this rank's shards of the parameters, in their order
    assert [w.shape for w in hook["anchor"]] == [p.shape for p in shards]
    assert any(not torch.equal(w, p) for w, p in zip(hook["anchor"], shards))  # the model saved is the point


@pytest.mark.slow  # a whole `python train.py` with four ranks, and one refused: 20 s alone, 45 s on a loaded machine
@pytest.mark.timeout(480)
def test_the_issues_command_line_trains_and_a_bad_shard_size_stops_it_in_one_line(tmp_path):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env |= {"PYTHONPATH": str(root) + os.pathsep + env.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}

    def train_py(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(root / "train.py"), *args, "progress=false"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    proc = train_py("parallel=hsdp", "shard_size=2", "averaging=wagma", "steps=40", f"run_dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "policy        wagma on 4 rank(s) (hsdp: 2 replicas x 2 shards), 40 steps" in proc.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["parallel"] == "hsdp" and summary["shard_size"] == 2 and summary["test_accuracy"] > 0.5
    bad = train_py("parallel=hsdp", "shard_size=3", f"run_dir={tmp_path / 'bad'}")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1] == (
        "error: invalid configuration: shard_size: expected a divisor of the world size 4 with parallel=hsdp, found 3"
    )
