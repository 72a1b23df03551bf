"""The world an averager, engine or hook averages over: the whole job, a process group, or a mesh dimension.

Data parallelism usually spans the whole job. With HSDP (FSDP2 on a 2-D ``DeviceMesh``, dimensions
``("replicate", "shard")``) the model averaging belongs on the ``replicate`` dimension: replica r's shard j only
meets shard j of the other replicas, so every shard index has its own world, and the worlds of a job are
disjoint and equally large. wagma calls such a set of worlds a *family*; every rank is in at most one of them.

Within a world, ranks are numbered 0 .. size - 1 in the order of the world's group (its *world ranks*);
schedules, rounds and groups are in world ranks, and :meth:`World.global_rank` gives a rank's number in the job
for messages and point-to-point calls.

Creating a group stays collective over the job, as ``torch.distributed.new_group`` is: :meth:`World.new_group`
creates the group in every world of the family (one ``new_group`` per world, in the same order on every rank, as
``DeviceMesh`` creates its dimension groups) and keeps the one of the calling rank's world. So every rank of the
job constructs the averager on its own world at the same time; two averagers on disjoint worlds of one family run
side by side, each waiting only for its own world's ranks.

Resolving a world given as a process group reads every rank's world from the c10d store (one exchange, collective
over the job, bounded by a deadline); a mesh dimension names its family itself.
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
from collections.abc import Sequence
from typing import Any, Union

import torch.distributed as dist

from wagma.groups import DEFAULT_TIMEOUT, as_timeout, new_timeout_group, require_initialized, store_barrier

__all__ = ["World", "WorldLike", "as_world", "member_world"]


class World:
    """One world of a family of disjoint, equally large worlds that covers some ranks of the job.

    Build it with :func:`as_world` (from ``None``, a process group, a ``(DeviceMesh, dim)`` pair or a ``World``).

    Attributes:
        family: every world of the family as sorted tuples of global ranks (world-rank order: a group's order),
            sorted by first rank.
        ranks: the calling rank's world (global ranks, world-rank order); empty on a rank in no world.
        rank: the calling rank's world rank (``-1`` on a rank in no world).
        size: ranks per world.
        group: a process group over ``ranks`` (the one it was given or the job's default group), or ``None``.
    """

    def __init__(
        self, family: Sequence[Sequence[int]], group: dist.ProcessGroup | None = None, *, whole_job: bool = False
    ) -> None:
        require_initialized("World")
        me = dist.get_rank()
        fam = tuple(sorted(tuple(sorted(int(r) for r in w)) for w in family))  # sorted, as new_group orders them
        _check_family(fam, dist.get_world_size())
        self.family: tuple[tuple[int, ...], ...] = fam
        self.size: int = len(fam[0])
        self.ranks: tuple[int, ...] = next((w for w in fam if me in w), ())
        self.rank: int = self.ranks.index(me) if self.ranks else -1
        self.group = group if self.ranks else None
        self.whole_job: bool = whole_job
        #: Prefix for this world's keys in the c10d store ("" for the whole job: keys as before worlds existed).
        self.key: str = (
            "" if whole_job else "w" + hashlib.sha1(",".join(map(str, self.ranks)).encode()).hexdigest()[:10] + "/"
        )

    @property
    def is_member(self) -> bool:
        """Whether the calling rank is in one of the family's worlds."""
        return self.rank >= 0

    def global_rank(self, world_rank: int) -> int:
        """The job's rank of ``world_rank`` in the calling rank's world."""
        return self.ranks[world_rank]

    def describe(self, world_rank: int) -> str:
        """``"rank g"`` for the whole job, ``"rank g (world rank r)"`` otherwise: for messages."""
        g = self.ranks[world_rank] if 0 <= world_rank < len(self.ranks) else world_rank
        return f"rank {g}" if self.whole_job else f"rank {g} (world rank {world_rank})"

    def new_world_group(self, timeout: datetime.timedelta) -> dist.ProcessGroup:
        """:meth:`new_group` over the whole world, which always holds the calling rank: its group, never ``None``."""
        group = self.new_group(None, timeout)
        if group is None:  # pragma: no cover -- every rank is in its own world
            raise RuntimeError(f"World.new_world_group: this rank is in no world of {self.family}")
        return group

    def new_group(
        self, world_ranks: Sequence[int] | None, timeout: datetime.timedelta, *, wait: bool = True
    ) -> dist.ProcessGroup | None:
        """Create the group of ``world_ranks`` (``None``: the whole world) in every world of the family.

        Collective over the job: every rank calls it with the same ``world_ranks``, in the same order.
        ``wait=True`` returns once every rank has created every world's group
        (:func:`wagma.groups.new_timeout_group`); ``wait=False`` is a plain ``new_group``, for a caller that
        meets its groups' members itself afterwards.

        Returns:
            The calling rank's group, or ``None`` where the calling rank is not in it.
        """
        if world_ranks is not None:
            bad = [r for r in world_ranks if not 0 <= r < self.size]
            if bad or len(set(world_ranks)) != len(world_ranks):
                raise ValueError(
                    f"world_ranks: expected distinct world ranks in [0, {self.size}), found {list(world_ranks)}"
                )
        if not self.whole_job:
            self._agree(world_ranks, timeout)
        mine: dist.ProcessGroup | None = None
        for world in self.family:
            ranks = list(world) if world_ranks is None else [world[r] for r in world_ranks]
            arg = None if self.whole_job and world_ranks is None else ranks
            group = new_timeout_group(arg, timeout) if wait else dist.new_group(arg, timeout=timeout)
            if world == self.ranks and isinstance(group, dist.ProcessGroup):
                mine = group
        return mine

    def _agree(self, world_ranks: Sequence[int] | None, timeout: datetime.timedelta) -> None:
        """Check that every rank asks for the same group now (else the creations would pair wrongly and hang).

        Raises:
            ValueError: naming two ranks that asked for different groups (e.g. different averagers per world).
        """
        asked = "all" if world_ranks is None else ",".join(map(str, world_ranks))
        values = _exchange("World.new_group", asked, timeout)
        if len(set(values)) > 1:
            first = values[0]
            other = next(r for r, v in enumerate(values) if v != first)
            raise ValueError(
                f"World.new_group: rank 0 creates the group of world ranks [{first}] while rank {other} creates "
                f"[{values[other]}]; every world of a family builds the same averager, with the same arguments, "
                "at the same time (group creation is collective over the job)"
            )

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its process group (a group cannot be pickled; the ranks and the family are kept)."""
        return {k: v for k, v in self.__dict__.items() if k != "group"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.group = None

    def __repr__(self) -> str:
        if self.whole_job:
            return f"World(whole job, {self.size} ranks)"
        return f"World(ranks={list(self.ranks)}, {len(self.family)} worlds of {self.size})"


WorldLike = Union[None, World, dist.ProcessGroup, "tuple[Any, str]"]
"""What a ``world=`` argument accepts: ``None`` (the whole job), a :class:`World`, a ``ProcessGroup`` over the
calling rank's world, or a ``(DeviceMesh, dim_name)`` pair (see :func:`as_world`)."""

_exchanges = itertools.count()  # the same sequence on every rank: resolving a process group is collective


def as_world(world: WorldLike, timeout: datetime.timedelta | float = DEFAULT_TIMEOUT) -> World:
    """Resolve a ``world=`` argument.

    Args:
        world: ``None`` for the whole job; a :class:`World` (returned as is); a ``ProcessGroup`` over the calling
            rank's world (``GroupMember.NON_GROUP_MEMBER`` on a rank in none), in which case every rank of the
            job calls this at the same time and the worlds are exchanged through the c10d store; or a
            ``(DeviceMesh, dim_name)`` pair, whose dimension's groups are the family.
        timeout: deadline of the exchange for a process group.

    Raises:
        ValueError: for anything else, or worlds that overlap or differ in size (naming them).
        TimeoutError: if some rank did not take part in the exchange within ``timeout``.
    """
    require_initialized("as_world")
    if world is None:
        return World([range(dist.get_world_size())], dist.group.WORLD, whole_job=True)
    if isinstance(world, World):
        return world
    if isinstance(world, tuple) and len(world) == 2 and isinstance(world[1], str):
        return _mesh_world(*world)
    if isinstance(world, dist.ProcessGroup) or world is dist.GroupMember.NON_GROUP_MEMBER:
        return _exchanged_world(world, as_timeout(timeout))
    raise ValueError(
        "world: expected None (the whole job), a wagma.World, a ProcessGroup or a (DeviceMesh, dim_name) pair, "
        f"found {type(world).__name__}"
    )


def member_world(world: WorldLike, timeout: datetime.timedelta | float = DEFAULT_TIMEOUT) -> World:
    """:func:`as_world`, for a rank that works inside its world: refuse one that is in none of the worlds.

    Raises:
        ValueError: if the calling rank is in none of the worlds (naming them), or whatever :func:`as_world` raises.
    """
    resolved = as_world(world, timeout)
    if not resolved.is_member:
        raise ValueError(f"world: rank {dist.get_rank()} is in none of the worlds {list(resolved.family)}")
    return resolved


def _mesh_world(mesh: Any, dim: str) -> World:
    names = getattr(mesh, "mesh_dim_names", None)
    if not hasattr(mesh, "mesh") or names is None:
        raise ValueError(
            f"world: expected (DeviceMesh with named dimensions, dim_name), found ({type(mesh).__name__}, {dim!r})"
        )
    if dim not in names:
        raise ValueError(f"world: the mesh has the dimensions {tuple(names)}, found {dim!r}")
    d = names.index(dim)
    grid = mesh.mesh
    family = grid.movedim(d, -1).reshape(-1, grid.shape[d]).tolist()
    if grid.numel() != dist.get_world_size():
        raise ValueError(
            f"world: the mesh covers {grid.numel()} ranks, the job has {dist.get_world_size()}; "
            "a mesh over part of the job is not supported yet"
        )
    return World(family, mesh.get_group(dim), whole_job=len(family) == 1)


def _exchange(what: str, value: str, timeout: datetime.timedelta) -> list[str]:
    """Every rank's ``value``, in rank order, through the default store; collective over the job, bounded.

    Raises:
        TimeoutError: naming the ranks that did not take part within ``timeout``.
    """
    me, size = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    key = f"wagma/worlds/{next(_exchanges)}"
    store.set(f"{key}/{me}", value)
    try:
        store.wait([f"{key}/{r}" for r in range(size)], timeout)
    except dist.DistStoreError as err:
        there = [r for r in range(size) if store.check([f"{key}/{r}"])]
        raise TimeoutError(
            f"{what}: rank(s) {sorted(set(range(size)) - set(there))} did not take part within "
            f"{timeout.total_seconds():.0f} s; every rank of the job builds its averager (on its own world) at the "
            "same time"
        ) from err
    values = [store.get(f"{key}/{r}").decode() for r in range(size)]
    store_barrier(store, f"{key}/read", size, timeout)  # every rank has read every key
    store.delete_key(f"{key}/{me}")
    return values


def _exchanged_world(group: Any, timeout: datetime.timedelta) -> World:
    ranks = list(dist.get_process_group_ranks(group)) if isinstance(group, dist.ProcessGroup) else []
    values = _exchange("as_world", ",".join(map(str, ranks)), timeout)
    worlds = {tuple(int(x) for x in v.split(",") if x) for v in values}
    worlds.discard(())
    if not worlds:
        raise ValueError("world: no rank is in any world (every rank passed a group it is not a member of)")
    whole = len(worlds) == 1 and len(next(iter(worlds))) == dist.get_world_size()
    return World(sorted(worlds), group, whole_job=whole and isinstance(group, dist.ProcessGroup))


def _check_family(family: tuple[tuple[int, ...], ...], job: int) -> None:
    sizes = {len(w) for w in family}
    if len(sizes) != 1 or 0 in sizes:
        raise ValueError(
            "world: expected worlds of one size (a family of disjoint, equally large worlds), found "
            + ", ".join(f"{list(w)}" for w in family)
        )
    seen: dict[int, tuple[int, ...]] = {}
    for w in family:
        for r in w:
            if r in seen:
                raise ValueError(f"world: expected disjoint worlds, found rank {r} in {list(seen[r])} and {list(w)}")
            if not 0 <= r < job:
                raise ValueError(f"world: rank {r} is outside the job's {job} ranks")
            seen[r] = w
