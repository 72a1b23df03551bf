"""A byte-level language-modelling task on real text every machine has: the Python source of the installed torch.

``data=torch_source`` trains a model to predict every next byte of a document. The documents are the functions
(a top-level function or a method, with its decorators; a class's or a module's lines before its first function)
of every ``.py`` file under the installed ``torch`` package, in sorted path order, so every machine with the same
torch wheel has the same bytes without a download (the run records the corpus's SHA-256, :attr:`Corpus.digest`;
``torch/version.py`` is left out, as it names the build). Their lengths are heavy-tailed: with torch 2.13.0, 52,641
documents, median 353 bytes, 10 % below 79 and 10 % above 1,848 (20 % are longer than the default ``max_len`` of
1,024 and are cut). A batch is cut to its longest row, so with a few rows per batch a step's cost follows the
lengths it drew: on one core the byte-level model's forward and backward of 2 rows took 9 ms at 128 bytes and 122
ms at 1,024. A rank that draws short documents finishes its step early, with no injected delay.

A document of n bytes (cut to its first ``max_len + 1``) is one training row: the input ``x`` its bytes but the
last, the target ``y`` its bytes but the first (the next byte at every position), both as tokens ``byte + 1`` padded
with 0 to ``max_len``. The model (``model=byte_lm``) returns logits for every position; the loss is the mean
cross-entropy over the real positions (:func:`token_cross_entropy`), and the bits per byte are that loss / ln 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import math
import os
import re
import tempfile
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from wagma.app.specs import TaskSpec, check_lengths
from wagma.checks import check_int

__all__ = [
    "VOCAB",
    "Corpus",
    "SourceSpec",
    "bits_per_byte",
    "cache_dir",
    "corpus_digest",
    "documents",
    "generate",
    "load_rows",
    "token_cross_entropy",
]

PAD = 0
VOCAB = 257
"""Token ids: 0 pads, ``byte + 1`` for the 256 byte values."""

_TOP = re.compile(rb"^(?:    )?(?:@|def |async def |class )")
_LEFT_OUT = ("version.py",)  # names the build (CUDA or CPU): not the same bytes on every machine


@dataclasses.dataclass(frozen=True)
class SourceSpec(TaskSpec):
    """The task's parameters (the ``data=torch_source`` config's keys)."""

    task: ClassVar[str] = "torch_source"

    examples: int = 10000
    max_len: int = 1024
    min_len: int = 16
    data_seed: int = 0

    def check(self) -> None:
        """Raise ``ValueError`` naming the first parameter out of range."""
        check_lengths(self.min_len, self.max_len, 2)
        check_int("data.examples", self.examples, 2)


@dataclasses.dataclass(frozen=True)
class Corpus:
    """The documents of one torch installation, in order, and the SHA-256 of their bytes."""

    docs: tuple[bytes, ...]
    digest: str
    root: str

    @property
    def lengths(self) -> np.ndarray:
        """Each document's length in bytes."""
        return np.fromiter((len(d) for d in self.docs), dtype=np.int64, count=len(self.docs))


def _split(source: bytes) -> list[bytes]:
    """A file's functions: a new block starts at a ``def``, ``class`` or decorator at column 0 or 4 (a method),
    unless the block so far is only decorators (a decorator belongs to what it decorates)."""
    blocks: list[list[bytes]] = [[]]
    only_decorators = False
    for line in source.splitlines(keepends=True):
        if _TOP.match(line) and not only_decorators and any(x.strip() for x in blocks[-1]):
            blocks.append([])
        if _TOP.match(line):
            only_decorators = line.lstrip().startswith(b"@")
        elif line.strip():
            only_decorators = False
        blocks[-1].append(line)
    return [b"".join(b).strip(b"\n") + b"\n" for b in blocks if any(x.strip() for x in b)]


@functools.lru_cache(maxsize=2)
def documents(root: str | None = None) -> Corpus:
    """Every function (:func:`_split`) of every ``.py`` file under ``root`` (default: the installed ``torch``
    package), in sorted path order; cached per process.

    Raises:
        ValueError: ``root`` holds no Python file.
    """
    base, files = _files(root)
    digest = hashlib.sha256()
    docs: list[bytes] = []
    for path in files:
        data = path.read_bytes()
        digest.update(path.relative_to(base).as_posix().encode() + b"\0" + data)
        docs.extend(_split(data))
    if not docs:
        raise ValueError(f"no Python source under {base}")
    return Corpus(tuple(docs), digest.hexdigest(), str(base))


def _files(root: str | None) -> tuple[Path, list[Path]]:
    base = Path(root) if root is not None else Path(torch.__file__).parent
    return base, sorted(p for p in base.rglob("*.py") if p.name not in _LEFT_OUT or p.parent != base)


@functools.lru_cache(maxsize=2)
def corpus_digest(root: str | None = None) -> str:
    """:attr:`Corpus.digest` of ``root`` without splitting the files (about a tenth of :func:`documents`' time)."""
    base, files = _files(root)
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(base).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def cache_dir() -> Path:
    """Where :func:`load_rows` keeps generated rows: ``$WAGMA_CACHE`` or ``~/.cache/wagma``, then ``torch_source``."""
    return Path(os.environ.get("WAGMA_CACHE") or Path.home() / ".cache" / "wagma") / "torch_source"


def load_rows(spec: SourceSpec, root: str | None = None) -> tuple[np.ndarray, np.ndarray, str]:
    """:func:`generate`'s ``(x, y)`` for ``spec`` and the corpus's digest, through a file cache keyed by both: a
    second run (every rank of a job after the first) reads the rows instead of splitting the corpus again. A cache
    file that cannot be read is made again; one that cannot be written is skipped."""
    digest = corpus_digest(root)
    key = hashlib.sha256(f"{digest} {dataclasses.astuple(spec)}".encode()).hexdigest()[:24]
    path = cache_dir() / f"rows-{key}.npy"
    try:
        tokens = np.load(path)
        if tokens.shape == (spec.examples, spec.max_len + 1):
            return _shifted(tokens.astype(np.int64)) + (digest,)
    except (OSError, ValueError):
        pass
    x, y = generate(spec, documents(root))
    tokens = np.concatenate([x[:, :1], y], axis=1).astype(np.uint16)  # the whole row: x's first byte, then y
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as tmp:
            np.save(tmp, tokens)
        os.chmod(tmp.name, 0o644)
        os.replace(tmp.name, path)  # whole or absent: ranks that write at once each replace it with the same
    except OSError:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp.name)
    return x, y, digest


def _shifted(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)`` from whole rows of ``max_len + 1`` tokens: x drops the last real token, y the first."""
    x = tokens[:, :-1].copy()
    x[tokens[:, 1:] == PAD] = PAD  # a row's last real token is nobody's input
    return x, tokens[:, 1:].copy()


def generate(spec: SourceSpec, corpus: Corpus | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)``: ``spec.examples`` documents of at least ``min_len`` bytes drawn without replacement (seeded by
    ``data_seed``) from the corpus, as ``(examples, max_len)`` int64 token rows, 0-padded: the input and the next
    byte at every position. Deterministic in ``spec`` and the corpus.

    Raises:
        ValueError: the corpus has fewer than ``examples`` documents of ``min_len`` bytes or more.
    """
    spec.check()
    corpus = corpus if corpus is not None else documents()
    eligible = np.flatnonzero(corpus.lengths >= spec.min_len)
    if len(eligible) < spec.examples:
        raise ValueError(
            f"data.examples={spec.examples} exceeds the {len(eligible)} documents of >= {spec.min_len} bytes "
            f"in {corpus.root}"
        )
    rng = np.random.Generator(np.random.PCG64(spec.data_seed))
    chosen = np.sort(rng.choice(eligible, size=spec.examples, replace=False))
    x = np.zeros((spec.examples, spec.max_len), dtype=np.int64)
    y = np.zeros((spec.examples, spec.max_len), dtype=np.int64)
    for row, index in enumerate(chosen.tolist()):
        tokens = np.frombuffer(corpus.docs[index][: spec.max_len + 1], dtype=np.uint8).astype(np.int64) + 1
        x[row, : len(tokens) - 1] = tokens[:-1]
        y[row, : len(tokens) - 1] = tokens[1:]
    return x, y


def token_cross_entropy(logits: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of ``(N, L, V)`` logits against ``(N, L)`` next tokens, over the real (non-0) targets only."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=PAD, reduction=reduction)


def bits_per_byte(loss: float) -> float:
    """A mean cross-entropy in nats per byte, in bits per byte."""
    return loss / math.log(2)
