"""Consensus distance: how far the ranks' models are from their mean, (1/P) Σ_i ‖w_i − w̄‖².

Model-averaging policies let replicas drift apart between reductions; this number says by how much (it
is 0 right after a global average and grows between them). :class:`ConsensusMeter` computes it with two
allreduces on a process group of its own, created up front (never DDP's, never a policy's): one of the
flattened parameters (for w̄) and one of this rank's squared distance. Sums run in float64 so identical
replicas give exactly 0 for any world size whose mean is exact, and tiny distances are not lost.

It is a collective over all ranks: every rank must call :meth:`ConsensusMeter.measure` at the same steps.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from wagma.averaging.tensors import local_tensor
from wagma.groups import destroy_groups, new_timeout_group, require_initialized

__all__ = ["ConsensusMeter"]


class ConsensusMeter:
    """Measures the consensus distance of a set of parameters over all ranks.

    Construct it on every rank, in the same order relative to other group creations (it creates a
    process group). Call :meth:`close` (or use it as a context manager) to release the group.

    Args:
        timeout: timeout of the meter's process group.
        mesh: under ``parallel=hsdp`` the ``("replicate", "shard")`` mesh: the distance is then between the
            replicas' models, (1/R) Σ_r ‖w_r − w̄‖², summed shard by shard (``params`` are sharded ``DTensor``s).
    """

    def __init__(self, timeout: datetime.timedelta = datetime.timedelta(minutes=5), *, mesh: Any = None) -> None:
        require_initialized(type(self).__name__)
        self.world_size = dist.get_world_size()
        self._group: dist.ProcessGroup | None = new_timeout_group(None, timeout) if self.world_size > 1 else None
        # Under HSDP the models are the replicas: shard j is compared with shard j of the other replicas (their
        # mean over the mesh's replicate group), and the squared distances of all shards add up over the job.
        self._replicas: dist.ProcessGroup | None = None if mesh is None else mesh.get_group("replicate")
        self.replicas = self.world_size if self._replicas is None else dist.get_world_size(self._replicas)
        self._closed = False

    @torch.no_grad()
    def measure(self, params: Iterable[torch.Tensor]) -> float:
        """(1/P) Σ_i ‖w_i − w̄‖² of ``params`` (collective: every rank calls it with the same shapes)."""
        if self._closed:
            raise RuntimeError("ConsensusMeter is closed: build a new one to keep measuring")
        tensors = [local_tensor(p).detach().reshape(-1) for p in params]
        if not tensors:
            raise ValueError("params: expected at least one tensor to measure")
        flat = torch.cat([t.to(torch.float64) for t in tensors])
        if self._group is None:
            return 0.0
        mean = flat.clone()
        dist.all_reduce(mean, group=self._group if self._replicas is None else self._replicas)
        mean.div_(self.replicas)
        squared = (flat - mean).square().sum().reshape(1)
        dist.all_reduce(squared, group=self._group)
        return float(squared.item()) / self.replicas

    def close(self) -> None:
        """Destroy the meter's process group (idempotent)."""
        self._closed = True
        group, self._group = self._group, None
        destroy_groups([group])

    def __enter__(self) -> ConsensusMeter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
