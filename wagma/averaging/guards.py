"""Guard rails of the averagers: one warning for a setup that runs but does not do what its user meant.

- :class:`DoubleCommunicationGuard` -- an averager whose parameters belong to a ``DistributedDataParallel``
  model that still allreduces gradients pays for two communications per step (DDP's gradient allreduce
  and the model average), and while gradients are averaged every step the model average changes nothing.
- :func:`order_ignored_by_caller` -- an averager whose ``order`` is ``"average_then_step"`` driven by
  torch's ``PostLocalSGDOptimizer``, which always steps first and then averages.

Both warn once per averager (a ``UserWarning``) and never communicate, so ranks need not agree on them.
"""

from __future__ import annotations

import functools
import gc
import itertools
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "DoubleCommunicationGuard",
    "ddp_gradient_communication",
    "hook_communicates",
    "order_ignored_by_caller",
    "warn_at_caller",
]

_WAGMA_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def warn_at_caller(message: str) -> None:
    """``warnings.warn(message, UserWarning)`` attributed to the first calling frame outside wagma.

    The line a user sees is then their own call (``optimizer.step()``, the averager's constructor), not a
    line inside wagma's wrappers, however deep the call came in.
    """
    frame: FrameType | None = sys._getframe(1)
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(_WAGMA_DIR):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, UserWarning, stacklevel=level)


def _unwrap(hook: Any) -> Any:
    while isinstance(hook, functools.partial):
        hook = hook.func
    return hook


def _always(what: str) -> Callable[[Any], str]:
    return lambda state: what


def _never(state: Any) -> None:
    return None


def _wagma_post_local(state: Any) -> str | None:
    if state is not None and getattr(state, "synchronous", False):
        return f"post_local_hook is still in its warm-up (step {state.step} < warmup_steps {state.warmup_steps})"
    return None


def _torch_post_local_sgd(state: Any) -> str | None:
    if state is None:
        return None
    if state.iter < state.start_localSGD_iter:
        return (
            f"post_localSGD_hook is still in its warm-up (iteration {state.iter} < start_localSGD_iter "
            f"{state.start_localSGD_iter})"
        )
    if getattr(state, "post_local_gradient_allreduce", False):
        return "post_localSGD_hook allreduces gradients in its subgroup (post_local_gradient_allreduce=True)"
    return None


_TORCH_HOOKS = "torch.distributed.algorithms.ddp_comm_hooks"
#: (module, function name) of a known hook -> what it communicates this iteration given its state (None:
#: nothing). Keyed by name so that no hook module is imported for the lookup; :func:`hook_communicates`
#: checks that the registered function is the module's own.
_KNOWN_HOOKS: dict[tuple[str, str], Callable[[Any], str | None]] = {
    ("wagma.hooks.basic", "local_hook"): _never,
    ("wagma.hooks.post_local", "post_local_hook"): _wagma_post_local,
    ("wagma.hooks.basic", "allreduce_hook"): _always("wagma's allreduce_hook is registered"),
    ("wagma.hooks.basic", "group_allreduce_hook"): _always("wagma's group_allreduce_hook is registered"),
    ("wagma.hooks.partial", "partial_allreduce_hook"): _always("wagma's partial_allreduce_hook is registered"),
    (f"{_TORCH_HOOKS}.debugging_hooks", "noop_hook"): _never,
    (f"{_TORCH_HOOKS}.post_localSGD_hook", "post_localSGD_hook"): _torch_post_local_sgd,
    (f"{_TORCH_HOOKS}.default_hooks", "allreduce_hook"): _always("torch's allreduce_hook is registered"),
    (f"{_TORCH_HOOKS}.default_hooks", "fp16_compress_hook"): _always("torch's fp16_compress_hook is registered"),
    (f"{_TORCH_HOOKS}.default_hooks", "bf16_compress_hook"): _always("torch's bf16_compress_hook is registered"),
    (f"{_TORCH_HOOKS}.powerSGD_hook", "powerSGD_hook"): _always("torch's powerSGD_hook is registered"),
    (f"{_TORCH_HOOKS}.powerSGD_hook", "batched_powerSGD_hook"): _always("torch's batched_powerSGD_hook is registered"),
}


def hook_communicates(hook: Callable[..., Any], state: Any) -> str | None:
    """What a DDP comm hook exchanges in this iteration, as far as wagma can tell.

    Returns:
        A short description when the hook is one of wagma's or torch's and exchanges gradients now
        (given ``state``, e.g. a post-local hook in its warm-up); ``None`` when it does not, or when the
        hook is unknown (custom hooks are given the benefit of the doubt).
    """
    hook = _unwrap(hook)
    key = (getattr(hook, "__module__", None) or "", getattr(hook, "__qualname__", None) or "")
    rule = _KNOWN_HOOKS.get(key)
    if rule is None or getattr(sys.modules.get(key[0]), key[1], None) is not hook:
        return None
    return rule(state)


def ddp_gradient_communication(ddp: DistributedDataParallel) -> str | None:
    """Whether ``ddp`` allreduces gradients in its next backward pass: a description, or ``None``.

    Reads the hook DDP keeps from ``register_comm_hook`` (``ddp._comm_hooks``, a list of ``(hook, state)``):
    without one DDP runs its own allreduce (or a builtin hook, which communicates too). An unknown custom
    hook counts as not communicating.
    """
    hooks = getattr(ddp, "_comm_hooks", None)
    if not hooks:
        return "it has no comm hook, so DDP allreduces every gradient"
    hook, state = hooks[-1]
    return hook_communicates(hook, state)


def _ddps_sharing(tensors: Sequence[torch.Tensor]) -> list[DistributedDataParallel]:
    """Every live ``DistributedDataParallel`` whose parameters include one of ``tensors``.

    DDP keeps no registry and a parameter does not know its module, so this walks the objects the
    garbage collector tracks, with the type test in C (``map``/``compress``): about 60 ms per 300,000
    objects on an idle core, which is why callers do it once.
    """
    kinds, todo = set(), [DistributedDataParallel]
    while todo:  # DDP and its subclasses, as they exist now
        cls = todo.pop()
        kinds.add(cls)
        todo.extend(cls.__subclasses__())
    objects = gc.get_objects()
    candidates = list(itertools.compress(objects, map(kinds.__contains__, map(type, objects))))
    del objects
    ids = {id(t) for t in tensors}
    return [ddp for ddp in candidates if any(id(p) in ids for p in ddp.parameters())]


class DoubleCommunicationGuard:
    """Warns once when an averager reduces models that a DDP instance still averages gradients for.

    :meth:`check` is called by the averager after each reduction it ran. The first call looks for the
    ``DistributedDataParallel`` models that own the averaged tensors (once: see :func:`_ddps_sharing`) and
    keeps weak references to them; every call then asks each one whether its comm hook communicates
    (cheap), until the warning has been given or no DDP model was found.

    Args:
        owner: the averager's name, for the message.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.warned = False
        self._ddps: list[weakref.ref[DistributedDataParallel]] | None = None  # None: not looked yet

    def check(self, tensors: Sequence[torch.Tensor]) -> None:
        """Warn (once) if a DDP model owning ``tensors`` exchanges gradients in its current backward passes."""
        if self.warned or self._ddps == []:
            return
        if self._ddps is None:
            self._ddps = [weakref.ref(d) for d in _ddps_sharing(tensors)]
        for ref in self._ddps:
            ddp = ref()
            what = None if ddp is None else ddp_gradient_communication(ddp)
            if what is not None:
                self.warned = True
                warn_at_caller(
                    f"{self.owner} averages the parameters of a DistributedDataParallel model that still "
                    f"allreduces gradients ({what}): every such step pays for two communications, the gradient "
                    f"allreduce and the model average. {_advice(what)}"
                )
                return


def _advice(what: str) -> str:
    if "warm-up" in what:
        return (
            "Let the averager start when the hook's warm-up ends (the same warmup_steps for PeriodicAverager or "
            "HierarchicalAverager), or give the hook no warm-up (WagmaAverager has none)"
        )
    return (
        "Register a hook without gradient communication, ddp.register_comm_hook(PostLocalState(warmup_steps), "
        "post_local_hook) or ddp.register_comm_hook(None, local_hook), or average a model not wrapped in DDP"
    )


def order_ignored_by_caller(order: str | None, owner: str, *, depth: int = 6) -> str | None:
    """The warning text when ``order`` is ``"average_then_step"`` but torch's PostLocalSGDOptimizer drives the call.

    ``PostLocalSGDOptimizer.step`` always runs the optimizer step first and then
    ``averager.average_parameters``, so an averager built for the reference order silently runs the other
    one. Looks at the ``depth`` calling frames for a ``self`` that is such an optimizer; call it once.
    """
    if order != "average_then_step":
        return None
    # Not imported here (torch.distributed.optim takes seconds to import): a caller that is such an
    # optimizer has imported its module already.
    module = sys.modules.get("torch.distributed.optim.post_localSGD_optimizer")
    if module is None:
        return None
    frame: FrameType | None = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        if isinstance(frame.f_locals.get("self"), module.PostLocalSGDOptimizer):
            return (
                f"{owner} has order='average_then_step', but torch's PostLocalSGDOptimizer ignores it: it always "
                "runs optimizer.step() first and averages after it (step_then_average). Use "
                "wagma.AveragingOptimizer, which follows the averager's order, or build the averager with "
                "order='step_then_average' to say what runs"
            )
        frame = frame.f_back
    return None
