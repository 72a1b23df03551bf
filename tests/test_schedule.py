"""GroupSchedule: closed forms for the butterfly, mixing of mixed_radix, validation of every input."""

import numpy as np
import pytest

from wagma.schedule import GroupSchedule

MIXED_CASES = [(6, 2), (12, 4), (12, 3), (8, 2), (24, 4), (10, 5)]


def _ceil_log(p: int, s: int) -> int:
    m = 0
    while s**m < p:
        m += 1
    return m


def _product(sched: GroupSchedule, rounds: int) -> np.ndarray:
    w = np.eye(sched.world_size)
    for r in range(rounds):
        w = w @ sched.mixing_matrix(r)
    return w


def _assert_partition(groups: list[tuple[int, ...]], world_size: int) -> None:
    flat = [x for g in groups for x in g]
    assert sorted(flat) == list(range(world_size))
    assert all(list(g) == sorted(g) for g in groups)
    assert groups == sorted(groups)


# --------------------------------------------------------------------------------------------------
# butterfly


def test_butterfly_64_8_matches_closed_form():
    s = GroupSchedule.butterfly(64, 8)
    assert s.period == 2 and s.world_size == 64 and s.group_size == 8 and s.name == "butterfly"
    assert s.groups(0) == [tuple(range(8 * k, 8 * k + 8)) for k in range(8)]
    assert s.groups(1) == [tuple(range(q, 64, 8)) for q in range(8)]
    # rounds alternate
    assert s.groups(2) == s.groups(0) and s.groups(7) == s.groups(1)


def test_butterfly_16_2_pairs_by_xor():
    s = GroupSchedule.butterfly(16, 2)
    assert s.period == 4
    for j in range(4):
        for x in range(16):
            assert s.group_of(x, j) == tuple(sorted((x, x ^ (1 << j))))
            assert s.group_of(x, j + 4) == s.group_of(x, j)


@pytest.mark.parametrize("p,s", [(2, 2), (4, 2), (8, 2), (16, 2), (9, 3), (27, 3), (16, 4), (64, 8), (5, 5)])
def test_mixed_radix_equals_butterfly_on_powers(p, s):
    b = GroupSchedule.butterfly(p, s)
    m = GroupSchedule.mixed_radix(p, s)
    assert m.period == b.period == _ceil_log(p, s)
    assert [m.groups(r) for r in range(m.period)] == [b.groups(r) for r in range(b.period)]
    assert m == b and hash(m) == hash(b)


def test_world_size_one_is_trivial():
    for kind in ("butterfly", "mixed_radix", "auto"):
        s = GroupSchedule.create(kind, 1, 1)
        assert s.period == 1 and s.groups(0) == [(0,)] and s.group_of(0, 5) == (0,)
        assert s.distinct_groups() == [(0,)]
        np.testing.assert_array_equal(s.mixing_matrix(0), [[1.0]])
    assert GroupSchedule.from_partitions([[[0]]]).world_size == 1


# --------------------------------------------------------------------------------------------------
# mixed_radix


@pytest.mark.parametrize("p,s", MIXED_CASES)
def test_mixed_radix_partitions_and_mixes_in_one_period(p, s):
    sched = GroupSchedule.mixed_radix(p, s)
    assert sched.name == "mixed_radix" and sched.world_size == p and sched.group_size == s
    assert sched.period >= _ceil_log(p, s)
    for r in range(sched.period):
        groups = sched.groups(r)
        _assert_partition(groups, p)
        assert len(groups) == p // s and all(len(g) == s for g in groups)
    assert sched.groups(0) == [tuple(range(b * s, b * s + s)) for b in range(p // s)]
    assert (_product(sched, sched.period) > 0).all()
    # the period is the smallest that mixes
    assert not (_product(sched, sched.period - 1) > 0).all()


@pytest.mark.parametrize("p,s", MIXED_CASES)
def test_mixed_radix_follows_digit_rotation(p, s):
    q = p // s
    rot = [x // s + q * (x % s) for x in range(p)]
    sched = GroupSchedule.mixed_radix(p, s)
    power = list(range(p))
    for r in range(sched.period):
        for x in range(p):
            assert sched.group_of(x, r) == tuple(y for y in range(p) if power[y] // s == power[x] // s)
        power = [rot[v] for v in power]


def test_mixed_radix_periods():
    periods = {(p, s): GroupSchedule.mixed_radix(p, s).period for p, s in MIXED_CASES}
    assert periods == {(6, 2): 3, (12, 4): 2, (12, 3): 3, (8, 2): 3, (24, 4): 3, (10, 5): 2}


# --------------------------------------------------------------------------------------------------
# queries


@pytest.mark.parametrize("p,s", [(12, 3), (64, 8), (6, 2)])
def test_group_of_consistent_with_groups(p, s):
    sched = GroupSchedule.create("auto", p, s)
    for r in range(sched.period + 2):
        for g in sched.groups(r):
            for x in g:
                assert sched.group_of(x, r) == g
                assert sched.group_of(np.int64(x), np.int32(r)) == g


def test_distinct_groups_cover_every_group_once_in_first_appearance_order():
    sched = GroupSchedule.mixed_radix(12, 3)
    everything = [g for r in range(sched.period) for g in sched.groups(r)]
    distinct = sched.distinct_groups()
    assert len(distinct) == len(set(distinct))
    assert set(distinct) == set(everything)
    assert distinct == list(dict.fromkeys(everything))
    assert distinct[:4] == sched.groups(0)
    # groups repeated across rounds appear once
    rep = GroupSchedule.from_partitions([[[0, 1], [2, 3]], [[0, 2], [1, 3]], [[2, 3], [1, 0]]])
    assert rep.distinct_groups() == [(0, 1), (2, 3), (0, 2), (1, 3)]


def test_mixing_matrix_is_row_stochastic_within_groups():
    sched = GroupSchedule.mixed_radix(12, 4)
    for r in range(sched.period):
        w = sched.mixing_matrix(r)
        assert w.shape == (12, 12)
        np.testing.assert_allclose(w.sum(axis=1), 1.0)
        for i in range(12):
            for k in range(12):
                expected = 0.25 if k in sched.group_of(i, r) else 0.0
                assert w[i, k] == expected


def test_unequal_groups_and_numpy_ranks():
    parts = [[[np.int64(0), np.int64(1)], [np.int32(2)]], [[0], [2, 1]], [[1, 0], [2]]]
    sched = GroupSchedule.from_partitions(parts)
    assert sched.group_size is None and sched.name == "custom" and sched.period == 3
    assert sched.groups(1) == [(0,), (1, 2)]
    assert all(type(x) is int for g in sched.groups(0) for x in g)
    np.testing.assert_allclose(sched.mixing_matrix(0), [[0.5, 0.5, 0], [0.5, 0.5, 0], [0, 0, 1]])
    arr = GroupSchedule.from_partitions(np.array([[[0, 1], [2, 3]], [[0, 2], [1, 3]]]))
    assert arr == GroupSchedule.butterfly(4, 2) and arr.group_size == 2


def test_eq_and_repr():
    a = GroupSchedule.butterfly(8, 2)
    assert a == GroupSchedule.from_partitions([a.groups(r) for r in range(a.period)])
    assert a != GroupSchedule.butterfly(4, 2)
    assert a != "butterfly"
    text = repr(a)
    assert "butterfly" in text and "world_size=8" in text and "group_size=2" in text and "period=3" in text


def test_create_auto_picks_correctly():
    assert GroupSchedule.create("auto", 64, 8).name == "butterfly"
    assert GroupSchedule.create("auto", 16, 4).name == "butterfly"
    assert GroupSchedule.create("auto", 8, 4).name == "mixed_radix"  # 8 is not a power of 4
    assert GroupSchedule.create("auto", 12, 4).name == "mixed_radix"
    assert GroupSchedule.create("butterfly", 8, 2) == GroupSchedule.butterfly(8, 2)
    assert GroupSchedule.create("mixed_radix", 6, 2) == GroupSchedule.mixed_radix(6, 2)


# --------------------------------------------------------------------------------------------------
# validation


@pytest.mark.parametrize("factory", [GroupSchedule.butterfly, GroupSchedule.mixed_radix])
def test_bad_sizes_rejected(factory):
    with pytest.raises(ValueError, match="^world_size: expected an integer >= 1, found 0$"):
        factory(0, 2)
    with pytest.raises(ValueError, match="^group_size: expected an integer >= 1, found 0$"):
        factory(4, 0)
    with pytest.raises(ValueError, match="^group_size: expected a divisor of world_size 12, found 5$"):
        factory(12, 5)
    with pytest.raises(ValueError, match="^world_size: expected an integer, found 4.0$"):
        factory(4.0, 2)


def test_butterfly_needs_a_power():
    with pytest.raises(ValueError, match=r"power of group_size.*mixed_radix"):
        GroupSchedule.butterfly(12, 4)
    with pytest.raises(ValueError, match="power of group_size"):
        GroupSchedule.butterfly(8, 4)


@pytest.mark.parametrize(
    "build",
    [
        lambda: GroupSchedule.mixed_radix(4, 1),
        lambda: GroupSchedule.butterfly(4, 1),
        lambda: GroupSchedule.create("auto", 6, 1),
        lambda: GroupSchedule.from_partitions([[[0], [1], [2]]]),
    ],
)
def test_group_size_one_never_mixes(build):
    with pytest.raises(ValueError, match=r"does not mix.*single rank"):
        build()


def test_same_partition_every_round_rejected():
    with pytest.raises(ValueError, match=r"does not mix.*rank \d+ has not mixed with rank \d+"):
        GroupSchedule.from_partitions([[[0, 1], [2, 3]]] * 3)
    # two rounds that leave rank 2 unreached from rank 0 in round order
    with pytest.raises(ValueError, match="does not mix"):
        GroupSchedule.from_partitions([[[0, 1], [2]], [[0], [1, 2]]])


@pytest.mark.parametrize(
    "parts,pattern",
    [
        ([], "at least one round"),
        ([[[0, 1], [1, 2], [3]]], "overlap"),
        ([[[0, 1], [2, 3]], [[0, 1], [3]]], r"missing \[2\]"),
        ([[[0, 1], [2, 3]], [[0, 1], [2, 7]]], r"out of range \[7\]"),
        ([[[0, 1], [2, 3]], [[0, 1], [2, -1]]], r"out of range \[-1\]"),
        ([[[0, 1], [2, 3]], [[0, 1], [2, 3], [4, 5]]], "different world sizes"),
        ([[[0, 1], [2, 3]], [[0, 1], [2]]], "different world sizes"),
        ([[[0, 1], []]], r"round 0, group 1: expected at least one rank, found \[\]"),
        ([[]], r"round 0: expected a partition of the ranks \(at least one group\), found \[\]"),
        ([[[0, 1.5]]], "^round 0, group 0: rank: expected an integer, found 1.5$"),
        ([[[0, True]]], "^round 0, group 0: rank: expected an integer, found True$"),
        ([[0, 1], [2, 3]], "whole partition"),
    ],
)
def test_bad_partitions_rejected(parts, pattern):
    with pytest.raises(ValueError, match=pattern):
        GroupSchedule.from_partitions(parts)


def test_bad_queries_rejected():
    sched = GroupSchedule.butterfly(4, 2)
    with pytest.raises(ValueError, match="^rank: expected an integer >= 0 and <= 3, found 4$"):
        sched.group_of(4, 0)
    with pytest.raises(ValueError, match="^round: expected an integer >= 0, found -1$"):
        sched.groups(-1)
    with pytest.raises(ValueError, match="^kind: expected one of 'butterfly', 'mixed_radix', 'auto', found 'ring'$"):
        GroupSchedule.create("ring", 4, 2)


@pytest.mark.parametrize("world_size", range(1, 12))
@pytest.mark.parametrize("group_size", [2, 3, 4])
def test_for_members_covers_any_membership_and_mixes(world_size, group_size):
    schedule = GroupSchedule.for_members(world_size, group_size)
    assert schedule.world_size == world_size
    for k in range(schedule.period):
        groups = schedule.groups(k)
        assert sorted(r for g in groups for r in g) == list(range(world_size))
        if world_size >= group_size:
            assert min(len(g) for g in groups) >= group_size
    if world_size % group_size == 0 and world_size > group_size:
        assert schedule == GroupSchedule.create("auto", world_size, group_size)


def test_for_members_refuses_bad_sizes():
    with pytest.raises(ValueError, match=r"^world_size: expected an integer >= 1, found 0$"):
        GroupSchedule.for_members(0, 2)
    with pytest.raises(ValueError, match=r"^group_size: expected an integer >= 2, found True$"):
        GroupSchedule.for_members(4, True)
    with pytest.raises(ValueError, match=r"^group_size: expected an integer >= 2, found 1$"):
        GroupSchedule.for_members(4, 1)
