"""Recipe 1: eager-SGD in your own DDP script — solo partial allreduce of gradients as a DDP comm hook.

    torchrun --standalone --nproc-per-node=4 examples/eager_sgd_hook.py

Every step one rank is a straggler (it sleeps 50 ms). With plain DDP every rank would wait for it; with
the partial allreduce hook the first rank to finish its backward pass triggers the round, the straggler
takes part with whatever gradient it has accumulated, and its fresh gradient is carried into a later
round, never dropped. Every rank applies the same round results, so the replicas stay identical.

The state is the shipped configuration (the application's ``averaging=eager_solo_overlap_lookahead_local``):
each round's exchange runs behind the next iteration (``overlap=True``), so every gradient is applied one
round late, and each backward pass runs where the model will be when that round lands (``late="lookahead_local"``:
momentum's step plus this rank's own gradient of the round in flight), which keeps SGD with momentum 0.9 at
allreduce's accuracy.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from wagma import PartialAllreduceState, partial_allreduce_hook


def main(steps: int = 30) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial model on every rank
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    model = DDP(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)

    # Build the state on every rank, in the same order (it creates communicators and a progress thread).
    state = PartialAllreduceState(
        model.parameters(),
        mode="solo",
        sync_period=32,  # every 33rd round is a blocking, fully fresh allreduce
        overlap=True,  # round r's exchange runs during iteration r + 1
        max_lead=0,  # every gradient exactly one round late
        late="lookahead_local",  # backward passes at the point the late gradient will be applied to
        timeout=60.0,
    )
    state.attach(optimizer)  # the look-ahead steps as this optimizer does
    model.register_comm_hook(state, partial_allreduce_hook)

    data = torch.Generator().manual_seed(rank)  # each rank its own shard
    start = time.perf_counter()
    for step in range(steps):
        if step % world == rank:
            time.sleep(0.05)  # this step's straggler: the other ranks do not wait for it
        x = torch.randn(32, 8, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()  # the hook runs here
        optimizer.step()
    state.flush(optimizer)  # collective: apply the round in flight and the residuals; the parameters hold w again
    elapsed = time.perf_counter() - start

    # Same round results on every rank: the replicas are identical, bit for bit.
    flat = torch.cat([p.detach().flatten() for p in net.parameters()])
    copies = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(copies, flat)
    assert all(torch.equal(c, flat) for c in copies), "replicas differ"
    if rank == 0:
        print(
            f"eager-SGD solo: {steps} steps on {world} ranks in {elapsed:.2f} s, loss {loss.item():.4f}, "
            f"fresh fraction {state.fresh_fraction():.2f}, replicas identical"
        )
    state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
