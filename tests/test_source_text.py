"""The byte-level language-modelling task (wagma/app/source_text.py): the corpus, its rows, the causal model that
reads them, the loss and the evaluation over real next bytes, and a training run on it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from wagma.app.config import ConfigError, validate_config
from wagma.app.data import BatchIterator, dataset_info, load_dataset
from wagma.app.models import ByteLM, build_model
from wagma.app.source_text import (
    VOCAB,
    SourceSpec,
    _split,
    bits_per_byte,
    corpus_digest,
    documents,
    generate,
    load_rows,
    token_cross_entropy,
)
from wagma.app.train import evaluate, train
from wagma.testing import run_workers

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

SOURCE = b'''"""A module."""
import os


@decorated
@twice
def first(a):
    return a


class Thing:
    """Doc."""

    x = 1

    def method(self):
        return 2

    @property
    def value(self):
        return 3
'''


def _compose(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        return compose("config", overrides=list(overrides))


def test_a_file_splits_into_its_functions_with_their_decorators_and_loses_no_line():
    docs = _split(SOURCE)
    assert [d.splitlines()[0] for d in docs] == [
        b'"""A module."""',
        b"@decorated",
        b"class Thing:",
        b"    def method(self):",
        b"    @property",
    ]
    assert b"@twice\ndef first(a):" in docs[1] and docs[4].endswith(b"return 3\n")
    lines = [line for line in SOURCE.splitlines() if line.strip()]
    assert [line for d in docs for line in d.splitlines() if line.strip()] == lines


def test_the_corpus_is_deterministic_leaves_out_the_build_and_its_digest_names_the_bytes(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_bytes(SOURCE)
    (tmp_path / "b.py").write_bytes(b"def f():\n    pass\n")
    (tmp_path / "version.py").write_bytes(b"cuda = '12.8'\n")  # names the build: not part of the corpus
    corpus = documents(str(tmp_path))
    assert len(corpus.docs) == 6 and corpus.docs[0] == b"def f():\n    pass\n"  # b.py sorts before pkg/a.py
    assert documents.__wrapped__(str(tmp_path)).digest == corpus.digest
    (tmp_path / "version.py").write_bytes(b"cuda = None\n")
    assert documents.__wrapped__(str(tmp_path)).digest == corpus.digest
    (tmp_path / "b.py").write_bytes(b"def f():\n    pass  \n")
    assert documents.__wrapped__(str(tmp_path)).digest != corpus.digest
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"^no Python source under .*empty$"):
        documents.__wrapped__(str(tmp_path / "empty"))


def test_rows_come_from_a_cache_keyed_by_the_corpus_and_the_spec(tmp_path, monkeypatch):
    monkeypatch.setenv("WAGMA_CACHE", str(tmp_path / "cache"))
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_bytes(SOURCE * 3)
    root = str(tmp_path / "src")
    spec = SourceSpec(examples=6, max_len=24, min_len=8)
    x, y, digest = load_rows(spec, root)
    made = generate(spec, documents.__wrapped__(root))
    assert np.array_equal(x, made[0]) and np.array_equal(y, made[1]) and digest == corpus_digest.__wrapped__(root)
    (cached,) = (tmp_path / "cache" / "torch_source").glob("rows-*.npy")
    monkeypatch.setattr("wagma.app.source_text.generate", None)  # a hit generates nothing
    again = load_rows(spec, root)
    assert np.array_equal(again[0], x) and np.array_equal(again[1], y) and again[2] == digest
    monkeypatch.undo()
    monkeypatch.setenv("WAGMA_CACHE", str(tmp_path / "cache"))
    cached.write_bytes(b"not an array")  # a torn or foreign file is made again
    assert np.array_equal(load_rows(spec, root)[0], x) and np.load(cached).shape == (6, 25)
    assert len(list(cached.parent.glob("rows-*.npy"))) == 1
    load_rows(SourceSpec(examples=6, max_len=24, min_len=8, data_seed=1), root)
    assert len(list(cached.parent.glob("rows-*.npy"))) == 2  # another spec, another file


@pytest.mark.slow  # 4-7 s: moved out of the quick suite to keep it under 10 minutes
def test_rows_are_a_document_and_its_next_bytes_and_the_lengths_are_heavy_tailed():
    spec = SourceSpec(examples=2000, max_len=1024, min_len=16)
    x, y = generate(spec)
    again, _ = generate(spec)
    assert np.array_equal(x, again) and x.shape == y.shape == (2000, 1024) and x.dtype == y.dtype == np.int64
    assert not np.array_equal(x, generate(SourceSpec(examples=2000, max_len=1024, data_seed=1))[0])
    real = x != 0
    assert np.array_equal(real, y != 0)  # one target per input byte
    assert np.array_equal(x[:, 1:][real[:, 1:]], y[:, :-1][real[:, 1:]])  # the target is the next input
    assert x.max() <= VOCAB - 1 and x[real].min() >= 1
    lengths = real.sum(axis=1)
    assert lengths.min() >= 15 and 200 < np.median(lengths) < 600 and 0.1 < (lengths == 1024).mean() < 0.35
    first = bytes((x[0][real[0]] - 1).astype(np.uint8).tolist())
    assert first[:1] in (b"d", b"c", b"@", b'"', b"#", b"i", b"f", b" ") or first.isascii()
    with pytest.raises(ValueError, match=r"^data\.examples=100000 exceeds the \d+ documents of >= 16 bytes"):
        generate(SourceSpec(examples=100_000))


def test_options_are_checked_by_name():
    assert dataset_info({"name": "torch_source", "max_len": 64}).token_targets
    with pytest.raises(ValueError, match=r"has no option\(s\) \['vocab'\]"):
        SourceSpec.from_options({"name": "torch_source", "vocab": 3})
    with pytest.raises(ValueError, match=r"^data\.max_len: expected an integer, found 1\.5$"):
        SourceSpec.from_options({"max_len": 1.5})
    with pytest.raises(ValueError, match=r"^data\.max_len: expected an integer >= data\.min_len = 64, found 32$"):
        SourceSpec.from_options({"max_len": 32, "min_len": 64})
    with pytest.raises(ValueError, match=r"torch_source batches by samples"):
        dataset_info({"name": "torch_source", "batching": "tokens"})


def test_a_batch_cuts_its_targets_with_its_inputs():
    x = torch.zeros(4, 10, dtype=torch.int64)
    y = torch.zeros(4, 10, dtype=torch.int64)
    for row, n in enumerate((3, 5, 2, 4)):
        x[row, :n] = torch.arange(1, n + 1)
        y[row, :n] = torch.arange(2, n + 2)
    batches = BatchIterator(x, y, 2, seed=0, rank=0)
    for _ in range(4):
        xb, yb = next(batches)
        assert xb.shape == yb.shape and xb.shape[1] == int((xb != 0).sum(1).max())


def test_the_model_is_causal_and_the_loss_ignores_padding():
    torch.manual_seed(0)
    model = ByteLM((32,), VOCAB, vocab_size=VOCAB, d_model=16, heads=2, layers=2, ff=32)
    x = torch.randint(1, VOCAB, (3, 32))
    changed = x.clone()
    changed[:, 20:] = torch.randint(1, VOCAB, (3, 12))
    a, b = model(x), model(changed)
    assert a.shape == (3, 32, VOCAB)
    torch.testing.assert_close(a[:, :20], b[:, :20])  # positions before 20 never see what follows
    assert not torch.allclose(a[:, 20:], b[:, 20:])
    target = torch.randint(1, VOCAB, (3, 32))
    target[:, 25:] = 0
    noisy = a.detach().clone()
    noisy[:, 25:] = 100.0  # whatever the model says where there is no next byte
    assert token_cross_entropy(noisy, target) == token_cross_entropy(a.detach(), target)
    by_hand = torch.nn.functional.cross_entropy(a[:, :25].reshape(-1, VOCAB), target[:, :25].reshape(-1))
    torch.testing.assert_close(token_cross_entropy(a, target), by_hand)
    assert bits_per_byte(math.log(2)) == 1.0


def test_byte_lm_and_torch_source_go_together_and_say_so():
    with pytest.raises(ValueError, match=r"^model=byte_lm predicts the next byte: use it with data=torch_source$"):
        build_model("byte_lm", (16,), VOCAB, vocab_size=VOCAB)
    with pytest.raises(ValueError, match=r"^data=torch_source predicts every next byte: it needs model=byte_lm"):
        build_model("transformer", (16,), VOCAB, vocab_size=VOCAB, token_targets=True)
    with pytest.raises(ConfigError, match=r"data=torch_source predicts every next byte: it needs model=byte_lm, not "):
        validate_config(_compose("data=torch_source", "model=mlp"), 2)
    validate_config(_compose("experiment=torch_source_lm"), 8)


def _evaluate_worker(rank: int, world_size: int) -> tuple[float, float]:
    torch.manual_seed(0)
    model = ByteLM((12,), VOCAB, vocab_size=VOCAB, d_model=16, heads=2, layers=1, ff=32)
    x = torch.zeros(5, 12, dtype=torch.int64)
    y = torch.zeros(5, 12, dtype=torch.int64)
    for row in range(5):
        n = 3 + 2 * row
        x[row, :n] = torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(row))
        y[row, :n] = torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(100 + row))
    accuracy, loss = evaluate(model, x, y, rank, world_size, batch_size=2)
    logits = model(x)
    real = y != 0
    by_hand = ((logits.argmax(-1) == y) & real).sum() / real.sum(), token_cross_entropy(logits, y)
    return accuracy - float(by_hand[0]), loss - float(by_hand[1])


def test_evaluation_averages_over_real_next_bytes_not_rows():
    for accuracy_gap, loss_gap in run_workers(_evaluate_worker, 2, timeout_s=60):
        assert abs(accuracy_gap) < 1e-9 and abs(loss_gap) < 1e-5


def _train_worker(rank: int, world_size: int, cfg: DictConfig) -> dict:
    return train(cfg)


@pytest.mark.slow  # 4-7 s: moved out of the quick suite to keep it under 10 minutes
def test_a_language_model_trains_on_the_source_and_reports_bits_per_byte(tmp_path, monkeypatch):
    monkeypatch.setenv("WAGMA_CACHE", str(tmp_path / "cache"))
    cfg = _compose(
        "experiment=torch_source_lm",
        "averaging=wagma",
        "progress=false",
        "steps=30",
        "eval_every=0",
        "checkpoint_every=0",
        "batch_size=4",
        "data.examples=400",
        "data.max_len=64",
        "model.d_model=32",
        "model.ff=64",
        "optim.lr=0.01",
    )
    cfg.run_dir = str(tmp_path)
    run_workers(_train_worker, 2, cfg, timeout_s=150)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["dataset"] == "torch_source" and summary["model"] == "byte_lm"
    assert summary["data_digest"] == documents().digest
    assert summary["test_bits_per_byte"] == pytest.approx(summary["test_loss"] / math.log(2))
    assert summary["test_bits_per_byte"] < 6.0  # uniform over 256 bytes: 8 bits; the common bytes come first
    assert load_dataset("torch_source", test_fraction=0.05, examples=400, max_len=64).x_test.shape == (20, 64)
