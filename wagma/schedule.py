"""Group schedules: which ranks average together in which averaging round.

A :class:`GroupSchedule` maps an averaging round ``r`` to a partition of the ``P`` ranks into disjoint
groups (docs/design.md §2.1). It is pure Python and needs no process group: the progress engine later creates
one communicator per group of :meth:`GroupSchedule.distinct_groups`, on every rank, in that order,
before the first round.

Ways to build one:

- :meth:`GroupSchedule.butterfly` -- the reference, for ``P = S**m``: round ``j`` groups the ranks that
  agree on every base-``S`` digit except digit ``j``.
- :meth:`GroupSchedule.mixed_radix` -- any ``S`` dividing ``P``: rotating mixed-radix digits; equal to the
  butterfly when ``P`` is a power of ``S``.
- :meth:`GroupSchedule.from_partitions` -- explicit partitions, one per round of the period.
- :meth:`GroupSchedule.create` -- by name, as a config would pick one (``"auto"`` chooses for you).

Every schedule is checked at construction to *mix*: over one period, in round order, the product of
its per-round membership matrices must connect every rank to every other, directly or indirectly.
A schedule that does not mix is refused with a :class:`ValueError`.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from wagma.checks import check_choice, check_int, fail

__all__ = ["GroupSchedule", "check_group_fits"]

Group = tuple[int, ...]
Partition = tuple[Group, ...]

_KINDS = ("butterfly", "mixed_radix", "auto")


class GroupSchedule:
    """A periodic sequence of partitions of the ranks ``0..P-1`` into disjoint groups.

    Round ``r`` uses partition ``r % period``. Within a round the groups are sorted and each group is a
    sorted tuple of ranks, so every rank that builds the same schedule sees the same groups in the same
    order. Instances are immutable; two schedules are equal when they use the same partitions in the
    same rounds (the name is a label and does not take part).
    """

    def __init__(self, partitions: Sequence[Sequence[Sequence[int]]], *, name: str = "custom") -> None:
        """Validate and store a schedule.

        Args:
            partitions: ``partitions[j]`` is the partition used in round ``j`` of the period: a sequence
                of groups, each a sequence of integer ranks (numpy integers are accepted). Every round
                must use every rank ``0..P-1`` exactly once, with the same ``P`` in every round.
            name: a label shown in ``repr`` (``"butterfly"``, ``"mixed_radix"``, ``"custom"``).

        Raises:
            ValueError: the partitions are empty, overlap, miss ranks, hold ranks out of range, differ
                in world size between rounds, or do not mix every rank with every other in one period.
        """
        rounds, world_size = _normalize(partitions)
        _check_mixes(rounds, world_size)
        self._rounds: tuple[Partition, ...] = rounds
        self._world_size = world_size
        self.name: str = name
        # rank -> group, per round of the period, so group_of is a lookup.
        table: list[tuple[Group, ...]] = []
        for partition in rounds:
            row: list[Group] = [()] * world_size
            for group in partition:
                for rank in group:
                    row[rank] = group
            table.append(tuple(row))
        self._table = tuple(table)
        sizes = {len(g) for partition in rounds for g in partition}
        self._group_size = sizes.pop() if len(sizes) == 1 else None

    # ----------------------------------------------------------------------------------------------
    # Constructors

    @classmethod
    def butterfly(cls, world_size: int, group_size: int) -> GroupSchedule:
        """The reference butterfly schedule for ``world_size == group_size ** m`` (``m >= 1``).

        Round ``j`` (``j = 0..m-1``) groups the ranks that agree on every digit of their base-``S``
        representation except digit ``j``; the period is ``m``. ``P = 1`` (with ``S = 1``) gives the
        trivial one-round schedule ``[(0,)]``. ``S = P`` is one group of every rank in every round: each
        round is a global average (wait-avoiding under the engine, which is what eager-SGD's partial
        allreduce uses), not a group average.

        Raises:
            ValueError: invalid sizes, ``group_size`` larger than ``world_size`` or not dividing it, or
                ``world_size`` not a power of ``group_size`` (use :meth:`mixed_radix` or ``create("auto", ...)`` then).
        """
        world_size, group_size = _check_sizes(world_size, group_size)
        if world_size == 1:
            return cls([[(0,)]], name="butterfly")
        if group_size == 1:
            # Never mixes; let the constructor's mixing check refuse it with its explanation.
            return cls([[(x,) for x in range(world_size)]], name="butterfly")
        m = _exact_log(world_size, group_size)
        if m is None:
            raise fail(
                "world_size",
                f"a power of group_size={group_size} for a butterfly (group_size**m, m >= 1)",
                world_size,
                "use GroupSchedule.mixed_radix or GroupSchedule.create('auto', ...) for other world sizes",
            )
        partitions = []
        for d in range(m):
            stride = group_size**d
            bases = [x for x in range(world_size) if (x // stride) % group_size == 0]
            partitions.append([tuple(b + k * stride for k in range(group_size)) for b in bases])
        return cls(partitions, name="butterfly")

    @classmethod
    def mixed_radix(cls, world_size: int, group_size: int) -> GroupSchedule:
        """A rotating mixed-radix schedule for any ``group_size`` dividing ``world_size``.

        With ``Q = P // S`` and the digit rotation ``T(x) = x // S + Q * (x % S)``, round ``j`` groups the
        ranks ``{x : T**j(x) // S == b}`` for ``b = 0..Q-1``; round 0 is contiguous blocks. The period is
        the smallest number of rounds after which every rank has mixed with every other (at least
        ``ceil(log_S P)``). When ``P = S**m`` this is exactly :meth:`butterfly`.

        Raises:
            ValueError: invalid sizes, ``group_size`` not dividing ``world_size``, or no mixing within
                ``4 * world_size`` rounds (``group_size == 1`` with ``world_size > 1`` never mixes).
        """
        world_size, group_size = _check_sizes(world_size, group_size)
        if world_size == 1:
            return cls([[(0,)]], name="mixed_radix")
        q = world_size // group_size
        rotation = [x // group_size + q * (x % group_size) for x in range(world_size)]
        identity = list(range(world_size))
        power = identity  # T**j, as a list: power[x] = T**j(x)
        reach = _identity_reach(world_size)
        reach_at_cycle_start = reach
        partitions: list[Partition] = []
        for _ in range(4 * world_size):
            blocks: list[list[int]] = [[] for _ in range(q)]
            for x in range(world_size):
                blocks[power[x] // group_size].append(x)
            partition = tuple(tuple(b) for b in blocks)
            partitions.append(partition)
            reach = _advance(reach, partition)
            if _all_mixed(reach, world_size):
                return cls(partitions, name="mixed_radix")
            power = [rotation[p] for p in power]
            if power == identity:
                # The partitions repeat from here on; a whole cycle that added nothing never will.
                if reach == reach_at_cycle_start:
                    break
                reach_at_cycle_start = reach
        raise ValueError(
            f"mixed_radix(world_size={world_size}, group_size={group_size}) does not mix: expected "
            f"every rank to mix with every other within {4 * world_size} rounds, but after "
            f"{len(partitions)} round(s) (when the search stopped) {_unmixed_pair(reach, world_size)}. "
            f"{_hint(partitions)}"
        )

    @classmethod
    def from_partitions(cls, partitions: Sequence[Sequence[Sequence[int]]], *, name: str = "custom") -> GroupSchedule:
        """An explicit schedule: ``partitions[j]`` is used in round ``j`` of the period.

        Groups may have unequal sizes here (then :attr:`group_size` is ``None``). Validated as in the
        constructor, including the mixing check.
        """
        return cls(partitions, name=name)

    @classmethod
    def create(cls, kind: str, world_size: int, group_size: int) -> GroupSchedule:
        """Build a schedule by name, as a config picks one.

        Args:
            kind: ``"butterfly"``, ``"mixed_radix"`` or ``"auto"`` (butterfly when ``world_size`` is a
                power of ``group_size``, else mixed_radix).
            world_size: number of ranks ``P``.
            group_size: ranks per group ``S``; must divide ``P``.

        Raises:
            ValueError: an unknown ``kind``, or whatever the chosen constructor refuses.
        """
        check_choice("kind", kind, _KINDS)
        if kind == "butterfly":
            return cls.butterfly(world_size, group_size)
        if kind == "mixed_radix":
            return cls.mixed_radix(world_size, group_size)
        world_size, group_size = _check_sizes(world_size, group_size)
        if world_size == 1 or (group_size > 1 and _exact_log(world_size, group_size) is not None):
            return cls.butterfly(world_size, group_size)
        return cls.mixed_radix(world_size, group_size)

    @classmethod
    def for_members(cls, world_size: int, group_size: int) -> GroupSchedule:
        """A schedule for any number of ranks: for a membership that changes, as replicas leave and join.

        When ``group_size`` divides ``world_size`` this is ``create("auto", ...)``. Otherwise, with
        ``Q = world_size // group_size`` groups, the first ``Q * group_size`` ranks follow the auto schedule of
        that many ranks and the remaining ranks ``Q * group_size + j`` are dealt to group ``j % Q`` of every
        round, so every group has at least ``group_size`` members and all ranks still mix. Fewer ranks than
        ``group_size`` form one group.

        Raises:
            ValueError: ``world_size`` not an integer >= 1, or ``group_size`` not one >= 2 (groups of one never mix).
        """
        world_size, group_size = check_int("world_size", world_size, 1), check_int("group_size", group_size, 2)
        if world_size <= group_size:
            return cls([[tuple(range(world_size))]], name="members")
        if world_size % group_size == 0:
            return cls.create("auto", world_size, group_size)
        groups = world_size // group_size
        base = cls.create("auto", groups * group_size, group_size)
        partitions = []
        for round in range(base.period):
            blocks = [list(group) for group in base.groups(round)]
            for extra in range(groups * group_size, world_size):
                blocks[(extra - groups * group_size) % groups].append(extra)
            partitions.append(blocks)
        return cls(partitions, name="members")

    # ----------------------------------------------------------------------------------------------
    # Queries

    @property
    def world_size(self) -> int:
        """Number of ranks ``P``."""
        return self._world_size

    @property
    def period(self) -> int:
        """Number of rounds after which the partitions repeat."""
        return len(self._rounds)

    @property
    def group_size(self) -> int | None:
        """``S`` when every group of every round has ``S`` ranks, else ``None``."""
        return self._group_size

    def groups(self, round: int) -> list[tuple[int, ...]]:
        """The partition used in ``round`` (``round % period``): sorted groups of sorted ranks."""
        return list(self._rounds[self._slot(round)])

    def group_of(self, rank: int, round: int) -> tuple[int, ...]:
        """The group ``rank`` belongs to in ``round``, itself included (a table lookup)."""
        r = check_int("rank", _as_int(rank, "rank"), minimum=0, maximum=self._world_size - 1)
        return self._table[self._slot(round)][r]

    def distinct_groups(self) -> list[tuple[int, ...]]:
        """Every distinct group over one period, each once, in order of first appearance.

        This is the order in which every rank must create the communicators (docs/design.md §2.1).
        """
        seen: dict[Group, None] = {}
        for partition in self._rounds:
            for group in partition:
                seen.setdefault(group, None)
        return list(seen)

    def mixing_matrix(self, round: int) -> np.ndarray:
        """The ``P x P`` averaging matrix of ``round``: ``W[i, k] = 1/|G|`` when ``i, k`` share group ``G``.

        Row-stochastic (and symmetric, so doubly stochastic); float64.
        """
        w = np.zeros((self._world_size, self._world_size), dtype=np.float64)
        for group in self._rounds[self._slot(round)]:
            idx = np.asarray(group)
            w[np.ix_(idx, idx)] = 1.0 / len(group)
        return w

    def _slot(self, round: int) -> int:
        return check_int("round", _as_int(round, "round"), minimum=0) % len(self._rounds)

    def __repr__(self) -> str:
        return (
            f"GroupSchedule(name={self.name!r}, world_size={self._world_size}, "
            f"group_size={self._group_size}, period={self.period})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GroupSchedule):
            return NotImplemented
        return self._rounds == other._rounds

    def __hash__(self) -> int:
        return hash(self._rounds)


# --------------------------------------------------------------------------------------------------
# Helpers


def _as_int(value: Any, what: str) -> int:
    """``value`` as an ``int``: any integer type (a NumPy one too, unlike :func:`wagma.checks.check_int`), no bool."""
    if isinstance(value, (bool, np.bool_)):
        raise fail(what, "an integer", value)
    try:
        return operator.index(value)
    except TypeError:
        raise fail(what, "an integer", value) from None


def check_group_fits(group_size: int, world_size: int, what: str = "group_size") -> None:
    """Refuse a group that holds more ranks than the world has, with a message that says so.

    Without this check a too-large group surfaces as "not a divisor" (or, at one rank, not at all), which
    hides the real mistake: a config written for a bigger job run on a smaller one.

    Args:
        group_size: ranks per group (``S``).
        world_size: ranks in the world (``P``).
        what: the argument's name, for the message (``"local_group_size"``, ``"averaging.group_size"``).

    Raises:
        ValueError: if ``group_size > world_size``, listing the group sizes this world allows.
    """
    if group_size > world_size:
        allowed = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"{what} {group_size} is larger than the world ({world_size} rank{'s' if world_size != 1 else ''}): "
            f"a group cannot hold more ranks than the job has; pick a divisor of {world_size} "
            f"({', '.join(map(str, allowed))}) or start more ranks"
        )


def _check_sizes(world_size: Any, group_size: Any) -> tuple[int, int]:
    p = check_int("world_size", _as_int(world_size, "world_size"), minimum=1)
    s = check_int("group_size", _as_int(group_size, "group_size"), minimum=1)
    check_group_fits(s, p)
    if p % s != 0:
        raise fail("group_size", f"a divisor of world_size {p}", s)
    return p, s


def _exact_log(n: int, base: int) -> int | None:
    """``m >= 1`` with ``base**m == n``, or None (``base >= 2``)."""
    m = 0
    while n > 1 and n % base == 0:
        n //= base
        m += 1
    return m if n == 1 and m >= 1 else None


def _normalize(partitions: Any) -> tuple[tuple[Partition, ...], int]:
    """Validate ``partitions`` and return them sorted, as tuples, with the world size."""
    try:
        raw_rounds = list(partitions)
    except TypeError:
        raise fail("partitions", "a sequence of partitions", type(partitions)) from None
    if not raw_rounds:
        raise fail("partitions", "at least one round", raw_rounds)
    rounds: list[Partition] = []
    world_size = 0
    for j, raw in enumerate(raw_rounds):
        try:
            raw_groups = list(raw)
        except TypeError:
            raise fail(f"round {j}", "a sequence of groups", raw) from None
        if not raw_groups:
            raise fail(f"round {j}", "a partition of the ranks (at least one group)", raw_groups)
        groups: list[Group] = []
        owner: dict[int, int] = {}
        for g, raw_group in enumerate(raw_groups):
            try:
                members = list(raw_group)
            except TypeError:
                raise fail(
                    f"round {j}, group {g}",
                    "a sequence of ranks",
                    raw_group,
                    "each entry of partitions is a whole partition (a list of groups), not one group",
                ) from None
            if not members:
                raise fail(f"round {j}, group {g}", "at least one rank", members)
            group = tuple(sorted(_as_int(x, f"round {j}, group {g}: rank") for x in members))
            for x in group:
                if x in owner:
                    raise ValueError(
                        f"round {j}: groups overlap: expected each rank in exactly one group, "
                        f"rank {x} is in group {owner[x]} and group {g}"
                    )
                owner[x] = g
            groups.append(group)
        count = len(owner)
        if j == 0:
            world_size = count
        elif count != world_size and set(owner) == set(range(count)):
            raise ValueError(
                f"rounds have different world sizes: round 0 covers {world_size} ranks, round {j} covers {count}"
            )
        missing = sorted(set(range(world_size)) - set(owner))
        outside = sorted(x for x in owner if not 0 <= x < world_size)
        if missing or outside:
            raise ValueError(
                f"round {j}: expected every rank 0..{world_size - 1} exactly once; "
                f"missing {missing}, out of range {outside}"
            )
        rounds.append(tuple(sorted(groups)))
    return tuple(rounds), world_size


# Mixing is tracked with one bitset per rank k: bit i set when entry (i, k) of the boolean product of
# the membership matrices so far is nonzero. A round replaces each member's set by its group's union.


def _identity_reach(world_size: int) -> list[int]:
    return [1 << k for k in range(world_size)]


def _advance(reach: list[int], partition: Partition) -> list[int]:
    new = list(reach)
    for group in partition:
        union = 0
        for k in group:
            union |= reach[k]
        for k in group:
            new[k] = union
    return new


def _all_mixed(reach: list[int], world_size: int) -> bool:
    full = (1 << world_size) - 1
    return all(r == full for r in reach)


def _unmixed_pair(reach: list[int], world_size: int) -> str:
    full = (1 << world_size) - 1
    for k, r in enumerate(reach):
        if r != full:
            gap = full & ~r
            i = (gap & -gap).bit_length() - 1
            return f"rank {i} has not mixed with rank {k}, directly or indirectly"
    return "every rank has mixed"


def _hint(rounds: Sequence[Partition]) -> str:
    if all(len(g) == 1 for partition in rounds for g in partition):
        return (
            "Every group holds a single rank (group size 1), so no rank ever averages with another: "
            "use a group size of at least 2."
        )
    return "Add rounds whose groups join the separate parts, or use GroupSchedule.mixed_radix."


def _check_mixes(rounds: tuple[Partition, ...], world_size: int) -> None:
    reach = _identity_reach(world_size)
    for partition in rounds:
        reach = _advance(reach, partition)
    if not _all_mixed(reach, world_size):
        raise ValueError(
            f"schedule does not mix: expected every rank to mix with every other over one period "
            f"({len(rounds)} round(s)), but {_unmixed_pair(reach, world_size)}. {_hint(rounds)}"
        )
