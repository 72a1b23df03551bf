"""The model-averaging policies: local optimizer steps, and an averager of :mod:`wagma.averaging` that brings
the models together around each step (``local_sgd``, ``hierarchical``, ``hierarchical_momentum``, ``wagma``,
and the gossip baselines).

They wrap the model in DDP with :func:`~wagma.hooks.post_local.post_local_hook`: gradients are allreduced
during an optional warm-up of synchronous SGD and not communicated afterwards, so every policy runs through
the same DDP code path and the replicas are identical when model averaging takes over. The gossip baselines
(``dpsgd``, ``sgp``, ``osgp``, ``adpsgd``: :class:`GossipPolicy`) run the same way with the averagers of
:mod:`wagma.averaging.gossip`. DDP's per-forward
buffer broadcast is off: it would otherwise broadcast buffers from rank 0 before every forward pass, a
global barrier each step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from wagma.app.parallel import shard_model
from wagma.app.policies.base import Policy, ddp_without_buffer_sync, timeout
from wagma.app.policies.hsdp import replicate_world
from wagma.averaging import (
    ADPSGDAverager,
    AveragerStats,
    DPSGDAverager,
    HierarchicalAverager,
    PeriodicAverager,
    ReductionMomentum,
    SGPAverager,
    WagmaAverager,
    flatten_parameters,
)
from wagma.averaging.gossip import Topology
from wagma.averaging.tensors import local_tensor
from wagma.averaging.wagma import Mixing, Order
from wagma.checks import check_choice
from wagma.engine import Sync
from wagma.hooks.post_local import PostLocalState, post_local_hook
from wagma.schedule import GroupSchedule
from wagma.wire import as_wire_dtype, wire_dtype_name

__all__ = [
    "GossipPolicy",
    "HierarchicalPolicy",
    "LocalSGDPolicy",
    "ModelAveragingPolicy",
    "WagmaPolicy",
    "averager_stats",
]


class _Averager(Protocol):
    """What :class:`ModelAveragingPolicy` needs of an averager (every wagma averager has it)."""

    @property
    def stats(self) -> AveragerStats: ...

    def average_parameters(self, params: Any, buffers: Any = None) -> Any: ...
    def synchronize(self, params: Any, buffers: Any = None) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


def named_parameters(net: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``net``'s parameters with their names, as a list (names make an averager's errors say which)."""
    return list(net.named_parameters())


def named_buffers(net: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``net``'s buffers with their names, as a list."""
    return list(net.named_buffers())


def averager_stats(stats: AveragerStats) -> dict[str, Any]:
    """An averager's counters as the metrics want them (flat numbers, plus the staleness histogram).

    ``staleness`` is the mean staleness (in rounds) of this rank's contributions so far, ``staleness_max``
    the largest, ``fresh_fraction`` the share of fresh ones (1.0 for synchronous averagers, which record
    no contributions: all of theirs are fresh). ``comm_wait_s`` is the averager's own blocking time (the
    loop's ``wait_s`` is the whole step's waiting, which includes it).
    """
    hist = {int(k): int(v) for k, v in stats.staleness_hist.items()}
    contributions = stats.fresh_contributions + stats.stale_contributions
    return {
        "global_reductions": stats.global_reductions,
        "local_reductions": stats.local_reductions,
        "bytes_sent": stats.bytes_sent,
        "comm_wait_s": stats.wait_s,
        "staleness": sum(k * v for k, v in hist.items()) / contributions if contributions else 0.0,
        "staleness_max": max(hist, default=0),
        "fresh_fraction": stats.fresh_contributions / contributions if contributions else 1.0,
        "staleness_hist": hist,
    }


class ModelAveragingPolicy(Policy):
    """Local optimizer steps on every rank; an averager brings the models together around each step.

    Subclasses say which averager (:meth:`build_averager`, called from :meth:`wrap`, i.e. on every rank in
    the same order, because averagers create their process groups when built). Each step the policy calls
    ``averager.average_parameters(model.named_parameters(), model.named_buffers())`` (names make a binding
    error name the parameters) once: in ``before_step`` when the
    averager's ``order`` is ``"average_then_step"`` (the gradient computed at w_t is applied to the
    average of w_t), else in ``after_step``. ``finalize`` calls ``averager.synchronize(...)`` unless the
    last step already ended with a global mean. Under ``parallel=hsdp`` (:attr:`Policy.mesh` set) ``wrap``
    shards the model with FSDP2 over the ``shard`` dimension instead of wrapping it in DDP, the averager runs on
    the world ``(mesh, "replicate")``, and a warm-up step allreduces the shard gradients over the replicas.

    Args:
        device: where the model lives (a CUDA device is DDP's only device).
        warmup_steps: steps of synchronous SGD (DDP gradient allreduce) before local steps begin.
        bucket_cap_mb: DDP's gradient bucket size (used by the warm-up allreduce).
        timeout_s: timeout of the averager's process groups.
        wire_dtype: ``null`` (the model's dtype), ``bf16`` or ``fp16``: what the averager's reductions send.
    """

    remedy = "more frequent averaging (a smaller averaging.period, local_period or global_period) or a lower optim.lr"

    def __init__(
        self,
        *,
        device: torch.device,
        warmup_steps: int = 0,
        bucket_cap_mb: float = 25.0,
        timeout_s: float = 300.0,
        wire_dtype: str | None = None,
    ) -> None:
        self.device = device
        #: The dtype the averager's reductions send (``averaging.wire_dtype``; :mod:`wagma.wire`).
        self.wire_dtype = as_wire_dtype(wire_dtype)
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.timeout_s = float(timeout_s)
        self.hook_state = PostLocalState(warmup_steps)
        self.averager: _Averager | None = None
        self.steps_done = 0
        self._net: nn.Module | None = None

    def build_averager(self, net: nn.Module) -> _Averager:
        """Create the averager for ``net`` (collective: every rank, same order)."""
        raise NotImplementedError

    @property
    def average_before_step(self) -> bool:
        """Whether averaging runs before ``optimizer.step()`` (the averager's ``order``)."""
        return getattr(self.averager, "order", "step_then_average") == "average_then_step"

    @property
    def world(self) -> Any:
        """The averager's world: ``(mesh, "replicate")`` under ``parallel=hsdp``, else ``None`` (the whole job)."""
        return replicate_world(self.mesh)

    def wrap(self, model: nn.Module) -> nn.Module:
        self._net = model
        if self.mesh is not None:  # HSDP: FSDP2 inside a replica; the averager averages shards across replicas
            shard_model(model, self.mesh["shard"])
            self.averager = self.build_averager(model)
            return model
        # One flat storage for the parameters and buffers, in the order the averager binds them: its rounds then
        # average that memory in place instead of copying the model into a flat buffer and back.
        flatten_parameters(model)
        self.averager = self.build_averager(model)
        ddp = ddp_without_buffer_sync(model, self.device, self.bucket_cap_mb)
        ddp.register_comm_hook(self.hook_state, post_local_hook)
        return ddp

    def _average(self) -> None:
        assert self.averager is not None and self._net is not None, "wrap() the model first"
        self.averager.average_parameters(self._net.named_parameters(), self._net.named_buffers())

    def before_step(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        if self.mesh is not None and step < self.hook_state.warmup_steps:
            self._warmup_allreduce()
        if self.average_before_step:
            self._average()

    @torch.no_grad()
    def _warmup_allreduce(self) -> None:
        """HSDP's warm-up step: average the shard gradients over the replicas (as the DDP hook's warm-up does)."""
        assert self._net is not None and self.mesh is not None
        group = self.mesh.get_group("replicate")
        replicas = dist.get_world_size(group)
        for param in self._net.parameters():
            if param.grad is not None:
                grad = local_tensor(param.grad)
                dist.all_reduce(grad, group=group)
                grad.div_(replicas)

    def after_step(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        if not self.average_before_step:
            self._average()
        elif getattr(self.averager, "publish_after_step", False):  # WagmaAverager.publish: the stepped model
            assert self.averager is not None and self._net is not None
            self.averager.publish(self._net.named_parameters(), self._net.named_buffers())  # type: ignore[attr-defined]
        self.steps_done = step + 1
        self.hook_state.step = self.steps_done

    def finalize(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        assert self.averager is not None and self._net is not None, "wrap() the model first"
        ended_global = not self.average_before_step and getattr(self.averager, "last_reduction", None) == "global"
        if not ended_global:
            self.averager.synchronize(self._net.named_parameters(), self._net.named_buffers())

    def state_dict(self) -> dict[str, Any]:
        assert self.averager is not None, "wrap() the model first"
        return {"steps_done": self.steps_done, "averager": self.averager.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        assert self.averager is not None, "wrap() the model first"
        self.averager.load_state_dict(dict(state["averager"]))
        self.steps_done = int(state["steps_done"])
        self.hook_state.step = self.steps_done

    def stats(self) -> dict[str, Any]:
        return averager_stats(self.averager.stats) if self.averager is not None else {}

    def close(self) -> None:
        if self.averager is not None:
            self.averager.close()


class LocalSGDPolicy(ModelAveragingPolicy):
    """K-AVG / local SGD: :class:`~wagma.averaging.PeriodicAverager` after every step.

    The call of step ``s`` averages globally iff ``s >= warmup_steps`` and ``(s - warmup_steps) % period
    == 0`` (torch's ``PeriodicModelAverager`` semantics), so ``steps`` steps without warm-up run
    ``ceil(steps / period)`` global reductions.

    Args:
        period: steps between global means (K).
        average_buffers: also average floating-point buffers.
        **kwargs: see :class:`ModelAveragingPolicy`.
    """

    name = "local_sgd"

    def __init__(self, *, period: int, average_buffers: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.period = int(period)
        self.average_buffers = bool(average_buffers)

    def build_averager(self, net: nn.Module) -> _Averager:
        return PeriodicAverager(
            self.period,
            self.hook_state.warmup_steps,
            average_buffers=self.average_buffers,
            timeout=timeout(self.timeout_s),
            world=self.world,
            wire_dtype=self.wire_dtype,
        )


class HierarchicalPolicy(ModelAveragingPolicy):
    """Local means in fixed groups, global means less often; optionally with reduction momentum.

    Args:
        local_group_size: ranks per local group (contiguous ranks: node-local under torchrun).
        local_period: steps between local means.
        global_period: steps between global means (a multiple of ``local_period``).
        momentum: reduction momentum μ in [0, 1); ``None`` for plain averaging.
        lr: outer learning rate of the momentum update.
        nesterov: Nesterov form of the momentum update.
        apply_to: ``"global"`` (momentum at global reductions only) or ``"all"``.
        average_buffers: also average floating-point buffers.
        **kwargs: see :class:`ModelAveragingPolicy`.
    """

    name = "hierarchical"

    def __init__(
        self,
        *,
        local_group_size: int,
        local_period: int,
        global_period: int,
        momentum: float | None = None,
        lr: float = 1.0,
        nesterov: bool = False,
        apply_to: str = "global",
        average_buffers: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.local_group_size, self.local_period, self.global_period = local_group_size, local_period, global_period
        self.momentum, self.lr, self.nesterov, self.apply_to = momentum, lr, nesterov, apply_to
        self.average_buffers = bool(average_buffers)
        if momentum is not None:
            self.name = "hierarchical_momentum"

    def build_averager(self, net: nn.Module) -> _Averager:
        averager = HierarchicalAverager(
            self.local_group_size,
            self.local_period,
            self.global_period,
            self.hook_state.warmup_steps,
            average_buffers=self.average_buffers,
            timeout=timeout(self.timeout_s),
            world=self.world,
            wire_dtype=self.wire_dtype,
        )
        if self.momentum is None:
            return averager
        return ReductionMomentum(
            averager,
            float(self.momentum),
            float(self.lr),
            self.nesterov,
            self.apply_to,  # type: ignore[arg-type]
        )


class WagmaPolicy(ModelAveragingPolicy):
    """WAGMA-SGD: wait-avoiding group model averaging with :class:`~wagma.averaging.WagmaAverager`.

    No gradient communication (DDP with the post-local hook and no warm-up). With ``order=
    "average_then_step"`` (the reference) the round runs in ``before_step``: the gradient computed at w_t
    is applied by the optimizer to the group average of w_t; with ``"step_then_average"`` it runs in
    ``after_step``. ``finalize`` is ``averager.synchronize`` (a blocking global mean after the last round).

    Args:
        group_size: ranks per averaging group S.
        sync_period: τ; every (τ+1)-th round is a global mean (a sync round).
        sync: how sync rounds run (:data:`wagma.app.policies.options.WAGMA_SYNCS`): ``"barrier"`` (blocking,
            fresh models) or ``"wait_avoiding"`` (triggered by the first arrival; staleness <= ``max_lead``).
        schedule: ``"auto"``, ``"butterfly"``, ``"mixed_radix"`` or explicit partitions (list of rounds,
            each a list of groups of ranks).
        mixing: how a round combines models (:data:`wagma.app.policies.options.WAGMA_MIXINGS`).
        order: :data:`wagma.app.policies.options.ORDERS`.
        average_buffers: also average floating-point buffers.
        max_lead: rounds the progress thread may run ahead of the main thread (``None``: the averager's
            default).
        overlap: apply each group round's result one step later, so its exchange overlaps the next step
            (:class:`~wagma.averaging.WagmaAverager`'s ``overlap``).
        progress_nice: nice levels below the training thread for the progress threads and their communicators'
            threads (CPU on Linux; :class:`~wagma.averaging.WagmaAverager`'s ``progress_nice``).
        transport: ``"default"`` or ``"shm"`` (CPU, one host: the group rounds through shared memory;
            :class:`~wagma.averaging.WagmaAverager`'s ``transport``).
        publish_after_step: publish the model right after each optimizer step, so a rank late for a round takes
            part with its current model (:class:`~wagma.averaging.WagmaAverager`'s ``publish_after_step``).
        **kwargs: ``device``, ``bucket_cap_mb``, ``timeout_s`` (see :class:`ModelAveragingPolicy`).
    """

    name = "wagma"
    remedy = (
        "averaging=wagma (barrier sync rounds, no overlap), a smaller averaging.sync_period or averaging.max_lead, "
        "or a lower optim.lr"
    )

    def __init__(
        self,
        *,
        group_size: int,
        sync_period: int,
        schedule: str | list[Any] = "auto",
        mixing: Mixing = "reference",
        order: Order = "average_then_step",
        average_buffers: bool = True,
        max_lead: int | None = None,
        sync: Sync = "barrier",
        overlap: bool = False,
        progress_nice: int = 0,
        transport: str = "default",
        publish_after_step: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(warmup_steps=0, **kwargs)
        self.transport = str(transport)
        self.group_size, self.sync_period = int(group_size), int(sync_period)
        self.schedule, self.mixing, self.order = schedule, mixing, order
        self.average_buffers, self.max_lead = bool(average_buffers), max_lead
        self.sync = sync
        self.overlap = bool(overlap)
        self.publish_after_step = bool(publish_after_step)
        self.progress_nice = int(progress_nice)
        # The preset's name: wagma, wagma_relaxed, wagma_overlap, wagma_relaxed_overlap, wagma_ahead_conserve (and,
        # with publish_after_step set by hand, wagma_ahead, wagma_relaxed_ahead, ...).
        ahead = "_ahead" + ("_conserve" if mixing == "conserve" else "") if self.publish_after_step else ""
        self.name = (
            "wagma" + ("_relaxed" if sync == "wait_avoiding" else "") + ("_overlap" if self.overlap else "") + ahead
        )

    def build_averager(self, net: nn.Module) -> _Averager:
        schedule: str | GroupSchedule = (
            self.schedule if isinstance(self.schedule, str) else GroupSchedule(self.schedule, name="custom")
        )
        return WagmaAverager(
            self.group_size,
            self.sync_period,
            params=named_parameters(net),
            buffers=named_buffers(net) if self.average_buffers else None,
            schedule=schedule,
            mixing=self.mixing,
            order=self.order,
            average_buffers=self.average_buffers,
            max_lead=self.max_lead,
            sync=self.sync,
            overlap=self.overlap,
            timeout=timeout(self.timeout_s),
            progress_nice=self.progress_nice,
            transport=self.transport,
            world=self.world,
            wire_dtype=self.wire_dtype,
            publish_after_step=self.publish_after_step,
        )

    def finalize(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        assert self.averager is not None and self._net is not None, "wrap() the model first"
        self.averager.synchronize(self._net.named_parameters(), self._net.named_buffers())


class GossipPolicy(ModelAveragingPolicy):
    """The decentralized baselines: D-PSGD (``dpsgd``), SGP (``sgp``), OSGP (``osgp``) and AD-PSGD (``adpsgd``).

    Local optimizer steps (DDP with the post-local hook), then one gossip round per step with
    :class:`~wagma.averaging.DPSGDAverager` or :class:`~wagma.averaging.SGPAverager` (``overlap=True`` for
    OSGP); AD-PSGD's :class:`~wagma.averaging.ADPSGDAverager` exchanges on its progress thread and the step only
    adds what finished. ``finalize`` is the averager's ``synchronize``: a blocking global average after the last
    round (for push-sum, Σx / Σw with the round in flight collected), so the evaluated model is the consensus.

    Args:
        kind: ``"dpsgd"``, ``"sgp"``, ``"osgp"`` or ``"adpsgd"``.
        topology: D-PSGD's graph, ``"ring"`` or ``"exponential"`` (ignored by SGP / OSGP).
        average_buffers: also average floating-point buffers.
        **kwargs: ``device``, ``warmup_steps``, ``bucket_cap_mb``, ``timeout_s`` (see :class:`ModelAveragingPolicy`).
    """

    remedy = "a smaller optim.lr, or a policy with global averages (averaging=wagma or local_sgd)"
    KINDS: tuple[str, ...] = ("dpsgd", "sgp", "osgp", "adpsgd")

    def __init__(self, *, kind: str, topology: Topology = "ring", average_buffers: bool = True, **kwargs: Any) -> None:
        check_choice("kind", kind, self.KINDS)
        super().__init__(**kwargs)
        if self.wire_dtype is not None:
            raise ValueError(
                f"averaging.wire_dtype: the gossip baseline {kind} sends its models in their own dtype; expected null, "
                f"found {wire_dtype_name(self.wire_dtype)} (a compressed wire is for wagma, local_sgd, hierarchical, "
                "allreduce and the eager presets)"
            )
        self.name = kind
        self.topology: Topology = topology
        self.average_buffers = bool(average_buffers)

    def build_averager(self, net: nn.Module) -> _Averager:
        if self.name == "dpsgd":
            return DPSGDAverager(
                self.topology,
                self.hook_state.warmup_steps,
                average_buffers=self.average_buffers,
                timeout=timeout(self.timeout_s),
                world=self.world,
            )
        if self.name == "adpsgd":
            return ADPSGDAverager(
                self.hook_state.warmup_steps,
                average_buffers=self.average_buffers,
                timeout=timeout(self.timeout_s),
                world=self.world,
            )
        return SGPAverager(
            self.name == "osgp",
            self.hook_state.warmup_steps,
            average_buffers=self.average_buffers,
            timeout=timeout(self.timeout_s),
            world=self.world,
        )

    def finalize(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        assert self.averager is not None and self._net is not None, "wrap() the model first"
        self.averager.synchronize(self._net.named_parameters(), self._net.named_buffers())
