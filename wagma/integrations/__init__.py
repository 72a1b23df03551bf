"""Adapters for training frameworks: wagma's hooks and averagers inside Lightning, Accelerate and the HF Trainer.

``import wagma`` never imports this package, and this package imports no framework: each module imports its
framework when it is imported itself, and a missing one is one line naming the extra to install.

- :mod:`wagma.integrations.lightning` -- :class:`~wagma.integrations.lightning.WagmaDDPStrategy`, a Lightning
  ``DDPStrategy`` that registers any wagma DDP comm hook (on CPU too), runs any wagma averager after the optimizer
  step and keeps every rank's state in Lightning's checkpoints.
- :mod:`wagma.integrations.accelerate` -- :func:`~wagma.integrations.accelerate.prepare_wagma`: the hook on the
  prepared DDP model, the averager around the prepared optimizer, both in ``save_state`` / ``load_state``.
- :mod:`wagma.integrations.transformers` -- :class:`~wagma.integrations.transformers.WagmaCallback`, a
  ``TrainerCallback`` that does the same for the Hugging Face ``Trainer``, resumable from its checkpoints.
"""
