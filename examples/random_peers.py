"""A policy of one's own: each step, every rank averages its model with one peer drawn at random.

The worked example of docs/custom-policy.md. Each round, all ranks draw the same random pairing from a seed they
share (a rank sits the round out when P is odd); the two ranks of a pair exchange their models and both take the
mean, ``w <- (w + w_peer) / 2``. Pairwise means keep the sum of the models, and a fresh pairing every round mixes
every rank with every other over a few rounds. It blocks, like D-PSGD, but with one peer instead of two.

This module is all of it: the averager (the library's :class:`~wagma.averaging.base.AveragerBase`), the policy
that trains with it (the application's :class:`~wagma.app.policies.averaging.ModelAveragingPolicy`), and its
registration under the name its config uses (``configs/averaging/candidate/random_peers.yaml``, whose
``policy_module`` makes ``train.py`` import this module)::

    python train.py averaging=candidate/random_peers
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from wagma.app.policies import ModelAveragingPolicy, register_policy
from wagma.app.policies.base import timeout
from wagma.averaging.base import AveragerBase, Reduction
from wagma.checks import check_int


def pairing(world_size: int, round_: int, seed: int) -> list[tuple[int, int]]:
    """Round ``round_``'s pairs of ranks: the same on every rank (one generator seeded by ``seed`` and the round)."""
    order = torch.randperm(world_size, generator=torch.Generator().manual_seed(seed * 1_000_003 + round_)).tolist()
    return [(order[i], order[i + 1]) for i in range(0, world_size - 1, 2)]


class RandomPeersAverager(AveragerBase):
    """Pairwise model means with a peer drawn at random every round (after ``warmup_steps`` calls).

    Args:
        seed: the pairing's seed, the same on every rank.
        warmup_steps: calls before the first round; at least 0.
        **kwargs: :class:`~wagma.averaging.base.AveragerBase`'s (``average_buffers``, ``timeout``, ``world``).
    """

    def __init__(self, seed: int = 0, warmup_steps: int = 0, **kwargs: Any) -> None:
        self.seed = check_int("seed", seed, 0)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        super().__init__(**kwargs)

    def _average_step(self, tensors: list[torch.Tensor]) -> Reduction | None:
        if self.step < self.warmup_steps:
            return None
        me = self.process_group.rank()
        peer = next(
            (b if a == me else a for a, b in pairing(self.world_size, self.step, self.seed) if me in (a, b)), None
        )
        if peer is None:
            return None  # an odd world: this rank sits the round out
        start = time.perf_counter()
        flat = self.flat_buffers(tensors)
        buffers = flat.pack()
        inboxes = [torch.empty_like(b) for b in buffers]
        works = []
        for buffer, inbox in zip(buffers, inboxes):  # send and receive at once: neither side waits for the other
            # the receive first: gloo sends once the peer's receive is posted (benchmarks/rank_net.py, "pair")
            works.append(dist.irecv(inbox, group=self.process_group, group_src=peer))
            works.append(dist.isend(buffer, group=self.process_group, group_dst=peer))
        self.wait_collective(works, f"exchange with rank {peer}", 2)
        for buffer, inbox in zip(buffers, inboxes):
            buffer.add_(inbox).div_(2)
        flat.unpack()
        self.stats.record_reduction(
            "local", sum(b.numel() * b.element_size() for b in buffers), time.perf_counter() - start
        )
        return "local"


class RandomPeersPolicy(ModelAveragingPolicy):
    """Train with :class:`RandomPeersAverager` after every step (``averaging.seed``, ``average_buffers``)."""

    name = "random_peers"

    def __init__(self, *, seed: int = 0, average_buffers: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seed, self.average_buffers = int(seed), bool(average_buffers)

    def build_averager(self, net: nn.Module) -> RandomPeersAverager:
        return RandomPeersAverager(
            self.seed,
            self.hook_state.warmup_steps,
            average_buffers=self.average_buffers,
            timeout=timeout(self.timeout_s),
            world=self.world,
        )


register_policy(
    "random_peers", lambda *, rank, world_size, device, **options: RandomPeersPolicy(device=device, **options)
)
