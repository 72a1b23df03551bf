"""HSDP x WAGMA: FSDP2 shards a model inside a replica, wagma averages each shard across the replicas."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch import nn

from wagma.averaging import PeriodicAverager, WagmaAverager
from wagma.averaging.tensors import local_tensor
from wagma.hooks.lookahead import lookahead_coefficient
from wagma.testing import rank_device, run_workers, run_workers_outcomes

fsdp = pytest.importorskip("torch.distributed.fsdp")
TIMEOUT = datetime.timedelta(seconds=30)


def _sharded(rank: int, replicas: int, shards: int, *, tagged: bool = True, device: str = "cpu"):
    """A (replicas x shards) mesh and a model fully_shard-ed over the shard dimension; parameters hold rank + 1
    (``tagged``) or one initialization shared by all ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    dev = rank_device(device, rank)
    mesh = init_device_mesh(device, (replicas, shards), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)).to(dev)
    fsdp.fully_shard(model, mesh=mesh["shard"])  # FSDP inside a replica; nothing crosses replicas on its own
    if tagged:
        with torch.no_grad():
            for p in model.parameters():
                local_tensor(p).fill_(float(rank + 1))
    return mesh, model


def _shards(model: nn.Module) -> list[torch.Tensor]:
    return [local_tensor(p).detach().clone() for p in model.parameters()]


def _replicas_of(mesh, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Every replica's copy of this rank's shards (all-gathered over the replicate dimension)."""
    group = mesh.get_group("replicate")
    out = []
    for t in tensors:
        parts = [torch.empty_like(t) for _ in range(group.size())]
        dist.all_gather(parts, t.contiguous(), group=group)
        out.append(parts)
    return out


def _round0_worker(rank, world_size, replicas, shards, device="cpu"):
    mesh, model = _sharded(rank, replicas, shards, device=device)
    assert type(next(model.parameters())).__name__ == "DTensor"
    with WagmaAverager(2, 5, params=model.parameters(), max_lead=0, world=(mesh, "replicate"), timeout=TIMEOUT) as avg:
        kind = avg.average_parameters(model.parameters())
        group = [avg.world.global_rank(r) for r in avg.schedule.group_of(avg.world.rank, 0)]
        sizes = [local_tensor(p).numel() for p in model.parameters()]
        full = [p.numel() for p in model.parameters()]
    return kind, group, [float(s.flatten()[0]) for s in _shards(model) if s.numel()], sizes, full


@pytest.mark.parametrize("replicas,shards", [(2, 2), pytest.param(4, 2, marks=pytest.mark.slow)])
def test_each_shard_is_the_s_plus_one_mix_of_its_groups_same_shard(replicas, shards):
    check_round0_on("cpu", replicas, shards)


def check_round0_on(device: str, replicas: int = 2, shards: int = 2) -> None:
    out = run_workers(
        _round0_worker, replicas * shards, replicas, shards, device, collective_timeout_s=30, timeout_s=120
    )
    for rank, (kind, group, values, sizes, full) in enumerate(out):
        assert kind == "local" and rank in group and len(group) == 2
        assert all(r % shards == rank % shards for r in group), f"rank {rank} met another shard index: {group}"
        assert sum(sizes) * shards >= sum(full) > sum(sizes)  # this rank holds about 1/shards of the model
        (partner,) = [j for j in group if j != rank]
        expected = (2 * (rank + 1) + (partner + 1)) / 3  # the (S + 1)-mix, shard by shard
        assert values == pytest.approx([expected] * len(values))


def _train_worker(rank, world_size, replicas, shards, policy, device="cpu"):
    mesh, model = _sharded(rank, replicas, shards, tagged=False, device=device)
    dev = rank_device(device, rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if policy == "wagma":
        avg = WagmaAverager(2, 3, params=model.parameters(), world=(mesh, "replicate"), timeout=TIMEOUT)
    else:
        avg = PeriodicAverager(2, world=(mesh, "replicate"), timeout=TIMEOUT)
    gen = torch.Generator().manual_seed(rank)  # every replica its own data

    def batch(g, n=16):
        x = torch.randn(n, 4, generator=g).to(dev)
        return x, x[:, :2] * 2 - x[:, 2:]  # a linear target the model can learn

    def loss_on(data):
        with torch.no_grad():
            return float(((model(data[0]) - data[1]) ** 2).mean())

    held_out = batch(torch.Generator().manual_seed(1234), 256)  # the same on every rank
    before = loss_on(held_out)
    with avg:
        for _ in range(40):
            x, y = batch(gen)
            loss = ((model(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            avg.average_parameters(model.parameters())
        avg.synchronize(model.parameters())
    after = loss_on(held_out)
    copies = _replicas_of(mesh, _shards(model))
    same = all(torch.equal(c, copies_[0]) for copies_ in copies for c in copies_)
    return same, before, after


@pytest.mark.parametrize("policy", ["wagma", pytest.param("periodic", marks=pytest.mark.slow)])
def test_after_a_sync_every_replica_holds_the_same_shards_and_the_model_trains(policy):
    check_sync_trains_on("cpu", policy)


def check_sync_trains_on(device: str, policy: str = "wagma") -> None:
    out = run_workers(_train_worker, 4, 2, 2, policy, device, collective_timeout_s=30, timeout_s=120)
    for rank, (same, first, last) in enumerate(out):
        assert same, f"rank {rank}: replicas differ after synchronize()"
        assert last < 0.5 * first, (rank, first, last)  # the held-out loss at least halves


def _momentum_worker(rank, world_size):
    from wagma.averaging import ReductionMomentum

    mesh, model = _sharded(rank, 2, 2)
    with ReductionMomentum(PeriodicAverager(1, world=(mesh, "replicate"), timeout=TIMEOUT), 0.5) as avg:
        avg.average_parameters(model.parameters())
    return [float(s.flatten()[0]) for s in _shards(model) if s.numel()]


def test_reduction_momentum_over_sharded_parameters_averages_each_shard():
    for rank, values in enumerate(run_workers(_momentum_worker, 4, collective_timeout_s=30)):
        expected = ((rank % 2 + 1) + (rank % 2 + 3)) / 2  # first global reduction: the plain mean
        assert values == pytest.approx([expected] * len(values))


def _dcp_worker(rank, world_size, ckpt: str, phase: str, steps: int, cut: int):
    """``reference``: train 0..steps, saving a DCP checkpoint at ``cut``; ``killed``: the same run, rank 1 killed
    (SIGKILL) two steps after the checkpoint; ``resumed``: load the checkpoint and train cut..steps.

    Between averages the replicas' models differ, and DCP would keep one copy of a DTensor sharded over the
    ``shard`` dimension only (it takes the replicas for copies): each replica saves its own checkpoint, over its
    shard group."""
    import os
    import signal

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    mesh, model = _sharded(rank, 2, 2, tagged=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    avg = PeriodicAverager(3, world=(mesh, "replicate"), timeout=datetime.timedelta(seconds=5))
    replica = f"{ckpt}/replica{mesh.get_local_rank('replicate')}"
    shard_group = mesh.get_group("shard")
    start = 0
    if phase == "resumed":
        model_sd, opt_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": opt_sd, "averager": avg.state_dict()}
        dcp.load(state, checkpoint_id=replica, process_group=shard_group)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        avg.load_state_dict(state["averager"])
        start = avg.step
    with avg:
        for step in range(start, steps):
            if phase == "killed" and rank == 1 and step == cut + 2:
                os.kill(os.getpid(), signal.SIGKILL)
            g = torch.Generator().manual_seed(1000 * rank + step)  # the data of (rank, step), whatever the run
            x = torch.randn(16, 4, generator=g)
            loss = ((model(x) - x[:, :2]) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            avg.average_parameters(model.parameters())
            if step + 1 == cut and phase != "resumed":
                model_sd, opt_sd = get_state_dict(model, opt)
                dcp.save(
                    {"model": model_sd, "optim": opt_sd, "averager": avg.state_dict()},
                    checkpoint_id=replica,
                    process_group=shard_group,
                )
    return _shards(model)


@pytest.mark.slow  # a real fault: SIGKILL, then a second job
def test_a_dcp_checkpoint_of_sharded_model_and_averager_resumes_exactly_after_a_rank_is_killed(tmp_path):
    steps, cut = 10, 5
    reference = run_workers(_dcp_worker, 4, str(tmp_path / "ref"), "reference", steps, cut, collective_timeout_s=30)
    killed = run_workers_outcomes(
        _dcp_worker, 4, str(tmp_path / "run"), "killed", steps, cut, collective_timeout_s=5, timeout_s=60
    )
    assert killed[1].exitcode == -9 and not any(o.ok for o in killed)  # the survivors fail too, in bounded time
    resumed = run_workers(_dcp_worker, 4, str(tmp_path / "run"), "resumed", steps, cut, collective_timeout_s=30)
    for rank, (ref, res) in enumerate(zip(reference, resumed)):
        assert all(torch.equal(a, b) for a, b in zip(ref, res)), f"rank {rank}: resumed shards differ"


def _one_copy_worker(rank, world_size, ckpt):
    import torch.distributed.checkpoint as dcp

    mesh, model = _sharded(rank, 2, 2)  # replicas differ: rank + 1
    state = {"model": model.state_dict()}
    dcp.save(state, checkpoint_id=ckpt)  # one checkpoint for the whole job
    dcp.load(state, checkpoint_id=ckpt)
    model.load_state_dict(state["model"])
    return [float(s.flatten()[0]) for s in _shards(model) if s.numel()]


def test_one_dcp_checkpoint_for_all_replicas_keeps_one_replicas_shards_which_is_why_each_replica_saves_its_own(
    tmp_path,
):
    out = run_workers(_one_copy_worker, 4, str(tmp_path / "one"), collective_timeout_s=30)
    # before: shard j of replica r holds 2r + j + 1; after: both replicas hold one replica's shards
    assert out[0] == out[2] and out[1] == out[3], out


def _eager_worker(rank, world_size, mode, steps, late_rank, wire_dtype=None, device="cpu"):
    import time

    from torch.distributed.device_mesh import init_device_mesh

    from wagma import FSDPPartialAllreduce

    dev = rank_device(device, rank)
    mesh = init_device_mesh(device, (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Linear(5, 3, bias=True).to(dev)
    fsdp.fully_shard(model, mesh=mesh["shard"])
    initial = _shards(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)  # the parameters move by exactly what the rounds apply
    state = FSDPPartialAllreduce(
        model,
        world=(mesh, "replicate"),
        mode=mode,
        sync_period=4,
        warmup_iters=1,
        timeout=TIMEOUT,
        wire_dtype=wire_dtype,
    )
    x = torch.full((1, 5), float(rank + 1), device=dev)  # a gradient independent of the parameters: known exactly
    for step in range(steps):
        if rank == late_rank and step % 3 == 1:
            time.sleep(0.3)  # a straggling replica: the others' rounds go without its fresh gradient
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    flushed = state.flush(opt)
    stats = state.stats.as_dict()
    state.close()
    return [t.cpu() for t in initial], [t.cpu() for t in _shards(model)], flushed, stats  # CPU: picklable anywhere


@pytest.mark.parametrize(
    "mode,wire_dtype",
    [
        pytest.param("solo", None, marks=pytest.mark.slow),
        pytest.param("majority", None, marks=pytest.mark.slow),
        ("solo", "bf16"),
    ],
)
def test_eager_sgd_through_fsdp2s_all_reduce_hook_keeps_every_gradient_and_the_replicas_identical(mode, wire_dtype):
    check_eager_conserves_on("cpu", mode, wire_dtype)


def check_eager_conserves_on(device: str, mode: str = "solo", wire_dtype: str | None = None) -> None:
    steps = 9
    out = run_workers(_eager_worker, 4, mode, steps, 2, wire_dtype, device, collective_timeout_s=30, timeout_s=120)
    # rank r's gradient: every weight entry r + 1, bias 1; FSDP2 averages it over its replica's two ranks (the shard
    # group {2c, 2c + 1}), so replica c's shard gradient is the mean of its two ranks' inputs
    mean_x = {0: (1 + 2) / 2, 1: (3 + 4) / 2}  # replica c: the mean of its two ranks' inputs
    for rank, (initial, final, _flushed, _stats) in enumerate(out):
        partner = rank ^ 2  # the same shard index in the other replica
        assert all(torch.equal(a, b) for a, b in zip(final, out[partner][1])), f"rank {rank}: replicas differ"
        # conservation: the sum over the replicas of what was applied is the sum of every computed gradient
        weight_grad = steps * (mean_x[0] + mean_x[1])  # per element of the weight, over both replicas
        bias_grad = steps * 2.0
        applied = [2 * (a - b) for a, b in zip(initial, final)]  # both replicas applied the same, R = 2
        torch.testing.assert_close(applied[0], torch.full_like(applied[0], weight_grad))
        if applied[1].numel():
            torch.testing.assert_close(applied[1], torch.full_like(applied[1], bias_grad))
    if wire_dtype is not None:  # bfloat16 on the wire (these gradients are exact in it): 2 bytes a value a round
        stats = out[0][3]
        rounds = stats["global_reductions"] + stats["local_reductions"] - 2  # less the warm-up and the flush
        shard = sum(t.numel() for t in out[0][0])
        assert stats["bytes_sent"] == 4 * shard * 2 + 2 * shard * rounds, stats
    late = out[2][3]  # the straggling replica's rank: rounds went without its fresh gradient, carried, not lost
    if mode == "solo":
        assert late["stale_contributions"] > 0 and out[2][2], late  # ... and flush() applied what was left


def _eager_resume_worker(rank, world_size, steps_before, steps_after):
    import time

    from torch.distributed.device_mesh import init_device_mesh

    from wagma import FSDPPartialAllreduce

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    x = torch.full((1, 5), float(rank + 1))

    def build():
        torch.manual_seed(0)
        model = nn.Linear(5, 3, bias=True)
        fsdp.fully_shard(model, mesh=mesh["shard"])
        return model, torch.optim.SGD(model.parameters(), lr=1.0)

    def train(model, opt, steps, first):
        for step in range(first, first + steps):
            if rank == 2 and (step % 3 == 1 or step == steps_before - 1):
                # a straggling replica: its gradients are carried in the residual, and (late at the last step
                # before the checkpoint) one is pending when the state is saved, whatever the timing before it
                time.sleep(0.3)
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()

    model, opt = build()
    initial = _shards(model)
    state = FSDPPartialAllreduce(model, world=(mesh, "replicate"), sync_period=4, warmup_iters=1, timeout=TIMEOUT)
    train(model, opt, steps_before, 0)
    saved, shards = state.state_dict(), _shards(model)  # what a checkpoint holds (SGD without momentum: no state)
    state.close()
    model, opt = build()  # the resumed run: a fresh model and hook, given the checkpoint
    with torch.no_grad():
        for p, value in zip(model.parameters(), shards):
            local_tensor(p).copy_(value)
    state = FSDPPartialAllreduce(model, world=(mesh, "replicate"), sync_period=4, warmup_iters=1, timeout=TIMEOUT)
    state.load_state_dict(saved)
    train(model, opt, steps_after, steps_before)
    state.flush(opt)
    out = (
        initial,
        _shards(model),
        saved["residual"] is not None and bool(saved["residual"].ne(0).any()),
        state.iteration,
        state.rounds,
    )
    state.close()
    return out


def test_the_fsdp_hook_resumes_from_its_state_dict_with_every_gradient_kept():
    before, after = 7, 5
    out = run_workers(_eager_resume_worker, 4, before, after, collective_timeout_s=30, timeout_s=120)
    mean_x = {0: (1 + 2) / 2, 1: (3 + 4) / 2}  # replica c's shard gradient per weight element (see the test above)
    steps = before + after
    for _rank, (initial, final, _, iteration, rounds) in enumerate(out):
        assert iteration == steps and rounds == steps - 1  # the counters went on across the restart
        applied = [2 * (a - b) for a, b in zip(initial, final)]  # both replicas applied the same
        torch.testing.assert_close(applied[0], torch.full_like(applied[0], steps * (mean_x[0] + mean_x[1])))
        if applied[1].numel():
            torch.testing.assert_close(applied[1], torch.full_like(applied[1], steps * 2.0))
    # Something really was pending at the checkpoint on some rank (else the restore would test nothing).
    assert any(o[2] for o in out), "no residual was pending at the checkpoint: the straggler did not straggle"


def _nested_worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    from wagma import FSDPPartialAllreduce

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("shard",))
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    fsdp.fully_shard(model[0], mesh=mesh)
    fsdp.fully_shard(model, mesh=mesh)
    with pytest.raises(ValueError, match=r"expected one fully_shard-ed module .* found nested ones: \['0'\]"):
        FSDPPartialAllreduce(model, world=None)
    return True


def test_the_fsdp_hook_refuses_a_module_fsdp2_did_not_shard_and_nested_fully_shard_modules():
    from wagma import FSDPPartialAllreduce

    with pytest.raises(ValueError, match="expected a module sharded with .*fully_shard .* found Linear"):
        FSDPPartialAllreduce(nn.Linear(2, 2), world=None)
    assert all(run_workers(_nested_worker, 2, collective_timeout_s=20))


# -- late="lookahead" on the sharded parameters ----------------------------------------------------------------------


def _lookahead_worker(rank, world_size, rounds):
    import pickle

    from torch.distributed.device_mesh import init_device_mesh

    from wagma import FSDPPartialAllreduce
    from wagma.testing import error_messages

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def build():
        torch.manual_seed(0)
        model = nn.Linear(5, 3, bias=True)
        fsdp.fully_shard(model, mesh=mesh["shard"])
        kw = dict(world=(mesh, "replicate"), sync_period=4, warmup_iters=1, timeout=TIMEOUT, late="lookahead")
        return model, lambda **more: FSDPPartialAllreduce(model, **(kw | more))

    model, make = build()
    errors = error_messages({str(bad): lambda bad=bad: make(lookahead_rounds=bad) for bad in (0, -1, True, 1.5)})
    state = make(lookahead_rounds=rounds, max_lead=rounds - 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state.attach(opt)
    after = []  # this rank's shards of (w, v, the parameters) after every step
    opt.register_step_post_hook(
        lambda *_: after.append(
            [
                (local_tensor(w).clone(), local_tensor(opt.state[p]["momentum_buffer"]).clone(), _shards(model)[i])
                for i, (w, p) in enumerate(zip(state.weights(), model.parameters()))
            ]
        )
    )
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))
    for _ in range(5):
        opt.zero_grad()
        (model(x) ** 2).sum().backward()
        opt.step()
    saved = pickle.loads(pickle.dumps(state.state_dict()))  # the parameters hold the look-ahead point now
    model2, make2 = build()
    with torch.no_grad():
        for p, value in zip(model2.parameters(), _shards(model)):
            local_tensor(p).copy_(value)
    with make2(lookahead_rounds=rounds) as resumed:
        resumed.load_state_dict(saved)
        loaded = [local_tensor(w).clone() for w in resumed.weights()]
    flushed = state.flush(opt)
    final, weights = _shards(model), [local_tensor(w).clone() for w in state.weights()]
    state.close()
    return errors, after, saved["anchor"], loaded, flushed, final, weights


@pytest.mark.parametrize("rounds", [1, 2])
def test_the_fsdp_hooks_look_ahead_moves_the_shards_and_flush_and_weights_give_w(rounds):
    lr, mu = 0.1, 0.9
    reach = lookahead_coefficient(lr, mu, rounds)
    assert reach == pytest.approx(lr * sum(mu**k for k in range(1, rounds + 1)), rel=1e-15)
    out = run_workers(_lookahead_worker, 4, rounds, collective_timeout_s=30, timeout_s=120)
    for errors, after, anchor, loaded, flushed, final, weights in out:
        assert all(m and "lookahead_rounds: expected an integer >= 1, found" in m for m in errors.values()), errors
        assert len(after) == 5 + flushed  # the five training steps, and the flush's when something was left
        for step in after[:5]:
            for w, v, point in step:
                # exactly the hook's one operation (w - reach * v rounds twice, and 1.9e-6 from it at |w| ~ 20)
                expected = torch.sub(w, v, alpha=reach)
                assert torch.equal(point, expected), (point - expected).abs().max()
                assert point.numel() == 0 or not torch.equal(point, w)  # the shard really moved
        # the state_dict keeps this rank's shards of w (plain tensors), and a load gives them back as weights()
        assert all(type(a) is torch.Tensor for a in anchor)
        assert all(torch.equal(a, w) for a, (w, _, _) in zip(anchor, after[4]))
        assert all(torch.equal(a, b) for a, b in zip(anchor, loaded))
        # the flush ends at w: the parameters are the true weights of the last step (its own, if it stepped)
        assert all(torch.equal(f, w) and torch.equal(f, s[0]) for f, w, s in zip(final, weights, after[-1]))
    for rank in range(4):  # replicas identical
        assert all(torch.equal(a, b) for a, b in zip(out[rank][5], out[rank ^ 2][5]))
