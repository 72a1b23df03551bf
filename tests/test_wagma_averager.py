"""WagmaAverager: WAGMA-SGD model averaging: round 0's closed form, sync rounds as global means, fast ranks that wait
for a late one only on sync rounds, digits trained as well as DDP, state round trips, and the options (wait-avoiding
sync, overlap, conserve mixing, publishing after the step)."""

from __future__ import annotations

import datetime
import random
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from wagma.averaging import AveragingOptimizer, WagmaAverager, flatten_parameters
from wagma.testing import error_messages, rank_device, run_workers

TIMEOUT = datetime.timedelta(seconds=20)


def _tagged(rank: int) -> nn.Module:
    model = nn.Linear(3, 2)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.fill_(float(rank + 1) * (i + 1))
    model.register_buffer("stat", torch.full((2,), float(rank + 1)))
    return model


def _round0_worker(rank, world, mixing):
    model = _tagged(rank)
    with WagmaAverager(
        2, 5, params=model.parameters(), buffers=model.buffers(), mixing=mixing, max_lead=0, timeout=TIMEOUT
    ) as avg:
        kind = avg.average_parameters(model.parameters(), model.buffers())
        group = avg.schedule.group_of(rank, 0)
    return kind, group, [p.detach().clone() for p in model.parameters()], model.stat.clone()


@pytest.mark.parametrize("mixing", ["reference", "mean", "conserve"])
def test_round0_mixing_closed_form(mixing):
    world = 4
    out = run_workers(_round0_worker, world, mixing)
    for rank, (kind, group, params, stat) in enumerate(out):
        assert kind == "local"
        (partner,) = [j for j in group if j != rank]
        w, o = rank + 1.0, partner + 1.0
        expected = (w + w + o) / 3 if mixing == "reference" else (w + o) / 2  # conserve: the mean when fresh
        for i, p in enumerate(params):
            torch.testing.assert_close(p, torch.full_like(p, expected * (i + 1)))
        torch.testing.assert_close(stat, torch.full_like(stat, expected))  # buffers averaged too


def _sync_worker(rank, world, steps):
    torch.manual_seed(rank)
    model = _tagged(rank)
    snapshots = []
    with WagmaAverager(2, 1, params=model.parameters(), max_lead=0, timeout=TIMEOUT) as avg:
        for _step in range(steps):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p))  # a local "update"
            before = [p.detach().clone() for p in model.parameters()]
            mean = [b.clone() for b in before]
            for m in mean:
                dist.all_reduce(m)
                m.div_(world)
            kind = avg.average_parameters(model.parameters())
            snapshots.append((kind, before, mean, [p.detach().clone() for p in model.parameters()]))
    return snapshots


@pytest.mark.parametrize("world", [4, pytest.param(6, marks=pytest.mark.slow)])
def test_sync_rounds_are_global_means(world):
    out = run_workers(_sync_worker, world, 6)
    for _rank, snaps in enumerate(out):
        for step, (kind, _before, mean, after) in enumerate(snaps):
            if step % 2 == 1:
                assert kind == "global"
                for a, m in zip(after, mean):
                    torch.testing.assert_close(a, m)
            else:
                assert kind == "local"
    # After every sync round all replicas are identical.
    for step in range(1, 6, 2):
        for rank in range(1, world):
            for a, b in zip(out[0][step][3], out[rank][step][3]):
                assert torch.equal(a, b)


def _sgd_worker(rank, world, steps, policy, device="cpu"):
    torch.manual_seed(0)
    dev = rank_device(device, rank)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dev)
    g = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(64, 6, generator=g).to(dev), torch.randint(0, 3, (64,), generator=g).to(dev)
    if policy == "wagma_flat":
        flatten_parameters(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if policy.startswith("wagma"):
        avg = WagmaAverager(
            2,
            0,
            params=model.parameters(),
            order="step_then_average",
            timeout=TIMEOUT,
            transport="shm" if policy == "wagma_shm" else "default",
        )
        opt = AveragingOptimizer(opt, avg)
        aliased = avg.flat_buffers(list(model.parameters())).aliased
        assert aliased == [policy == "wagma_flat"], aliased
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if policy == "mean":
            with torch.no_grad():
                for p in model.parameters():
                    dist.all_reduce(p)
                    p.div_(world)
    if policy.startswith("wagma"):
        avg.close()
    return [p.detach().cpu().clone() for p in model.parameters()]


@pytest.mark.slow  # 4-7 s: moved out of the quick suite to keep it under 10 minutes
def test_sync_period_zero_equals_a_global_mean_every_step():
    check_sync_period_zero()


def check_sync_period_zero(device: str = "cpu") -> None:
    world = 4
    wagma = run_workers(_sgd_worker, world, 8, "wagma", device)
    mean = run_workers(_sgd_worker, world, 8, "mean", device)
    for a, b in zip(wagma[0], mean[0]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # 4-7 s: moved out of the quick suite to keep it under 10 minutes
def test_sync_period_zero_through_shared_memory_equals_a_global_mean_every_step():
    world = 4
    wagma = run_workers(_sgd_worker, world, 8, "wagma_shm")
    mean = run_workers(_sgd_worker, world, 8, "mean")
    for rank in range(world):
        for a, b in zip(wagma[rank], mean[rank]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # 4-7 s: moved out of the quick suite to keep it under 10 minutes
def test_flattened_parameters_average_in_place_to_the_same_bits():
    check_flattened_bits()


def check_flattened_bits(device: str = "cpu") -> None:
    world = 4
    copied = run_workers(_sgd_worker, world, 8, "wagma", device)
    in_place = run_workers(_sgd_worker, world, 8, "wagma_flat", device)  # the worker asserts its buffer is aliased
    for rank in range(world):
        for a, b in zip(copied[rank], in_place[rank]):
            assert torch.equal(a, b)


def _straggler_worker(rank, world, rounds, sync_period, delay_s, device="cpu", transport="default"):
    shared = random.Random(3)
    sleepers = [shared.randrange(world) for _ in range(rounds)]
    model = _tagged(rank).to(rank_device(device, rank))
    waits, synced = [], []
    with WagmaAverager(2, sync_period, params=model.parameters(), timeout=TIMEOUT, transport=transport) as avg:
        if transport == "shm":  # every group of this rank, and the global one, has its shared segment
            assert all(len(engine._core.shm) == 1 + len(engine._core.groups) for engine in avg._engines)
        for step in range(rounds):
            if sleepers[step] == rank:
                time.sleep(delay_s)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * (rank + 1))
            t0 = time.perf_counter()
            kind = avg.average_parameters(model.parameters())
            waits.append((step, kind, time.perf_counter() - t0, sleepers[step] == rank))
            if kind == "global":
                synced.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu())
        stats = avg.stats.as_dict()
    return waits, synced, stats


def test_fast_ranks_do_not_wait_for_a_late_rank_except_on_sync_rounds():
    check_late_rank_not_waited_for()


@pytest.mark.slow  # 4-6 s: moved out of the quick suite to keep it under 10 minutes
def test_with_shared_memory_fast_ranks_do_not_wait_for_a_late_rank_except_on_sync_rounds():
    check_late_rank_not_waited_for(transport="shm")


def check_late_rank_not_waited_for(device: str = "cpu", transport: str = "default") -> None:
    world, rounds, sync_period, delay = 4, 16, 7, 0.2
    out = run_workers(_straggler_worker, world, rounds, sync_period, delay, device, transport)
    # From the second round on: the first call also pays one-time costs (binding, the guard rails' search for
    # a DDP model, ~0.1 s and more on a loaded machine) that are not waiting for a straggler.
    async_waits = [w for waits, _, _ in out for (step, kind, w, _) in waits if kind == "local" and step > 0]
    # A rank that does not sleep still spends time in averaging only for the exchange itself; with a
    # straggler present most of the time, waiting for it would cost ~delay per round.
    assert sorted(async_waits)[len(async_waits) // 2] < 0.05, sorted(async_waits)
    assert sum(async_waits) / len(async_waits) < delay / 4
    for k in range(len(out[0][1])):
        for rank in range(1, world):
            assert torch.equal(out[0][1][k], out[rank][1][k])  # identical after each sync round
    stats = out[0][2]
    assert stats["global_reductions"] == 2 and stats["local_reductions"] == rounds - 2
    assert stats["stale_contributions"] + stats["fresh_contributions"] == rounds


def _digits_worker(rank, world, policy, steps):
    from wagma.app.data import load_dataset
    from wagma.app.models import build_model

    data = load_dataset("digits", seed=0)
    x, y = data.shard(rank, world)
    torch.manual_seed(0)
    model = build_model("mlp", data.in_shape, data.num_classes)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    if policy == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        avg = WagmaAverager(2, 10, params=model.parameters(), overlap=policy == "wagma_overlap", timeout=TIMEOUT)
    for _step in range(steps):
        idx = torch.randint(0, len(y), (32,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        if policy != "ddp":
            avg.average_parameters(model.parameters())  # average, then step (the reference order)
        opt.step()
    if policy != "ddp":
        avg.synchronize(model.parameters())
        avg.close()
    with torch.no_grad():
        acc = (model(data.x_test).argmax(1) == data.y_test).float().mean().item()
    return acc


@pytest.mark.slow  # 11 s: two 4-rank trainings
def test_wagma_trains_digits_as_well_as_ddp():
    world, steps = 4, 250
    ddp = run_workers(_digits_worker, world, "ddp", steps, timeout_s=120)
    assert ddp[0] > 0.9
    for policy in ("wagma", "wagma_overlap"):  # overlap: every group round applied one step late
        wagma = run_workers(_digits_worker, world, policy, steps, timeout_s=120)
        assert len(set(wagma)) == 1  # the final synchronize made the replicas identical
        assert wagma[0] >= ddp[0] - 0.02, (policy, wagma[0], ddp[0])


def _resume_worker(rank, world, split):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    g = torch.Generator().manual_seed(rank)
    data = [torch.randn(8, 4, generator=g) for _ in range(10)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    avg = WagmaAverager(2, 3, params=model.parameters(), max_lead=0, timeout=TIMEOUT)
    aopt = AveragingOptimizer(opt, avg)
    for step in range(10):
        if split is not None and step == split:
            state = {"model": model.state_dict(), "opt": aopt.state_dict()}
            avg.close()
            torch.manual_seed(1)
            model = nn.Linear(4, 3)  # a fresh process would build a different model ...
            model.load_state_dict(state["model"])  # ... and load the checkpoint
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            avg = WagmaAverager(2, 3, params=model.parameters(), max_lead=0, timeout=TIMEOUT)
            aopt = AveragingOptimizer(opt, avg)
            aopt.load_state_dict(state["opt"])
        aopt.zero_grad()
        model(data[step]).pow(2).sum().backward()
        aopt.step()
    avg.close()
    return [p.detach().clone() for p in model.parameters()], avg.step


@pytest.mark.slow  # 4-7 s: moved out of the quick suite to keep it under 10 minutes
def test_state_dict_round_trip_continues_like_an_uninterrupted_run():
    world = 4
    straight = run_workers(_resume_worker, world, None)
    resumed = run_workers(_resume_worker, world, 6)
    for (a, sa), (b, sb) in zip(straight, resumed):
        assert sa == sb == 10
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def _bad_args_worker(rank, world):
    model = nn.Linear(2, 2)
    cases = {
        "group size": dict(group_size=3, sync_period=2),
        "negative sync": dict(group_size=2, sync_period=-1),
        "mixing": dict(group_size=2, sync_period=2, mixing="median"),
        "order": dict(group_size=2, sync_period=2, order="sideways"),
        "lead": dict(group_size=2, sync_period=2, max_lead=3),
        "schedule": dict(group_size=2, sync_period=2, schedule="ring"),
        "sync": dict(group_size=2, sync_period=2, sync="lazy"),
        "publish order": dict(group_size=2, sync_period=2, publish_after_step=True, order="step_then_average"),
        "publish overlap": dict(group_size=2, sync_period=2, publish_after_step=True, overlap=True),
        "publish flag": dict(group_size=2, sync_period=2, publish_after_step=1),
    }
    return error_messages(
        {
            name: lambda kw=kwargs: WagmaAverager(params=model.parameters(), timeout=TIMEOUT, **kw).close()
            for name, kwargs in cases.items()
        }
    )


def test_bad_arguments_raise_value_errors():
    errors = run_workers(_bad_args_worker, 4)[0]
    assert "divisor of the world size 4" in errors["group size"]
    assert "sync_period" in errors["negative sync"]
    assert "mixing: expected one of 'reference', 'mean', 'conserve', found 'median'" in errors["mixing"]
    assert "average_then_step" in errors["order"]
    assert "max_lead" in errors["lead"]
    assert "schedule" in errors["schedule"]
    assert "'barrier', 'wait_avoiding'" in errors["sync"] and "'lazy'" in errors["sync"]
    for case in ("publish order", "publish overlap"):
        assert "order='average_then_step' and overlap=False" in errors[case], errors[case]
    assert "order='step_then_average'" in errors["publish order"] and "overlap=True" in errors["publish overlap"]
    assert "expected True or False, found 1" in errors["publish flag"]


# -- parameters bound by identity, fp16 sums, one reduction per round ------------------------------------------


def _order_worker(rank, world, order):
    """Rounds on a Linear whose call order is natural, reversed on odd ranks, or via a reordered optimizer."""
    model = _tagged(rank)
    params = list(model.parameters())  # weight (2, 3), bias (2,): the same flat size in either order
    avg = WagmaAverager(2, 3, params=model.named_parameters(), max_lead=0, timeout=TIMEOUT)
    opt = torch.optim.SGD([{"params": params[::-1] if order == "optimizer" else params}], lr=0.5)
    aopt = AveragingOptimizer(opt, avg)
    for step in range(6):
        for i, p in enumerate(params):
            p.grad = torch.full_like(p, float(rank * (i + 2) + step))
        if order == "optimizer":
            aopt.step()
        else:  # average, then step: the averager's order, as AveragingOptimizer runs it
            avg.average_parameters(params[::-1] if order == "reversed" and rank % 2 else params)
            opt.step()
    errors = error_messages(
        {
            "missing": lambda: avg.average_parameters([model.weight]),
            "new": lambda: avg.average_parameters(params + [nn.Parameter(torch.ones(4, 4))]),
        }
    )
    avg.close()
    return [p.detach().clone() for p in params], errors


def test_parameters_are_bound_by_identity_not_position():
    world = 4
    natural = run_workers(_order_worker, world, "natural")
    for order in ("reversed", "optimizer"):
        other = run_workers(_order_worker, world, order)
        for (a, _), (b, _) in zip(natural, other):
            for x, y in zip(a, b):
                assert torch.equal(x, y), (order, x, y)
    errors = natural[0][1]
    assert "1 bound tensor(s) missing: 'bias' (2,) float32" in errors["missing"]
    assert "1 tensor(s) never bound: #2 (4, 4) float32" in errors["new"]
    assert "call bind() on every rank" in errors["new"]


def _fp16_worker(rank, world):
    w = torch.full((5,), 40000.0 if rank == 0 else 30000.0, dtype=torch.float16)
    out = []
    with WagmaAverager(2, 1, params=[w], max_lead=0, timeout=TIMEOUT) as avg:
        for _ in range(2):  # round 0: async (w + w + o) / 3; round 1: sync mean
            avg.average_parameters([w])
            out.append(w.clone())
    return out


def test_fp16_group_sums_do_not_overflow():
    out = run_workers(_fp16_worker, 2)
    # Round 0 sums 110000 > float16's 65504 before dividing by 3: it must be summed in float32.
    r0 = [(40000.0 * 2 + 30000.0) / 3, (30000.0 * 2 + 40000.0) / 3]
    for rank, (a, b) in enumerate(out):
        assert torch.isfinite(a).all() and torch.isfinite(b).all(), (a, b)
        torch.testing.assert_close(a.float(), torch.full((5,), r0[rank]).half().float())
        torch.testing.assert_close(b.float(), torch.full((5,), sum(r0) / 2).half().float(), rtol=1e-3, atol=0)


def _mixed_dtype_worker(rank, world):
    w32 = torch.full((3,), float(rank))
    w64 = torch.full((2,), float(rank), dtype=torch.float64)
    with WagmaAverager(2, 1, params=[w32, w64], max_lead=0, timeout=TIMEOUT) as avg:
        for _ in range(4):
            avg.average_parameters([w32, w64])
        return avg.stats.as_dict()


def test_one_reduction_per_round_whatever_the_number_of_dtype_buffers():
    for stats in run_workers(_mixed_dtype_worker, 2):
        assert (stats["local_reductions"], stats["global_reductions"]) == (2, 2), stats
        assert stats["bytes_sent"] == 4 * (3 * 4 + 2 * 8)
        assert stats["fresh_contributions"] + stats["stale_contributions"] == 4


def test_exit_without_close_during_an_exchange_ends_cleanly():
    from exit_without_close import run_world

    for rc, text in run_world("wagma"):
        assert rc == 0 and "leaves without close()" in text, (rc, text)  # rc -6 / 134: SIGABRT


# exit: 6 s, slow (it passes on the old engine too: at exit the thread begins the round before the finalizer);
# close is the case that fails without the drain.
@pytest.mark.parametrize("leave", [pytest.param("exit", marks=pytest.mark.slow), "close"])
def test_a_round_activated_before_a_rank_leaves_is_still_run_by_it(leave):
    # Rank 1 is stopped while rank 0 triggers round 1 and leaves (falls off the end of its script, or close()s at
    # once): rank 0 runs round 1 with its last contribution before it goes, so rank 1, resumed, completes it.
    from exit_without_close import run_world

    (rc0, text0), (rc1, text1) = run_world("wagma", peer_stopped=True, leave=leave)
    assert rc0 == 0 and f"rank 0 leaves by {leave}" in text0, (rc0, text0)
    assert rc1 == 0 and "rank 1 completed round 1" in text1, (rc1, text1)


def _dropped_worker(rank, world):
    import gc

    w = torch.ones(3) * rank
    avg = WagmaAverager(2, 3, params=[w], timeout=TIMEOUT)
    avg.average_parameters([w])
    avg.self_cycle = avg  # a reference cycle: only the garbage collector can drop it
    threads = [e._core.thread for e in avg._engines]
    groups = list(avg._owned_groups)
    del avg
    gc.collect()
    for t in threads:
        t.join(timeout=10.0)
    return [t.is_alive() for t in threads], [g in dist.distributed_c10d._world.pg_map for g in groups]


def test_a_dropped_averager_stops_its_threads_and_releases_its_groups():
    for alive, groups in run_workers(_dropped_worker, 2):
        assert alive == [False] and groups == [False], (alive, groups)


# -- sync="wait_avoiding", a sync round that is not a barrier ----------------------------------------------------


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _relaxed_worker(rank, world, rounds, sleeps, sync_period, max_lead):
    """Rounds of sync="wait_avoiding" where rank ``r`` sleeps ``sleeps(r, step)`` before each step."""
    model = _tagged(rank)
    records = []
    with WagmaAverager(
        2, sync_period, params=model.parameters(), max_lead=max_lead, sync="wait_avoiding", timeout=TIMEOUT
    ) as avg:
        for step in range(rounds):
            time.sleep(sleeps(rank, step))
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * (rank + 1))  # a rank-dependent local "update": the replicas drift apart
            before, fresh_before = _flat(model), avg.stats.fresh_contributions
            t0 = time.perf_counter()
            kind = avg.average_parameters(model.parameters())
            wait = time.perf_counter() - t0
            records.append((kind, wait, avg.stats.fresh_contributions > fresh_before, before, _flat(model)))
        stats = avg.stats.as_dict()
    return records, stats


def _persistent(slow: int, delay_s: float):
    return lambda rank, step: delay_s if rank == slow else 0.0


@pytest.mark.parametrize("world", [4, pytest.param(6, marks=pytest.mark.slow)])
def test_wait_avoiding_sync_bounds_staleness_with_a_persistently_slow_rank(world):
    """Rank P-1 sleeps before every step, so it falls behind as far as the protocol lets it: its
    contributions reach, and never pass, the staleness bound L = max_lead (docstring, point 1); sync rounds
    are not barriers: the slow rank joins them late, with its published model; and the closed form of
    point 3 holds at every sync round: the fresh ranks hold the same mean m, a late rank (w + P m)/(P + 1),
    so the consensus distance after a sync round is at most max ||w_late - m||^2 / (P + 1)^2."""
    rounds, sync_period, lead, delay = 16, 3, 2, 0.08
    out = run_workers(_relaxed_worker, world, rounds, _persistent(world - 1, delay), sync_period, lead, timeout_s=90)
    for rank, (_, stats) in enumerate(out):
        hist = {int(k): v for k, v in stats["staleness_hist"].items()}
        assert max(hist) <= lead, (rank, hist)
        assert sum(hist.values()) == rounds
        assert stats["global_reductions"] == rounds // (sync_period + 1)
    slow_hist = {int(k): v for k, v in out[world - 1][1]["staleness_hist"].items()}
    assert max(slow_hist) == lead, slow_hist  # the slow rank does fall behind up to the bound
    late_syncs = 0
    for step in range(rounds):
        kinds = {out[r][0][step][0] for r in range(world)}
        if step % (sync_period + 1) != sync_period:
            assert kinds == {"local"}
            continue
        assert kinds == {"global"}
        fresh = [r for r in range(world) if out[r][0][step][2]]
        late = [r for r in range(world) if not out[r][0][step][2]]
        assert fresh, f"sync round {step}: no rank was fresh"
        m = out[fresh[0]][0][step][4]
        for r in fresh:
            assert torch.equal(out[r][0][step][4], m), (step, r)
        for r in late:
            w = out[r][0][step][3]
            torch.testing.assert_close(out[r][0][step][4], (w + world * m) / (world + 1))
        after = torch.stack([out[r][0][step][4] for r in range(world)])
        consensus = (after - after.mean(0)).pow(2).sum(1).mean().item()
        bound = max([(out[r][0][step][3] - m).pow(2).sum().item() for r in late], default=0.0) / (world + 1) ** 2
        assert consensus <= bound + 1e-9, (step, consensus, bound)
        late_syncs += bool(late)
    assert late_syncs >= 2, "the slow rank should have joined sync rounds late (not a barrier)"


def _random_sleeper(world: int, rounds: int, delay_s: float):
    shared = random.Random(5)
    sleepers = [shared.randrange(world) for _ in range(rounds)]
    return lambda rank, step: delay_s if sleepers[step] == rank else 0.0


def test_wait_avoiding_sync_rounds_do_not_wait_for_a_late_rank():
    """One random rank per step sleeps (random_k1): under sync="barrier" every sync round would cost the
    ranks that did not sleep about the delay; under "wait_avoiding" they do not wait for it there either."""
    world, rounds, sync_period, delay = 4, 16, 3, 0.2
    sleeps = _random_sleeper(world, rounds, delay)
    out = run_workers(_relaxed_worker, world, rounds, sleeps, sync_period, sync_period, timeout_s=90)
    sync_waits = [
        rec[1]
        for rank, (records, _) in enumerate(out)
        for step, rec in enumerate(records)
        if rec[0] == "global" and sleeps(rank, step) == 0.0
    ]
    assert len(sync_waits) == (world - 1) * rounds // (sync_period + 1)
    assert sorted(sync_waits)[len(sync_waits) // 2] < delay / 4, sorted(sync_waits)
    for _, stats in out:
        assert max(int(k) for k in stats["staleness_hist"]) <= sync_period


# -- overlap=True, a group round's exchange hidden behind the next step --------------------------------------------
def _overlap_closed_form_worker(rank, world):
    model = _tagged(rank)
    kinds, after = [], []
    with WagmaAverager(2, 5, params=model.parameters(), max_lead=0, overlap=True, timeout=TIMEOUT) as avg:
        kinds.append(avg.average_parameters(model.parameters()))  # submits round 0 with the tagged model
        unchanged = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for p in model.parameters():
                p.add_(10.0 * (rank + 1))  # one local step
        kinds.append(avg.average_parameters(model.parameters()))  # applies round 0, submits round 1
        after = [p.detach().clone() for p in model.parameters()]
        group = avg.schedule.group_of(rank, 0)
        stats = avg.stats.as_dict()
        # What round 1 will be applied against is each engine's own snapshot, not a copy kept by the averager.
        no_copy = all(sent is engine.published() for sent, engine in zip(avg._submitted, avg._engines))
    assert no_copy
    return kinds, unchanged, after, group, stats


def test_overlap_applies_each_round_one_call_later_keeping_the_local_step_whole():
    world = 4
    for rank, (kinds, unchanged, after, group, stats) in enumerate(run_workers(_overlap_closed_form_worker, world)):
        assert kinds == [None, "local"]  # call 0 only submits; call 1 applies round 0
        for i, p in enumerate(unchanged):
            torch.testing.assert_close(p, torch.full_like(p, (rank + 1.0) * (i + 1)))
        (partner,) = [j for j in group if j != rank]
        for i, p in enumerate(after):
            # Round 0 summed the tagged models of the pair (max_lead=0: both fresh). Its reference average
            # replaces the submitted model, and the local step taken since is kept whole: w + avg - sent.
            sent, other = (rank + 1.0) * (i + 1), (partner + 1.0) * (i + 1)
            fresh = sent + 10.0 * (rank + 1)
            expected = fresh + (sent + sent + other) / 3 - sent
            torch.testing.assert_close(p, torch.full_like(p, expected))
        assert stats["local_reductions"] == 1 and stats["staleness_hist"] == {1: 1}


def _overlap_late_worker(rank, world):
    """Rank 1 sleeps before its first call, so its progress thread runs round 0 with the initial model: late."""
    model = _tagged(rank)
    with WagmaAverager(2, 5, params=model.parameters(), max_lead=1, overlap=True, timeout=TIMEOUT) as avg:
        if rank == 1:
            time.sleep(0.5)
        avg.average_parameters(model.parameters())  # submits round 0 (rank 0 triggers it at once)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(10.0 * (rank + 1))
        avg.average_parameters(model.parameters())  # applies round 0
        after = [p.detach().clone() for p in model.parameters()]
        hist = dict(avg.stats.as_dict()["staleness_hist"])
    return after, hist


def test_overlap_mixes_a_round_this_rank_was_late_for_as_a_late_rank():
    """Rank 0 contributed the model it submitted (fresh): w + (sent + sum) / 3 - sent. Rank 1's thread
    contributed its initial model before rank 1 submitted anything, so what it submitted is not in the sum:
    it mixes as a late rank, (w + sum) / 3 (docs/design.md §2.3), and counts the contribution 2 calls old."""
    (after0, hist0), (after1, hist1) = run_workers(_overlap_late_worker, 2)
    assert hist0 == {1: 1} and hist1 == {2: 1}, (hist0, hist1)
    for i, (p0, p1) in enumerate(zip(after0, after1)):
        t0, t1 = 1.0 * (i + 1), 2.0 * (i + 1)  # the tagged (and initial) models
        total = t0 + t1  # round 0: rank 0's submitted model and rank 1's initial one
        torch.testing.assert_close(p0, torch.full_like(p0, (t0 + 10.0) + (t0 + total) / 3 - t0))
        torch.testing.assert_close(p1, torch.full_like(p1, ((t1 + 20.0) + total) / 3))


def _overlap_run_worker(rank, world, steps, sync_period):
    torch.manual_seed(rank)
    model = _tagged(rank)
    kinds, synced = [], []
    with WagmaAverager(2, sync_period, params=model.parameters(), overlap=True, timeout=TIMEOUT) as avg:
        for step in range(steps):
            if step % 3 == rank % 3:
                time.sleep(0.05)  # a straggler now and then: rounds run ahead, results wait to be applied
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p))
            kind = avg.average_parameters(model.parameters())
            kinds.append(kind)
            if kind == "global":
                synced.append(_flat(model))
        avg.synchronize(model.parameters())  # collects the round in flight, then a fresh global mean
        final = _flat(model)
        stats = avg.stats.as_dict()
        left = {k: len(e._uncollected) for k, e in enumerate(avg._engines)}
    return kinds, synced, final, stats, left


def test_overlap_keeps_sync_rounds_blocking_and_fresh_and_leaves_no_round_behind():
    world, steps, sync_period = 4, 14, 4
    out = run_workers(_overlap_run_worker, world, steps, sync_period)
    # Rounds 4, 9 are sync rounds (applied at once); every other call applies the round before it, except
    # the call after a sync round and the first call, which have none.
    expected = [
        None,
        "local",
        "local",
        "local",
        "global",
        None,
        "local",
        "local",
        "local",
        "global",
        None,
        "local",
        "local",
        "local",
    ]
    for kinds, _synced, _final, stats, left in out:
        assert kinds == expected
        assert left == {0: 0}  # synchronize() collected the round in flight
        # Two sync rounds and synchronize(); a sync call first applies the group round before it (3 and 8).
        assert stats["global_reductions"] == 2 + 1 and stats["local_reductions"] == 9 + 2
        hist = stats["staleness_hist"]  # sync rounds fresh; group rounds applied a call late: 1 + their lag
        assert hist[0] == 2 and sum(hist.values()) == 13 and all(1 <= s <= sync_period + 1 for s in hist if s)
    for rank in range(1, world):
        assert all(torch.equal(a, b) for a, b in zip(out[0][1], out[rank][1]))  # identical after each sync round
        assert torch.equal(out[0][2], out[rank][2])


# -- sync="wait_avoiding" with overlap=True: a rank waits for nothing but its staleness bounds -------------------
def _relaxed_overlap_worker(rank, world, rounds, sleeps, sync_period, max_lead):
    model = _tagged(rank)
    kinds, waits = [], []
    with WagmaAverager(
        2,
        sync_period,
        params=model.parameters(),
        max_lead=max_lead,
        sync="wait_avoiding",
        overlap=True,
        timeout=TIMEOUT,
    ) as avg:
        for step in range(rounds):
            time.sleep(sleeps(rank, step))
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * (rank + 1))
            t0 = time.perf_counter()
            kinds.append(avg.average_parameters(model.parameters()))
            waits.append(time.perf_counter() - t0)
        avg.synchronize(model.parameters())  # collects the round in flight, then a fresh global mean
        stats = avg.stats.as_dict()
        left = len(avg._engines[0]._uncollected)
    return kinds, waits, _flat(model), stats, left


def test_wait_avoiding_sync_with_overlap_bounds_staleness_by_max_lead_plus_one():
    """Both relaxations together (averaging=reference/wagma_relaxed_overlap): every round, sync rounds included, is
    submitted and applied one call later, so a call waits only where a staleness bound holds it; a persistently
    slow rank falls behind until its contributions are L rounds old, applied one call later: L + 1 (docstring,
    point 1), never more (from then on the fast ranks' lead bound holds them, as it must). Each call k >= 1 applies
    round k - 1, whose kind (global every sync_period + 1 rounds) it returns."""
    world, rounds, sync_period, lead, delay = 4, 16, 3, 2, 0.08
    out = run_workers(
        _relaxed_overlap_worker, world, rounds, _persistent(world - 1, delay), sync_period, lead, timeout_s=90
    )
    expected = [None] + ["global" if k % (sync_period + 1) == sync_period else "local" for k in range(rounds - 1)]
    for rank, (kinds, _waits, _, stats, left) in enumerate(out):
        assert kinds == expected, (rank, kinds)
        hist = {int(k): v for k, v in stats["staleness_hist"].items()}
        assert min(hist) >= 1 and max(hist) <= lead + 1, (rank, hist)
        assert sum(hist.values()) == rounds - 1  # rounds 0 .. rounds-2, each applied one call late
        assert left == 0
    slow = {int(k): v for k, v in out[world - 1][3]["staleness_hist"].items()}
    assert max(slow) == lead + 1, slow
    for rank in range(1, world):
        assert torch.equal(out[0][2], out[rank][2])  # synchronize(): identical replicas


@pytest.mark.slow
def test_wait_avoiding_sync_with_overlap_waits_for_no_late_rank():
    """random_k1 (one random rank per step sleeps): a rank that did not sleep normally waits for nothing, sync
    rounds included: each call only collects the round its previous call submitted, done by then."""
    world, rounds, sync_period, delay = 4, 16, 3, 0.2
    sleeps = _random_sleeper(world, rounds, delay)
    out = run_workers(_relaxed_overlap_worker, world, rounds, sleeps, sync_period, sync_period, timeout_s=90)
    waits = [w for rank, (_, ws, _, _, _) in enumerate(out) for step, w in enumerate(ws) if sleeps(rank, step) == 0.0]
    assert sorted(waits)[len(waits) // 2] < delay / 10, sorted(waits)  # the lead bound may hold a rank now and then
    for _, _, _, stats, _ in out:
        assert max(int(k) for k in stats["staleness_hist"]) <= sync_period + 1


# -- mixing="conserve": a round replaces what this rank contributed by the group's mean, keeping the rest whole -----
def _conserve_late_worker(rank, world, overlap):
    """Rank 1 sleeps before its first step, so its thread runs round 0 with the initial (tagged) model: late."""
    model = _tagged(rank)
    with WagmaAverager(
        2, 5, params=model.parameters(), max_lead=1, mixing="conserve", overlap=overlap, timeout=TIMEOUT
    ) as avg:
        if rank == 1:
            time.sleep(0.5)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(10.0 * (rank + 1))  # one local step
        avg.average_parameters(model.parameters())  # overlap: submits round 0; else: round 0, applied
        if overlap:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(100.0 * (rank + 1))  # a second local step
            avg.average_parameters(model.parameters())  # applies round 0
        after = [p.detach().clone() for p in model.parameters()]
        hist = dict(avg.stats.as_dict()["staleness_hist"])
    return after, hist


@pytest.mark.parametrize("overlap", [False, True])
def test_conserve_keeps_a_late_ranks_progress_whole(overlap):
    """Round 0: rank 0 contributed its fresh model t0 + 10, rank 1's thread its tagged model t1 (rank 1 was still
    asleep). Rank 0 takes the mean (plus, with overlap, its step since); rank 1 takes the mean plus all its progress
    since t1, not 1/3 of it as under the reference mixing. The two models still sum to what they summed before."""
    (after0, hist0), (after1, hist1) = run_workers(_conserve_late_worker, 2, overlap)
    late = 1 if overlap else 0
    assert hist0 == {late: 1} and hist1 == {late + 1: 1}, (hist0, hist1)
    for i, (p0, p1) in enumerate(zip(after0, after1)):
        t0, t1 = 1.0 * (i + 1), 2.0 * (i + 1)
        w0, w1 = t0 + 10.0, t1 + 20.0
        mean = (w0 + t1) / 2  # round 0's sum / 2
        if overlap:
            expected0, expected1 = mean + 100.0, mean + (w1 - t1) + 200.0
        else:
            expected0, expected1 = mean, mean + (w1 - t1)
        torch.testing.assert_close(p0, torch.full_like(p0, expected0))
        torch.testing.assert_close(p1, torch.full_like(p1, expected1))
        steps = 10.0 + 20.0 + (300.0 if overlap else 0.0)
        torch.testing.assert_close(p0 + p1, torch.full_like(p0, t0 + t1 + steps))


def _sum_worker(rank, world, rounds, sleeps, mixing, overlap, sync_period, max_lead, device="cpu", publish=False):
    """Random local steps and sleeps; returns the model before and after, the steps' total and the staleness.
    ``publish``: publish_after_step, the model published right after each local step."""
    model = _tagged(rank).to(rank_device(device, rank))
    initial, steps = _flat(model), torch.zeros_like(_flat(model))
    gen = torch.Generator().manual_seed(1000 + rank)
    with WagmaAverager(
        2,
        sync_period,
        params=model.parameters(),
        max_lead=max_lead,
        sync="wait_avoiding",
        mixing=mixing,
        overlap=overlap,
        publish_after_step=publish,
        timeout=TIMEOUT,
    ) as avg:
        for step in range(rounds):
            time.sleep(sleeps(rank, step))
            offset = 0
            with torch.no_grad():
                for p in model.parameters():
                    delta = torch.randn(p.shape, generator=gen).to(p.device)
                    p.add_(delta)
                    steps[offset : offset + p.numel()] += delta.reshape(-1)
                    offset += p.numel()
            if publish and step:  # after the step that followed the previous round (none before the first)
                avg.publish(model.parameters())
            avg.average_parameters(model.parameters())
        final = _flat(model)  # with overlap, the last round is still in flight: applied by no rank, it changes no sum
        hist = {int(k): v for k, v in avg.stats.as_dict()["staleness_hist"].items()}
        avg.synchronize(model.parameters())  # every rank's rounds done before any rank closes its communicators
    return initial.cpu(), steps.cpu(), final.cpu(), hist


@pytest.mark.slow  # 6 s each: both in the slow suite, to keep the quick one under 10 minutes
@pytest.mark.parametrize("overlap", [False, True])
def test_conserve_keeps_the_sum_of_all_models_whatever_the_staleness(overlap):
    """The invariant conserve mixing is for: with a persistently slow rank (contributions up to max_lead rounds
    old) and wait-avoiding sync rounds, the sum of all models is the initial sum plus every local step, exactly as
    under DDP, where the mean model moves by the mean step. The reference mixing, on the same run, loses part of
    each late rank's progress (the check fails for it), so the invariant is conserve's, not the schedule's."""
    check_conserve_sum(overlap)


@pytest.mark.slow  # 6 s
def test_conserve_keeps_the_sum_when_ranks_publish_after_the_step():
    """wagma_ahead_conserve's pair: a late rank's thread sends the model published after its step, and the round
    replaces only what was sent, so the sum of all models is still the initial sum plus every local step."""
    check_conserve_sum(False, publish=True)


def check_conserve_sum(overlap: bool, device: str = "cpu", publish: bool = False) -> None:
    world, rounds, sync_period, lead, delay = 4, 16, 3, 2, 0.06
    sums = {}
    for mixing in ("conserve", "reference"):
        out = run_workers(
            _sum_worker,
            world,
            rounds,
            _persistent(world - 1, delay),
            mixing,
            overlap,
            sync_period,
            lead,
            device,
            publish,
            timeout_s=90,
        )
        initial = sum(o[0] for o in out)
        steps = sum(o[1] for o in out)
        final = sum(o[2] for o in out)
        bound = lead + 1 if overlap else lead
        assert all(max(o[3]) <= bound for o in out), [o[3] for o in out]
        assert max(out[world - 1][3]) >= 2, out[world - 1][3]  # the slow rank was late: stale rounds happened
        sums[mixing] = (final - (initial + steps)).abs().max().item(), steps.abs().max().item()
    assert sums["conserve"][0] < 1e-4 * (1 + sums["conserve"][1]), sums
    assert sums["reference"][0] > 0.1, sums  # a real loss, far above rounding


# -- publish_after_step: a late rank contributes the model after its step, not its previous call's ------------------


def _publish_ahead_worker(rank, world, ahead, device="cpu"):
    """Call 0 together; then rank 1 'computes' (sleeps) longer before call 1, so rank 0 starts round 1 without it.

    The gradients are set by hand so each SGD step (lr 1) adds 10 (rank 0) or 20 (rank 1) to every parameter.
    Returns the model after each call and the staleness of each of this rank's contributions.
    """
    model = _tagged(rank).to(rank_device(device, rank))
    avg = WagmaAverager(2, 5, params=model.parameters(), max_lead=1, publish_after_step=ahead, timeout=TIMEOUT)
    opt = AveragingOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), avg)
    after, staleness = [], []
    for call in range(2):
        for p in model.parameters():
            p.grad = torch.full_like(p, -10.0 * (rank + 1))
        if call == 1:  # rank 0 waits for rank 1 to be done with its step (and publish), not with its next gradient
            time.sleep(0.4 if rank == 0 else 1.2)
        before = dict(avg.stats.as_dict()["staleness_hist"])
        opt.step()  # round `call` (average, then step; with `ahead`, then publish)
        hist = avg.stats.as_dict()["staleness_hist"]
        staleness.append(next(int(k) for k in hist if hist[k] != before.get(k, 0)))
        after.append([p.detach().cpu().clone() for p in model.parameters()])
    avg.synchronize(model.parameters())  # both ranks done with round 1 before either closes
    avg.close()
    return after, staleness


@pytest.mark.parametrize("ahead", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_publish_after_step_makes_a_late_rank_contribute_its_stepped_model(ahead):
    """Round 0 mixes the tagged models t0, t1 (both ranks at their first call): a_r = (w_r + t0 + t1) / 3; the
    steps make w0 = a0 + 10 and w1 = a1 + 20. Rank 0 starts round 1 while rank 1 sleeps: rank 1's thread sends
    its stepped model w1 under publish_after_step (fresh, staleness 0), else the model of its call 0, t1 (one
    step and one round old, staleness 1). Either way rank 1 then mixes its fresh model once with the sum."""
    check_publish_after_step(ahead)


def check_publish_after_step(ahead: bool, device: str = "cpu") -> None:
    (after0, stale0), (after1, stale1) = run_workers(_publish_ahead_worker, 2, ahead, device)
    assert stale0[1] == 0 and stale1[1] == (0 if ahead else 1), (stale0, stale1)
    for i in range(2):
        t0, t1 = 1.0 * (i + 1), 2.0 * (i + 1)
        a0, a1 = (2 * t0 + t1) / 3, (t0 + 2 * t1) / 3
        torch.testing.assert_close(after0[0][i], torch.full_like(after0[0][i], a0 + 10.0))
        torch.testing.assert_close(after1[0][i], torch.full_like(after1[0][i], a1 + 20.0))
        w0, w1 = a0 + 10.0, a1 + 20.0
        sent1 = w1 if ahead else t1
        torch.testing.assert_close(after0[1][i], torch.full_like(after0[1][i], (2 * w0 + sent1) / 3 + 10.0))
        torch.testing.assert_close(after1[1][i], torch.full_like(after1[1][i], (w1 + w0 + sent1) / 3 + 20.0))


def _publish_misuse_worker(rank, world):
    model = nn.Linear(2, 2)
    with WagmaAverager(2, 5, params=model.parameters(), max_lead=0, timeout=TIMEOUT) as plain:
        errors = error_messages({"not enabled": lambda: plain.publish(model.parameters())}, (RuntimeError,))
        plain.average_parameters(model.parameters())
    with WagmaAverager(2, 5, params=model.parameters(), max_lead=0, publish_after_step=True, timeout=TIMEOUT) as avg:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            avg.average_parameters(model.parameters())  # the first call: nothing to publish before it
            first = len(caught)
            avg.average_parameters(model.parameters())  # a step went by with no publish(): warned once
            avg.average_parameters(model.parameters())
    return errors, first, [str(w.message) for w in caught]


def test_publish_needs_the_option_and_a_missing_publish_is_warned_once():
    errors, first, messages = run_workers(_publish_misuse_worker, 2)[0]
    assert errors["not enabled"].startswith("RuntimeError: publish() needs publish_after_step=True")
    assert first == 0 and len(messages) == 1, messages
    assert "publish() was not called after the optimizer step before round 1" in messages[0]
