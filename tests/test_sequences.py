"""The generated sequence workload (wagma/app/sequences.py), its batching and the Transformer that reads it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from wagma.app.config import ConfigError, validate_config
from wagma.app.data import dataset_info, load_dataset, make_batches
from wagma.app.metrics import read_metrics
from wagma.app.models import Transformer, build_model
from wagma.app.sequences import SequenceSpec, TokenBatchIterator, generate, trim_padding
from wagma.app.train import train
from wagma.testing import run_workers

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _compose(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        return compose("config", overrides=list(overrides))


def _lengths(x: torch.Tensor | np.ndarray) -> np.ndarray:
    return np.asarray((np.asarray(x) != 0).sum(axis=1))


def test_generated_data_is_deterministic_heavy_tailed_and_carries_its_label():
    spec = SequenceSpec(examples=4000, max_len=128, median_len=16, sigma=1.0, signal=0.3)
    tokens, labels = generate(spec)
    again, _ = generate(spec)
    assert np.array_equal(tokens, again) and tokens.shape == (4000, 128) and tokens.dtype == np.int64
    assert not np.array_equal(tokens, generate(SequenceSpec(examples=4000, max_len=128, data_seed=1))[0])
    lengths = _lengths(tokens)
    assert lengths.min() >= spec.min_len and lengths.max() <= spec.max_len
    # Padding only at the end; real tokens in 1..vocab-1.
    assert all((row[:n] > 0).all() and (row[n:] == 0).all() for row, n in zip(tokens[:200], lengths[:200]))
    assert tokens.max() < spec.vocab
    # A heavy right tail: the 99th percentile several times the median (log-normal, sigma 1: ~10x before clipping).
    assert np.median(lengths) == pytest.approx(16, abs=2) and np.percentile(lengths, 99) >= 5 * np.median(lengths)
    assert set(np.bincount(labels, minlength=4) // 100) <= {9, 10, 11}  # balanced classes
    # The label is the over-represented token class: counting wins far above chance (and more often when long).
    classes = np.where(tokens > 0, (tokens - 1) % spec.classes, -1)
    counts = np.stack([(classes == c).sum(axis=1) for c in range(spec.classes)], axis=1)
    right = counts.argmax(axis=1) == labels
    assert right.mean() > 0.7 and right[lengths >= 32].mean() > right[lengths <= 12].mean()


@pytest.mark.parametrize(
    "options,match",
    [
        (
            {"vocab": 4, "classes": 4},
            "data.vocab: expected an integer >= classes \\+ 1 = 5 \\(token 0 pads\\), found 4",
        ),
        ({"min_len": 10, "max_len": 5}, "data.max_len: expected an integer >= data.min_len = 10, found 5"),
        (
            {"median_len": 500},
            "data.median_len: expected a number in \\[min_len, max_len\\] = \\[8, 256\\], found 500.0",
        ),
        ({"signal": 1.5}, "data.signal: expected a finite number >= 0 and <= 1, found 1.5"),
        ({"examples": 3.5}, "data.examples: expected an integer, found 3.5"),
        ({"lenght": 3}, "data=sequences has no option\\(s\\) \\['lenght'\\]"),
    ],
)
def test_bad_options_are_named(options, match):
    with pytest.raises(ValueError, match=match):
        SequenceSpec.from_options(options)


def test_batches_by_samples_are_cut_to_their_longest_sequence():
    ds = load_dataset("sequences", seed=0, examples=800, max_len=128)
    assert ds.in_shape == (128,) and ds.vocab_size == 32 and ds.x_train.dtype == torch.int64
    batches = make_batches(ds.x_train, ds.y_train, {"batching": "samples"}, 16, seed=0, rank=0)
    widths = set()
    for _ in range(30):
        x, y = next(batches)
        assert len(x) == len(y) == 16 and x.shape[1] == _lengths(x).max()
        widths.add(x.shape[1])
    assert len(widths) > 5  # the step's size varies with the data
    images = torch.randn(4, 1, 8, 8)
    assert trim_padding(images) is images


def test_token_batches_fit_the_budget_cover_each_epoch_once_and_resume_exactly():
    ds = load_dataset("sequences", seed=0, examples=600, max_len=128)
    x, y = ds.x_train, ds.y_train
    it = TokenBatchIterator(x, y, 512, seed=3, rank=1)
    rows = {tuple(row.tolist()): i for i, row in enumerate(x)}  # generated rows are distinct (checked below)
    assert len(rows) == len(x)
    seen, sizes, padded = [], [], 0
    for _ in range(it.batches_per_epoch):
        bx, by = next(it)
        assert len(bx) * bx.shape[1] <= 512 or len(bx) == 1
        assert bx.shape[1] == _lengths(bx).max()
        width = x.shape[1]
        seen.extend(rows[tuple(torch.cat([r, r.new_zeros(width - len(r))]).tolist())] for r in bx)
        assert torch.equal(by, y[seen[-len(bx) :]])
        sizes.append(len(bx))
        padded += int((bx == 0).sum())
    assert it.epoch == 0 and sorted(seen) == list(range(len(x)))  # every sequence once per epoch
    assert max(sizes) >= 4 * min(sizes)  # short sequences come many to a batch, long ones few
    assert padded < 0.2 * int((x != 0).sum())  # batched by length: little padding
    # Save, draw three batches, restore into a fresh iterator: the same three batches.
    saved = it.state_dict()
    drawn = [next(it) for _ in range(3)]
    fresh = TokenBatchIterator(x, y, 512, seed=3, rank=1)
    fresh.load_state_dict(saved)
    for (ax, ay), (bx, by) in zip(drawn, (next(fresh) for _ in range(3))):
        assert torch.equal(ax, bx) and torch.equal(ay, by)
    with pytest.raises(ValueError, match="saved with tokens=512 into one with tokens=256"):
        TokenBatchIterator(x, y, 256, seed=3, rank=1).load_state_dict(saved)
    with pytest.raises(
        ValueError,
        match=r"^x: expected \(N, L\) int64 token rows \(batching by tokens, data=sequences\), "
        r"found \(torch.float32, \(10, 1, 8, 8\)\)$",
    ):
        TokenBatchIterator(torch.randn(10, 1, 8, 8), torch.zeros(10), 512, seed=0, rank=0)


@pytest.mark.slow  # a training, 5-6 s (the quick suite's 10-minute budget)
def test_the_transformer_ignores_padding_and_learns():
    torch.manual_seed(0)
    net = Transformer((64,), 4, vocab_size=32, d_model=32, heads=2, layers=2, ff=64)
    x = torch.randint(1, 32, (3, 10))
    padded = torch.cat([x, torch.zeros(3, 20, dtype=torch.int64)], dim=1)
    assert torch.allclose(net(x), net(padded), atol=1e-5)  # padding changes nothing
    with pytest.raises(ValueError, match="L <= 64"):
        net(torch.ones(2, 65, dtype=torch.int64))
    with pytest.raises(ValueError, match="heads dividing d_model"):
        Transformer((64,), 4, vocab_size=32, d_model=30, heads=4)
    # A few hundred SGD steps on the generated task: far above chance (25 %).
    ds = load_dataset("sequences", seed=0, examples=3000, max_len=64)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    batches = make_batches(ds.x_train, ds.y_train, {}, 32, seed=0, rank=0)
    for _ in range(250):
        bx, by = next(batches)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(bx), by).backward()
        opt.step()
    with torch.no_grad():
        accuracy = (net(ds.x_test).argmax(1) == ds.y_test).float().mean().item()
    assert accuracy > 0.7


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["data=sequences"], "model=mlp reads images: data=sequences needs model=transformer"),
        (["model=transformer"], "model=transformer reads token data: use it with data=sequences"),
        (
            ["data=sequences", "model=transformer", "data.batching=words"],
            "data.batching: expected one of 'samples', 'tokens', found 'words'",
        ),
        (
            ["data=sequences", "model=transformer", "data.max_len=4"],
            "data.max_len: expected an integer >= data.min_len = 8, found 4",
        ),
    ],
)
def test_a_config_that_cannot_work_is_refused_in_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate_config(_compose(*overrides), 2)
    with pytest.raises(ValueError, match="needs token data \\(data=sequences\\)"):
        dataset_info({"name": "digits", "batching": "tokens"})
    with pytest.raises(ValueError, match="model=mlp reads images"):
        build_model("mlp", (128,), 4, vocab_size=32)


def _train_worker(rank: int, world_size: int, cfg: DictConfig) -> dict:
    return train(cfg)


@pytest.mark.parametrize("batching", ["samples", "tokens"])
def test_train_on_sequences_counts_the_samples_each_step_really_had(tmp_path, batching):
    cfg = _compose(
        "data=sequences",
        "model=transformer",
        "averaging=allreduce",
        "progress=false",
        "steps=40",
        "eval_every=20",
        "batch_size=16",
        f"data.batching={batching}",
        "data.tokens=512",
        "data.examples=2000",
        "data.max_len=64",
    )
    cfg.run_dir = str(tmp_path)
    run_workers(_train_worker, 2, cfg, timeout_s=150)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["dataset"] == "sequences" and summary["model"] == "transformer"
    assert summary["test_accuracy"] > 0.5  # four classes: chance is 0.25
    samples = [[r["samples"] for r in read_metrics(tmp_path, rank)] for rank in range(2)]
    if batching == "samples":
        assert all(s == 16 for per_rank in samples for s in per_rank)
    else:  # as many sequences as fit 512 padded tokens: the count varies from step to step
        assert len({s for per_rank in samples for s in per_rank}) > 3
    records = read_metrics(tmp_path, 0)
    assert all(r["tokens"] > 0 and r["samples_per_s"] == pytest.approx(r["samples"] / r["step_s"]) for r in records)
    # samples_per_s counts what the ranks trained on, over the slowest rank's training time.
    assert summary["samples_per_s"] == pytest.approx(sum(map(sum, samples)) / summary["step_time_s"], rel=1e-6)


def test_an_integer_option_takes_an_integral_float_and_the_token_budget_is_checked_by_name():
    spec = SequenceSpec.from_options({"examples": 100.0, "median_len": 16})
    assert spec.examples == 100 and type(spec.examples) is int and type(spec.median_len) is float
    x, y = torch.ones(4, 8, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"^data\.tokens: expected an integer >= 1, found 0$"):
        TokenBatchIterator(x, y, 0, seed=0, rank=0)
    with pytest.raises(ValueError, match=r"^len\(x\), len\(y\): expected non-empty and equal, found \(4, 3\)$"):
        TokenBatchIterator(x, y[:3], 8, seed=0, rank=0)
