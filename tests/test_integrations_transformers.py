"""wagma.integrations.transformers: WagmaCallback's checks (quick) and whole trainings of the example (slow)."""

from __future__ import annotations

import os
import types
from pathlib import Path

import pytest
import torch

from wagma.testing import run_torchrun

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'wagma[transformers]')")
pytest.importorskip("accelerate", reason="Accelerate is not installed (pip install 'wagma[transformers]')")

from accelerate.utils import DistributedType

from wagma import PeriodicAverager, partial_allreduce_hook
from wagma.integrations.transformers import WagmaCallback

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(tmp_path: Path, nproc: int, *args: str) -> str:
    script = ROOT / "examples" / "hf_trainer_wagma.py"
    return run_torchrun(script, nproc, *args, cwd=tmp_path, env={"PYTHONPATH": str(ROOT)}).stdout


def _trainer(kind: DistributedType) -> types.SimpleNamespace:
    """What the callback reads of a Trainer: its accelerator, DDP model (here none) and optimizer."""
    return types.SimpleNamespace(
        accelerator=types.SimpleNamespace(distributed_type=kind), model_wrapped=torch.nn.Linear(2, 2), optimizer=None
    )


# -- quick: wrong combinations -------------------------------------------------------------------------------------


def test_neither_a_hook_nor_an_averager_is_refused():
    with pytest.raises(ValueError, match=r"WagmaCallback: expected a comm_hook, an averager or both, found neither"):
        WagmaCallback(_trainer(DistributedType.MULTI_CPU))


@pytest.mark.parametrize("kind", [DistributedType.FSDP, DistributedType.DEEPSPEED], ids=["fsdp", "deepspeed"])
def test_a_hook_on_a_trainer_without_ddp_stops_naming_the_combination(kind, tmp_path):
    callback = WagmaCallback(_trainer(kind), comm_hook=partial_allreduce_hook)
    args, state = types.SimpleNamespace(output_dir=str(tmp_path)), types.SimpleNamespace(global_step=0)
    with pytest.raises(ValueError, match=rf"a wagma DDP comm hook with Accelerate's {kind.name} \(the prepared model"):
        callback.on_train_begin(args, state, None)


def test_a_resume_without_wagmas_state_is_refused_naming_the_path(tmp_path):
    callback = WagmaCallback(_trainer(DistributedType.MULTI_CPU), averager=lambda m: PeriodicAverager(4))
    args, state = types.SimpleNamespace(output_dir=str(tmp_path)), types.SimpleNamespace(global_step=10)
    with pytest.raises(ValueError) as info:
        callback.on_train_begin(args, state, None)
    expected = os.path.join(str(tmp_path), "checkpoint-10", "wagma.pt")
    assert str(info.value) == (
        f"WagmaCallback: resuming at step 10, expected wagma's state in {expected}, found none; "
        "pass WagmaCallback(resume_from=<the checkpoint folder>)"
    )


# -- slow: whole trainings on CPU ranks ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_hf_trainer_eager_hook_is_called_on_every_rank_and_replicas_end_identical(tmp_path):
    out = _torchrun(tmp_path, 2, "--policy", "eager")
    assert "hf trainer eager: step 20 on 2 ranks, hook calls per rank [20, 20]" in out, out


@pytest.mark.slow
@pytest.mark.timeout(175)
def test_hf_trainer_resume_continues_bit_for_bit_with_every_replica(tmp_path):
    out = _torchrun(tmp_path, 2, "--output-dir", "whole", "--out", "whole")
    assert "step 20 on 2 ranks" in out and "5 global averages checked identical" in out, out
    _torchrun(tmp_path, 2, "--steps", "10", "--output-dir", "run")
    assert (tmp_path / "run" / "checkpoint-10" / "wagma.pt").is_file()
    out = _torchrun(tmp_path, 2, "--output-dir", "run", "--resume", "--out", "resumed")
    assert "step 20 on 2 ranks" in out and "2 global averages checked identical" in out, out
    whole = [torch.load(tmp_path / f"whole.rank{r}.pt") for r in range(2)]
    resumed = [torch.load(tmp_path / f"resumed.rank{r}.pt") for r in range(2)]
    assert not torch.equal(whole[0], whole[1])  # the last step is no average: the replicas differ, both must resume
    assert all(torch.equal(w, r) for w, r in zip(whole, resumed))
