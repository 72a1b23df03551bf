"""eager-SGD's partial allreduce hook (wagma.hooks.partial): without delays it equals a plain allreduce; late gradients
are carried to a later round, never dropped, so every gradient is applied once (solo and majority, overlap, the bf16
wire, shared memory); a state_dict round trip continues like an uninterrupted run."""

from __future__ import annotations

import datetime
import pickle
import random
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from wagma.hooks import get as get_hook
from wagma.hooks.fsdp import FSDPPartialAllreduce
from wagma.hooks.lookahead import LookAhead, in_flight_steps
from wagma.hooks.partial import PartialAllreduceState, partial_allreduce_hook
from wagma.testing import error_messages, rank_device, run_workers

TIMEOUT = datetime.timedelta(seconds=20)


def _model() -> nn.Module:
    torch.manual_seed(0)
    # Two buckets' worth of layers with a tiny bucket cap, so the hook sees several buckets per iteration.
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def _batches(rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(10 + rank)
    return [
        (torch.randn(8, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)
    ]


def _train(
    rank,
    world,
    iters,
    mode,
    sleep_s,
    max_lead,
    seed=0,
    device="cpu",
    momentum=0.0,
    overlap=False,
    bucket_view=False,
    transport="default",
    wire_dtype=None,
):
    """Train with DDP + the partial hook (or plain DDP when mode is None); record local gradients."""
    dev = rank_device(device, rank)
    model = _model().to(dev)
    ddp = DDP(model, bucket_cap_mb=0.0005, gradient_as_bucket_view=bucket_view)
    state = None
    if mode is not None:
        state = PartialAllreduceState(
            model.parameters(),
            mode=mode,
            sync_period=5,
            max_lead=max_lead,
            seed=seed,
            overlap=overlap,
            timeout=TIMEOUT,
            transport=transport,
            wire_dtype=wire_dtype,
        )
        assert bool(state.engine._core.shm) == (transport == "shm")
        ddp.register_comm_hook(state, partial_allreduce_hook)
    local_grads = torch.zeros(sum(p.numel() for p in model.parameters()), dtype=torch.float64, device=dev)
    offsets, at = {}, 0
    for p in model.parameters():
        offsets[p] = at
        at += p.numel()

        def record(g, p=p):
            local_grads[offsets[p] : offsets[p] + p.numel()] += g.reshape(-1)

        p.register_hook(record)
    initial = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    shared = random.Random(seed + 99)
    checks = []
    for x, y in _batches(rank, iters):
        if sleep_s and shared.randrange(world) == rank:
            time.sleep(sleep_s)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x.to(dev)), y.to(dev)).backward()
        opt.step()
        checks.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu())
    extra = {}
    if state is not None:
        extra["flushed"] = state.flush(opt)
        extra.update(state.stats_dict())
        extra["initiators"] = [state.engine.initiator(k) for k in range(20)]
        state.close()
    final = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    total_grads = local_grads.clone()
    dist.all_reduce(total_grads)
    return initial.cpu(), final.cpu(), total_grads.cpu(), checks, extra


def test_without_delays_and_with_a_flush_it_equals_plain_allreduce():
    check_equals_plain_allreduce()


def check_equals_plain_allreduce(device: str = "cpu") -> None:
    world, iters = 3, 12
    # max_lead=0: each rank's exchange waits for its own gradient, so every round is fully fresh.
    partial = run_workers(_train, world, iters, "solo", 0.0, 0, 0, device)
    plain = run_workers(_train, world, iters, None, 0.0, 0, 0, device)
    torch.testing.assert_close(partial[0][1], plain[0][1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", ["solo", "majority"])
def test_late_gradients_are_carried_not_dropped(mode):
    check_late_gradients_carried(mode)


def check_late_gradients_carried(mode: str, device: str = "cpu") -> None:
    world, iters, lr = 4, 40, 0.1
    out = run_workers(_train, world, iters, mode, 0.03, None, 0, device, timeout_s=120)
    initial, final, total_grads, _, stats = out[0]
    # SGD without momentum: the total change is -lr * (sum of every gradient computed) / P.
    torch.testing.assert_close(final - initial, -lr * total_grads / world, rtol=1e-9, atol=1e-10)
    # Replicas are identical after every step.
    for rank in range(1, world):
        for a, b in zip(out[0][3], out[rank][3]):
            assert torch.equal(a, b)
        assert torch.equal(out[0][1], out[rank][1])
    assert stats["rounds"] == iters - 2  # after the two warm-up iterations
    # Some gradient really was late and carried (otherwise this would not test anything).
    assert any(o[4]["stale_contributions"] > 0 for o in out), [o[4] for o in out]


@pytest.mark.parametrize("overlap", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_gradient_as_bucket_view_conserves_every_gradient(overlap):
    # DDP's .grad are then views of its buckets, which the hook writes the round's mean into: the hook's own
    # write after DDP's finalizer finds them in place. Nothing may be lost or applied twice either way.
    world, iters, lr = 4, 30, 0.1
    out = run_workers(_train, world, iters, "solo", 0.03, None, 0, "cpu", 0.0, overlap, True, timeout_s=120)
    initial, final, total_grads, _, stats = out[0]
    torch.testing.assert_close(final - initial, -lr * total_grads / world, rtol=1e-9, atol=1e-10)
    for rank in range(1, world):
        assert all(torch.equal(a, b) for a, b in zip(out[0][3], out[rank][3]))
    assert any(o[4]["stale_contributions"] > 0 for o in out)  # some gradient really was late and carried


@pytest.mark.parametrize("overlap", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_bf16_wire_conserves_every_gradient_up_to_the_sums_rounding(overlap):
    # Gradients travel in bfloat16 with error feedback: what a cast rounds off stays in the residual.
    # Only the rounding of the round sums themselves (bfloat16, the same on every rank) is not fed back.
    world, iters, lr = 4, 30, 0.1
    out = run_workers(
        _train, world, iters, "solo", 0.03, None, 0, "cpu", 0.0, overlap, False, "default", "bf16", timeout_s=120
    )
    initial, final, total_grads, _, stats = out[0]
    rounds = stats["rounds"]
    # Each round's sum rounds by at most a few bfloat16 steps (2^-8 relative) of the largest round sum.
    bound = rounds * lr / world * 2.0**-6 * float(total_grads.abs().max())
    err = (final - initial + lr * total_grads / world).abs().max().item()
    assert err <= bound, (err, bound)
    for rank in range(1, world):
        assert all(torch.equal(a, b) for a, b in zip(out[0][3], out[rank][3]))  # one result for all replicas
    fp64_bytes = 8 * sum(p.numel() for p in _model().parameters())
    partial_bytes = stats["bytes_sent"] - 3 * fp64_bytes  # the two warm-up allreduces and the flush send float64
    partial_rounds = stats["global_reductions"] + stats["local_reductions"] - 3  # overlap: one fewer collected
    assert partial_rounds >= rounds - 1 and partial_bytes == partial_rounds * fp64_bytes // 4, stats


@pytest.mark.parametrize("overlap", [pytest.param(False, marks=pytest.mark.slow), True])
def test_shared_memory_transport_conserves_every_gradient(overlap):
    world, iters, lr = 4, 30, 0.1
    out = run_workers(_train, world, iters, "solo", 0.03, None, 0, "cpu", 0.0, overlap, True, "shm", timeout_s=120)
    initial, final, total_grads, _, stats = out[0]
    torch.testing.assert_close(final - initial, -lr * total_grads / world, rtol=1e-9, atol=1e-10)
    for rank in range(1, world):
        assert all(torch.equal(a, b) for a, b in zip(out[0][3], out[rank][3]))
    assert any(o[4]["stale_contributions"] > 0 for o in out)


def test_majority_initiators_are_shared_and_most_contributions_fresh():
    world, iters = 4, 40
    out = run_workers(_train, world, iters, "majority", 0.03, None, timeout_s=120)
    initiators = out[0][4]["initiators"]
    assert all(o[4]["initiators"] == initiators for o in out)
    assert len(set(initiators)) > 1
    fresh = [o[4]["fresh_fraction"] for o in out]
    assert sum(fresh) / len(fresh) >= 0.5, fresh


def _registry_worker(rank, world):
    model = _model()
    hook, make = get_hook("partial_majority")
    state = make(params=model.parameters(), timeout=TIMEOUT)
    try:
        copy = pickle.loads(pickle.dumps(state))
        return hook is partial_allreduce_hook, state.mode, copy.engine is None and copy.group is None
    finally:
        state.close()


def test_registry_and_pickling_drop_threads_and_groups():
    assert run_workers(_registry_worker, 2)[0] == (True, "majority", True)


def _bad_args_worker(rank, world):
    model = _model()
    cases = {"mode": dict(mode="plurality"), "sync": dict(sync_period=-2), "warmup": dict(warmup_iters=1)}
    return error_messages(
        {
            name: lambda kw=kwargs: PartialAllreduceState(model.parameters(), timeout=TIMEOUT, **kw).close()
            for name, kwargs in cases.items()
        }
    )


def test_bad_arguments_raise_value_errors():
    errors = run_workers(_bad_args_worker, 2)[0]
    assert "mode: expected one of 'solo', 'majority', found 'plurality'" in errors["mode"]
    assert "sync_period" in errors["sync"]
    assert "warmup_iters" in errors["warmup"]


def _resume_worker(rank, world, split):
    batches = _batches(rank, 12)
    model = _model()
    ddp = DDP(model, bucket_cap_mb=0.0005)
    state = PartialAllreduceState(model.parameters(), sync_period=3, max_lead=0, timeout=TIMEOUT)
    ddp.register_comm_hook(state, partial_allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for i, (x, y) in enumerate(batches):
        if i == split:
            saved = pickle.loads(
                pickle.dumps({"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()})
            )
            state.close()
            model = _model()
            model.load_state_dict(saved["model"])
            ddp = DDP(model, bucket_cap_mb=0.0005)
            state = PartialAllreduceState(model.parameters(), sync_period=3, max_lead=0, timeout=TIMEOUT)
            state.load_state_dict(saved["hook"])
            ddp.register_comm_hook(state, partial_allreduce_hook)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            opt.load_state_dict(saved["opt"])
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    state.flush(opt)
    rounds = state.rounds
    state.close()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), rounds


def test_state_dict_round_trip_continues_like_an_uninterrupted_run():
    straight = run_workers(_resume_worker, 3, None)
    resumed = run_workers(_resume_worker, 3, 7)
    for (a, ra), (b, rb) in zip(straight, resumed):
        assert ra == rb == 10
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# -- empty flushes, fp16 sums, exit without close, unused parameters ----------------------------------------


def test_flush_with_empty_residuals_does_not_step():
    # Every round fully fresh (max_lead=0, no delays): nothing is left to flush. With momentum, a step on
    # zero gradients would still move the parameters away from plain DDP's.
    world, iters = 3, 8
    partial = run_workers(_train, world, iters, "solo", 0.0, 0, 0, "cpu", 0.9)
    plain = run_workers(_train, world, iters, None, 0.0, 0, 0, "cpu", 0.9)
    assert [o[4]["flushed"] for o in partial] == [False] * world
    for rank in range(world):
        torch.testing.assert_close(partial[rank][1], plain[rank][1], rtol=1e-12, atol=1e-12)


def _fp16_worker(rank, world):
    model = nn.Linear(1, 1, bias=False).half()
    with torch.no_grad():
        model.weight.fill_(1.0)
    ddp = DDP(model)
    state = PartialAllreduceState(model.parameters(), sync_period=3, max_lead=0, timeout=TIMEOUT)
    ddp.register_comm_hook(state, partial_allreduce_hook)
    grads = []
    for _ in range(5):  # 2 warm-up iterations, then partial rounds
        model.weight.grad = None
        ddp(torch.full((1, 1), 30000.0, dtype=torch.float16)).sum().backward()
        grads.append(model.weight.grad.item())
    state.close()
    return grads


def test_fp16_gradient_sums_do_not_overflow():
    # Each rank's gradient is 30000; a float16 sum over 3 ranks (90000) overflows before the division.
    for grads in run_workers(_fp16_worker, 3):
        assert grads == [30000.0] * 5, grads


@pytest.mark.slow  # 4-6 s: moved out of the quick suite to keep it under 10 minutes
def test_exit_without_close_during_an_exchange_ends_cleanly():
    from exit_without_close import run_world

    for rc, text in run_world("partial"):
        assert rc == 0 and "leaves without close()" in text, (rc, text)  # rc -6 / 134: SIGABRT


class _Branchy(nn.Module):
    """Three heads; each iteration uses a data-dependent subset, so some parameters get no gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(5, 3), nn.Linear(5, 3), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor, which: int) -> torch.Tensor:
        out = self.a(x)
        if which == 1:
            out = out + self.b(x)
        if which == 2:
            out = out + self.c(x)
        return out


def _unused_worker(rank, world, iters, sleep_s, local_map=False):
    model = _Branchy().double()
    state = PartialAllreduceState(model.parameters(), sync_period=5, timeout=TIMEOUT)
    group = state.process_group_for_ddp() if local_map else None
    ddp = DDP(model, process_group=group, find_unused_parameters=True)
    ddp.register_comm_hook(state, partial_allreduce_hook)
    params = list(model.parameters())
    local = [torch.zeros_like(p) for p in params]
    for p, acc in zip(params, local):

        def record(g, acc=acc):  # returns None: the gradient itself is left alone
            acc.add_(g)

        p.register_hook(record)
    initial = [p.detach().clone() for p in params]
    opt = torch.optim.SGD(params, lr=0.1)
    shared, data = random.Random(5), torch.Generator().manual_seed(rank)
    backward_s = []
    for _ in range(iters):
        slow = shared.randrange(world)
        # Half the iterations leave a head unused on every rank, the others on some ranks only.
        which = shared.randrange(3) if shared.random() < 0.5 else rank % 3
        if slow == rank:
            time.sleep(sleep_s)
        opt.zero_grad()
        start = time.perf_counter()
        ddp(torch.randn(4, 5, generator=data, dtype=torch.float64), which).sum().backward()
        backward_s.append((slow, time.perf_counter() - start))
        opt.step()
    state.flush(opt)
    stale = state.stats.stale_contributions
    state.close()
    total = torch.cat([g.reshape(-1) for g in local])
    dist.all_reduce(total)
    change = torch.cat([(p.detach() - p0).reshape(-1) for p, p0 in zip(params, initial)])
    return change, total, torch.cat([p.detach().reshape(-1) for p in params]), stale, backward_s


def test_find_unused_parameters_conserves_every_gradient():
    world, iters, lr = 3, 20, 0.1
    out = run_workers(_unused_worker, world, iters, 0.03, timeout_s=120)
    change, total, final, _, _ = out[0]
    # Sum of applied round results x P == sum of all gradients computed (SGD without momentum).
    torch.testing.assert_close(change, -lr * total / world, rtol=1e-9, atol=1e-12)
    assert all(torch.equal(final, o[2]) for o in out)
    assert sum(o[3] for o in out) > 0  # some gradient really was late and carried


@pytest.mark.slow  # 5 s: the quick suite keeps the conservation test of the same worker above
def test_find_unused_parameters_with_the_state_group_is_not_a_barrier():
    world, iters, lr, sleep_s = 3, 20, 0.1, 0.3
    out = run_workers(_unused_worker, world, iters, sleep_s, True, timeout_s=120)
    change, total, final, _, _ = out[0]
    torch.testing.assert_close(change, -lr * total / world, rtol=1e-9, atol=1e-12)
    assert all(torch.equal(final, o[2]) for o in out)
    # Partial rounds (after 2 warm-up iterations, except every 6th: a blocking sync round): a rank's
    # backward pass does not wait for the rank that sleeps in that iteration.
    for rank, o in enumerate(out):
        waits = [t for i, (slow, t) in enumerate(o[4]) if i >= 2 and (i - 2) % 6 != 5 and slow != rank]
        assert waits and max(waits) < sleep_s / 2, (rank, waits)


# -- overlap=True, a round's exchange hidden behind the next iteration ---------------------------------------------


@pytest.mark.parametrize("mode", ["solo", pytest.param("majority", marks=pytest.mark.slow)])
def test_overlap_conserves_every_gradient_and_keeps_replicas_identical(mode):
    world, iters, lr = 4, 30, 0.1
    out = run_workers(_train, world, iters, mode, 0.03, None, 0, "cpu", 0.0, True, timeout_s=120)
    initial, final, total_grads, _, stats = out[0]
    # Every round applied once, one iteration late, and the flush takes the last one along: nothing lost.
    torch.testing.assert_close(final - initial, -lr * total_grads / world, rtol=1e-9, atol=1e-10)
    for rank in range(1, world):
        assert all(torch.equal(a, b) for a, b in zip(out[0][3], out[rank][3]))
        assert torch.equal(out[0][1], out[rank][1])
    assert stats["rounds"] == iters - 2
    # Rounds applied: all but the last (in flight at the end, taken by the flush), one iteration after their
    # round: a contribution is as old as its round's lag + 1, or 0 when its exchange started late enough to
    # take the gradient of the applying iteration along.
    hist = stats["staleness_hist"]
    assert sum(hist.values()) == iters - 3 and 0 <= min(hist) and max(hist) <= 5 + 1 and hist.get(1, 0) > 0


@pytest.mark.slow
def test_overlap_applies_nothing_at_its_first_partial_iteration():
    # Iteration i applies round i - 1; the flush applies the last. The first partial iteration has nothing in
    # flight: it applies a zero gradient, so (SGD without momentum) the model after it is the warm-up's.
    world, iters = 3, 8
    out = run_workers(_train, world, iters, "solo", 0.0, 0, 0, "cpu", 0.0, True)
    plain = run_workers(_train, world, iters, None, 0.0, 0, 0, "cpu", 0.0)
    checks, plain_checks = out[0][3], plain[0][3]
    torch.testing.assert_close(checks[1], plain_checks[1], rtol=1e-12, atol=1e-12)  # warm-up: plain allreduce
    assert torch.equal(checks[2], checks[1])  # the first partial iteration has nothing in flight to apply
    assert not torch.equal(checks[3], checks[2])
    assert out[0][4]["flushed"] is True


def _overlap_resume_worker(rank, world, split, lr=0.1):
    """SGD without momentum, a straggler now and then, a state_dict() round trip before iteration ``split``:
    returns (initial, final, sum over ranks of every gradient computed)."""
    shared = random.Random(5)
    model = _model()
    initial = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    computed = torch.zeros_like(initial)

    def build(module):
        ddp = DDP(module, bucket_cap_mb=0.0005)
        state = PartialAllreduceState(module.parameters(), sync_period=3, overlap=True, timeout=TIMEOUT)
        ddp.register_comm_hook(state, partial_allreduce_hook)
        return ddp, state, torch.optim.SGD(module.parameters(), lr=lr)

    ddp, state, opt = build(model)
    for i, (x, y) in enumerate(_batches(rank, 14)):
        if i == split:
            saved = pickle.loads(pickle.dumps({"model": model.state_dict(), "hook": state.state_dict()}))
            state.close()
            model = _model()
            model.load_state_dict(saved["model"])
            ddp, state, opt = build(model)
            state.load_state_dict(saved["hook"])
        if shared.randrange(world) == rank:
            time.sleep(0.03)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x), y)
        computed += torch.cat(
            [g.reshape(-1) for g in torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)]
        )
        loss.backward()
        opt.step()
    state.flush(opt)
    state.close()
    dist.all_reduce(computed)
    return initial, torch.cat([p.detach().reshape(-1) for p in model.parameters()]), computed


@pytest.mark.slow  # 4-7 s: moved out of the quick suite to keep it under 10 minutes
def test_overlap_state_dict_carries_the_round_in_flight():
    # Under overlap the rounds' contents depend on timing (a rank's next gradient may join a round whose
    # exchange has not started), so runs are not bitwise repeatable; what a resume must keep is every
    # gradient: the round in flight travels in the state (in_flight), the residual beside it.
    world, lr = 3, 0.1
    for split in (6, 9):
        for initial, final, computed in run_workers(_overlap_resume_worker, world, split, lr):
            torch.testing.assert_close(final - initial, -lr * computed / world, rtol=1e-9, atol=1e-10)


# -- late="lookahead": every backward pass at w - lr * mu * v ------------------------------------------------------


def _assert_conserved_and_identical(out, world, iters):
    """_lookahead_worker's results: every gradient applied once (sum of rounds x P = sum computed), every round
    run and flushed, the replicas identical."""
    for _, _, applied, computed, _, _, flushed, stats, _ in out:
        torch.testing.assert_close(sum(applied) * world, computed, rtol=1e-9, atol=1e-10)
        assert stats["rounds"] == iters - 2 and flushed
    for rank in range(1, world):
        assert all(torch.equal(a, b) for a, b in zip(out[0][0], out[rank][0]))
        assert torch.equal(out[0][4], out[rank][4])


def _lookahead_worker(
    rank, world, late, nesterov, iters=12, sleep_s=0.0, max_lead=0, split=None, overlap=True, lookahead_rounds=1
):
    """overlap=True: every gradient at least one round late. Record where each backward pass ran, the true weights
    and momentum buffers after each step, the mean gradient each step applied, every gradient computed (summed over
    the ranks) and this rank's gradient of each iteration."""
    model = _model()
    ddp = DDP(model, bucket_cap_mb=0.0005)

    def build(model):
        kw = dict(sync_period=5, max_lead=max_lead, overlap=overlap, timeout=TIMEOUT, late=late)
        kw.update(lookahead_rounds=lookahead_rounds)
        return PartialAllreduceState(model.parameters(), **kw)

    lr, mu = 0.1, 0.9
    state = build(model)
    ddp.register_comm_hook(state, partial_allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=mu, nesterov=nesterov)
    flat = lambda ts: torch.cat([t.detach().reshape(-1) for t in ts]).clone()  # noqa: E731
    points, after, applied = [], [], []

    def watch(opt, state):
        state.attach(opt)  # its hooks first: ours see the true weights before a step, the look-ahead point after
        opt.register_step_pre_hook(lambda *_: applied.append(flat(p.grad for p in model.parameters())))
        opt.register_step_post_hook(
            lambda *_: after.append(
                (flat(state.weights()), flat(opt.state[p]["momentum_buffer"] for p in model.parameters()))
            )
        )

    computed = torch.zeros(sum(p.numel() for p in model.parameters()), dtype=torch.float64)
    own: list[torch.Tensor] = []  # this rank's gradient of each iteration, in parameter order

    def count(model):  # every gradient this rank computes, summed in parameter order
        at = 0
        for p in model.parameters():

            def add(g, view=computed[at:][: p.numel()], at=at):  # noqa: B008
                view.add_(g.reshape(-1))
                own[-1][at:][: g.numel()].add_(g.reshape(-1))

            p.register_hook(add)
            at += p.numel()

    watch(opt, state)
    count(model)
    shared = random.Random(99)
    for i, (x, y) in enumerate(_batches(rank, iters)):
        if i == split:  # a checkpoint and a resume into a new model, optimizer and state
            saved = pickle.loads(
                pickle.dumps({"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()})
            )
            state.close()
            model = _model()
            model.load_state_dict(saved["model"])
            ddp = DDP(model, bucket_cap_mb=0.0005)
            state = build(model)
            state.load_state_dict(saved["hook"])
            ddp.register_comm_hook(state, partial_allreduce_hook)
            opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=mu, nesterov=nesterov)
            opt.load_state_dict(saved["opt"])
            watch(opt, state)
            count(model)
        if sleep_s and shared.randrange(world) == rank:
            time.sleep(sleep_s)
        points.append(flat(model.parameters()))
        own.append(torch.zeros_like(computed))
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    flushed = state.flush(opt)
    final = flat(model.parameters())
    weights = flat(state.weights())
    stats = state.stats_dict()
    state.close()
    dist.all_reduce(computed)
    return points, after, applied, computed, final, weights, flushed, stats, own


def test_lookahead_runs_every_backward_pass_at_the_look_ahead_point():
    lr, mu = 0.1, 0.9
    out = run_workers(_lookahead_worker, 2, "lookahead", False)
    for points, after, _, _, final, weights, *_ in out:
        assert len(after) == len(points) + 1  # every step and the flush's
        for t in range(1, len(points)):
            w, v = after[t - 1]  # the true weights and the momentum buffer after step t - 1
            torch.testing.assert_close(points[t], w - lr * mu * v, rtol=0, atol=1e-14)
            assert not torch.equal(points[t], w)  # the point really moved
        # After the flush the parameters hold the true weights, the model to evaluate and keep.
        assert torch.equal(final, weights) and torch.equal(final, after[-1][0])
    assert all(torch.equal(a, b) for a, b in zip(out[0][0], out[1][0]))  # replicas identical


def test_lookahead_is_nesterov_momentum_whose_parameters_are_the_look_ahead_point():
    # w - lr*mu*v under heavy ball follows PyTorch's Nesterov recurrence y' = y - lr (g + mu v'), v' = mu v + g
    # exactly, whatever the gradients' lateness: replay it on the means each step applied (which rounds took
    # which gradient depends on timing, so the replay uses the run's own).
    lr, mu = 0.1, 0.9
    for points, _, applied, *_ in run_workers(_lookahead_worker, 2, "lookahead", False, 12, 0.02, None):
        y, v = points[0].clone(), torch.zeros_like(points[0])
        for t, g in enumerate(applied[: len(points) - 1]):
            v = mu * v + g
            y = y - lr * (g + mu * v)
            torch.testing.assert_close(points[t + 1], y, rtol=0, atol=1e-12)


def test_lookahead_conserves_every_gradient_with_stragglers():
    # Stragglers and max_lead=None: contributions up to a few rounds late. The look-ahead moves where gradients are
    # computed, never what the rounds carry: the means applied over the run (warm-up, rounds, flush) times P are the
    # sum of every gradient computed, and the replicas stay identical.
    world, iters = 4, 30
    out = run_workers(_lookahead_worker, world, "lookahead", False, iters, 0.03, None, timeout_s=120)
    _assert_conserved_and_identical(out, world, iters)
    assert any(max(o[7]["staleness_hist"]) > 1 for o in out), [o[7]["staleness_hist"] for o in out]


@pytest.mark.slow
def test_lookahead_state_dict_round_trip_continues_like_an_uninterrupted_run():
    # Fully fresh rounds (max_lead=0, no overlap), so that both runs see the same rounds; the checkpoint is taken with
    # the parameters at the look-ahead point, the true weights in the hook's state.
    straight = run_workers(_lookahead_worker, 2, "lookahead", False, 12, 0.0, 0, None, False)
    resumed = run_workers(_lookahead_worker, 2, "lookahead", False, 12, 0.0, 0, 7, False)
    for a, b in zip(straight, resumed):
        assert all(torch.equal(pa, pb) for pa, pb in zip(a[0], b[0]))
        assert torch.equal(a[4], b[4])


# -- late="lookahead_local": also ahead by this rank's own gradient of the round in flight --------------------------


def test_lookahead_local_runs_every_backward_pass_ahead_by_this_ranks_share_of_the_round_in_flight():
    # Iteration t's backward pass runs at w - lr * mu * v - lr * g_own, where w, v are the weights and momentum
    # buffer after step t - 1 and g_own this rank's gradient of iteration t - 1 (the round then sent, in flight
    # until iteration t applies it); after the two warm-up iterations, whose allreduce is not in flight, by
    # momentum alone.
    lr, mu = 0.1, 0.9
    out = run_workers(_lookahead_worker, 2, "lookahead_local", False)
    for points, after, _, _, final, weights, _, _, own in out:
        assert len(after) == len(points) + 1  # every step and the flush's
        for t in range(1, len(points)):
            w, v = after[t - 1]
            expected = w - lr * mu * v - (lr * own[t - 1] if t - 1 >= 2 else 0)
            torch.testing.assert_close(points[t], expected, rtol=0, atol=1e-14)
            if t - 1 >= 2:
                assert not torch.allclose(points[t], w - lr * mu * v, rtol=0, atol=1e-6)  # not momentum alone
        assert torch.equal(final, weights) and torch.equal(final, after[-1][0])  # the flush ends at w
    # The ranks' points differ (each steps by its own gradient); their true weights do not.
    assert not torch.equal(out[0][0][-1], out[1][0][-1])
    assert all(torch.equal(a[0], b[0]) for a, b in zip(out[0][1], out[1][1]))


@pytest.mark.slow
def test_lookahead_local_conserves_every_gradient_with_stragglers():
    # The point moves by this rank's own gradient; the rounds carry and apply every gradient as before.
    world, iters = 4, 30
    out = run_workers(_lookahead_worker, world, "lookahead_local", False, iters, 0.03, 0, timeout_s=120)
    for _, _, applied, computed, _, _, flushed, stats, _ in out:
        torch.testing.assert_close(sum(applied) * world, computed, rtol=1e-9, atol=1e-10)
        assert stats["rounds"] == iters - 2 and flushed
    for rank in range(1, world):
        assert all(torch.equal(a[0], b[0]) for a, b in zip(out[0][1], out[rank][1]))  # the same w after every step
        assert torch.equal(out[0][4], out[rank][4])


def test_lookahead_local_resumes_from_a_state_dict_at_the_same_point_and_conserves():
    # overlap's rounds take whichever gradients are there, so two runs differ; what a checkpoint must keep is the
    # rule: the parameters saved at the point (the round in flight estimated), w in the hook's state, the round in
    # flight in it too. Across the resume at iteration 7 every backward pass is at w - lr * mu * v - lr * g_own and
    # every gradient is applied once.
    lr, mu, world, iters = 0.1, 0.9, 2, 12
    out = run_workers(_lookahead_worker, world, "lookahead_local", False, iters, 0.0, 0, 7, True)
    for points, after, applied, computed, *_, own in out:
        for t in range(3, len(points)):
            w, v = after[t - 1]
            torch.testing.assert_close(points[t], w - lr * mu * v - lr * own[t - 1], rtol=0, atol=1e-14)
        torch.testing.assert_close(sum(applied) * world, computed, rtol=1e-9, atol=1e-10)


def test_in_flight_steps_count_a_gradient_applied_at_each_of_s_heavy_ball_steps():
    mu = 0.9
    assert in_flight_steps(mu, 1) == 1.0
    assert in_flight_steps(mu, 2) == pytest.approx(2 + mu)
    assert in_flight_steps(mu, 3) == pytest.approx(3 + 2 * mu + mu**2)
    # the definition: v_j = mu v_(j-1) + g from v_0 = 0, and the model moves by lr * sum_j v_j
    v, moved = 0.0, 0.0
    for _ in range(4):
        v = mu * v + 1.0
        moved += v
    assert in_flight_steps(mu, 4) == pytest.approx(moved)


def test_lookahead_local_steps_as_sgd_would_with_weight_decay_dampening_and_maximize():
    torch.manual_seed(0)
    cases = [({"weight_decay": 0.01, "dampening": 0.3}, 1), ({"maximize": True}, 1), ({"weight_decay": 0.01}, 2)]
    for options, rounds in cases:
        params = [nn.Parameter(torch.randn(5, dtype=torch.float64)) for _ in range(2)]
        lr, mu = 0.1, 0.9
        # s rounds in flight: momentum's s steps and c_s steps of the held gradient (c_1 = 1, c_2 = 2 + mu)
        reach, times = (mu, 1.0) if rounds == 1 else (mu + mu**2, 2 + mu)
        opt = torch.optim.SGD(params, lr=lr, momentum=mu, **options)
        ahead = LookAhead(params, rounds, local=True)
        ahead.attach(opt)
        for step in range(3):
            for p in params:
                p.grad = torch.randn_like(p)
            held = [torch.randn_like(p) for p in params] if step != 1 else None  # step 1: nothing in flight
            ahead.hold_local(held)
            opt.step()
            for i, (p, w) in enumerate(zip(params, ahead.weights())):
                v = opt.state[p]["momentum_buffer"]
                expected = w - lr * reach * v
                if held is not None:
                    # where the next step takes w if its gradient is the held one: SGD's own rule
                    g = -held[i] if options.get("maximize") else held[i]
                    d = (1 - options.get("dampening", 0)) * (g + options.get("weight_decay", 0) * w)
                    expected = expected - lr * times * d
                torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-14)


def test_lookahead_local_refuses_what_it_cannot_estimate():
    model = _model()
    errors = error_messages(
        {
            "held": lambda: LookAhead(model.parameters(), local=True).hold_local([torch.zeros(1)]),
            "no overlap": lambda: PartialAllreduceState(model.parameters(), late="lookahead_local"),
        }
    )
    assert "hold_local: expected one gradient per parameter" in errors["held"], errors
    with pytest.raises(ValueError, match=r"^late: expected 'apply' or 'lookahead' \(FSDPPartialAllreduce has no"):
        FSDPPartialAllreduce(model, world=None, late="lookahead_local")
    assert errors["no overlap"].endswith(
        "late: 'lookahead_local' needs overlap=True (this rank's gradient stands "
        "in for the round in flight; without overlap none is), found overlap=False"
    )


def _lookahead_bad_worker(rank, world):
    model = _model()
    errors = error_messages(
        {"late": lambda: PartialAllreduceState(model.parameters(), timeout=TIMEOUT, late="outside").close()}
    )
    state = PartialAllreduceState(model.parameters(), timeout=TIMEOUT, late="lookahead")
    try:
        for name, opt in {
            "nesterov": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True),
            "momentum": torch.optim.SGD(model.parameters(), lr=0.1),
            "adam": torch.optim.Adam(model.parameters()),
        }.items():
            errors.update(error_messages({name: lambda opt=opt: state.attach(opt)}))
        ddp = DDP(model)
        ddp.register_comm_hook(state, partial_allreduce_hook)
        x, y = _batches(rank, 1)[0]
        for _ in range(4):  # 2 warm-up iterations, a first partial one (may run unattached), one needing the optimizer
            backward = lambda: nn.functional.cross_entropy(ddp(x), y).backward()  # noqa: E731
            errors.update(error_messages({"unattached": backward}, (RuntimeError,)))
    finally:
        state.close()
    return errors


def test_lookahead_bad_arguments_raise():
    errors = run_workers(_lookahead_bad_worker, 2)[0]
    assert "late: expected one of 'apply', 'lookahead', 'lookahead_local', found 'outside'" in errors["late"]
    assert all("nesterov=False" in errors[k] for k in ("nesterov", "momentum", "adam")), errors
    assert "attach(optimizer)" in errors["unattached"]


# -- lookahead_rounds: s rounds of heavy-ball momentum, w - lr * (mu + ... + mu**s) * v ------------------------------


@pytest.mark.parametrize("rounds", [2, 3])
def test_lookahead_rounds_put_every_backward_pass_s_rounds_of_momentum_ahead(rounds):
    lr, mu = 0.1, 0.9
    reach = lr * sum(mu**k for k in range(1, rounds + 1))
    out = run_workers(_lookahead_worker, 2, "lookahead", False, 6, 0.0, rounds - 1, None, True, rounds)
    for points, after, _, _, final, weights, *_ in out:
        for t in range(1, len(points)):
            w, v = after[t - 1]
            torch.testing.assert_close(points[t], w - reach * v, rtol=0, atol=1e-14)
            assert not torch.allclose(points[t], w - lr * mu * v, rtol=0, atol=1e-6)  # not one round's look-ahead
        assert torch.equal(final, weights) and torch.equal(final, after[-1][0])  # the flush ends at w


def test_lookahead_rounds_conserve_every_gradient_with_stragglers():
    # As test_lookahead_conserves_every_gradient_with_stragglers, with s = 2: the point moves, the rounds do not.
    world, iters = 3, 14
    out = run_workers(_lookahead_worker, world, "lookahead", False, iters, 0.03, None, None, True, 2, timeout_s=120)
    _assert_conserved_and_identical(out, world, iters)


def test_lookahead_one_round_is_lr_mu_bit_for_bit():
    # s = 1 is the look-ahead as it was: w.sub_(v, alpha=lr * mu), bit for bit (not a coefficient summed in a loop
    # that rounds differently).
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(7, dtype=torch.float64)) for _ in range(2)]
    lr, mu = 0.1, 0.9
    opt = torch.optim.SGD(params, lr=lr, momentum=mu)
    ahead = LookAhead(params)
    ahead.attach(opt)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        weights = [w.clone() for w in ahead.weights()]
        for p, w in zip(params, weights):
            assert torch.equal(p.detach(), w.clone().sub_(opt.state[p]["momentum_buffer"], alpha=lr * mu))
    ahead.restore()  # the parameters hold w again, the anchor is gone
    assert all(torch.equal(p.detach(), w) for p, w in zip(params, weights)) and ahead.anchor is None


def test_lookahead_refuses_an_optimizer_without_every_parameter_and_bad_groups():
    a, b, c = (nn.Parameter(torch.zeros(n)) for n in (2, 3, 4))
    errors = error_messages(
        {
            "missing": lambda: LookAhead([a, b, c]).attach(torch.optim.SGD([a, b], lr=0.1, momentum=0.9)),
            # equal values, other objects: the look-ahead would move tensors the optimizer never steps
            "copies": lambda: LookAhead([a]).attach(
                torch.optim.SGD([nn.Parameter(a.detach().clone())], lr=0.1, momentum=0.9)
            ),
            "group": lambda: LookAhead([a, b]).attach(
                torch.optim.SGD([{"params": [a]}, {"params": [b], "momentum": 0.0}], lr=0.1, momentum=0.9)
            ),
            "adam": lambda: LookAhead([a]).attach(torch.optim.Adam([a])),
        }
    )
    assert "ValueError: optimizer: expected every parameter the look-ahead moves" in errors["missing"], errors
    assert "found 1 of 3 missing: #2 (4,)" in errors["missing"], errors
    assert "found 1 of 1 missing: #0 (2,)" in errors["copies"], errors
    assert "ValueError: optimizer.param_groups[1]: expected torch.optim.SGD with momentum > 0" in errors["group"]
    assert "found momentum=0.0, nesterov=False" in errors["group"], errors
    assert errors["adam"].endswith("found Adam"), errors
    ahead = LookAhead([a, b])
    opt = torch.optim.SGD([a, b, c], lr=0.1, momentum=0.9)  # more than the look-ahead's parameters is fine
    ahead.attach(opt)
    ahead.attach(opt)  # the same one again: nothing
    assert (
        "another optimizer"
        in error_messages({"other": lambda: ahead.attach(torch.optim.SGD([a, b], lr=0.1, momentum=0.9))})["other"]
    )


def test_a_lookahead_anchor_of_other_parameters_is_refused_naming_what_differs():
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3, 2))
    errors = error_messages(
        {
            "count": lambda: LookAhead([a, b]).load_anchor([torch.ones(2)]),
            "shape": lambda: LookAhead([a, b]).load_anchor([torch.ones(2), torch.ones(2, 3)]),
        }
    )
    assert errors["count"].endswith("expected one tensor per reduced parameter (2), found 1"), errors
    assert errors["shape"].endswith(
        "state['anchor'][1]: expected the shape of reduced parameter 1, [3, 2], found [2, 3]"
    )
    ahead = LookAhead([a, b])
    ahead.load_anchor([torch.ones(2), torch.full((3, 2), 2.0)])  # the right shapes: the true weights restored
    assert ahead.anchor is not None and torch.equal(ahead.anchor[1], torch.full((3, 2), 2.0))


@pytest.mark.parametrize("rounds", [0, -1, True, 1.5])
def test_bad_lookahead_rounds_raise(rounds):
    # checked before any process group is created: no world needed
    model = _model()
    for build in (
        lambda: LookAhead(model.parameters(), rounds),
        lambda: PartialAllreduceState(model.parameters(), late="lookahead", lookahead_rounds=rounds),
    ):
        with pytest.raises(ValueError, match=rf"^lookahead_rounds: expected an integer >= 1, found {rounds!r}$"):
            build()
