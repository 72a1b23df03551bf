"""wagma in Lightning: a comm hook and an averager through WagmaDDPStrategy, on CPU ranks (gloo).

    python examples/lightning_wagma.py --policy periodic --devices 2          # K-step averaging, period 4
    python examples/lightning_wagma.py --policy wagma --devices 4             # WAGMA-SGD, groups of 2
    python examples/lightning_wagma.py --policy eager --devices 2             # eager-SGD partial allreduce hook
    python examples/lightning_wagma.py --epochs 1 --save run.ckpt             # stop after one epoch ...
    python examples/lightning_wagma.py --epochs 2 --resume run.ckpt           # ... and continue from there

Lightning starts the other ranks itself (it runs this script again for each). What the script checks on every
rank: the eager hook was called on every rank (Lightning's own ``DDPStrategy`` skips a hook on CPU); after every
global average of a ``PeriodicAverager``, and after the final synchronisation of the others, the replicas are
identical, bit for bit. ``--out`` writes each rank's final parameters (``<out>.rank<r>.pt``) so that a run and
its resume can be compared.
"""

from __future__ import annotations

import argparse
import datetime
import functools
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from wagma import PartialAllreduceState, PeriodicAverager, WagmaAverager, partial_allreduce_hook
from wagma.integrations.lightning import WagmaDDPStrategy


class Regression(L.LightningModule):
    """A tiny regression model: 8 inputs, 32 hidden units, 1 output."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def dataset(n: int = 512) -> torch.utils.data.TensorDataset:
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))


def counted(state: Any, bucket, *, hook: Any, calls: list[int]):
    """Count the calls of ``hook`` (a functools.partial of this is what the strategy registers).

    ``bucket`` and the return value carry no annotation: DDP compares a hook's annotations with
    ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]``, and under ``from __future__ import annotations``
    they would be strings.
    """
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


class CheckReplicas(L.Callback):
    """After each global average of a step-then-average averager, the replicas must be identical."""

    def __init__(self) -> None:
        self.seen = 0
        self.checked = 0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        averager = trainer.strategy.averager
        if averager is None or getattr(averager, "order", None) == "average_then_step":
            return  # WAGMA's sync round precedes the local step: checked after the final synchronisation
        if averager.stats.global_reductions != self.seen:  # the same steps on every rank
            self.seen = averager.stats.global_reductions
            assert identical_replicas(pl_module), f"replicas differ after global average {self.seen}"
            self.checked += 1


class SaveAt(L.Callback):
    """Save a checkpoint at the end of the last epoch (before the end-of-training flush or synchronisation)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch + 1 == trainer.max_epochs:
            trainer.save_checkpoint(self.path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", choices=["periodic", "wagma", "eager"], default="periodic")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save", help="save a checkpoint at the end of the last epoch")
    parser.add_argument("--resume", help="continue from this checkpoint")
    parser.add_argument("--out", help="write each rank's final parameters to <out>.rank<r>.pt")
    args = parser.parse_args()

    calls = [0]
    timeout = 60.0  # every wagma wait, and (below) the process group's collectives: fail fast, not in 30 minutes
    ddp = {"process_group_backend": "gloo", "timeout": datetime.timedelta(seconds=timeout)}
    if args.policy == "periodic":  # K-step averaging; no gradient traffic (the strategy registers local_hook)
        strategy = WagmaDDPStrategy(averager=lambda m: PeriodicAverager(period=4, timeout=timeout), **ddp)
    elif args.policy == "wagma":  # group averages of 2 ranks, a blocking global one every 4th round
        strategy = WagmaDDPStrategy(
            averager=lambda m: WagmaAverager(2, sync_period=3, params=m.parameters(), timeout=timeout),
            synchronize_at_end=True,
            **ddp,
        )
    else:  # eager-SGD: the first rank to finish its backward pass triggers the gradient round
        strategy = WagmaDDPStrategy(
            comm_hook=functools.partial(counted, hook=partial_allreduce_hook, calls=calls),
            comm_state=lambda m: PartialAllreduceState(m.parameters(), mode="solo", sync_period=4, timeout=timeout),
            **ddp,
        )

    L.seed_everything(0, verbose=False)  # the same initial model on every rank
    model = Regression()
    check = CheckReplicas()
    callbacks: list[L.Callback] = [check] + ([SaveAt(args.save)] if args.save else [])
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=args.devices,
        max_epochs=args.epochs,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = torch.utils.data.DataLoader(dataset(), batch_size=16, shuffle=True)
    trainer.fit(model, loader, ckpt_path=args.resume)

    rank = dist.get_rank()
    if args.policy == "eager":
        assert calls[0] > 0, f"rank {rank}: the comm hook was never called"
    if args.policy == "periodic":
        assert check.checked > 0, f"rank {rank}: no global average was checked"
    if args.policy != "periodic":  # eager: flushed; wagma: synchronised at the end
        assert identical_replicas(model), "replicas differ at the end of training"
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, calls[0])
    if args.out:
        torch.save(flat(model), f"{args.out}.rank{rank}.pt")
    if rank == 0:
        print(
            f"lightning {args.policy}: {trainer.global_step} steps on {dist.get_world_size()} ranks, "
            f"hook calls per rank {counts}, {check.checked} global averages checked identical"
        )
    # Lightning leaves the process group up; gloo's worker threads alive at interpreter exit abort the process.
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
