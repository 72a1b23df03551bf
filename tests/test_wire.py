"""The compressed wire: ``wire_dtype`` on the engine, the averagers and the eager-SGD hooks.

What must hold: values travel in the narrow type (half the bytes of float32, counted); nothing a rank computed is
lost to the cast (error feedback in accumulate mode, deltas from a shared reference in replace mode); replicas that
a global average makes equal stay bit for bit equal.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from wagma import AccumulatingGroupAllreduce, GroupSchedule, WaitAvoidingGroupAllreduce
from wagma.testing import rank_device, run_workers
from wagma.wire import as_wire_dtype, wire_nbytes

TIMEOUT = datetime.timedelta(seconds=20)


# --------------------------------------------------------------------------------------------- parsing
def test_wire_dtype_names_and_errors() -> None:
    assert as_wire_dtype(None) is None
    assert as_wire_dtype("float32") is None and as_wire_dtype(torch.float32) is None
    assert as_wire_dtype("bf16") is torch.bfloat16 and as_wire_dtype("BFloat16") is torch.bfloat16
    assert as_wire_dtype("fp16", torch.float32) is torch.float16
    assert as_wire_dtype(torch.bfloat16, torch.bfloat16) is None  # the model's own type: nothing to cast
    with pytest.raises(ValueError, match=r"expected one of .*'bf16'.*found 'int8'"):
        as_wire_dtype("int8")
    with pytest.raises(ValueError, match="expected torch.bfloat16, torch.float16 or torch.float32, found torch.int8"):
        as_wire_dtype(torch.int8)
    with pytest.raises(ValueError, match="narrower than the model's torch.float16"):
        as_wire_dtype("bf16", torch.float16)
    assert wire_nbytes(10, torch.float32, torch.bfloat16) == 20 and wire_nbytes(10, torch.float32, None) == 40


# --------------------------------------------------------------------------------------------- engine
def _accumulate_worker(rank: int, world: int, rounds: int, error_feedback: bool, device: str = "cpu") -> dict:
    # Rank 0 contributes c = 3 + 2^-8 every round, which bfloat16 cannot hold (its step at 3 is 2^-6); the others
    # contribute zeros, so every round's sum is exactly what rank 0 sent and the books can be checked bit for bit.
    c = 3.0 + 2.0**-8
    schedule = GroupSchedule.from_partitions([[list(range(world))]], name="global")
    dev = rank_device(device, rank)
    engine = AccumulatingGroupAllreduce(
        schedule,
        torch.zeros(64, device=dev),
        sync_period=1000,
        timeout=TIMEOUT,
        wire_dtype="bf16",
        error_feedback=error_feedback,
    )
    total = torch.zeros(64, dtype=torch.float64)
    for _ in range(rounds):
        res = engine(torch.full((64,), c if rank == 0 else 0.0, device=dev))
        total += res.sum.double().cpu()
        assert res.sum.dtype == torch.float32
    dist.barrier()
    left = engine.take_pending().double().cpu()
    engine.close()
    return {"applied": total.tolist(), "left": left.tolist(), "nbytes": engine.wire_nbytes, "c": c}


@pytest.mark.parametrize("error_feedback", [True, False])
def test_accumulate_mode_error_feedback_loses_nothing(error_feedback: bool) -> None:
    check_error_feedback(error_feedback)


def check_error_feedback(error_feedback: bool, device: str = "cpu") -> None:
    rounds = 40
    out = run_workers(_accumulate_worker, 2, rounds, error_feedback, device)
    assert out[0]["nbytes"] == 64 * 2  # bfloat16 on the wire: half of float32's 256 bytes
    applied = torch.tensor(out[0]["applied"])
    assert torch.equal(applied, torch.tensor(out[1]["applied"]))  # every rank applies the same sums
    computed = rounds * out[0]["c"]
    accounted = applied + torch.tensor(out[0]["left"]) + torch.tensor(out[1]["left"])
    if error_feedback:
        # Everything rank 0 computed was applied or is still pending: exactly, not approximately.
        assert torch.equal(accounted, torch.full_like(accounted, computed))
    else:
        # A plain cast drops 2^-8 per contribution rank 0's cast rounds down: the test above would catch its loss.
        assert (computed - accounted).min().item() >= 0.1


def _replace_worker(rank: int, world: int, device: str = "cpu") -> list[list[float]]:
    # Models near 100, where bfloat16's step is 0.5: cast whole, the ranks' small differences would vanish. Sent as
    # deltas from a reference all ranks share (rank 0's initial tensor, then each sync round's mean), they arrive
    # with bfloat16's relative precision of the delta. The initial tensors differ: only rank 0's is the reference.
    schedule = GroupSchedule.from_partitions([[list(range(world))]], name="global")
    model = torch.full((8,), 100.0, device=rank_device(device, rank))
    engine = WaitAvoidingGroupAllreduce(
        schedule,
        model + rank,
        sync_period=1,
        max_lead=0,
        timeout=TIMEOUT,
        wire_dtype=torch.bfloat16,
    )
    sums = []
    for k in range(4):
        w = model + 0.01 * (rank + 1) * (k + 1)
        sums.append(engine(w).sum.tolist())
    engine.close()
    return sums


def test_replace_mode_sends_deltas_from_a_shared_reference() -> None:
    check_deltas()


def check_deltas(device: str = "cpu") -> None:
    sums = run_workers(_replace_worker, 2, device)
    assert sums[0] == sums[1]
    for k in range(4):
        exact = 200.0 + 0.03 * (k + 1)
        err = max(abs(v - exact) for v in sums[0][k])
        assert err < 1e-3, (k, sums[0][k], exact)  # a whole cast: 200 (the deltas lost)


def test_engine_refuses_the_wire_on_shared_memory() -> None:
    def worker(rank: int, world: int) -> str:
        schedule = GroupSchedule.from_partitions([[list(range(world))]], name="global")
        try:
            WaitAvoidingGroupAllreduce(schedule, torch.zeros(4), sync_period=1, wire_dtype="fp16", transport="shm")
        except ValueError as err:
            return str(err)
        return "no error"

    for message in run_workers(worker, 2):
        assert "wire_dtype=torch.float16 needs transport='default'" in message


# --------------------------------------------------------------------------------------------- averagers
def _averager_worker(rank: int, world: int, kind: str, wire: str | None, steps: int) -> dict:
    from wagma import PeriodicAverager, WagmaAverager

    # A model near 100 (bfloat16's step there is 0.5) that each rank moves by its own small step: cast whole, the
    # steps would vanish; as deltas from the last global mean they survive.
    model = torch.nn.Parameter(torch.full((32,), 100.0))
    if kind == "wagma":
        averager = WagmaAverager(2, sync_period=3, params=[model], max_lead=0, timeout=TIMEOUT, wire_dtype=wire)
    else:
        averager = PeriodicAverager(2, timeout=TIMEOUT, wire_dtype=wire)
    after_global = []
    state = None
    for step in range(steps):
        with torch.no_grad():
            model.add_(0.01 * (rank + 1) * (1 + step % 3))
        kind_ran = averager.average_parameters([model])
        if kind_ran == "global":
            after_global.append(model.detach().clone())
        if step == steps // 2:
            state = averager.state_dict()
    out = {
        "model": model.detach().clone(),
        "after_global": after_global,
        "bytes": averager.stats.bytes_sent,
        "state_keys": sorted(state or {}),
    }
    if kind == "wagma":  # an exact global mean at the end (evaluation, checkpoints): the replicas become equal
        averager.synchronize([model])
        out["synchronized"] = model.detach().clone()
    if kind == "periodic" and wire is not None:
        # Resume: a fresh averager given the state (and the model) continues exactly like this one.
        assert state is not None and state["wire_references"][0] is not None
        again = PeriodicAverager(2, timeout=TIMEOUT, wire_dtype=wire)
        again.load_state_dict(averager.state_dict())
        twin = torch.nn.Parameter(model.detach().clone())
        for _step in range(4):
            for p in (model, twin):
                with torch.no_grad():
                    p.add_(0.01 * (rank + 1))
            averager.average_parameters([model])
            again.average_parameters([twin])
        out["resumed_equal"] = torch.equal(model, twin)
        again.close()
    averager.close()
    return out


@pytest.mark.slow  # 4-7 s: moved out of the quick suite to keep it under 10 minutes
@pytest.mark.parametrize("kind", ["wagma", "periodic"])  # 4 s each
def test_averagers_on_a_bf16_wire_keep_small_steps_and_equal_replicas(kind: str) -> None:
    steps = 12
    narrow = run_workers(_averager_worker, 4, kind, "bf16", steps, timeout_s=90)
    wide = run_workers(_averager_worker, 4, kind, None, steps, timeout_s=90)
    for rank in range(4):
        # The same training as float32 within bfloat16's precision of the deltas (a whole cast would be off by ~0.5).
        err = (narrow[rank]["model"] - wide[rank]["model"]).abs().max().item()
        assert err < 2e-3, (rank, err)
        assert narrow[rank]["bytes"] * 2 == wide[rank]["bytes"]  # half the bytes, counted
    # A global average leaves every replica bit for bit the same.
    assert narrow[0]["after_global"], "no global average ran"
    for rank in range(1, 4):
        for a, b in zip(narrow[0]["after_global"], narrow[rank]["after_global"]):
            assert torch.equal(a, b)
    if kind == "wagma":
        assert all(torch.equal(o["synchronized"], narrow[0]["synchronized"]) for o in narrow)
    if kind == "periodic":
        assert "wire_references" in narrow[0]["state_keys"] and "wire_references" not in wide[0]["state_keys"]
        assert all(o["resumed_equal"] for o in narrow)


# --------------------------------------------------------------------------------------------- DDP's own hook
def _ddp_worker(rank: int, world: int, wire: str | None) -> torch.Tensor:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from wagma import AllreduceState, allreduce_hook

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 1)
    ddp = DDP(model)
    ddp.register_comm_hook(AllreduceState(wire_dtype=wire), allreduce_hook)
    x = torch.full((4, 6), 1.0 + rank / 3)
    ddp(x).sum().backward()
    return model.weight.grad.detach().clone()


def test_allreduce_hook_on_a_bf16_wire_on_gloo() -> None:
    # torch's bf16_compress_hook needs NCCL; this one runs on gloo: the mean to bfloat16's precision.
    narrow = run_workers(_ddp_worker, 2, "bf16")
    wide = run_workers(_ddp_worker, 2, None)
    assert torch.equal(narrow[0], narrow[1])
    torch.testing.assert_close(narrow[0], wide[0], rtol=2**-7, atol=0)  # two roundings: the cast, the sum
    assert not torch.equal(narrow[0], wide[0])  # it really went through bfloat16 (1 + 1/3 is not exact in it)
