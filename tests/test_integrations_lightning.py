"""wagma.integrations.lightning: WagmaDDPStrategy's checks (quick) and whole trainings of the example (slow)."""

from __future__ import annotations

import datetime
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning", reason="Lightning is not installed (pip install 'wagma[lightning]')")

from wagma import PeriodicAverager, partial_allreduce_hook
from wagma.integrations.lightning import WagmaDDPStrategy
from wagma.testing import run_workers

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "lightning_wagma.py"


def _example(tmp_path: Path, *args: str) -> str:
    """Run the example as a user does (Lightning starts the other ranks itself); its stdout."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        env.pop(var, None)
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=150, env=env, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


# -- quick: the strategy's arguments ------------------------------------------------------------------------------


def test_lightnings_own_hook_and_averaging_arguments_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"found Lightning's ddp_comm_hook, model_averaging_period; pass them"):
        WagmaDDPStrategy(ddp_comm_hook=partial_allreduce_hook, model_averaging_period=4)


def test_a_hook_state_without_a_hook_is_refused():
    with pytest.raises(ValueError, match=r"comm_state: expected a comm_hook to go with it, found comm_hook=None"):
        WagmaDDPStrategy(comm_state=object())


def test_an_averager_must_be_a_factory():
    with pytest.raises(ValueError, match=r"averager: expected a factory f\(module\) -> averager, found int"):
        WagmaDDPStrategy(averager=4)  # type: ignore[arg-type]


def test_a_functools_partial_hook_gets_the_name_ddp_and_lightning_read():
    def hook(state, bucket, *, scale):
        return scale

    strategy = WagmaDDPStrategy(comm_hook=functools.partial(hook, scale=2.0))
    registered = strategy.wagma_comm_hook
    assert isinstance(registered, functools.partial) and registered.__name__ == "hook"
    assert registered(None, None) == 2.0


def _hook_on_a_sharded_model(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from wagma.integrations._common import check_unsharded

    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    fully_shard(model, mesh=mesh)
    try:
        check_unsharded(model, "Lightning's DDP strategy", "use ModelParallelStrategy and wagma.FSDPPartialAllreduce")
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_a_comm_hook_on_an_fsdp2_sharded_model_stops_naming_the_combination_and_the_alternative():
    pytest.importorskip("torch.distributed.fsdp")
    (message,) = set(run_workers(_hook_on_a_sharded_model, 2, timeout_s=60.0))
    assert message.startswith("a wagma DDP comm hook with Lightning's DDP strategy on a sharded model (parameter '0.")
    assert "use ModelParallelStrategy and wagma.FSDPPartialAllreduce" in message and "\n" not in message


def test_the_averager_is_built_lazily_and_not_at_construction():
    built = []
    strategy = WagmaDDPStrategy(averager=lambda m: built.append(m) or PeriodicAverager(4))
    assert built == [] and strategy.averager is None  # the process group does not exist yet


# -- slow: whole trainings on CPU ranks ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_lightning_cpu_registers_the_eager_hook_on_every_rank_and_replicas_end_identical(tmp_path):
    out = _example(tmp_path, "--policy", "eager", "--devices", "2")
    # Lightning's own DDPStrategy(ddp_comm_hook=...) calls a hook 0 times on CPU; this one every backward pass.
    calls = [int(c) for c in out.split("hook calls per rank [")[1].split("]")[0].split(",")]
    assert len(calls) == 2 and all(c >= 32 for c in calls), out  # 2 epochs x 16 steps, one bucket each


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_lightning_wagma_averager_on_4_ranks_ends_with_identical_replicas(tmp_path):
    out = _example(tmp_path, "--policy", "wagma", "--devices", "4", "--epochs", "1")
    assert "lightning wagma: 8 steps on 4 ranks" in out, out


@pytest.mark.slow
@pytest.mark.timeout(175)
def test_lightning_resume_continues_bit_for_bit_with_every_replica(tmp_path):
    _example(tmp_path, "--policy", "periodic", "--epochs", "2", "--out", "whole")
    out = _example(tmp_path, "--policy", "periodic", "--epochs", "1", "--save", "run.ckpt")
    assert "8 steps" not in out and "global averages checked identical" in out
    _example(tmp_path, "--policy", "periodic", "--epochs", "2", "--resume", "run.ckpt", "--out", "resumed")
    whole = [torch.load(tmp_path / f"whole.rank{r}.pt") for r in range(2)]
    resumed = [torch.load(tmp_path / f"resumed.rank{r}.pt") for r in range(2)]
    assert not torch.equal(whole[0], whole[1])  # the last step is no average: the replicas differ, both must resume
    assert all(torch.equal(w, r) for w, r in zip(whole, resumed))
    saved = torch.load(tmp_path / "run.ckpt", weights_only=False)["wagma"]
    assert saved["world_size"] == 2 and [r["averaging"]["steps"] for r in saved["ranks"]] == [16, 16]


def test_a_checkpoint_of_another_world_size_is_refused(tmp_path):
    path = tmp_path / "run.ckpt"
    torch.save({"state_dict": {}, "wagma": {"world_size": 4, "ranks": [{}] * 4}}, path)
    from lightning.pytorch.plugins.environments import LightningEnvironment

    environment = LightningEnvironment()
    environment.set_world_size(2)  # two ranks, as a Trainer(devices=2) sets
    strategy = WagmaDDPStrategy(cluster_environment=environment, timeout=datetime.timedelta(seconds=10))
    with pytest.raises(ValueError, match=r"expected one saved by 2 ranks, found 4; resume with the same number"):
        strategy.load_checkpoint(path)
