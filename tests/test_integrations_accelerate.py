"""wagma.integrations.accelerate: prepare_wagma's checks (quick) and whole trainings of the example (slow)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from wagma.testing import run_torchrun

pytest.importorskip("accelerate", reason="Accelerate is not installed (pip install 'wagma[accelerate]')")

from accelerate.utils import DistributedType

from wagma import PartialAllreduceState, PeriodicAverager, partial_allreduce_hook
from wagma.integrations.accelerate import prepare_wagma

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(tmp_path: Path, nproc: int, *args: str) -> str:
    script = ROOT / "examples" / "accelerate_wagma.py"
    env = {"PYTHONPATH": str(ROOT)}
    return run_torchrun(script, nproc, *args, cwd=tmp_path, env=env, unset=("ACCELERATE_USE_CPU",)).stdout


# -- quick: wrong combinations -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        (
            DistributedType.FSDP,
            "use wagma.FSDPPartialAllreduce (gradients) or an averager with world=(mesh, 'replicate')",
        ),
        (DistributedType.DEEPSPEED, "use Accelerate's multi-process DDP"),
        (DistributedType.NO, "launch more than one process"),
    ],
    ids=["fsdp", "deepspeed", "single-process"],
)
def test_a_hook_without_ddp_stops_naming_the_combination_and_the_alternative(kind, expected):
    accelerator = types.SimpleNamespace(distributed_type=kind)
    model = torch.nn.Linear(2, 2)  # what such a run's prepare returns: no DistributedDataParallel module
    with pytest.raises(ValueError) as info:
        prepare_wagma(accelerator, model, None, comm_hook=partial_allreduce_hook, comm_state=lambda m: None)
    message = str(info.value)
    assert message.startswith(f"wagma.integrations.accelerate: a wagma DDP comm hook with Accelerate's {kind.name} ")
    assert expected in message and "\n" not in message


def test_an_averager_without_ddp_is_refused_too():
    accelerator = types.SimpleNamespace(distributed_type=DistributedType.FSDP)
    with pytest.raises(ValueError, match=r"a wagma averager with Accelerate's FSDP \(the prepared model is a Linear"):
        prepare_wagma(accelerator, torch.nn.Linear(2, 2), None, averager=lambda m: PeriodicAverager(4))


def test_neither_a_hook_nor_an_averager_is_refused():
    accelerator = types.SimpleNamespace(distributed_type=DistributedType.MULTI_CPU)
    with pytest.raises(ValueError, match=r"expected a comm_hook, an averager or both, found neither"):
        prepare_wagma(accelerator, torch.nn.Linear(2, 2), None)


def test_a_real_single_process_accelerator_is_refused_before_anything_is_built():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    try:
        accelerator = Accelerator(cpu=True)
        net = torch.nn.Linear(2, 2)
        model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        built = []
        with pytest.raises(ValueError, match=r"with Accelerate's NO \(the prepared model is a Linear, not a Distrib"):
            prepare_wagma(
                accelerator,
                model,
                optimizer,
                comm_hook=partial_allreduce_hook,
                comm_state=lambda m: built.append(m) or PartialAllreduceState(m.parameters()),
            )
        assert built == []
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


# -- slow: whole trainings on CPU ranks ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_accelerate_eager_hook_is_called_on_every_rank_and_replicas_end_identical(tmp_path):
    out = _torchrun(tmp_path, 2, "--policy", "eager")
    assert "accelerate eager: step 20 on 2 ranks, hook calls per rank [20, 20]" in out, out


@pytest.mark.slow
@pytest.mark.timeout(175)
def test_accelerate_resume_continues_bit_for_bit_with_every_replica(tmp_path):
    out = _torchrun(tmp_path, 2, "--out", "whole")
    assert "step 20 on 2 ranks" in out and "5 global averages checked identical" in out, out
    _torchrun(tmp_path, 2, "--steps", "10", "--save", "ckpt")
    out = _torchrun(tmp_path, 2, "--resume", "ckpt", "--out", "resumed")
    assert "step 20 on 2 ranks" in out and "2 global averages checked identical" in out, out
    whole = [torch.load(tmp_path / f"whole.rank{r}.pt") for r in range(2)]
    resumed = [torch.load(tmp_path / f"resumed.rank{r}.pt") for r in range(2)]
    assert not torch.equal(whole[0], whole[1])  # the last step is no average: the replicas differ, both must resume
    assert all(torch.equal(w, r) for w, r in zip(whole, resumed))
