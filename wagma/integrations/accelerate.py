"""Accelerate: :func:`prepare_wagma`, one call that adds a wagma comm hook and a wagma averager to a prepared model.

Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` takes only its own enum of torch's hooks, and its
``LocalSGD`` takes no averager. ``accelerator.prepare(model)`` does return the ``DistributedDataParallel`` module,
though, and DDP accepts any hook before the first backward pass; the optimizer Accelerate returns wraps the one it
steps. So, after ``prepare``::

    from wagma import PeriodicAverager
    from wagma.integrations.accelerate import prepare_wagma

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    wagma_run = prepare_wagma(accelerator, model, optimizer, averager=lambda m: PeriodicAverager(4, timeout=60.0))
    ...                                     # the usual loop: accelerator.backward(loss); optimizer.step()
    accelerator.save_state("ckpt")          # every rank's averager, hook, model and optimizer state
    wagma_run.close()

The averager runs inside the optimizer Accelerate steps (only on steps it does not skip for gradient
accumulation), in the averager's ``order``.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from wagma.averaging.optimizer import AveragingOptimizer
from wagma.hooks.basic import local_hook
from wagma.hooks.post_local import PostLocalState
from wagma.integrations._common import build, check_unsharded, close_quietly, ddp_hook, gather_states, require, to_cpu

require("accelerate", "accelerate", "Accelerate")

from accelerate.utils import DistributedType  # noqa: E402

__all__ = ["WagmaAccelerate", "prepare_wagma"]

#: Accelerate's distributed types whose prepared model is a ``DistributedDataParallel`` module.
DDP_TYPES = ("MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_XPU", "MULTI_HPU")


class _CountingAveragingOptimizer(AveragingOptimizer):
    """:class:`~wagma.AveragingOptimizer` that also counts its steps for a :class:`~wagma.PostLocalState` hook.

    Its ``state_dict`` is the wrapped optimizer's alone: the framework's optimizer file stays one a plain optimizer
    loads (the Trainer loads it before the wrapper is in place), and :class:`WagmaAccelerate` saves the averager's.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, averager: Any, module: torch.nn.Module, hook_state: Any):
        super().__init__(optimizer, averager, module=module)
        self.hook_state = hook_state
        self.steps = 0

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        self.steps += 1
        if isinstance(self.hook_state, PostLocalState):
            self.hook_state.step = self.steps
        return loss


class WagmaAccelerate:
    """What :func:`prepare_wagma` set up: the hook state, the averager, and their checkpoint state.

    Registered with ``accelerator.register_for_checkpointing``: :meth:`state_dict` (collective, called by
    ``save_state`` on every rank) gathers every rank's hook state, averager state, model and optimizer state into
    rank 0's file; :meth:`load_state_dict` (``load_state``, after Accelerate restored rank 0's model and optimizer)
    gives each rank its own back, so a resume continues where the saved run stopped, replicas that differ included.

    Attributes:
        comm_state: the registered hook's state (``None``: no wagma hook).
        averager: the averager (``None``: none).
        module: the unwrapped model.
    """

    def __init__(self, module: torch.nn.Module, optimizer: Any, comm_state: Any, averager: Any) -> None:
        self.module = module
        self.optimizer = optimizer  # Accelerate's AcceleratedOptimizer
        self.comm_state = comm_state
        self.averager = averager

    @property
    def _inner(self) -> torch.optim.Optimizer:
        inner = self.optimizer.optimizer
        return inner.optimizer if isinstance(inner, AveragingOptimizer) else inner

    def state_dict(self) -> dict[str, Any]:
        """Collective: every rank's wagma state, model and optimizer state (the full list on rank 0)."""
        wrapper = self.optimizer.optimizer
        mine = {
            "steps": getattr(wrapper, "steps", 0),
            "averager": to_cpu(self.averager.state_dict()) if self.averager is not None else None,
            "comm_state": to_cpu(self.comm_state.state_dict()) if hasattr(self.comm_state, "state_dict") else None,
            "model": to_cpu(self.module.state_dict()),
            "optimizer": to_cpu(self._inner.state_dict()),
        }
        ranks = gather_states(mine)
        return {"world_size": dist.get_world_size(), "ranks": ranks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """This rank's entry of :meth:`state_dict` output.

        Raises:
            ValueError: the state was saved by a different number of ranks.
        """
        world, rank = dist.get_world_size(), dist.get_rank()
        if state.get("world_size") != world or not state.get("ranks"):
            raise ValueError(
                f"checkpoint: expected wagma's state of {world} ranks, found {state.get('world_size')}; resume with "
                "the same number of processes"
            )
        mine = state["ranks"][rank]
        self.module.load_state_dict(mine["model"])
        self._inner.load_state_dict(mine["optimizer"])
        wrapper = self.optimizer.optimizer
        if isinstance(wrapper, _CountingAveragingOptimizer):
            wrapper.steps = int(mine["steps"])
            if isinstance(self.comm_state, PostLocalState):
                self.comm_state.step = wrapper.steps
        if self.averager is not None and mine["averager"] is not None:
            self.averager.load_state_dict(mine["averager"])
        if mine["comm_state"] is not None:
            self.comm_state.load_state_dict(mine["comm_state"])

    def flush(self) -> None:
        """Apply what a partial-allreduce hook still carries (collective; call after the last step)."""
        flush = getattr(self.comm_state, "flush", None)
        if callable(flush):
            flush(self._inner)

    def synchronize(self) -> None:
        """A blocking global average of the models (collective), e.g. before evaluation or the final save."""
        if self.averager is not None:
            self.averager.synchronize(self.module.parameters(), self.module.buffers())

    def close(self) -> None:
        """Close the averager and the hook state (their threads and process groups); the optimizer steps alone."""
        close_quietly(self.averager, self.comm_state)
        if isinstance(self.optimizer.optimizer, _CountingAveragingOptimizer):
            self.optimizer.optimizer = self.optimizer.optimizer.optimizer


def _refuse(combination: str, alternative: str) -> ValueError:
    return ValueError(f"wagma.integrations.accelerate: {combination} is not supported; {alternative}")


def _require_ddp(accelerator: Any, model: torch.nn.Module, comm_hook: Any) -> None:
    """Refuse a run whose prepared model is not a ``DistributedDataParallel`` module, naming what to use instead."""
    kind = accelerator.distributed_type
    kind_name = getattr(kind, "name", str(kind))
    if kind_name in DDP_TYPES and isinstance(model, DistributedDataParallel):
        return
    if kind == DistributedType.FSDP:
        alternative = (
            "shard with FSDP2's fully_shard yourself and use wagma.FSDPPartialAllreduce (gradients) or an "
            "averager with world=(mesh, 'replicate') (models), or use Accelerate's multi-process DDP"
        )
    elif kind_name == "NO":
        alternative = "launch more than one process (accelerate launch --num_processes 2, or torchrun)"
    else:
        alternative = "use Accelerate's multi-process DDP (accelerate launch --multi_gpu, or --cpu on CPU)"
    what = "a wagma DDP comm hook" if comm_hook is not None else "a wagma averager"
    raise _refuse(
        f"{what} with Accelerate's {kind_name} (the prepared model is a {type(model).__name__}, not a "
        "DistributedDataParallel module)",
        alternative,
    )


def prepare_wagma(
    accelerator: Any,
    model: torch.nn.Module,
    optimizer: Any,
    *,
    comm_hook: Any = None,
    comm_state: Any = None,
    averager: Any = None,
    checkpoint: bool = True,
) -> WagmaAccelerate:
    """Register a wagma comm hook on the prepared DDP model and run a wagma averager inside the prepared optimizer.

    Call it on every rank, after ``accelerator.prepare`` and before the first backward pass.

    Args:
        accelerator: the ``accelerate.Accelerator``.
        model: the model ``prepare`` returned (a ``DistributedDataParallel`` module on a multi-process run).
        optimizer: the optimizer ``prepare`` returned (an ``AcceleratedOptimizer``).
        comm_hook: a DDP comm hook ``hook(state, bucket)`` (a ``functools.partial`` of one included). ``None`` with
            an averager: ``local_hook`` (no gradient traffic, the averager averages the models); ``None`` without
            one: DDP's allreduce.
        comm_state: the hook's state, or a factory ``f(module) -> state`` (``module``: the unwrapped model).
        averager: a wagma averager or a factory ``f(module) -> averager``.
        checkpoint: register the returned object with ``accelerator.register_for_checkpointing``.

    Returns:
        The :class:`WagmaAccelerate` handle (``flush``, ``synchronize``, ``close``).

    Raises:
        ValueError: a hook or an averager on a run Accelerate did not wrap in DDP (FSDP, DeepSpeed, Megatron-LM,
            a single process), naming the combination and what to use instead.
    """
    if comm_hook is None and comm_state is None and averager is None:
        raise ValueError("prepare_wagma: expected a comm_hook, an averager or both, found neither")
    _require_ddp(accelerator, model, comm_hook)
    module = accelerator.unwrap_model(model)
    hook = ddp_hook(comm_hook)
    if comm_state is not None and hook is None:
        raise ValueError("comm_state: expected a comm_hook to go with it, found comm_hook=None")
    if hook is None and averager is not None:
        hook = local_hook  # the models are averaged: DDP's gradient allreduce would be wasted traffic
    state = None
    if hook is not None:
        check_unsharded(module, "Accelerate's DDP", "use wagma.FSDPPartialAllreduce on an FSDP2 model instead")
        state = build(comm_state, module, "comm_state")
        cast(DistributedDataParallel, model).register_comm_hook(state, hook)  # _require_ddp checked it
    built = build(averager, module, "averager")
    if built is not None:
        optimizer.optimizer = _CountingAveragingOptimizer(optimizer.optimizer, built, module, state)
    handle = WagmaAccelerate(module, optimizer, state, built)
    if checkpoint:
        accelerator.register_for_checkpointing(handle)
    return handle
