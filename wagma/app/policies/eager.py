"""eager-SGD as a policy: DDP with the partial-allreduce comm hook of :mod:`wagma.hooks.partial` (``eager_solo``,
``eager_majority``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from wagma.app.parallel import shard_model
from wagma.app.policies.averaging import averager_stats
from wagma.app.policies.base import Policy, ddp_without_buffer_sync, timeout
from wagma.app.policies.hsdp import replicate_world
from wagma.hooks.fsdp import FSDPPartialAllreduce
from wagma.hooks.partial import Late, Mode, PartialAllreduceState, partial_allreduce_hook
from wagma.wire import as_wire_dtype

__all__ = ["EagerPolicy"]


class EagerPolicy(Policy):
    """eager-SGD: DDP with the partial-allreduce comm hook of :mod:`wagma.hooks.partial`.

    ``wrap`` builds ``PartialAllreduceState(params, mode=..., sync_period=..., warmup_iters=..., seed=...,
    timeout=...)`` and registers it with ``ddp.register_comm_hook(state, partial_allreduce_hook)``;
    ``finalize`` is ``state.flush(optimizer)``: a blocking, fully fresh round that applies every gradient
    still in the residual buffers, after which the replicas agree. Under ``parallel=hsdp`` (:attr:`Policy.mesh` set)
    ``wrap`` shards the root alone over the ``shard`` dimension and the hook is :class:`wagma.FSDPPartialAllreduce`
    on the replicas (no ``overlap``, no ``transport``; a resume restores its rounds and residuals, so no gradient is
    lost, though which gradients make which round is not reproduced bit for bit).

    Args:
        device: where the model lives.
        mode: ``"solo"`` or ``"majority"``.
        sync_period: τ; a blocking fully fresh allreduce every τ rounds bounds staleness.
        warmup_iters: iterations of plain allreduce first (DDP rebuilds its buckets after the first).
        seed: seed of the shared initiator draw (majority).
        max_lead: rounds the hook's progress thread may run ahead of the backward passes
            (``None``: ``sync_period``; 0: every round waits for every rank's fresh gradient).
        overlap: apply round r's result at iteration r + 1, so its exchange overlaps that iteration
            (:class:`~wagma.PartialAllreduceState`'s ``overlap``).
        bucket_cap_mb: DDP's gradient bucket size.
        timeout_s: bound of every wait of the hook's engine.
        progress_nice: nice levels below the training thread for the hook's progress thread and its
            communicators' threads (CPU on Linux; :class:`~wagma.PartialAllreduceState`'s ``progress_nice``).
        transport: ``"default"`` or ``"shm"`` (CPU, one host: the rounds through shared memory;
            :class:`~wagma.PartialAllreduceState`'s ``transport``).
        wire_dtype: ``null``, ``bf16`` or ``fp16``: the dtype the partial rounds send gradients in, with error
            feedback (:mod:`wagma.wire`).
        late: ``"apply"`` or ``"lookahead"``: the backward passes run at ``w - lr * (mu + ... + mu**s) * v``
            (:class:`~wagma.PartialAllreduceState`'s and :class:`~wagma.FSDPPartialAllreduce`'s ``late``; the policy
            attaches the optimizer at its first ``before_step``, under ``parallel=ddp`` and ``parallel=hsdp``).
            ``"lookahead_local"`` (``overlap`` only, ``parallel=ddp``): also ahead by this rank's own gradient of
            the round in flight (``c_s`` steps of it for ``lookahead_rounds=s``).
        lookahead_rounds: ``s >= 1``, the rounds of delay the look-ahead covers (the hooks' ``lookahead_rounds``).
    """

    @property
    def remedy(self) -> str:  # type: ignore[override]  # the advice names the shipped preset unless this is it
        shipped = (self.mode, self.late, self.max_lead, self.lookahead_rounds) == ("solo", "lookahead_local", 0, 1)
        first = (
            ""
            if shipped
            else "averaging=eager_solo_overlap_lookahead_local (the eager preset that ships: every gradient one "
            "round late, computed where it will be applied), "
        )
        return (
            f"{first}averaging=wagma (model averaging takes stale information far better than late gradients), "
            "a smaller averaging.sync_period (more fully fresh rounds), or a lower optim.lr / optim.momentum"
        )

    def __init__(
        self,
        *,
        device: torch.device,
        mode: Mode,
        sync_period: int = 32,
        warmup_iters: int = 2,
        seed: int = 0,
        max_lead: int | None = None,
        overlap: bool = False,
        bucket_cap_mb: float = 25.0,
        timeout_s: float = 300.0,
        progress_nice: int = 0,
        transport: str = "default",
        wire_dtype: str | None = None,
        late: Late = "apply",
        lookahead_rounds: int = 1,
    ) -> None:
        # the preset's name (eager_solo_overlap, eager_solo_overlap_lookahead, eager_solo_overlap_lookahead_local);
        # a look-ahead's point is made for gradients max_lead + 1 rounds late: a max_lead above 0 is named (_lead1),
        # and so is a point more than one round ahead (_rounds2)
        self.name = f"eager_{mode}" + ("_overlap" if overlap else "") + ("" if late == "apply" else f"_{late}")
        if late != "apply" and max_lead:
            self.name += f"_lead{int(max_lead)}"
        if late != "apply" and lookahead_rounds != 1:
            self.name += f"_rounds{int(lookahead_rounds)}"
        self.late: Late = late
        self.lookahead_rounds = lookahead_rounds
        self.progress_nice = int(progress_nice)
        self.transport = str(transport)
        self.wire_dtype = as_wire_dtype(wire_dtype)
        self.device, self.mode = device, mode
        self.sync_period, self.warmup_iters, self.seed = int(sync_period), int(warmup_iters), int(seed)
        self.max_lead = None if max_lead is None else int(max_lead)
        self.overlap = bool(overlap)
        self.bucket_cap_mb, self.timeout_s = float(bucket_cap_mb), float(timeout_s)
        self.hook_state: Any = None
        self.steps_done = 0

    def wrap(self, model: nn.Module) -> nn.Module:
        if self.mesh is not None:  # HSDP: the root alone sharded in a replica; the FSDP hook sums across replicas
            shard_model(model, self.mesh["shard"], per_layer=False)
            self.hook_state = FSDPPartialAllreduce(
                model,
                world=replicate_world(self.mesh),
                mode=self.mode,
                sync_period=self.sync_period,
                warmup_iters=self.warmup_iters,
                seed=self.seed,
                max_lead=self.max_lead,
                timeout=timeout(self.timeout_s),
                progress_nice=self.progress_nice,
                wire_dtype=self.wire_dtype,
                late=self.late,
                lookahead_rounds=self.lookahead_rounds,
            )
            return model
        self.hook_state = PartialAllreduceState(
            list(model.parameters()),
            mode=self.mode,
            sync_period=self.sync_period,
            warmup_iters=self.warmup_iters,
            seed=self.seed,
            max_lead=self.max_lead,
            overlap=self.overlap,
            timeout=timeout(self.timeout_s),
            progress_nice=self.progress_nice,
            transport=self.transport,
            wire_dtype=self.wire_dtype,
            late=self.late,
            lookahead_rounds=self.lookahead_rounds,
        )
        ddp = ddp_without_buffer_sync(model, self.device, self.bucket_cap_mb)
        ddp.register_comm_hook(self.hook_state, partial_allreduce_hook)
        return ddp

    def before_step(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        self.hook_state.attach(optimizer)  # late="lookahead" hooks the optimizer once; otherwise nothing

    def after_step(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        self.steps_done = step + 1

    def finalize(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        assert self.hook_state is not None, "wrap() the model first"
        self.hook_state.flush(optimizer)

    def state_dict(self) -> dict[str, Any]:
        assert self.hook_state is not None, "wrap() the model first"
        return {"steps_done": self.steps_done, "hook": self.hook_state.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        assert self.hook_state is not None, "wrap() the model first"
        if state.get("hook") is None:
            raise ValueError(
                f"averaging={self.name} cannot resume: expected the hook's rounds and residuals in the checkpoint, "
                "found none (a checkpoint of parallel=hsdp from before FSDPPartialAllreduce had a state_dict); start "
                "afresh, or resume with another policy and resume_policy_change=true"
            )
        self.hook_state.load_state_dict(state["hook"])
        self.steps_done = int(state["steps_done"])

    def stats(self) -> dict[str, Any]:
        if self.hook_state is None:
            return {}
        if self.mesh is not None:  # the FSDP hook keeps an averager's counters
            stats = averager_stats(self.hook_state.stats) | {
                "rounds": self.hook_state.rounds,
                "iteration": self.hook_state.iteration,
            }
        else:
            stats = dict(self.hook_state.stats_dict())
        if "wait_s" in stats:  # the loop's wait_s is the whole step's; keep the hook's apart
            stats["comm_wait_s"] = stats.pop("wait_s")
        return {"global_reductions": 0, "local_reductions": 0, "staleness": 0.0} | stats

    def close(self) -> None:
        if self.hook_state is not None:
            self.hook_state.close()
