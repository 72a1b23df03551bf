"""Lightning: :class:`WagmaDDPStrategy`, DDP with any wagma comm hook and any wagma averager, on CPU and GPU.

Lightning's own ``DDPStrategy(ddp_comm_hook=...)`` registers the hook only when the root device is CUDA (on CPU
it is skipped without a word), logs the hook's ``__qualname__`` (which a ``functools.partial`` lacks), and runs
no averager but torch's ``PeriodicModelAverager``. This strategy registers the hook itself on every device, runs
a wagma averager after the optimizer step (or between the backward pass and the step, for
``order="average_then_step"``), and keeps every rank's averager, hook state, model and optimizer state in
Lightning's checkpoint, so a resumed run continues where the saved one stopped::

    from wagma import PeriodicAverager
    from wagma.integrations.lightning import WagmaDDPStrategy

    strategy = WagmaDDPStrategy(averager=lambda module: PeriodicAverager(period=4, timeout=60.0),
                                process_group_backend="gloo")
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=2)

Hook states and averagers create process groups, so they are given as factories ``f(module)`` (the
LightningModule), called on every rank once the process group exists.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from wagma.hooks.basic import local_hook
from wagma.integrations._common import (
    AveragingStep,
    build,
    check_unsharded,
    close_quietly,
    ddp_hook,
    gather_states,
    require,
    to_cpu,
)

require("lightning", "lightning", "Lightning")

from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

__all__ = ["WagmaDDPStrategy"]

#: The key of wagma's entry in a Lightning checkpoint.
CHECKPOINT_KEY = "wagma"


class WagmaDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` with a wagma DDP comm hook and a wagma averager, on CPU and CUDA alike.

    Args:
        comm_hook: a DDP comm hook ``hook(state, bucket)`` (``partial_allreduce_hook``, ``post_local_hook``,
            ``allreduce_hook``, a ``functools.partial`` of one, or any other); registered on the DDP model right
            after Lightning wraps it, on every device type. ``None`` with an averager: ``local_hook`` (no gradient
            traffic: the averager averages the models); ``None`` without one: DDP's own allreduce.
        comm_state: the hook's state, or a factory ``f(module) -> state`` called after the process group exists
            (``lambda m: PartialAllreduceState(m.parameters(), mode="solo", timeout=60.0)``).
        averager: a factory ``f(module) -> averager`` (any wagma averager), called on every rank in ``setup``;
            it runs at every optimizer step in its ``order``.
        synchronize_at_end: at the end of ``fit``, a blocking global average of the models (the averager's
            ``synchronize``), so every replica leaves training identical (for evaluation and the final save).
        save_replicas: keep every rank's model and optimizer state in the checkpoint (rank 0 writes them all),
            so a resume is exact where the replicas differ (between the averages of a model-averaging policy).
            ``False`` keeps only the averagers' and hooks' states: every rank then resumes from rank 0's model.
        **kwargs: ``DDPStrategy``'s own arguments (``process_group_backend``, ``timeout``, DDP's keyword
            arguments). Its ``ddp_comm_hook``, ``ddp_comm_state``, ``ddp_comm_wrapper`` and
            ``model_averaging_period`` are refused: pass the hook and the averager above.

    Raises:
        ValueError: a Lightning hook or averaging argument beside wagma's, a state without a hook, or (in
            ``setup``) a comm hook on a model whose parameters are FSDP2 shards.
    """

    def __init__(
        self,
        comm_hook: Callable[[Any, Any], Any] | None = None,
        comm_state: Any = None,
        averager: Callable[[torch.nn.Module], Any] | None = None,
        *,
        synchronize_at_end: bool = False,
        save_replicas: bool = True,
        **kwargs: Any,
    ) -> None:
        lightning_own = sorted(
            k
            for k in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")
            if kwargs.get(k) is not None
        )
        if lightning_own:
            raise ValueError(
                f"WagmaDDPStrategy: expected the hook and averager as comm_hook=, comm_state=, averager=, found "
                f"Lightning's {', '.join(lightning_own)}; pass them to DDPStrategy instead, or wagma's here"
            )
        if comm_state is not None and comm_hook is None:
            raise ValueError("comm_state: expected a comm_hook to go with it, found comm_hook=None")
        if averager is not None and not callable(averager):
            raise ValueError(f"averager: expected a factory f(module) -> averager, found {type(averager).__name__}")
        super().__init__(**kwargs)
        self.wagma_comm_hook = ddp_hook(comm_hook)
        self.wagma_comm_state_factory = comm_state
        self.wagma_averager_factory = averager
        self.synchronize_at_end = bool(synchronize_at_end)
        self.save_replicas = bool(save_replicas)
        #: The built hook state and averager (``None`` until ``setup``).
        self.comm_state: Any = None
        self.averager: Any = None
        self.averaging: AveragingStep | None = None
        self._restored: dict[str, Any] | None = None

    # -- set-up -------------------------------------------------------------------------------------------------

    def configure_ddp(self) -> None:
        """Wrap in DDP (Lightning), then register the wagma hook on any device and build the averager."""
        super().configure_ddp()  # registers nothing of ours: Lightning's hook arguments are None
        module = self.lightning_module
        assert module is not None
        hook = self.wagma_comm_hook
        if hook is None and self.wagma_averager_factory is not None:
            hook = local_hook  # the models are averaged: DDP's gradient allreduce would be wasted traffic
        if hook is not None:
            check_unsharded(
                module,
                "Lightning's DDP strategy",
                "use ModelParallelStrategy and wagma.FSDPPartialAllreduce (FSDP2's all-reduce hook) instead",
            )
            self.comm_state = build(self.wagma_comm_state_factory, module, "comm_state")
            self.model.register_comm_hook(self.comm_state, hook)  # type: ignore[union-attr,operator]
        self.averager = build(self.wagma_averager_factory, module, "averager")
        self.averaging = AveragingStep(self.averager, module, self.comm_state)
        if self._restored is not None:
            self._load_wagma_state(self._restored)
            self._restored = None

    def _load_wagma_state(self, state: dict[str, Any]) -> None:
        assert self.averaging is not None and self.lightning_module is not None
        if "state_dict" in state:
            # DDP's constructor broadcast rank 0's parameters over the replica Lightning restored: restore it again.
            self.lightning_module.load_state_dict(state["state_dict"])
        self.averaging.load_state_dict(state["averaging"])
        if state.get("comm_state") is not None:
            load = getattr(self.comm_state, "load_state_dict", None)
            if not callable(load):
                raise ValueError(
                    f"checkpoint: expected a comm_state with load_state_dict() for the saved hook state, found "
                    f"{type(self.comm_state).__name__}"
                )
            load(state["comm_state"])

    # -- the step -----------------------------------------------------------------------------------------------

    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any],
        model: Any = None,
        **kwargs: Any,
    ) -> Any:
        """Lightning's step with the averager's step around it (after the closure's backward pass, or after)."""
        averaging = self.averaging
        if averaging is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        groups = optimizer.param_groups
        out = super().optimizer_step(optimizer, averaging.wrap_closure(closure, groups), model, **kwargs)
        averaging.after_step(groups)
        return out

    def on_train_end(self) -> None:
        """Apply the gradients a partial-allreduce hook still carries (``flush``, collective), once per fit; with
        ``synchronize_at_end``, average the models globally."""
        super().on_train_end()
        flush = getattr(self.comm_state, "flush", None)
        if callable(flush) and self.optimizers:
            flush(self.optimizers[0])
        module = self.lightning_module
        if self.synchronize_at_end and self.averager is not None and module is not None:
            self.averager.synchronize(module.parameters(), module.buffers())

    def teardown(self) -> None:
        """Close the averager and the hook state, then Lightning's teardown."""
        close_quietly(self.averager, self.comm_state)
        self.averager = self.comm_state = self.averaging = None
        super().teardown()

    # -- checkpoints ---------------------------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Every rank's wagma state (and, with ``save_replicas``, model and optimizer state) into rank 0's file.

        Collective: Lightning calls it on every rank.
        """
        if self.averaging is not None:
            mine: dict[str, Any] = {"averaging": to_cpu(self.averaging.state_dict())}
            state_dict = getattr(self.comm_state, "state_dict", None)
            mine["comm_state"] = to_cpu(state_dict()) if callable(state_dict) else None
            if self.save_replicas:
                mine["state_dict"] = to_cpu(checkpoint.get("state_dict"))
                mine["optimizer_states"] = to_cpu(checkpoint.get("optimizer_states"))
            ranks = gather_states(mine)
            if ranks is not None:
                checkpoint = {**checkpoint, CHECKPOINT_KEY: {"world_size": len(ranks), "ranks": ranks}}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's load, then this rank's model, optimizer and wagma state from the checkpoint's wagma entry.

        Raises:
            ValueError: the checkpoint was saved by a different number of ranks.
        """
        # wagma's entry holds plain Python state (counters, schedules): not loadable with weights_only=True.
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=False)
        entry = checkpoint.get(CHECKPOINT_KEY)
        if entry is None:
            return checkpoint
        if entry["world_size"] != self.world_size:
            raise ValueError(
                f"checkpoint {checkpoint_path}: expected one saved by {self.world_size} ranks, found "
                f"{entry['world_size']}; resume with the same number of devices and nodes"
            )
        mine = entry["ranks"][self.global_rank]
        if "state_dict" in mine:
            checkpoint["state_dict"] = mine["state_dict"]
            checkpoint["optimizer_states"] = mine["optimizer_states"]
        self._restored = mine
        return checkpoint
