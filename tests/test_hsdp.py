"""HSDP x WAGMA: FSDP2 shards a model inside a replica, wagma averages each shard across the replicas (issue 31)."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch import nn

from wagma.averaging import PeriodicAverager, WagmaAverager
from wagma.averaging.tensors import local_tensor
from wagma.testing import run_workers

fsdp = pytest.importorskip("torch.distributed.fsdp")
TIMEOUT = datetime.timedelta(seconds=30)


def _sharded(rank: int, replicas: int, shards: int, *, tagged: bool = True):
    """A (replicas x shards) mesh and a model fully_shard-ed over the shard dimension; parameters hold rank + 1
    (``tagged``) or one initialization shared by all ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
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


def _round0_worker(rank, world_size, replicas, shards):
    mesh, model = _sharded(rank, replicas, shards)
    assert type(next(model.parameters())).__name__ == "DTensor"
    with WagmaAverager(2, 5, params=model.parameters(), max_lead=0, world=(mesh, "replicate"), timeout=TIMEOUT) as avg:
        kind = avg.average_parameters(model.parameters())
        group = [avg.world.global_rank(r) for r in avg.schedule.group_of(avg.world.rank, 0)]
        sizes = [local_tensor(p).numel() for p in model.parameters()]
        full = [p.numel() for p in model.parameters()]
    return kind, group, [float(s.flatten()[0]) for s in _shards(model) if s.numel()], sizes, full


@pytest.mark.parametrize("replicas,shards", [(2, 2), pytest.param(4, 2, marks=pytest.mark.slow)])
def test_each_shard_is_the_s_plus_one_mix_of_its_groups_same_shard(replicas, shards):
    out = run_workers(_round0_worker, replicas * shards, replicas, shards, collective_timeout_s=30, timeout_s=120)
    for rank, (kind, group, values, sizes, full) in enumerate(out):
        assert kind == "local" and rank in group and len(group) == 2
        assert all(r % shards == rank % shards for r in group), f"rank {rank} met another shard index: {group}"
        assert sum(sizes) * shards >= sum(full) > sum(sizes)  # this rank holds about 1/shards of the model
        (partner,) = [j for j in group if j != rank]
        expected = (2 * (rank + 1) + (partner + 1)) / 3  # the (S + 1)-mix, shard by shard
        assert values == pytest.approx([expected] * len(values))


def _train_worker(rank, world_size, replicas, shards, policy):
    mesh, model = _sharded(rank, replicas, shards, tagged=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if policy == "wagma":
        avg = WagmaAverager(2, 3, params=model.parameters(), world=(mesh, "replicate"), timeout=TIMEOUT)
    else:
        avg = PeriodicAverager(2, world=(mesh, "replicate"), timeout=TIMEOUT)
    gen = torch.Generator().manual_seed(rank)  # every replica its own data

    def batch(g, n=16):
        x = torch.randn(n, 4, generator=g)
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


@pytest.mark.parametrize("policy", ["wagma", "periodic"])
def test_after_a_sync_every_replica_holds_the_same_shards_and_the_model_trains(policy):
    out = run_workers(_train_worker, 4, 2, 2, policy, collective_timeout_s=30, timeout_s=120)
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
