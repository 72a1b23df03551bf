"""Imbalance injectors: shared draws without communication, the right amounts, argument checks."""

import numpy as np
import pytest
import torch.distributed as dist

from wagma.app.imbalance import HeavyTail, NoImbalance, Persistent, RandomK, build_imbalance
from wagma.testing import run_workers

STEPS = 200


def _random_k_draws(rank: int, world_size: int, k: int) -> tuple[list[list[int]], list[float]]:
    inj = RandomK(rank, world_size, k=k, delay_s=0.003, seed=11)
    draws = [sorted(inj.delayed_ranks(step)) for step in range(STEPS)]
    slept = [inj(step) for step in range(20)]
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, draws)  # compare with what the other ranks drew on their own
    assert all(g == draws for g in gathered)
    return draws, slept


@pytest.mark.parametrize("world_size,k", [(4, 2), (3, 1)])
def test_random_k_draws_the_same_k_ranks_on_every_rank(world_size, k):
    results = run_workers(_random_k_draws, world_size, k)
    draws = results[0][0]
    assert all(len(set(d)) == k and all(0 <= r < world_size for r in d) for d in draws)
    assert len({tuple(d) for d in draws}) > 1  # the set changes from step to step
    # Each rank slept exactly on the steps it was drawn, for about delay_s.
    for rank, (_, slept) in enumerate(results):
        for step, s in enumerate(slept):
            if rank in draws[step]:
                assert 0.003 <= s < 0.05
            else:
                assert s == 0.0
    # Over many steps every rank is delayed about k/P of the time.
    share = np.mean([[r in d for r in range(world_size)] for d in draws], axis=0)
    assert np.allclose(share, k / world_size, atol=0.12)


def test_random_k_expected_delays():
    inj = RandomK(0, 8, k=2, delay_s=0.32, seed=0)
    assert inj.expected_mean_delay_s() == pytest.approx(0.08)
    assert inj.expected_max_delay_s() == pytest.approx(0.32)
    assert RandomK(0, 8, k=0, delay_s=0.32).expected_max_delay_s() == 0.0


def test_random_k_draw_depends_on_seed_and_step_only():
    a, b = RandomK(0, 16, k=3, delay_s=0.1, seed=7), RandomK(5, 16, k=3, delay_s=0.1, seed=7)
    assert [a.delayed_ranks(s) for s in range(50)] == [b.delayed_ranks(s) for s in range(50)]
    other = RandomK(0, 16, k=3, delay_s=0.1, seed=8)
    assert [a.delayed_ranks(s) for s in range(50)] != [other.delayed_ranks(s) for s in range(50)]


def test_persistent_uses_base_or_measured_compute():
    fixed = [Persistent(r, 4, ranks=[1, 3], factor=3.0, base_s=0.01) for r in range(4)]
    assert [p.delay_s(0) for p in fixed] == [0.0, pytest.approx(0.02), 0.0, pytest.approx(0.02)]
    assert fixed[0].expected_mean_delay_s() == pytest.approx(0.01)
    assert fixed[0].expected_max_delay_s() == pytest.approx(0.02)
    measured = Persistent(1, 4, ranks=[1], factor=2.5)
    assert measured.delay_s(7, compute_s=0.004) == pytest.approx(0.006)
    assert measured.delay_s(7) == 0.0  # no measurement yet: no delay
    assert measured.expected_mean_delay_s(0.004) == pytest.approx(0.0015)


@pytest.mark.parametrize("distribution,shape", [("lognormal", 0.8), ("pareto", 2.5)])
def test_heavy_tail_is_seeded_and_matches_its_expectations(distribution, shape):
    inj = [HeavyTail(r, 4, distribution=distribution, scale_s=0.01, shape=shape, seed=3) for r in range(4)]
    again = HeavyTail(2, 4, distribution=distribution, scale_s=0.01, shape=shape, seed=3)
    assert [again.delay_s(s) for s in range(30)] == [inj[2].delay_s(s) for s in range(30)]
    assert inj[0].delay_s(4) != inj[1].delay_s(4)  # ranks draw independently
    draws = np.array([[i.delay_s(s) for i in inj] for s in range(4000)])
    assert (draws >= 0).all()
    assert draws.mean() == pytest.approx(inj[0].expected_mean_delay_s(), rel=0.15)
    assert draws.max(axis=1).mean() == pytest.approx(inj[0].expected_max_delay_s(), rel=0.15)
    assert inj[0].expected_max_delay_s() > inj[0].expected_mean_delay_s()


def test_heavy_tail_cap_holds():
    inj = HeavyTail(0, 2, distribution="pareto", scale_s=0.01, shape=0.5, max_s=0.05, seed=0)
    draws = [inj.delay_s(s) for s in range(2000)]
    assert max(draws) == pytest.approx(0.05) and min(draws) >= 0
    assert inj.expected_mean_delay_s() <= 0.05


def test_none_never_sleeps():
    inj = NoImbalance(0, 4)
    assert inj(3, 1.0) == 0.0 and inj.expected_mean_delay_s() == 0.0 and inj.expected_max_delay_s() == 0.0


@pytest.mark.parametrize(
    "cfg,match",
    [
        (
            {"name": "random_k", "k": 5, "delay_s": 0.1},
            r"^imbalance.k: expected 0 <= k <= the world size 4 \(random_k\), found 5$",
        ),
        (
            {"name": "random_k", "k": 1, "delay_s": -0.1},
            "^imbalance.delay_s: expected a finite number >= 0, found -0.1$",
        ),
        (
            {"name": "persistent", "ranks": [0], "factor": 0.5},
            "^imbalance.factor: expected a finite number >= 1, found 0.5$",
        ),
        (
            {"name": "persistent", "ranks": [4], "factor": 2},
            r"^imbalance.ranks: expected distinct ranks in \[0, 4\) \(persistent\), found \[4\]$",
        ),
        (
            {"name": "persistent", "ranks": [1, 1], "factor": 2},
            r"^imbalance.ranks: expected distinct ranks in \[0, 4\) \(persistent\), found \[1, 1\]$",
        ),
        (
            {"name": "persistent", "ranks": [1], "factor": 2, "base_s": "1"},
            "^imbalance.base_s: expected None or a finite number >= 0, found '1'$",
        ),
        (
            {"name": "heavy_tail", "scale_s": -1, "shape": 1},
            "^imbalance.scale_s: expected a finite number >= 0, found -1$",
        ),
        (
            {"name": "heavy_tail", "scale_s": 1, "shape": 0},
            "^imbalance.shape: expected a finite number > 0, found 0$",
        ),
        (
            {"name": "heavy_tail", "scale_s": 1, "shape": 1, "max_s": -2},
            "^imbalance.max_s: expected None or a finite number >= 0, found -2$",
        ),
        ({"name": "heavy_tail", "distribution": "pareto", "scale_s": 0.1, "shape": 1.0}, "infinite mean"),
        (
            {"name": "heavy_tail", "distribution": "cauchy", "scale_s": 0.1, "shape": 1.0},
            "^imbalance.distribution: expected one of 'lognormal', 'pareto', found 'cauchy'$",
        ),
        ({"name": "random_k", "k": 1, "delay_s": 0.1, "rank": 3}, "bad arguments"),
        ({"name": "stragglers"}, "known imbalances: heavy_tail, none, persistent, random_k"),
    ],
)
def test_bad_arguments_raise_value_error(cfg, match):
    with pytest.raises(ValueError, match=match):
        build_imbalance(cfg, 0, 4)


def test_build_imbalance_passes_arguments():
    inj = build_imbalance({"name": "random_k", "k": 2, "delay_s": 0.05, "seed": 9}, 1, 4)
    assert isinstance(inj, RandomK) and inj.k == 2 and inj.delay == 0.05 and inj.seed == 9
