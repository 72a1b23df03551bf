"""Recipe 5: a model sharded with FSDP2 inside each replica, WAGMA-SGD across the replicas (HSDP x WAGMA).

    torchrun --standalone --nproc-per-node=4 examples/fsdp2_wagma.py                  # 2 replicas x 2 shards
    torchrun --standalone --nproc-per-node=8 examples/fsdp2_wagma.py --shard-size 2   # 4 replicas x 2 shards

A 2-D ``DeviceMesh`` ``("replicate", "shard")``: ``fully_shard`` over the ``shard`` dimension splits every parameter
among the ranks of one replica (FSDP2's all-gather and reduce-scatter stay inside it), so no gradient crosses
replicas. Instead, after each local step, a :class:`~wagma.WagmaAverager` on the ``replicate`` dimension averages
this rank's shards with the same shards of the other replicas in its group (a group that changes every round,
without waiting for a straggler), and every ``sync_period + 1`` rounds all replicas average, blocking. Replica r's
shard j only ever meets shard j of other replicas.
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from wagma import WagmaAverager
from wagma.averaging.tensors import local_tensor


def main(steps: int = 40, shard_size: int = 2) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % shard_size:
        raise SystemExit(f"--shard-size: expected a divisor of the {world} ranks, found {shard_size}")
    replicas = world // shard_size
    mesh = init_device_mesh("cpu", (replicas, shard_size), mesh_dim_names=("replicate", "shard"))

    torch.manual_seed(0)  # the same initial model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])  # FSDP2 inside the replica only

    group_size = 2 if replicas % 2 == 0 else replicas  # S must divide the number of replicas
    averager = WagmaAverager(
        group_size, sync_period=10, params=model.parameters(), world=(mesh, "replicate"), timeout=60.0
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)

    data = torch.Generator().manual_seed(mesh.get_local_rank("replicate"))  # each replica its own data
    start = time.perf_counter()
    for step in range(steps):
        if step % replicas == mesh.get_local_rank("replicate"):
            time.sleep(0.05)  # this step's straggling replica
        x = torch.randn(32, 8, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        averager.average_parameters(model.parameters())  # this rank's shards, with its group's same shards
    averager.synchronize(model.parameters())  # a final average over all replicas, shard by shard
    elapsed = time.perf_counter() - start

    mine = torch.cat([local_tensor(p).detach().flatten() for p in model.parameters()])
    copies = [torch.empty_like(mine) for _ in range(replicas)]
    dist.all_gather(copies, mine, group=mesh.get_group("replicate"))
    assert all(torch.equal(c, mine) for c in copies), "replicas differ after the final average"
    held, total = mine.numel(), sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(
            f"HSDP x WAGMA: {steps} steps on {replicas} replicas x {shard_size} shards in {elapsed:.2f} s, "
            f"loss {loss.item():.4f}, each rank holds {held} of {total} parameters, "
            f"{averager.stats.global_reductions} global and {averager.stats.local_reductions} group averages, "
            "replicas identical after the final average"
        )
    averager.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--shard-size", type=int, default=2)
    args = parser.parse_args()
    main(args.steps, args.shard_size)
