"""What every framework adapter shares: the lazy import, the averaging step in the averager's order, the checks.

Nothing here imports a framework.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from wagma.hooks.post_local import PostLocalState

__all__ = [
    "AveragingStep",
    "build",
    "ddp_hook",
    "check_unsharded",
    "close_quietly",
    "require",
    "to_cpu",
]


def require(module: str, extra: str, what: str) -> ModuleType:
    """Import ``module``; if that fails, raise one line saying why and naming the extra that installs it.

    Raises:
        ModuleNotFoundError: ``module`` is not installed:
            ``wagma.integrations.<extra> needs <what> (<module> is not installed): pip install "wagma[<extra>]"``
            (so that ``pytest.importorskip`` skips).
        ImportError: ``module`` is installed but its own import failed (a dependency of it is missing or broken):
            the message names ``module`` and the underlying error.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
        if missing is not None and missing.split(".")[0] == module.split(".")[0]:
            raise ModuleNotFoundError(
                f'wagma.integrations.{extra} needs {what} ({module} is not installed): pip install "wagma[{extra}]"',
                name=module,
            ) from exc
        raise ImportError(
            f"wagma.integrations.{extra} needs {what}: {module} is installed but importing it failed ({exc}); "
            f'pip install "wagma[{extra}]" installs what it needs'
        ) from exc


def build(factory: Any, module: torch.nn.Module, what: str) -> Any:
    """``factory(module)`` if ``factory`` is callable and not already built, else ``factory`` itself.

    Hook states and averagers create process groups, so the adapters take factories and call them once the
    framework has initialised ``torch.distributed`` (on every rank, in the same order).
    """
    if factory is None:
        return None
    if isinstance(factory, type) or not callable(factory) or hasattr(factory, "average_parameters"):
        return factory
    built = factory(module)
    if built is None:
        raise ValueError(f"{what}: expected the factory to return an object, found None")
    return built


def ddp_hook(hook: Any) -> Any:
    """``hook`` as ``DistributedDataParallel.register_comm_hook`` takes it.

    DDP (and Lightning's logging) read the hook's ``__name__``, which a ``functools.partial`` lacks: a partial is
    copied with the name of the function it wraps (still a partial, so wagma's guard rails see through it).

    Raises:
        ValueError: ``hook`` is not callable.
    """
    if hook is None:
        return None
    if not callable(hook):
        raise ValueError(f"comm_hook: expected a callable hook(state, bucket), found {type(hook).__name__}")
    if isinstance(hook, functools.partial) and not hasattr(hook, "__name__"):
        inner = hook.func
        while isinstance(inner, functools.partial):
            inner = inner.func
        named = functools.partial(hook.func, *hook.args, **hook.keywords)
        named.__name__ = getattr(inner, "__name__", "hook")  # type: ignore[attr-defined]
        named.__qualname__ = getattr(inner, "__qualname__", named.__name__)  # type: ignore[attr-defined]
        return named
    return hook


def check_unsharded(module: torch.nn.Module, framework: str, alternative: str) -> None:
    """Refuse a DDP comm hook on a model whose parameters are FSDP2 shards (``DTensor``): DDP never wraps it.

    Raises:
        ValueError: naming the combination and ``alternative``.
    """
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return
    sharded = [n for n, p in module.named_parameters() if isinstance(p, DTensor)]
    if sharded:
        raise ValueError(
            f"a wagma DDP comm hook with {framework} on a sharded model (parameter {sharded[0]!r} is a DTensor): "
            f"DDP comm hooks need an unsharded DDP model; {alternative}"
        )


def to_cpu(obj: Any) -> Any:
    """A copy of a nested state (dicts, lists, tuples) with every tensor on the CPU, for pickling across ranks."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def close_quietly(*objects: Any) -> None:
    """``close()`` every object that has one (hook states, averagers)."""
    for obj in objects:
        close = getattr(obj, "close", None)
        if callable(close):
            close()


def gather_states(state: Any) -> list[Any] | None:
    """Every rank's ``state`` on rank 0 (``None`` elsewhere); ``[state]`` without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return [state]
    world = dist.get_world_size()
    out: list[Any] | None = [None] * world if dist.get_rank() == 0 else None
    dist.gather_object(state, out, dst=0)
    return out


class AveragingStep:
    """The averager's step around a framework's optimizer step, in the averager's ``order``.

    Frameworks call the optimizer as ``optimizer.step(closure)`` or ``optimizer.step()`` after the backward pass.
    ``order == "average_then_step"`` (WAGMA's reference) averages after the backward pass and before the step, so
    the gradient computed at the local model is applied to the average; every other averager steps, then averages.
    A :class:`~wagma.PostLocalState` hook state has its ``step`` advanced after every step.

    Args:
        averager: a wagma averager (or ``None``: only the hook state's step is kept).
        module: the unwrapped model, whose buffers are passed to the averager.
        hook_state: the registered hook's state, or ``None``.
    """

    def __init__(self, averager: Any, module: torch.nn.Module, hook_state: Any = None) -> None:
        self.averager = averager
        self.module = module
        self.hook_state = hook_state
        self.average_first = getattr(averager, "order", "step_then_average") == "average_then_step"
        self.takes_buffers = (
            averager is not None and "buffers" in inspect.signature(averager.average_parameters).parameters
        )
        self.steps = 0

    def before_step(self, param_groups: Iterable[dict[str, Any]]) -> None:
        """Call after the backward pass, before the optimizer step."""
        if self.averager is not None and self.average_first:
            self._average(list(param_groups))

    def after_step(self, param_groups: Iterable[dict[str, Any]]) -> None:
        """Call after the optimizer step."""
        groups = list(param_groups)
        if self.averager is not None:
            if not self.average_first:
                self._average(groups)
            elif getattr(self.averager, "publish_after_step", False):
                self.averager.publish(groups, self.module.buffers())
        self.steps += 1
        if isinstance(self.hook_state, PostLocalState):
            self.hook_state.step = self.steps

    def wrap_closure(self, closure: Callable[[], Any] | None, param_groups: list[dict[str, Any]]) -> Any:
        """``closure`` followed by :meth:`before_step`, for optimizers that run the closure inside ``step``."""
        if closure is None:
            return None

        def run() -> Any:
            loss = closure()
            self.before_step(param_groups)
            return loss

        return run

    def _average(self, groups: list[dict[str, Any]]) -> None:
        if self.takes_buffers:
            self.averager.average_parameters(groups, self.module.buffers())
        else:  # a torch ModelAverager: parameters only
            self.averager.average_parameters(groups)

    def state_dict(self) -> dict[str, Any]:
        """The step count (for :class:`~wagma.PostLocalState`) and the averager's state."""
        out: dict[str, Any] = {"steps": self.steps}
        if self.averager is not None:
            out["averager"] = self.averager.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.steps = int(state["steps"])
        if isinstance(self.hook_state, PostLocalState):
            self.hook_state.step = self.steps
        if self.averager is not None:
            if "averager" not in state:
                raise ValueError("state: expected an 'averager' entry (saved with an averager), found none")
            self.averager.load_state_dict(state["averager"])
