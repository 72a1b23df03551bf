"""Recipe 4: the decentralized baselines (D-PSGD, SGP, OSGP, AD-PSGD) in your own script, beside WAGMA-SGD.

    torchrun --standalone --nproc-per-node=4 examples/gossip_baselines.py --method sgp
    torchrun --standalone --nproc-per-node=4 examples/gossip_baselines.py --method dpsgd
    torchrun --standalone --nproc-per-node=4 examples/gossip_baselines.py --method osgp
    torchrun --standalone --nproc-per-node=4 examples/gossip_baselines.py --method adpsgd

The gossip averagers are used exactly like the other averagers: a local optimizer step, then
``average_parameters`` (here through :class:`~wagma.AveragingOptimizer`). D-PSGD averages with the ring
neighbours, SGP pushes a third of its push-sum numerator and weight to two peers of the directed
exponential graph, OSGP does the same one round late, AD-PSGD averages pairwise on a progress thread while the
loop goes on. ``synchronize`` (collective) collects what is in flight and takes the global mean: the consensus
model, identical on every rank (the script checks it).
"""

from __future__ import annotations

import argparse
import datetime

import torch
import torch.distributed as dist

from wagma import ADPSGDAverager, AveragingOptimizer, DPSGDAverager, SGPAverager


def main(method: str = "sgp", steps: int = 30) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial model on every rank
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    averager: DPSGDAverager | SGPAverager | ADPSGDAverager
    if method == "dpsgd":
        averager = DPSGDAverager("ring", timeout=60.0)
    elif method == "adpsgd":
        averager = ADPSGDAverager(timeout=60.0)  # even worlds: active (even) ranks meet passive (odd) ones
    else:
        averager = SGPAverager(overlap=method == "osgp", timeout=60.0)
    inner = torch.optim.SGD(net.parameters(), lr=0.05)
    optimizer = AveragingOptimizer(inner, averager, module=net)

    data = torch.Generator().manual_seed(rank)  # different data on every rank
    for _ in range(steps):
        x = torch.randn(32, 8, generator=data)
        loss = torch.nn.functional.mse_loss(net(x), x.sum(dim=1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()  # local step, then one gossip round (AD-PSGD: add what the thread finished)

    flat = torch.cat([p.detach().flatten() for p in net.parameters()])
    spread = flat.clone()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    low = flat.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    disagreement = float((spread - low).max())
    averager.synchronize(net.parameters(), net.buffers())  # the consensus model: evaluate and save this one
    flat = torch.cat([p.detach().flatten() for p in net.parameters()])
    copies = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(copies, flat)
    assert all(torch.equal(c, flat) for c in copies), "replicas differ after synchronize"
    if rank == 0:
        print(
            f"{method}: {steps} steps on {world} ranks, loss {loss.item():.4f}, models differed by at most "
            f"{disagreement:.4f} before synchronize, {averager.stats.local_reductions} exchanges added, "
            f"replicas identical after synchronize"
        )
    averager.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", choices=("dpsgd", "sgp", "osgp", "adpsgd"), default="sgp")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    main(args.method, args.steps)
