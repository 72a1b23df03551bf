"""A process group for DDP under a wait-avoiding hook: DDP's own per-iteration allreduce stays local.

With ``find_unused_parameters=True`` DDP allreduces a map of the parameters each rank used, on its
process group, at the end of every backward pass: every rank waits for the slowest one, whatever the
comm hook does. :class:`LocalUsedMapGroup` answers that allreduce at once with the local map and
delegates everything else DDP does on its group (the broadcast of the initial model and of buffers, the
shape check's allgather) to a real group. DDP then treats a parameter this rank did not use as unused
everywhere and leaves its ``.grad`` alone; the hook (:class:`~wagma.hooks.partial.PartialAllreduceState`)
therefore writes every parameter's ``.grad`` itself, after DDP's finalizer.

Only for DDP instances whose gradients go through such a hook: without one, DDP's gradient allreduce
would also be answered locally.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future  # type: ignore[attr-defined]

__all__ = ["LocalUsedMapGroup"]


def _completed_work(result: Any) -> Any:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(result)
    return _create_work_from_future(future)


class LocalUsedMapGroup(dist.ProcessGroup):
    """``allreduce`` returns its input unchanged at once; ``broadcast`` and ``allgather`` use ``real``.

    Args:
        real: the group DDP's broadcasts and allgathers run on (its collectives must be issued by the
            main thread only, as DDP does).
    """

    def __init__(self, real: dist.ProcessGroup) -> None:
        if not isinstance(real, dist.ProcessGroup):
            raise ValueError(f"real: expected a torch.distributed.ProcessGroup, found {type(real).__name__}")
        super().__init__(real.rank(), real.size())  # type: ignore[call-arg]  # the stubs list the store form only
        self._real = real

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:  # type: ignore[override]
        """DDP's used-parameter map: kept local (no communication, no wait)."""
        return _completed_work(tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:  # type: ignore[override]
        return self._real.broadcast(tensors, opts)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> Any:  # type: ignore[override]
        return self._real.allgather(outputs, inputs, opts)

    def size(self) -> int:
        return self._real.size()

    def getBackendName(self) -> str:
        return "wagma-local-used-map"
