"""The seam where an averaging policy plugs into the training loop, the plain-DDP policy, and the DDP wrapper
the other policies share.

A :class:`Policy` decides how the ranks' replicas are kept in agreement: by averaging gradients in a
DDP comm hook (eager-SGD, plain allreduce), by averaging models after optimizer steps (WAGMA-SGD, K-AVG,
hierarchical averaging), or both. The loop in :mod:`wagma.app.train` knows nothing else about it.

Policies are registered by name in :mod:`wagma.app.policies` (the registry); ``allreduce``
(:class:`AllreducePolicy`, DDP's own bucketed allreduce) is defined here.
"""

from __future__ import annotations

import datetime
import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from wagma.app.parallel import shard_model
from wagma.checks import check_number
from wagma.hooks.basic import AllreduceState, allreduce_hook
from wagma.shm import check_transport
from wagma.wire import as_wire_dtype, wire_dtype_for, wire_dtype_name, wire_nbytes

__all__ = ["AllreducePolicy", "Policy", "ddp_without_buffer_sync", "timeout"]


class Policy:
    """How replicas are kept in agreement. The loop drives it in this order:

    1. ``model = policy.wrap(model)`` once, after the initial model was broadcast from rank 0 and before
       the optimizer is built (the optimizer gets the *unwrapped* module's parameters, which a wrapper
       shares). Return a DDP wrapper with or without a comm hook, or the module itself.
    2. ``policy.load_state_dict(state)`` when resuming, with what :meth:`state_dict` returned at the
       checkpoint.
    3. Every step ``step`` (0-based, counting optimizer steps of the whole run), after ``loss.backward()``
       on the wrapped model: ``policy.before_step(optimizer, step)``, ``optimizer.step()``,
       ``policy.after_step(optimizer, step)``. Model averaging goes in one of the two ("average then
       step" or "step then average"); gradient averaging lives in the comm hook installed by ``wrap``.
    4. ``policy.stats()`` whenever the loop logs: JSON-able numbers. The loop records ``global_reductions``
       (cumulative count of global averaging rounds) and ``staleness`` (rounds by which the latest
       contributions were old; 0 when synchronous) when present, and every other key as is.
    5. At the end: a checkpoint (with :meth:`state_dict`), then ``policy.finalize(model, optimizer)``
       (a final global average, or flushing outstanding rounds) before the test evaluation and the final
       model are taken, then ``policy.close()``. ``close`` is also called when training fails; it must
       stop any thread the policy started and be safe to call twice.

    Every rank builds its policy in the same order, so a policy may create process groups in its
    constructor (all ranks, same order); it must never create them lazily.
    """

    name: str = ""
    #: Under ``parallel=hsdp``: the job's ``("replicate", "shard")`` ``DeviceMesh``, set by
    #: :func:`wagma.app.policies.build_policy` before :meth:`wrap`; ``wrap`` then shards the model with FSDP2 and the
    #: policy runs on the world ``(mesh, "replicate")`` (:mod:`wagma.app.policies.hsdp`). ``None``: one full
    #: replica per rank.
    mesh: Any = None
    #: What to try when the run-time guard (:mod:`wagma.app.guard`) finds a run of this policy not learning or
    #: staler than validated; the end of its warning line ("try ...").
    remedy: str = ""

    def wrap(self, model: nn.Module) -> nn.Module:
        """Wrap the (broadcast) model for training; default: no wrapper."""
        return model

    def before_step(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Called after backward, before ``optimizer.step()``; default: nothing."""

    def after_step(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Called after ``optimizer.step()``; default: nothing."""

    def finalize(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Bring the replicas to the model to evaluate and keep; default: nothing."""

    def state_dict(self) -> dict[str, Any]:
        """Opaque state to checkpoint (counters, residuals, schedule position); default: empty.

        Plain containers, numbers, strings and tensors only: checkpoints load with ``weights_only=True``.
        """
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; default: nothing."""

    def stats(self) -> dict[str, Any]:
        """Counters for the metrics (see the class docstring); default: empty."""
        return {}

    def close(self) -> None:
        """Release threads and resources (idempotent); default: nothing."""


class AllreducePolicy(Policy):
    """Synchronous data parallelism: DDP's bucketed gradient allreduce, one global reduction per step."""

    name = "allreduce"
    remedy = "a lower optim.lr (synchronous SGD: nothing is stale)"

    def __init__(
        self,
        *,
        device: torch.device,
        bucket_cap_mb: float = 25.0,
        transport: str = "default",
        wire_dtype: str | None = None,
    ) -> None:
        """
        Args:
            device: where the model lives; a CUDA device is passed to DDP as its only device.
            bucket_cap_mb: DDP's gradient bucket size.
            transport: ``"default"`` (DDP's own allreduce) or ``"shm"``: CPU gradients of ranks on one host are
                averaged through shared memory (:func:`wagma.allreduce_hook` with a shared-memory
                :class:`wagma.AllreduceState`), as the wagma and eager policies' rounds are with ``"shm"``.
            wire_dtype: ``null``, ``bf16`` or ``fp16``: DDP's gradients travel in that dtype
                (:func:`wagma.allreduce_hook` with an :class:`wagma.AllreduceState`'s ``wire_dtype``; no error
                feedback).
        """
        self.device = device
        self.bucket_cap_mb = check_number("bucket_cap_mb", bucket_cap_mb, 0, above=True)
        self.transport = check_transport(transport, device)
        self.wire_dtype = as_wire_dtype(wire_dtype)
        if self.wire_dtype is not None and self.transport == "shm":
            raise ValueError(
                f"averaging.wire_dtype={wire_dtype}: expected null with averaging.transport=shm (shared memory moves "
                "no bytes over a wire), found both"
            )
        self.global_reductions = 0
        self.bytes_sent = 0
        self._step_nbytes = 0  # set by wrap() under DDP
        self.hook_state: AllreduceState | None = None

    def wrap(self, model: nn.Module) -> nn.Module:
        if self.mesh is not None:  # FSDP2's own HSDP: reduce-scatter in a replica, allreduce across replicas
            if self.wire_dtype is not None:
                raise ValueError(
                    "averaging.wire_dtype: expected null for allreduce under parallel=hsdp (FSDP2 reduces in the "
                    f"model's dtype here), found {wire_dtype_name(self.wire_dtype)}; a bf16 wire across replicas is "
                    "in averaging=wagma, local_sgd, hierarchical or the eager presets"
                )
            return shard_model(model, self.mesh)
        device_ids = [self.device] if self.device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=self.bucket_cap_mb, **_DDP_OPTIONS)
        if self.transport == "shm":
            self.hook_state = AllreduceState(transport="shm", params=list(model.parameters()))
            ddp.register_comm_hook(self.hook_state, allreduce_hook)
        elif self.wire_dtype is not None:
            self.hook_state = AllreduceState(wire_dtype=self.wire_dtype)
            ddp.register_comm_hook(self.hook_state, allreduce_hook)
        self._step_nbytes = sum(  # what one step's gradient allreduce hands to the collectives
            wire_nbytes(p.numel(), p.dtype, wire_dtype_for(self.wire_dtype, p.dtype))
            for p in model.parameters()
            if p.requires_grad
        )
        return ddp

    def after_step(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        self.global_reductions += 1  # the gradients of this step were allreduced inside backward()
        self.bytes_sent += self._step_nbytes

    def state_dict(self) -> dict[str, Any]:
        return {"global_reductions": self.global_reductions, "bytes_sent": self.bytes_sent}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.global_reductions = int(state["global_reductions"])
        self.bytes_sent = int(state.get("bytes_sent", 0))  # (checkpoints from before it was counted lack it)

    def stats(self) -> dict[str, Any]:
        return {"global_reductions": self.global_reductions, "bytes_sent": self.bytes_sent, "staleness": 0}

    def close(self) -> None:
        if self.hook_state is not None and self.hook_state.shm is not None:
            self.hook_state.shm.close()


def timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(seconds))


# torch >= 2.13 renamed DDP's per-forward buffer broadcast; older releases only know broadcast_buffers.
_NO_BUFFER_SYNC: dict[str, Any] = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False}
)


# The gradients are views of DDP's buckets: backward writes them there directly, and DDP copies nothing back.
_DDP_OPTIONS: dict[str, Any] = {"gradient_as_bucket_view": True}


def ddp_without_buffer_sync(model: nn.Module, device: torch.device, bucket_cap_mb: float) -> DistributedDataParallel:
    """DDP without the per-forward buffer broadcast (a global barrier every step)."""
    device_ids = [device] if device.type == "cuda" else None
    return DistributedDataParallel(
        model, device_ids=device_ids, bucket_cap_mb=bucket_cap_mb, **_NO_BUFFER_SYNC, **_DDP_OPTIONS
    )
