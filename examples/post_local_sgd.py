"""Recipe 3: wagma's K-step averaging next to torch's own PostLocalSGDOptimizer.

    torchrun --standalone --nproc-per-node=4 examples/post_local_sgd.py

torch ships post-local SGD as ``PostLocalSGDOptimizer(optimizer, PeriodicModelAverager(period, warmup))``.
wagma's ``AveragingOptimizer(optimizer, PeriodicAverager(period, warmup))`` computes the same model (same
step semantics), and in addition averages parameters that have no gradient and floating-point buffers
(BatchNorm statistics), bounds its collectives by a timeout, and carries the averager's whole state in
``state_dict()``. This script trains two copies of one model side by side, one with each, on the same data,
and checks that they agree. Swap in ``HierarchicalAverager`` or ``WagmaAverager`` for fewer or
wait-avoiding global reductions without changing the loop.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.optim import PostLocalSGDOptimizer

from wagma import AveragingOptimizer, PeriodicAverager


def build() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial model on every rank, and for both copies
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def main(steps: int = 24, period: int = 4, warmup: int = 2) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    theirs, ours = build(), build()
    torch_opt = PostLocalSGDOptimizer(
        torch.optim.SGD(theirs.parameters(), lr=0.02), PeriodicModelAverager(period, warmup)
    )
    averager = PeriodicAverager(period, warmup, timeout=60.0)
    wagma_opt = AveragingOptimizer(torch.optim.SGD(ours.parameters(), lr=0.02), averager)

    data = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randn(32, 8, generator=data)
        for net, opt in ((theirs, torch_opt), (ours, wagma_opt)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), x.sum(dim=1, keepdim=True)).backward()
            opt.step()

    for a, b in zip(theirs.parameters(), ours.parameters()):
        # torch divides before its allreduce and wagma after: the last bits may differ, nothing more.
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    if rank == 0:
        print(
            f"post-local SGD, period {period}, warm-up {warmup}: torch's PostLocalSGDOptimizer and wagma's "
            f"AveragingOptimizer(PeriodicAverager) agree after {steps} steps on {world} ranks "
            f"({averager.stats.global_reductions} global averages)"
        )
    averager.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
