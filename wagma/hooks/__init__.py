"""DDP communication hooks by name, so a config can pick one (``hooks.get("group_allreduce")``).

Each name maps to ``(hook, state_factory)``: build the state on every rank (factories that create
process groups are collective) and register both with DDP::

    hook, make_state = wagma.hooks.get("group_allreduce")
    ddp_model.register_comm_hook(make_state(group_size=4), hook)

Built in: ``"allreduce"`` (:func:`allreduce_hook`, :class:`AllreduceState`), ``"group_allreduce"``
(:func:`group_allreduce_hook`, :class:`GroupAllreduceState`) and ``"local"`` (:func:`local_hook`, no state).
Other modules add theirs with :func:`register`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from wagma.checks import fail
from wagma.hooks.basic import (
    AllreduceState,
    GroupAllreduceState,
    allreduce_hook,
    group_allreduce_hook,
    local_hook,
    no_state,
)

__all__ = [
    "AllreduceState",
    "GroupAllreduceState",
    "HookFn",
    "StateFactory",
    "allreduce_hook",
    "available",
    "get",
    "group_allreduce_hook",
    "local_hook",
    "no_state",
    "register",
]

#: A DDP communication hook: ``hook(state, bucket) -> Future[Tensor]``.
HookFn = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]
#: Builds a hook's state from keyword arguments (collective if it creates process groups).
StateFactory = Callable[..., Any]

_REGISTRY: dict[str, tuple[HookFn, StateFactory]] = {}


def register(name: str, hook: HookFn, state_factory: StateFactory, *, replace: bool = False) -> None:
    """Make ``hook`` and its ``state_factory`` available as ``name``.

    Args:
        name: the registry key (what configs name).
        hook: the hook function.
        state_factory: called with keyword arguments to build the hook's state.
        replace: allow overwriting an existing name.

    Raises:
        ValueError: for an empty name, a non-callable hook or factory, or a taken name without ``replace``.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: expected a non-empty string, found {name!r}")
    if not callable(hook) or not callable(state_factory):
        raise ValueError(
            f"hook and state_factory: expected callables, found {type(hook).__name__} and "
            f"{type(state_factory).__name__}"
        )
    if name in _REGISTRY and not replace:
        raise ValueError(f"name: expected a new hook name, found {name!r} already registered (pass replace=True)")
    _REGISTRY[name] = (hook, state_factory)


def get(name: str) -> tuple[HookFn, StateFactory]:
    """The ``(hook, state_factory)`` registered as ``name``.

    Raises:
        ValueError: for an unknown name, listing the known ones.
    """
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise fail("hook name", f"one of {available()}", name) from None


def available() -> list[str]:
    """The registered hook names, sorted."""
    return sorted(_REGISTRY)


register("allreduce", allreduce_hook, AllreduceState)
register("group_allreduce", group_allreduce_hook, GroupAllreduceState)
register("local", local_hook, no_state)

# eager-SGD partial allreduce (imported last: it builds on the averaging base and the engine).
import functools  # noqa: E402

from wagma.hooks.partial import PartialAllreduceState, partial_allreduce_hook  # noqa: E402

register("partial_solo", partial_allreduce_hook, functools.partial(PartialAllreduceState, mode="solo"))
register("partial_majority", partial_allreduce_hook, functools.partial(PartialAllreduceState, mode="majority"))
__all__ += ["PartialAllreduceState", "partial_allreduce_hook"]
