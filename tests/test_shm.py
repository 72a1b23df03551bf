"""wagma.shm: the shared-memory allreduce of CPU tensors (sums, bits, layout, cleanup, errors, a dead member)."""

from __future__ import annotations

import datetime
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from wagma.groups import new_timeout_group
from wagma.shm import SHM_DIR, SharedMemoryAllreduce, check_transport
from wagma.testing import run_workers, run_workers_outcomes

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason=f"needs {SHM_DIR}")


def _ours(pids: list[int]) -> list[str]:
    return [f for f in os.listdir(SHM_DIR) if any(f.startswith(f"wagma-{pid}-") for pid in pids)]


def _sum_worker(rank, world):
    pids: list[int | None] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    shm = SharedMemoryAllreduce(None, 1000, torch.float64)
    dist.barrier()  # the creator unlinks right after the members' barrier: wait until it has
    left_after_construction = _ours(pids)
    out = []
    g = torch.Generator().manual_seed(rank)
    for n in (1000, 7, 1, 999, 3):  # full capacity, fewer elements than members' chunks, one element
        x = torch.randn(n, generator=g, dtype=torch.float64)
        mine = x.clone()
        total = torch.zeros(n, dtype=torch.float64)
        parts: list[torch.Tensor | None] = [None] * world
        dist.all_gather_object(parts, mine)
        for part in parts:
            total += part
        returned = shm.all_reduce(x)
        out.append((returned is x, x, total))
    source = torch.full((10,), float(rank), dtype=torch.float64)
    into = torch.zeros(10, dtype=torch.float64)
    returned = shm.all_reduce(source, out=into)  # out of place: the input is only read
    assert returned is into and source.eq(rank).all() and into.eq(sum(range(world))).all(), (source, into)
    wide = torch.arange(12.0, dtype=torch.float64).reshape(3, 4) * (rank + 1)
    transposed = wide.t()  # not contiguous: reduced through a copy, written back in its own layout
    shm.all_reduce(transposed)
    shm.close()
    return left_after_construction, out, wide


def test_sums_are_the_group_sums_with_the_same_bits_on_every_rank_and_nothing_left_in_dev_shm():
    world = 4
    res = run_workers(_sum_worker, world)
    for rank, (left, out, wide) in enumerate(res):
        assert left == [], f"rank {rank}: segments left in {SHM_DIR}: {left}"
        for same, x, total in out:
            assert same
            torch.testing.assert_close(x, total, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(wide, torch.arange(12.0, dtype=torch.float64).reshape(3, 4) * 10)
    for i in range(len(res[0][1])):
        assert all(torch.equal(res[0][1][i][1], r[1][i][1]) for r in res), f"call {i}: ranks got different bits"


def _bad_input_worker(rank, world):
    shm = SharedMemoryAllreduce(None, 4)
    errors = {}
    for what, tensor in {"long": torch.zeros(5), "dtype": torch.zeros(4, dtype=torch.float64)}.items():
        try:
            shm.all_reduce(tensor)
        except ValueError as exc:
            errors[what] = str(exc)
    try:
        shm.all_reduce(torch.zeros(4), out=torch.zeros(2, 2))
    except ValueError as exc:
        errors["out"] = str(exc)
    try:
        SharedMemoryAllreduce(None, 0)
    except ValueError as exc:
        errors["capacity"] = str(exc)
    try:  # far more than /dev/shm holds: refused before anything is mapped, on every member
        SharedMemoryAllreduce(None, 2**50, torch.float64)
    except ValueError as exc:
        errors["huge"] = str(exc)
    shm.all_reduce(torch.ones(4))  # still usable after refusals
    return errors


def test_bad_inputs_and_a_segment_too_large_for_dev_shm_are_refused_clearly():
    for rank, errors in enumerate(run_workers(_bad_input_worker, 2)):
        assert "at most 4 elements, found 5" in errors["long"]
        assert "torch.float32" in errors["dtype"] and "torch.float64" in errors["dtype"]
        assert "capacity: expected an integer >= 1, found 0" in errors["capacity"]
        assert "expected out of shape (4,), found (2, 2)" in errors["out"]
        if rank == 0:  # the creator names the size and the free space
            assert "MiB" in errors["huge"] and "free" in errors["huge"] and "--shm-size" in errors["huge"]
        else:
            assert "could not create" in errors["huge"] and "rank 0" in errors["huge"]


def test_transport_names_and_devices_are_checked():
    assert check_transport("shm", torch.device("cpu")) == "shm"
    assert check_transport("default", torch.device("cuda", 0)) == "default"
    with pytest.raises(ValueError, match="expected one of 'default', 'shm', found 'nccl'"):
        check_transport("nccl")
    with pytest.raises(ValueError, match="CPU tensors, found tensors on cuda:0"):
        check_transport("shm", torch.device("cuda", 0))


def _two_hosts_worker(rank, world):
    import wagma.shm as shm_module

    shm_module._host_identity = lambda: f"node{rank % 2}/boot"  # as if ranks 1 and 3 ran on another host
    try:
        SharedMemoryAllreduce(None, 8)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_members_on_different_hosts_are_refused_naming_them():
    for msg in run_workers(_two_hosts_worker, 4):
        assert "one host" in msg and "rank 1 on node1/boot" in msg and "rank 0 on node0/boot" in msg, msg


def _dead_member_worker(rank, world, victim):
    group = new_timeout_group(None, datetime.timedelta(seconds=2))
    shm = SharedMemoryAllreduce(group, 16)
    shm.all_reduce(torch.ones(16))
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        shm.all_reduce(torch.ones(16))
        return "no error", time.monotonic() - t0
    except RuntimeError as exc:
        return str(exc), time.monotonic() - t0


def test_a_killed_member_makes_the_others_raise_within_the_group_timeout():
    outs = run_workers_outcomes(_dead_member_worker, 3, 1, timeout_s=60)
    assert not outs[1].ok and outs[1].exitcode == -signal.SIGKILL
    for o in (outs[0], outs[2]):
        assert o.ok, o.error
        msg, waited = o.value
        assert msg != "no error" and waited < 2 * 2.0 + 2.0, (o.rank, msg, waited)
