"""One timed training step (:func:`timed_step`, and what it needs to split a step's time) and :func:`evaluate`.

How time is split (per rank and step, host clocks):

- ``imbalance_s``: the injected sleep, before the step's compute.
- ``compute_s``: forward, plus backward up to the moment the *last* parameter gradient was accumulated
  (seen through post-accumulate-grad hooks on the parameters, :class:`GradReadyClock`), plus ``optimizer.step()``.
- ``wait_s``: the rest of the step: the time ``backward()`` still took after the last gradient was ready
  (DDP blocks there on the outstanding bucket reductions -- communication that compute did not hide, and
  waiting for slower ranks), plus ``policy.before_step`` and ``policy.after_step`` (model averaging).

On CUDA these are host-side times (kernels are asynchronous), so the split between compute and wait is
approximate there; ``step_s`` is exact because the step ends with ``loss.item()``.
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from wagma.app.imbalance import Imbalance
from wagma.app.policies import Policy
from wagma.app.source_text import token_cross_entropy

__all__ = ["GradReadyClock", "TokenCrossEntropy", "evaluate", "mean_model", "timed_step"]


class GradReadyClock:
    """Remembers when the last parameter gradient of a backward pass was accumulated."""

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        self.last_ready = 0.0
        self._handles = [p.register_post_accumulate_grad_hook(self._mark) for p in params if p.requires_grad]

    def _mark(self, _param: torch.Tensor) -> None:
        self.last_ready = time.perf_counter()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class TokenCrossEntropy(nn.Module):
    """The loss of token targets (``data=torch_source``): mean cross-entropy over every real next token."""

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return token_cross_entropy(logits, target)


def timed_step(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    loss_fn: nn.Module,
    optimizer: torch.optim.Optimizer,
    policy: Policy,
    imbalance: Imbalance,
    clock: GradReadyClock,
    step: int,
    last_compute_s: float,
) -> dict[str, float]:
    """One training step, with the time split described in the module docstring."""
    t0 = time.perf_counter()
    imbalance_s = imbalance(step, last_compute_s)
    t1 = time.perf_counter()
    xb, yb = batch
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model(xb), yb)
    clock.last_ready = 0.0
    loss.backward()  # DDP (and a policy's comm hook) reduce gradients in here
    t2 = time.perf_counter()
    policy.before_step(optimizer, step)
    t3 = time.perf_counter()
    optimizer.step()
    t4 = time.perf_counter()
    policy.after_step(optimizer, step)
    loss_value = loss.item()
    t5 = time.perf_counter()
    grads_ready = clock.last_ready if t1 < clock.last_ready <= t2 else t2
    return {
        "loss": loss_value,
        "samples": len(yb),
        "tokens": int(xb.numel()) if xb.dtype == torch.int64 else 0,  # padded tokens of a token batch
        "step_s": t5 - t0,
        "compute_s": (grads_ready - t1) + (t4 - t3),
        "wait_s": (t2 - grads_ready) + (t3 - t2) + (t5 - t4),
        "imbalance_s": imbalance_s,
    }


@torch.no_grad()
def mean_model(net: nn.Module, scratch: nn.Module | None = None) -> nn.Module:
    """The ranks' mean of ``net`` (its parameters and floating-point buffers) in ``scratch``, to evaluate the model
    a global average would produce now without touching any rank's own; collective over the default group (one
    allreduce of the flattened model). ``scratch`` is a copy of ``net`` made on the first call (pass it back to
    reuse it); ``net`` holds whole replicas (not shards)."""
    if scratch is None:
        scratch = copy.deepcopy(net)
    pairs = [
        (mine, theirs)
        for mine, theirs in zip(
            itertools.chain(net.parameters(), net.buffers()), itertools.chain(scratch.parameters(), scratch.buffers())
        )
        if mine.is_floating_point()
    ]
    if not pairs:
        return scratch
    dtype = torch.float64 if any(mine.dtype == torch.float64 for mine, _ in pairs) else torch.float32
    flat = torch.cat([mine.detach().reshape(-1).to(dtype) for mine, _ in pairs])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flat)
        flat.div_(dist.get_world_size())
    offset = 0
    for mine, theirs in pairs:
        theirs.copy_(flat[offset : offset + mine.numel()].view_as(mine))
        offset += mine.numel()
    return scratch


@torch.no_grad()
def evaluate(
    net: nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int, world_size: int, batch_size: int = 1024
) -> tuple[float, float]:
    """Accuracy and mean cross-entropy of ``net`` on ``(x, y)``; collective over the default group.

    Rank r scores examples r, r + P, ... with its own model and the counts are summed, so with identical
    replicas this is the exact test accuracy, computed P times faster. Every rank runs the same number of
    forward passes (the last may be empty): a sharded model's forward all-gathers inside its replica. With token
    targets (``y`` of shape ``(N, L)``) both are per real next token: the next-byte accuracy and the loss in nats
    per byte, over batches of at most 8,192 tokens' worth of rows.
    """
    was_training = net.training
    net.eval()
    tokens = y.dim() == 2
    if tokens:  # rows x heads x L x L attention weights and rows x L x vocab logits stay small
        batch_size = max(1, min(batch_size, 8192 // max(1, y.shape[1])))
    xs, ys = x[rank::world_size], y[rank::world_size]
    correct = torch.zeros((), dtype=torch.float64, device=x.device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=x.device)
    count = torch.zeros((), dtype=torch.float64, device=x.device)
    for i in range(0, -(-len(x) // world_size), batch_size):  # the largest rank's share, on every rank
        logits = net(xs[i : i + batch_size])
        target = ys[i : i + batch_size]
        if tokens:
            real = target != 0
            correct += ((logits.argmax(dim=-1) == target) & real).sum()
            loss_sum += token_cross_entropy(logits, target, reduction="sum").double()
            count += real.sum()
        else:
            correct += (logits.argmax(dim=1) == target).sum()
            loss_sum += nn.functional.cross_entropy(logits, target, reduction="sum").double()
            count += len(target)
    totals = torch.stack([correct, loss_sum, count])
    dist.all_reduce(totals)
    net.train(was_training)
    total = max(1.0, float(totals[2]))
    return float(totals[0]) / total, float(totals[1]) / total
