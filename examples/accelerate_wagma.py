"""wagma in Accelerate: a comm hook and an averager on the prepared model with one call, on CPU ranks (gloo).

    torchrun --standalone --nproc-per-node=2 examples/accelerate_wagma.py --policy periodic
    torchrun --standalone --nproc-per-node=2 examples/accelerate_wagma.py --policy eager
    torchrun --standalone --nproc-per-node=2 examples/accelerate_wagma.py --steps 10 --save ckpt   # stop, save ...
    torchrun --standalone --nproc-per-node=2 examples/accelerate_wagma.py --resume ckpt           # ... continue

(``accelerate launch --cpu --num_processes 2 examples/accelerate_wagma.py`` starts the same job.) What the script
checks on every rank: the eager hook was called on every rank; after every global average of the
``PeriodicAverager`` the replicas are identical, bit for bit, and at the end too (after the hook's flush or a final
synchronisation). ``--out`` writes each rank's final parameters (``<out>.rank<r>.pt``) so that a run and its resume
can be compared.
"""

from __future__ import annotations

import argparse
import datetime
import functools
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs

from wagma import PartialAllreduceState, PeriodicAverager, partial_allreduce_hook
from wagma.integrations.accelerate import prepare_wagma


def counted(state: Any, bucket, *, hook: Any, calls: list[int]):
    """Count the calls of ``hook`` (``bucket`` and the return value carry no annotation: DDP checks them)."""
    calls[0] += 1
    return hook(state, bucket)


def flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def identical_replicas(module: torch.nn.Module) -> bool:
    """Collective: True when every rank holds the same parameters, bit for bit."""
    mine = flat(module)
    copies = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, mine)
    return all(torch.equal(c, mine) for c in copies)


class Progress:
    """The loop's position, saved and restored by Accelerate with the rest."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", choices=["periodic", "eager"], default="periodic")
    parser.add_argument("--steps", type=int, default=20, help="train until this step")
    parser.add_argument("--save", help="save the state (accelerator.save_state) at the end")
    parser.add_argument("--resume", help="continue from this state (accelerator.load_state)")
    parser.add_argument("--out", help="write each rank's final parameters to <out>.rank<r>.pt")
    args = parser.parse_args()

    timeout = 60.0  # every wagma wait, and the process group's collectives: fail fast, not in 30 minutes
    accelerator = Accelerator(
        cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=datetime.timedelta(seconds=60))]
    )
    rank, world = accelerator.process_index, accelerator.num_processes
    torch.manual_seed(0)  # the same initial model on every rank
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))

    calls = [0]
    if args.policy == "periodic":  # K-step averaging, period 4; no gradient traffic (local_hook)
        run = prepare_wagma(accelerator, model, optimizer, averager=lambda m: PeriodicAverager(4, timeout=timeout))
    else:  # eager-SGD: the first rank to finish its backward pass triggers the gradient round
        run = prepare_wagma(
            accelerator,
            model,
            optimizer,
            comm_hook=functools.partial(counted, hook=partial_allreduce_hook, calls=calls),
            comm_state=lambda m: PartialAllreduceState(m.parameters(), mode="solo", sync_period=4, timeout=timeout),
        )
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if args.resume:
        accelerator.load_state(args.resume)

    checked = 0
    while progress.step < args.steps:
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1000 * rank + progress.step))
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()  # local step, then the averager's step
        progress.step += 1
        if run.averager is not None and run.averager.reduction_at(run.averager.step - 1) == "global":
            assert identical_replicas(net), f"replicas differ after the global average of step {progress.step}"
            checked += 1
    if args.save:
        accelerator.save_state(args.save)
    if args.policy == "eager":
        assert calls[0] > 0, f"rank {rank}: the comm hook was never called"
        run.flush()  # apply what the residuals still carry
        assert identical_replicas(net), "replicas differ after the flush"
    counts = [None] * world
    dist.all_gather_object(counts, calls[0])
    if args.out:
        torch.save(flat(net), f"{args.out}.rank{rank}.pt")
    if rank == 0:
        print(
            f"accelerate {args.policy}: step {progress.step} on {world} ranks, hook calls per rank {counts}, "
            f"{checked} global averages checked identical"
        )
    run.close()
    accelerator.wait_for_everyone()  # no rank tears its process group down while another still uses it
    accelerator.end_training()


if __name__ == "__main__":
    main()
