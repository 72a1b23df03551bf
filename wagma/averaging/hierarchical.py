"""Two-level averaging: fixed groups of nearby ranks often, all ranks rarely (Cong et al., docs/design.md §2.5)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from wagma.averaging.base import AveragerBase, Reduction
from wagma.averaging.guards import warn_at_caller
from wagma.checks import check_int, fail
from wagma.groups import (
    DEFAULT_TIMEOUT,
    as_timeout,
    contiguous_subgroups,
    group_ranks,
    require_initialized,
)
from wagma.schedule import check_group_fits
from wagma.wire import WireDtype
from wagma.world import WorldLike, as_world

__all__ = ["HierarchicalAverager"]


class HierarchicalAverager(AveragerBase):
    """Local means inside fixed contiguous groups every ``local_period`` steps, global every ``global_period``.

    The ranks of the global group are cut into contiguous blocks of ``local_group_size`` (node-local when
    ranks are numbered node by node). After ``warmup_steps``, with ``s = step - warmup_steps``:

    - ``s % global_period == 0``: global mean over all ranks (``"global"``);
    - else ``s % local_period == 0``: mean inside this rank's block (``"local"``);
    - else nothing. On a step where both fire only the global mean runs.

    Counting from the end of the warm-up (not from step 0, as torch's ``HierarchicalModelAverager``
    does) makes the one-level cases equal :class:`PeriodicAverager`: with ``local_period ==
    global_period`` only global means run, every ``global_period`` steps; with ``local_group_size`` equal
    to the number of ranks the "local" group is everyone, so those means run (and count) as global
    ones, every ``local_period`` steps. With ``local_group_size == 1`` local means are no-ops and are
    skipped (nothing is sent or counted). These three cases are not hierarchical and warn once, at
    construction (a ``UserWarning`` naming the :class:`PeriodicAverager` they equal). A ``local_group_size``
    larger than the world raises ``ValueError`` saying so.

    Every rank creates all local groups in the constructor, in the same order.

    Args:
        local_group_size: ranks per local group; must divide the number of ranks.
        local_period: steps between local means; at least 1.
        global_period: steps between global means; a multiple of ``local_period``.
        warmup_steps: calls before the first mean; at least 0.
        process_group: group of the global mean; ``None`` creates a timeout-bound group over all ranks.
            A given group must span every rank of the default group (local groups are cut from it).
        average_buffers: also average the floating-point buffers passed to ``average_parameters``.
        timeout: timeout of the groups this averager creates (``timedelta`` or seconds).
        world: the ranks to average over (:func:`wagma.world.as_world`; ``None``: the whole job); local blocks
            are cut from the world's ranks.
        wire_dtype: the dtype reductions send and sum in (:mod:`wagma.wire`; ``None``: the model's own): deltas from
            the last global average, in ``"bf16"`` or ``"fp16"``, half the bytes.
    """

    def __init__(
        self,
        local_group_size: int,
        local_period: int,
        global_period: int,
        warmup_steps: int = 0,
        process_group: dist.ProcessGroup | None = None,
        *,
        average_buffers: bool = True,
        timeout: datetime.timedelta | float = DEFAULT_TIMEOUT,
        world: WorldLike = None,
        wire_dtype: WireDtype = None,
    ) -> None:
        self.local_group_size = check_int("local_group_size", local_group_size, 1)
        self.local_period = check_int("local_period", local_period, 1)
        self.global_period = check_int("global_period", global_period, 1)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        if global_period % local_period != 0:
            raise fail("global_period", f"a multiple of local_period ({local_period})", global_period)
        # Check everything that needs the world before creating any group, so a bad argument cannot leave
        # some ranks inside a collective group creation.
        require_initialized(type(self).__name__)
        resolved = as_world(world, as_timeout(timeout))
        world_size = resolved.size
        _check_process_group(process_group, world_size)
        check_group_fits(local_group_size, world_size, "local_group_size")
        if world_size % local_group_size != 0:
            raise fail("local_group_size", f"a divisor of the number of ranks ({world_size})", local_group_size)
        super().__init__(
            process_group, average_buffers=average_buffers, timeout=timeout, world=resolved, wire_dtype=wire_dtype
        )
        self._global_every = local_period if local_group_size == world_size else global_period
        self._has_local = 1 < local_group_size < world_size
        self.local_group: dist.ProcessGroup | None = None
        #: The local groups as lists of global ranks (block k holds ranks k*S .. k*S+S-1 of the global group).
        self.local_blocks: list[list[int]] = [[r] for r in group_ranks(self.process_group)]
        if self._has_local and process_group is None:  # blocks of world ranks, cut in every world of the family
            blocks = [list(range(i, i + local_group_size)) for i in range(0, world_size, local_group_size)]
            for block in blocks:
                group = self._new_group(block)
                if self.world.rank in block:
                    self.local_group = group
            if self.world.is_member:
                self.local_blocks = [[self.world.global_rank(r) for r in block] for block in blocks]
        elif self._has_local:
            self.local_group, self.local_blocks = contiguous_subgroups(
                local_group_size, group_ranks(self.process_group), self.timeout
            )
            if self.local_group is not None:
                self._owned_groups.append(self.local_group)
        elif local_group_size == world_size:
            self.local_blocks = [group_ranks(self.process_group)]
        degenerate = self._not_hierarchical(world_size)
        if degenerate is not None:
            warn_at_caller(degenerate)

    def _not_hierarchical(self, world: int) -> str | None:
        """The warning for a configuration with one level only on this world size, or ``None``."""
        if self.local_group_size == world:
            why = (
                f"local_group_size {self.local_group_size} equals the world ({world} ranks), "
                "so every local mean is global"
            )
            period = self.local_period
        elif self.local_group_size == 1:
            why = "local_group_size 1 makes every local mean a no-op"
            period = self.global_period
        elif self.local_period == self.global_period:
            why = f"local_period equals global_period ({self.global_period}), so a global mean replaces every local one"
            period = self.global_period
        else:
            return None
        return (
            f"HierarchicalAverager is not hierarchical on this world: {why}; it degenerates to plain periodic "
            f"averaging, a global mean every {period} step(s), as PeriodicAverager(period={period}, "
            f"warmup_steps={self.warmup_steps}) does. For two levels use 1 < local_group_size < {world} "
            "and a global_period larger than local_period"
        )

    def reduction_at(self, step: int) -> Reduction | None:
        """The reduction the call with this ``step`` runs: ``"global"``, ``"local"`` or ``None``."""
        if step < self.warmup_steps:
            return None
        s = step - self.warmup_steps
        if s % self._global_every == 0:
            return "global"
        if self._has_local and s % self.local_period == 0:
            return "local"
        return None

    def _average_step(self, tensors: list[torch.Tensor]) -> Reduction | None:
        kind = self.reduction_at(self.step)
        if kind == "global":
            self.allreduce_mean(tensors, self.process_group, "global")
        elif kind == "local":
            assert self.local_group is not None  # _has_local and a member: the constructor made it
            self.allreduce_mean(tensors, self.local_group, "local")
        return kind

    def __repr__(self) -> str:
        return (
            f"HierarchicalAverager(local_group_size={self.local_group_size}, local_period={self.local_period}, "
            f"global_period={self.global_period}, warmup_steps={self.warmup_steps}, step={self.step})"
        )


def _check_process_group(process_group: dist.ProcessGroup | None, world_size: int) -> None:
    """``None``, or a group this rank is in that spans all ``world_size`` ranks (local groups are cut from it)."""
    if process_group is not None:
        if not isinstance(process_group, dist.ProcessGroup) or process_group.size() != world_size:
            found = process_group.size() if isinstance(process_group, dist.ProcessGroup) else "none (not a member)"
            raise ValueError(
                f"process_group: expected a group spanning all {world_size} ranks (local groups are cut from it), "
                f"found {found} ranks"
            )
