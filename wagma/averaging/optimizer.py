"""An optimizer wrapper that averages the model after every local step (like torch's ``PostLocalSGDOptimizer``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.algorithms.model_averaging.averagers import ModelAverager

__all__ = ["AveragingOptimizer"]


class AveragingOptimizer(torch.optim.Optimizer):
    """``step()`` runs the local optimizer, then ``averager.average_parameters(optimizer.param_groups)``.

    Unlike torch's ``PostLocalSGDOptimizer``, :meth:`state_dict` carries the averager's whole state
    (step, counters, momentum buffers), nested beside the optimizer's, and the module's buffers can be
    passed to the averager.

    Args:
        optimizer: the local optimizer (its ``param_groups`` are what gets averaged).
        averager: a wagma averager (or any torch ``ModelAverager`` with ``state_dict``/``load_state_dict``).
        module: if given, its buffers are passed to the averager at every step (averaged if the averager's
            ``average_buffers`` is on).
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, averager: ModelAverager, module: torch.nn.Module | None = None
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer: expected a torch.optim.Optimizer, found {type(optimizer).__name__}")
        if not isinstance(averager, ModelAverager) or not callable(getattr(averager, "state_dict", None)):
            raise ValueError(
                "averager: expected a ModelAverager with state_dict()/load_state_dict() (any wagma averager), "
                f"found {type(averager).__name__}"
            )
        if module is not None and not isinstance(module, torch.nn.Module):
            raise ValueError(f"module: expected a torch.nn.Module or None, found {type(module).__name__}")
        # torch.optim.Optimizer.__init__ is not called: the wrapped optimizer owns groups and state.
        self.optimizer = optimizer
        self.averager = averager
        self.module = module

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The wrapped optimizer's parameter groups."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The wrapped optimizer's per-parameter state."""
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's defaults."""
        return self.optimizer.defaults

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One local optimizer step and one averager step, in the averager's ``order``.

        Averagers with ``order == "average_then_step"`` (WAGMA's reference) average first, so the step
        applies the gradient computed at the local model to the average; all others step, then average. An
        averager with ``publish_after_step`` then publishes the stepped model at once (``averager.publish``).
        Returns the closure's loss, if any.
        """
        average_first = getattr(self.averager, "order", "step_then_average") == "average_then_step"
        if average_first:
            self._average()
        loss = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        if not average_first:
            self._average()
        elif getattr(self.averager, "publish_after_step", False):
            # The model after the step is the one the next call submits: publish it now (WagmaAverager.publish).
            buffers = self.module.buffers() if self.module is not None else None
            self.averager.publish(self.param_groups, buffers)  # type: ignore[attr-defined]
        return loss

    def _average(self) -> None:
        if self.module is not None:
            self.averager.average_parameters(self.param_groups, self.module.buffers())  # type: ignore[call-arg]
        else:
            self.averager.average_parameters(self.param_groups)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the wrapped optimizer's gradients."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group to the wrapped optimizer; it is averaged from the next step on.

        The averager is rebound to the new set of parameters (its ``bind``), so every rank must add the
        same group at the same step (for a :class:`~wagma.averaging.WagmaAverager` this is collective: its
        engines restart).
        """
        self.optimizer.add_param_group(param_group)
        bind = getattr(self.averager, "bind", None)
        if callable(bind):
            bind(self.param_groups, self.module.buffers() if self.module is not None else None)

    def state_dict(self) -> dict[str, Any]:
        """``{"optimizer": the optimizer's state_dict, "averager": the averager's state_dict}``."""
        averager_state = self.averager.state_dict()  # type: ignore[attr-defined]
        return {"optimizer": self.optimizer.state_dict(), "averager": averager_state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore both states from :meth:`state_dict` output.

        Raises:
            ValueError: if either key is missing (e.g. a plain optimizer checkpoint).
        """
        if set(state_dict) != {"optimizer", "averager"}:
            raise ValueError(
                f"state_dict: expected the keys ['averager', 'optimizer'], found {sorted(state_dict)}; "
                "load a plain optimizer checkpoint into .optimizer instead"
            )
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.averager.load_state_dict(state_dict["averager"])  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"AveragingOptimizer({self.optimizer!r}, {self.averager!r})"
