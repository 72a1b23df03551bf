"""Hugging Face Trainer: :class:`WagmaCallback`, a wagma comm hook and averager in ``Trainer``, resumable.

The ``Trainer`` has no comm-hook option and no averager, but it builds its DDP model and its optimizer through
Accelerate before it calls ``on_train_begin``, and before the first backward pass. There the callback does what
:func:`wagma.integrations.accelerate.prepare_wagma` does: registers the hook on ``trainer.model_wrapped`` and runs
the averager inside the optimizer the Trainer steps. At every checkpoint (``on_save``) it writes every rank's
model, optimizer, averager and hook state into the checkpoint folder (``wagma.pt``, by rank 0), and a resumed run
gives each rank its own back at ``on_train_begin``::

    from wagma import PeriodicAverager
    from wagma.integrations.transformers import WagmaCallback

    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.add_callback(WagmaCallback(trainer, averager=lambda m: PeriodicAverager(4, timeout=60.0)))
    trainer.train()                                   # or trainer.train(resume_from_checkpoint=True)
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from wagma.integrations._common import require

require("transformers", "transformers", "transformers")
require("accelerate", "transformers", "Accelerate")

from transformers import TrainerCallback  # noqa: E402

from wagma.integrations.accelerate import WagmaAccelerate, prepare_wagma  # noqa: E402

__all__ = ["STATE_FILE", "WagmaCallback"]

#: The file, in each checkpoint folder, that holds every rank's wagma state.
STATE_FILE = "wagma.pt"


class WagmaCallback(TrainerCallback):
    """Registers a wagma comm hook and runs a wagma averager in a Hugging Face ``Trainer``; saves and resumes both.

    Args:
        trainer: the ``Trainer`` (the callback needs its DDP model and optimizer, which callbacks are not passed).
        comm_hook: a DDP comm hook ``hook(state, bucket)`` (a ``functools.partial`` of one included). ``None`` with an
            averager: ``local_hook`` (no gradient traffic); ``None`` without one: DDP's allreduce.
        comm_state: the hook's state, or a factory ``f(module) -> state``.
        averager: a wagma averager factory ``f(module) -> averager`` (built at ``on_train_begin``, on every rank).
        synchronize_at_end: at ``on_train_end``, a blocking global average of the models.
        resume_from: the checkpoint folder to take wagma's state from on a resumed run; by default
            ``<output_dir>/checkpoint-<global step>``, the folder the Trainer saved at that step.

    Raises:
        ValueError: (at ``on_train_begin``) a hook or averager on a run the Trainer did not wrap in DDP (FSDP,
            DeepSpeed, one process); a resumed run whose checkpoint holds no wagma state.
    """

    def __init__(
        self,
        trainer: Any,
        *,
        comm_hook: Any = None,
        comm_state: Any = None,
        averager: Any = None,
        synchronize_at_end: bool = False,
        resume_from: str | os.PathLike[str] | None = None,
    ) -> None:
        if comm_hook is None and averager is None:
            raise ValueError("WagmaCallback: expected a comm_hook, an averager or both, found neither")
        self.trainer = trainer
        self.comm_hook = comm_hook
        self.comm_state = comm_state
        self.averager = averager
        self.synchronize_at_end = bool(synchronize_at_end)
        self.resume_from = resume_from
        #: The set-up of the current ``train()`` call (``None`` outside one).
        self.run: WagmaAccelerate | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Register the hook on the DDP model and the averager in the optimizer; on a resume, load this rank's state."""
        path = None
        if state.global_step > 0:  # a resume: find wagma's state before building anything
            folder = self.resume_from or os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            path = os.path.join(folder, STATE_FILE)
            if not os.path.isfile(path):
                raise ValueError(
                    f"WagmaCallback: resuming at step {state.global_step}, expected wagma's state in {path}, found "
                    "none; pass WagmaCallback(resume_from=<the checkpoint folder>)"
                )
        trainer = self.trainer
        self.run = prepare_wagma(
            trainer.accelerator,
            trainer.model_wrapped,
            trainer.optimizer,
            comm_hook=self.comm_hook,
            comm_state=self.comm_state,
            averager=self.averager,
            checkpoint=False,
        )
        if path is not None:
            self.run.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Collective: every rank's state into ``<output_dir>/checkpoint-<step>/wagma.pt`` (written by rank 0)."""
        if self.run is None:
            return
        everything = self.run.state_dict()
        if dist.get_rank() == 0:
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            os.makedirs(folder, exist_ok=True)
            torch.save(everything, os.path.join(folder, STATE_FILE))
        dist.barrier()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Flush a partial-allreduce hook, synchronise if asked, close the hook state and the averager."""
        if self.run is None:
            return
        self.run.flush()
        if self.synchronize_at_end:
            self.run.synchronize()
        self.run.close()
        self.run = None
