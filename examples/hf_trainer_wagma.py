"""wagma in the Hugging Face Trainer: a comm hook and an averager through WagmaCallback, on CPU ranks (gloo).

    torchrun --standalone --nproc-per-node=2 examples/hf_trainer_wagma.py --policy periodic
    torchrun --standalone --nproc-per-node=2 examples/hf_trainer_wagma.py --policy eager
    torchrun --standalone --nproc-per-node=2 examples/hf_trainer_wagma.py --steps 10 --output-dir run  # stop ...
    torchrun --standalone --nproc-per-node=2 examples/hf_trainer_wagma.py --output-dir run --resume     # ... go on

The Trainer saves a checkpoint every 10 steps (``<output-dir>/checkpoint-<step>``, with wagma's ``wagma.pt``);
``--resume`` continues from the last one. What the script checks on every rank: the eager hook was called on every
rank; after every global average of the ``PeriodicAverager`` the replicas are identical, bit for bit, and at the end
too (after the hook's flush). ``--out`` writes each rank's final parameters (``<out>.rank<r>.pt``) so that a run
and its resume can be compared.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback, TrainingArguments

from wagma import PartialAllreduceState, PeriodicAverager, partial_allreduce_hook
from wagma.integrations.transformers import WagmaCallback


class Regression(torch.nn.Module):
    """A tiny regression model in the Trainer's convention: ``forward(**batch)`` returns the loss first."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


class Pairs(torch.utils.data.Dataset):
    def __init__(self, n: int = 512) -> None:
        self.x = torch.randn(n, 8, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.x[i].sum(dim=0, keepdim=True)}


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


class CheckReplicas(TrainerCallback):
    """After each global average of the averager, the replicas must be identical."""

    def __init__(self, wagma: WagmaCallback, model: torch.nn.Module) -> None:
        self.wagma, self.model, self.checked = wagma, model, 0

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        averager = self.wagma.run.averager if self.wagma.run is not None else None
        if averager is not None and averager.reduction_at(averager.step - 1) == "global":
            assert identical_replicas(self.model), (
                f"replicas differ after the global average of step {state.global_step}"
            )
            self.checked += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", choices=["periodic", "eager"], default="periodic")
    parser.add_argument("--steps", type=int, default=20, help="train until this step")
    parser.add_argument("--output-dir", default="hf_run")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --output-dir")
    parser.add_argument("--out", help="write each rank's final parameters to <out>.rank<r>.pt")
    args = parser.parse_args()

    torch.manual_seed(0)  # the same initial model on every rank
    model = Regression()
    training = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=16,
        learning_rate=0.05,
        lr_scheduler_type="constant",
        optim="sgd",
        max_grad_norm=0.0,  # no clipping: one allreduce fewer per step
        save_strategy="steps",
        save_steps=10,
        logging_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        ddp_backend="gloo",
        ddp_timeout=60,  # the process group's collectives: fail fast, not in 30 minutes
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = Trainer(model=model, args=training, train_dataset=Pairs())
    calls = [0]
    timeout = 60.0  # every wagma wait
    if args.policy == "periodic":  # K-step averaging, period 4; no gradient traffic (local_hook)
        wagma = WagmaCallback(trainer, averager=lambda m: PeriodicAverager(4, timeout=timeout))
    else:  # eager-SGD: the first rank to finish its backward pass triggers the gradient round
        wagma = WagmaCallback(
            trainer,
            comm_hook=functools.partial(counted, hook=partial_allreduce_hook, calls=calls),
            comm_state=lambda m: PartialAllreduceState(m.parameters(), mode="solo", sync_period=4, timeout=timeout),
        )
    check = CheckReplicas(wagma, model)
    trainer.add_callback(wagma)
    trainer.add_callback(check)
    trainer.train(resume_from_checkpoint=True if args.resume else None)

    rank, world = dist.get_rank(), dist.get_world_size()
    if args.policy == "eager":
        assert calls[0] > 0, f"rank {rank}: the comm hook was never called"
        assert identical_replicas(model), "replicas differ after the flush"
    counts = [None] * world
    dist.all_gather_object(counts, calls[0])
    if args.out:
        torch.save(flat(model), f"{args.out}.rank{rank}.pt")
    if rank == 0:
        print(
            f"hf trainer {args.policy}: step {trainer.state.global_step} on {world} ranks, hook calls per rank "
            f"{counts}, {check.checked} global averages checked identical"
        )
    dist.barrier()  # no rank tears its process group down while another still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # The run has finished and its process group is gone, but objects the Trainer keeps (its DDP wrapper among them)
    # are torn down with the interpreter, and gloo threads still alive then abort the process now and then (SIGABRT,
    # "terminate called without an active exception") after a successful run. Leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
