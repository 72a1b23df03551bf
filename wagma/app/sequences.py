"""A sequence task the project generates itself: load imbalance that comes from the data.

The papers' Transformer and RL workloads are imbalanced by their data (sentences and episodes differ in length),
not by injected sleeps. ``data=sequences`` is such a workload, generated offline and deterministically:

- lengths drawn from a log-normal distribution (median ``median_len``, shape ``sigma``) clipped to
  ``[min_len, max_len]``: a heavy right tail, like sentence lengths;
- tokens ``1 .. vocab-1`` (0 pads); token ``t`` belongs to class ``(t - 1) % classes``; a sequence of label ``y``
  draws each token from class ``y``'s tokens with probability ``signal`` and uniformly otherwise, so the label is
  the over-represented class, and longer sequences carry more evidence.

Sequences are stored padded to ``max_len`` as ``(N, max_len)`` int64. A batch is cut to its own longest sequence
(:func:`trim_padding`), so a step costs what its tokens cost: with ``batching: samples`` (``batch_size`` sequences
per step) a rank that draws a long sequence is a straggler; with ``batching: tokens``
(:class:`TokenBatchIterator`) each batch holds as many sequences as fit a padded-token budget, the sequence
trainers' usual batching. It bounds the padded tokens, not the cost (attention grows with the square of the
length, a step's overhead with its sequence count): measured in ``benchmarks/results/tts/README.md``, the per-step
spread stays as large.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import numpy as np
import torch

from wagma.app.epochs import EpochBatches
from wagma.app.specs import TaskSpec, check_lengths
from wagma.checks import check_int, check_number, fail

__all__ = ["SequenceSpec", "TokenBatchIterator", "generate", "trim_padding"]

PAD = 0


@dataclasses.dataclass(frozen=True)
class SequenceSpec(TaskSpec):
    """The generated task's parameters (the ``data=sequences`` config's keys)."""

    task: ClassVar[str] = "sequences"

    examples: int = 6000
    vocab: int = 32
    classes: int = 4
    min_len: int = 8
    max_len: int = 256
    median_len: float = 32.0
    sigma: float = 0.9
    signal: float = 0.25
    data_seed: int = 0

    def check(self) -> None:
        """Raise ``ValueError`` naming the first parameter out of range."""
        check_int("data.classes", self.classes, 2)
        if self.vocab < self.classes + 1:
            raise fail("data.vocab", f"an integer >= classes + 1 = {self.classes + 1} (token 0 pads)", self.vocab)
        check_lengths(self.min_len, self.max_len, 1)
        if not self.min_len <= self.median_len <= self.max_len:
            raise fail(
                "data.median_len", f"a number in [min_len, max_len] = [{self.min_len}, {self.max_len}]", self.median_len
            )
        check_number("data.sigma", self.sigma, 0)
        check_number("data.signal", self.signal, 0, 1)
        if self.examples < 2 * self.classes:
            raise fail("data.examples", f"an integer >= 2 x classes = {2 * self.classes}", self.examples)


def generate(spec: SequenceSpec) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens, labels)``: ``(examples, max_len)`` int64 padded with 0, and ``(examples,)`` int64 labels.

    Deterministic in ``spec`` (``data_seed`` included): every rank generates the same data.
    """
    spec.check()
    rng = np.random.Generator(np.random.PCG64(spec.data_seed))
    n, length = spec.examples, spec.max_len
    labels = rng.integers(0, spec.classes, size=n)
    lengths = np.clip(np.rint(rng.lognormal(math.log(spec.median_len), spec.sigma, size=n)), spec.min_len, length)
    lengths = lengths.astype(np.int64)
    uniform = rng.integers(1, spec.vocab, size=(n, length))
    # A token of class y: 1 + y + classes * k, for k such that it stays below vocab.
    per_class = (spec.vocab - 1 - labels + spec.classes - 1) // spec.classes  # tokens of class y in 1..vocab-1
    k = np.floor(rng.random((n, length)) * per_class[:, None]).astype(np.int64)
    signal = 1 + labels[:, None] + spec.classes * k
    tokens = np.where(rng.random((n, length)) < spec.signal, signal, uniform)
    tokens[np.arange(length)[None, :] >= lengths[:, None]] = PAD
    return tokens.astype(np.int64), labels.astype(np.int64)


def trim_padding(x: torch.Tensor) -> torch.Tensor:
    """``x`` (a batch of padded token rows) cut to its longest row, so that the step costs what its tokens cost;
    any other tensor unchanged."""
    if x.dtype != torch.int64 or x.dim() != 2 or x.shape[0] == 0:
        return x
    longest = int((x != PAD).sum(dim=1).max())
    return x[:, : max(1, longest)]


class TokenBatchIterator(EpochBatches):
    """Endless, seeded batches of whole sequences whose padded size (count x longest) fits a token budget.

    Per epoch, as fairseq and most sequence trainers batch: the shard in a fresh permutation seeded with
    ``(seed, rank, epoch)``, stably sorted by length, cut in order into batches (a sequence joins a batch while
    ``(count + 1) x longest <= tokens``; one longer than the budget is a batch of its own), the batches then
    visited in an order drawn from the same generator. Short sequences come many to a batch, long ones few, with
    little padding. ``position`` is the next batch's index in the epoch, so a restored iterator continues exactly
    where the saved one was (:class:`wagma.app.epochs.EpochBatches`, as :class:`wagma.app.data.BatchIterator`).
    """

    settings = ("tokens",)
    kind = "token batch iterator"

    def __init__(self, x: torch.Tensor, y: torch.Tensor, tokens: int, *, seed: int, rank: int) -> None:
        if len(x) != len(y) or len(x) == 0:
            raise fail("len(x), len(y)", "non-empty and equal", (len(x), len(y)))
        if x.dtype != torch.int64 or x.dim() != 2:
            raise fail("x", "(N, L) int64 token rows (batching by tokens, data=sequences)", (x.dtype, tuple(x.shape)))
        self.x, self.y, self.tokens = x, y, check_int("data.tokens", tokens, 1)
        self.lengths = (x != PAD).sum(dim=1).clamp(min=1).cpu().numpy()
        super().__init__(seed=seed, rank=rank)

    def _plan(self, epoch: int) -> None:
        """Lay out the epoch's batches in visiting order: (indices, longest length) each."""
        rng = self.epoch_rng(epoch)
        order = rng.permutation(len(self.x))
        order = order[np.argsort(self.lengths[order], kind="stable")]
        batches: list[tuple[list[int], int]] = []
        take: list[int] = []
        longest = 0
        for index in order.tolist():
            wider = max(longest, int(self.lengths[index]))
            if take and (len(take) + 1) * wider > self.tokens:
                batches.append((take, longest))
                take, wider = [], int(self.lengths[index])
            take.append(index)
            longest = wider
        batches.append((take, longest))
        self._batches = [batches[i] for i in rng.permutation(len(batches)).tolist()]

    @property
    def batches_per_epoch(self) -> int:
        """Number of batches in the current epoch (it depends on how the lengths fall into batches)."""
        return len(self._batches)

    def _batch(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        take, longest = self._batches[position]
        idx = torch.tensor(take, device=self.x.device)
        return self.x[idx][:, :longest], self.y[idx]
