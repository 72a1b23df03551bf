"""close() without synchronize(): every averager and hook with a background thread (or exchanges in flight)
ends promptly and leaves the default group usable, on one rank or on all, with or without a final synchronize.

Each world (4 gloo ranks, rank 3 a straggler, so the ranks' progress threads end at different places) runs three
phases with a fresh averager or hook each, the ranks aligned by a barrier before closing:

- ``"all"``: every rank closes without a final synchronize / flush, then a barrier on the default group;
- ``"sync"``: the same after a synchronize / flush on every rank;
- ``"one"``: only rank 0 closes (without synchronize); the others go to the barrier with theirs open and close after it.

The averagers' timeout is 20 s: a close that waits for a peer that has stopped (the old AD-PSGD thread, blocked in an
exchange its peer never started) shows as a close or a barrier of about 20 s. Every close and barrier must take
under 5 s.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from wagma.testing import run_workers, run_workers_outcomes

TIMEOUT_S = 20.0  # the averagers' timeout
PROMPT_S = 5.0  # the longest a close, or the barrier after it, may take
STEPS = 12
STRAGGLER_S = 0.02  # rank 3's pause after each step
PHASES = ("all", "sync", "one")


def _averager_case(kind: str, rank: int) -> tuple[Any, Callable[[], None], Callable[[], None]]:
    """(averager, one training step, the final synchronize) for an averager kind."""
    from wagma.averaging import ADPSGDAverager, SGPAverager, WagmaAverager
    from wagma.averaging.momentum import ReductionMomentum

    if kind.startswith("wagma"):  # built with the model identical on every rank
        params = [torch.ones(5, dtype=torch.float64), torch.ones(3, dtype=torch.float64)]
        options = {"overlap": True, "sync": "wait_avoiding"} if kind == "wagma_overlap_wait_avoiding" else {}
        averager: Any = WagmaAverager(2, 3, params=params, timeout=TIMEOUT_S, **options)
    else:
        params = [torch.full((5,), rank + 1.0, dtype=torch.float64), torch.full((3,), rank + 1.0, dtype=torch.float64)]
        if kind.startswith("adpsgd"):
            averager = ADPSGDAverager(timeout=TIMEOUT_S)
        elif kind == "osgp":
            averager = SGPAverager(overlap=True, timeout=TIMEOUT_S)
        else:
            raise ValueError(f"unknown averager kind {kind!r}")
    if kind.endswith("_momentum"):
        averager = ReductionMomentum(averager, 0.5)

    def step() -> None:
        for p in params:
            p.add_(0.01 * (rank + 1))  # the local step
        averager.average_parameters(params)

    return averager, step, lambda: averager.synchronize(params)


def _partial_case(rank: int) -> tuple[Any, Callable[[], None], Callable[[], None]]:
    """eager-SGD's DDP hook (overlap: a round is in flight at every step)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from wagma.hooks.partial import PartialAllreduceState, partial_allreduce_hook

    torch.manual_seed(0)
    model = nn.Linear(4, 2).double()
    ddp = DDP(model)
    state = PartialAllreduceState(model.parameters(), sync_period=3, overlap=True, timeout=TIMEOUT_S)
    ddp.register_comm_hook(state, partial_allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.full((2, 4), rank + 1.0, dtype=torch.float64)

    def step() -> None:
        opt.zero_grad()
        ddp(x).sum().backward()
        opt.step()

    return state, step, lambda: state.flush(opt)


def _fsdp_case(rank: int) -> tuple[Any, Callable[[], None], Callable[[], None]]:
    """eager-SGD through FSDP2's all-reduce hook, across the replicas of a 2 x 2 mesh."""
    from torch.distributed import fsdp
    from torch.distributed.device_mesh import init_device_mesh

    from wagma import FSDPPartialAllreduce

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    fsdp.fully_shard(model, mesh=mesh["shard"])
    state = FSDPPartialAllreduce(model, world=(mesh, "replicate"), sync_period=3, warmup_iters=1, timeout=TIMEOUT_S)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.full((1, 5), rank + 1.0)

    def step() -> None:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()

    return state, step, lambda: state.flush(opt)


def _case(kind: str, rank: int) -> tuple[Any, Callable[[], None], Callable[[], None]]:
    if kind == "partial_hook":
        return _partial_case(rank)
    if kind == "fsdp_partial_hook":
        return _fsdp_case(rank)
    return _averager_case(kind, rank)


def _closing_worker(rank: int, world_size: int, kind: str) -> dict[str, tuple[float, float, float]]:
    """Per phase: (seconds in close() before the barrier, in the barrier, in a close() after it)."""
    timings = {}
    for phase in PHASES:
        closer, step, synchronize = _case(kind, rank)
        for _ in range(STEPS):
            step()
            if rank == 3:
                time.sleep(STRAGGLER_S)
        if phase == "sync":
            synchronize()
        dist.barrier()  # every rank's training loop is done: what follows is only the close
        closes_first = phase != "one" or rank == 0
        start = time.perf_counter()
        if closes_first:
            closer.close()
        closed = time.perf_counter()
        dist.barrier()
        passed = time.perf_counter()
        if not closes_first:
            closer.close()
        timings[phase] = (closed - start, passed - closed, time.perf_counter() - passed)
    return timings


KINDS = [
    "adpsgd",
    pytest.param("adpsgd_momentum", marks=pytest.mark.slow),  # adpsgd's close, with momentum on top
    pytest.param("osgp", marks=pytest.mark.slow),
    "wagma",
    pytest.param("wagma_overlap_wait_avoiding", marks=pytest.mark.slow),
    pytest.param("wagma_momentum", marks=pytest.mark.slow),
    "partial_hook",
    pytest.param("fsdp_partial_hook", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("kind", KINDS)
def test_close_without_synchronize_ends_promptly_and_leaves_the_default_group_usable(kind):
    if kind == "fsdp_partial_hook":
        pytest.importorskip("torch.distributed.fsdp")
    results = run_workers(_closing_worker, 4, kind, timeout_s=150, collective_timeout_s=60)
    slow = {
        (rank, phase): tuple(round(t, 2) for t in timing)
        for rank, timings in enumerate(results)
        for phase, timing in timings.items()
        if max(timing) >= PROMPT_S
    }
    assert not slow, (
        f"{kind}: expected every close() and the barrier after it to take under {PROMPT_S:g} s (the timeout is "
        f"{TIMEOUT_S:g} s), found (rank, phase): (close, barrier, close after the barrier) = {slow}"
    )


def test_adpsgd_a_closed_partner_is_skipped_and_the_others_keep_averaging():
    """Rank 0 closes early: its partners skip its exchanges (no error, no wait) and go on with each other."""

    def worker(rank, world_size):
        from wagma.averaging import ADPSGDAverager

        params = [torch.full((4,), rank + 1.0, dtype=torch.float64)]
        averager = ADPSGDAverager(timeout=TIMEOUT_S)
        for _ in range(8):
            averager.average_parameters(params)
            time.sleep(0.01)
        if rank == 0:
            start = time.perf_counter()
            averager.close()
            took = time.perf_counter() - start
        dist.barrier()  # from here on, rank 0 has gone
        if rank == 0:
            return took, averager.departed, 0
        before = averager.exchanges
        for _ in range(30):
            averager.average_parameters(params)
            time.sleep(0.01)
        start = time.perf_counter()
        averager.close()
        return time.perf_counter() - start, averager.departed, averager.exchanges - before

    results = run_workers(worker, 4, timeout_s=120, collective_timeout_s=60)
    assert all(r[0] < PROMPT_S for r in results), results
    # exchange k pairs (0, 1), (2, 3) for even k and (0, 3), (2, 1) for odd k: 1 and 3 find rank 0 gone
    assert 0 in results[1][1] and 0 in results[3][1], results
    assert results[0][1] == [] and 0 not in results[2][1], results
    assert all(r[2] > 0 for r in results[1:]), results  # 1, 2 and 3 kept exchanging with each other


def test_adpsgd_a_rank_closing_before_its_thread_started_releases_the_partner_waiting_for_it():
    """Rank 1 closes before its first call (its thread never ran): rank 0, whose thread waits for it in exchange 0,
    is released at once."""

    def worker(rank, world_size):
        from wagma.averaging import ADPSGDAverager

        params = [torch.full((4,), rank + 1.0, dtype=torch.float64)]
        averager = ADPSGDAverager(timeout=TIMEOUT_S)
        if rank != 1:
            averager.average_parameters(params)  # the thread starts; rank 0's waits for rank 1 in exchange 0
        time.sleep(0.3)
        start = time.perf_counter()
        averager.close()
        closed = time.perf_counter()
        dist.barrier()
        return closed - start, time.perf_counter() - closed

    results = run_workers(worker, 4, timeout_s=120, collective_timeout_s=60)
    assert all(max(r) < PROMPT_S for r in results), results


@pytest.mark.slow  # 4-7 s: moved out of the quick suite to keep it under 10 minutes
def test_adpsgd_a_partner_that_died_is_still_named_and_close_stays_bounded():
    """A partner killed for real does not withdraw: the meeting times out naming it, and close() still returns."""

    def worker(rank, world_size):
        import os

        from wagma.averaging import ADPSGDAverager

        params = [torch.full((4,), rank + 1.0, dtype=torch.float64)]
        averager = ADPSGDAverager(timeout=datetime.timedelta(seconds=2))
        message = "no error"
        for step in range(60):
            if rank == 1 and step == 3:
                os._exit(17)  # no goodbye to anyone
            try:
                averager.average_parameters(params)
            except (TimeoutError, RuntimeError) as err:  # at the meeting, or a transfer the death broke
                message = str(err)
                break
            time.sleep(0.05)
        start = time.perf_counter()
        averager.close()
        return time.perf_counter() - start, message

    outcomes = run_workers_outcomes(worker, 4, timeout_s=120, collective_timeout_s=60)
    assert not outcomes[1].ok
    assert all(outcomes[r].ok and outcomes[r].value[0] < PROMPT_S for r in (0, 2, 3)), outcomes
    said = {r: outcomes[r].value[1] for r in (0, 2)}  # rank 1's partners
    named = [
        r
        for r, message in said.items()
        if "exchange" in message
        and ("no model arrived from rank 1" in message or "with rank 1 failed; rank 1 is probably gone" in message)
    ]
    assert named, [outcomes[r].value for r in (0, 2, 3)]
