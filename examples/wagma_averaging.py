"""Recipe 2: WAGMA-SGD model averaging in your own script, with DDP (and its no-communication hook) or without.

    torchrun --standalone --nproc-per-node=4 examples/wagma_averaging.py          # with DDP
    torchrun --standalone --nproc-per-node=4 examples/wagma_averaging.py --no-ddp # a plain module

Each rank takes local optimizer steps; after each, the averager averages the model inside a group of
``group_size`` ranks that changes every round, without waiting for a straggler (it takes part with the
model it published last), and every ``sync_period + 1`` rounds all ranks average, blocking. With DDP, the
``post_local_hook`` keeps DDP from also allreducing gradients (after an optional warm-up of synchronous
SGD): that communication would be wasted. :class:`~wagma.AveragingOptimizer` runs the local step and the
averager's step in the order the averager asks for.
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from wagma import AveragingOptimizer, PostLocalState, WagmaAverager, flatten_parameters, post_local_hook


def main(steps: int = 40, use_ddp: bool = True) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial model on every rank
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    flatten_parameters(net)  # one flat storage: every round averages it in place, no copies in and out
    model: torch.nn.Module = net
    hook_state = None
    if use_ddp:
        model = DDP(net, broadcast_buffers=False)  # the averager averages the buffers; no broadcast every forward
        hook_state = PostLocalState(warmup_steps=0)  # no gradient traffic: WAGMA averages the models
        model.register_comm_hook(hook_state, post_local_hook)

    group_size = 2 if world % 2 == 0 else world  # S must divide the world size
    # WagmaAverager binds what it averages at construction: the buffers too (BatchNorm's running statistics), since
    # AveragingOptimizer(module=net) passes them at every step.
    averager = WagmaAverager(
        group_size=group_size, sync_period=10, params=net.parameters(), buffers=net.buffers(), timeout=60.0
    )
    optimizer = AveragingOptimizer(torch.optim.SGD(net.parameters(), lr=0.02), averager, module=net)

    data = torch.Generator().manual_seed(rank)
    start = time.perf_counter()
    for step in range(steps):
        if step % world == rank:
            time.sleep(0.05)  # this step's straggler
        x = torch.randn(32, 8, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()  # local step and group average, in the averager's order
        if hook_state is not None:
            hook_state.step = step + 1
    averager.synchronize(net.parameters(), net.buffers())  # a final global average before evaluation
    elapsed = time.perf_counter() - start

    flat = torch.cat([p.detach().flatten() for p in net.parameters()])
    copies = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(copies, flat)
    assert all(torch.equal(c, flat) for c in copies), "replicas differ after the final global average"
    if rank == 0:
        print(
            f"WAGMA-SGD ({'DDP' if use_ddp else 'no DDP'}): {steps} steps on {world} ranks in {elapsed:.2f} s, "
            f"loss {loss.item():.4f}, {averager.stats.global_reductions} global and "
            f"{averager.stats.local_reductions} group averages, replicas identical after the final average"
        )
    averager.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-ddp", action="store_true", help="train a plain module (no DDP)")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    main(args.steps, use_ddp=not args.no_ddp)
