"""Endless, seeded batches epoch by epoch, with a position that checkpoints save and restore.

The shared part of :class:`wagma.app.data.BatchIterator` (batches of ``batch_size`` samples) and
:class:`wagma.app.sequences.TokenBatchIterator` (batches of whole sequences under a token budget): epoch ``e``'s plan
is drawn from a generator seeded with ``(seed, rank, e)`` alone, so a restored iterator, given the epoch and the
index of its next batch, continues exactly where the saved one was; a restore into another seed, rank or batching
setting is refused, naming it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

__all__ = ["EpochBatches"]


class EpochBatches(ABC):
    """Base of the application's batch iterators: epochs, their seeded generator, the position and its checks.

    A subclass sets :attr:`settings` (the attributes besides ``seed`` and ``rank`` that a restored position must
    match, e.g. ``("batch_size",)``), implements :meth:`_plan` (lay out an epoch with :meth:`epoch_rng`) and
    :meth:`_batch` (the batch at a position of the planned epoch) and :attr:`batches_per_epoch`, and calls
    ``super().__init__(seed=..., rank=...)`` once its own attributes are set.
    """

    #: Attributes a restored position must match, besides ``seed`` and ``rank``.
    settings: tuple[str, ...] = ()
    #: How errors name the iterator.
    kind = "batch iterator"

    def __init__(self, *, seed: int, rank: int) -> None:
        self.seed, self.rank = seed, rank
        self.epoch = 0
        self.position = 0  # index of the next batch within the epoch
        self._plan(0)

    def epoch_rng(self, epoch: int) -> np.random.Generator:
        """The generator of epoch ``epoch``'s plan: seeded with ``(seed, rank, epoch)`` and nothing else."""
        return np.random.Generator(np.random.PCG64([self.seed, self.rank, epoch]))

    @abstractmethod
    def _plan(self, epoch: int) -> None:
        """Lay out epoch ``epoch``'s batches (drawn from :meth:`epoch_rng`)."""

    @abstractmethod
    def _batch(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch at ``position`` of the planned epoch."""

    @property
    @abstractmethod
    def batches_per_epoch(self) -> int:
        """Number of batches in the planned epoch."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.position >= self.batches_per_epoch:
            self.epoch += 1
            self.position = 0
            self._plan(self.epoch)
        batch = self._batch(self.position)
        self.position += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        """The position: ``{"epoch", "position", "seed", "rank"}`` and the :attr:`settings`."""
        state: dict[str, Any] = {"epoch": self.epoch, "position": self.position, "seed": self.seed, "rank": self.rank}
        state.update({key: getattr(self, key) for key in self.settings})
        return state

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a position saved by :meth:`state_dict` on the same shard and settings.

        Raises:
            ValueError: if the saved seed, rank or a setting differs from this iterator's (naming it).
        """
        for key in ("seed", "rank", *self.settings):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"cannot restore a {self.kind} saved with {key}={state.get(key)} into one with "
                    f"{key}={getattr(self, key)}; resume with the settings of the saved run"
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._plan(self.epoch)
