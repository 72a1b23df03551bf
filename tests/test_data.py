"""Datasets, splits, shards and the resumable batch iterator."""

import pytest
import torch

from wagma.app.data import DATASET_INFO, IMAGE_DATASETS, BatchIterator, Dataset, load_dataset, train_split_size


def _indexed_dataset(n: int) -> Dataset:
    """Example i is the number i, so shards can be checked by value."""
    x = torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1)
    return Dataset("indexed", x, torch.arange(n), x[:1], torch.zeros(1, dtype=torch.long), 10)


@pytest.mark.parametrize("world_size", [1, 3, 4, 7])
def test_shards_are_disjoint_and_cover_the_training_split(world_size):
    ds = _indexed_dataset(101)
    seen = []
    sizes = []
    for rank in range(world_size):
        x, y = ds.shard(rank, world_size)
        assert torch.equal(x.view(-1).long(), y)  # inputs and labels stay paired
        seen += y.tolist()
        sizes.append(len(y))
    assert sorted(seen) == list(range(101))  # covering, and no example twice
    assert max(sizes) - min(sizes) <= 1


def test_shard_rejects_bad_rank():
    ds = _indexed_dataset(10)
    with pytest.raises(ValueError, match="rank"):
        ds.shard(4, 4)
    with pytest.raises(ValueError, match="exceeds"):
        ds.shard(0, 11)


@pytest.mark.parametrize(  # MNIST takes 4-5 s to load: in the slow phase
    "name", [pytest.param(n, marks=pytest.mark.slow) if n == "mnist" else n for n in IMAGE_DATASETS]
)
def test_split_shapes_and_normalisation(name):
    ds = load_dataset(name, seed=0)
    n, in_shape, classes = DATASET_INFO[name]
    assert ds.in_shape == in_shape and ds.num_classes == classes
    assert len(ds.x_train) == train_split_size(name, 0.2) and len(ds.x_train) + len(ds.x_test) == n
    assert ds.x_train.dtype == torch.float32 and ds.y_train.dtype == torch.int64
    assert ds.x_train.shape[1:] == in_shape
    assert Dataset.flat(ds.x_test).shape == (len(ds.x_test), in_shape[1] * in_shape[2])
    assert abs(float(ds.x_train.mean())) < 1e-4 and abs(float(ds.x_train.std()) - 1.0) < 1e-3
    # Stratified: every class is held out in proportion (within one example).
    test_counts = torch.bincount(ds.y_test, minlength=classes).float()
    all_counts = test_counts + torch.bincount(ds.y_train, minlength=classes).float()
    assert float((test_counts - 0.2 * all_counts).abs().max()) <= 1.0


def test_split_is_deterministic_and_seeded():
    a, b, c = load_dataset("digits", seed=3), load_dataset("digits", seed=3), load_dataset("digits", seed=4)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert not torch.equal(a.y_train, c.y_train)


def test_unknown_dataset_names_the_known_ones():
    with pytest.raises(ValueError, match="known datasets: digits, mnist"):
        load_dataset("cifar10")


def test_batch_iterator_visits_each_example_once_per_epoch():
    ds = _indexed_dataset(23)
    x, y = ds.shard(1, 2)  # 11 examples
    it = BatchIterator(x, y, 4, seed=0, rank=1)
    assert it.batches_per_epoch == 2
    epoch0 = torch.cat([next(it)[1] for _ in range(2)])
    assert len(set(epoch0.tolist())) == 8 and set(epoch0.tolist()) <= set(y.tolist())
    xb, yb = next(it)
    assert it.epoch == 1 and len(yb) == 4 and torch.equal(xb.view(-1).long(), yb)


def test_batch_iterator_is_seeded_per_rank():
    ds = _indexed_dataset(40)
    x, y = ds.x_train, ds.y_train
    first = [next(BatchIterator(x, y, 8, seed=0, rank=r))[1] for r in (0, 0, 1)]
    assert torch.equal(first[0], first[1]) and not torch.equal(first[0], first[2])


def test_batch_iterator_resumes_exactly():
    ds = _indexed_dataset(30)
    x, y = ds.x_train, ds.y_train
    it = BatchIterator(x, y, 7, seed=5, rank=0)
    for _ in range(6):  # into the second epoch
        next(it)
    state = it.state_dict()
    expected = [next(it)[1] for _ in range(9)]
    restored = BatchIterator(x, y, 7, seed=5, rank=0)
    restored.load_state_dict(state)
    assert all(torch.equal(a, next(restored)[1]) for a in expected)
    with pytest.raises(ValueError, match="batch_size"):
        BatchIterator(x, y, 5, seed=5, rank=0).load_state_dict(state)


def test_batch_iterator_rejects_batch_larger_than_shard():
    ds = _indexed_dataset(5)
    with pytest.raises(ValueError, match="shard size"):
        BatchIterator(ds.x_train, ds.y_train, 6, seed=0, rank=0)
