"""Post-local SGD's DDP comm hook: allreduce gradients for a warm-up, then no gradient communication.

Model-averaging policies (K-AVG, hierarchical averaging, WAGMA-SGD) train with local optimizer steps and
bring the replicas together by averaging *models*. Their optional warm-up is synchronous SGD: during the
first ``warmup_steps`` steps DDP averages gradients, so every replica is still identical when model
averaging takes over (reduction momentum relies on that common starting point). The hook below does
both phases; the training loop advances :attr:`PostLocalState.step` after every optimizer step.

Unlike torch's ``post_localSGD_hook`` it needs no subgroup (which fails on CPU without one, see
FACTS.md) and communicates nothing after the warm-up.

No ``from __future__ import annotations``: DDP checks the hook's annotations against the real objects.
"""

from typing import Any

import torch
import torch.distributed as dist

from wagma.checks import check_int

__all__ = ["PostLocalState", "post_local_hook"]


class PostLocalState:
    """State of :func:`post_local_hook`: the warm-up length and the number of steps done.

    Args:
        warmup_steps: optimizer steps whose gradients are allreduced over all ranks (0: none).
        process_group: group of the warm-up allreduce; ``None`` means the default group (DDP's).
            Pickling drops it (an unpickled state uses the default group).
    """

    def __init__(self, warmup_steps: int = 0, process_group: dist.ProcessGroup | None = None) -> None:
        self.warmup_steps = check_int("warmup_steps", warmup_steps, minimum=0)
        self.process_group = process_group
        #: Optimizer steps completed so far; the caller sets it (``step + 1`` after each step).
        self.step = 0

    @property
    def synchronous(self) -> bool:
        """Whether the next backward pass still averages gradients (the warm-up is not over)."""
        return self.step < self.warmup_steps

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "process_group"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.process_group = None


def post_local_hook(state: PostLocalState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Gradient mean over all ranks while ``state.synchronous``; afterwards the local gradients as they are.

    Args:
        state: a :class:`PostLocalState` whose ``step`` the training loop keeps current.
        bucket: the gradient bucket DDP hands over.
    """
    tensor = bucket.buffer()
    if state.synchronous:
        group = state.process_group if state.process_group is not None else dist.group.WORLD
        tensor.div_(dist.get_world_size(group))
        work = dist.all_reduce(tensor, group=group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(tensor)
    return fut
