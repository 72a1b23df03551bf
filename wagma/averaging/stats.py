"""The counters every averager and eager hook state keeps in ``self.stats``: :class:`AveragerStats`.

Reductions (global and local), bytes handed to collectives, seconds waited, and for the wait-avoiding ones fresh
and stale contributions with their staleness histogram; plain data, copied to dicts for logs, JSON and checkpoints
and rebuilt from them. The averagers (:mod:`wagma.averaging.base`) and the eager hook states
(:mod:`wagma.hooks.partial`, :mod:`wagma.hooks.fsdp`) share it; :mod:`wagma.averaging.base` re-exports both names.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from wagma.checks import check_int, fail

__all__ = ["AveragerStats", "Reduction"]

#: Kind of reduction an averager ran at a step: among a subset of ranks, or among all of them.
Reduction = Literal["local", "global"]


@dataclasses.dataclass
class AveragerStats:
    """Counters every averager keeps in ``self.stats`` (per rank, cumulative since construction).

    Attributes:
        global_reductions: reductions over all ranks (including :meth:`AveragerBase.synchronize`).
        local_reductions: reductions over a subset of ranks (node-local or schedule groups).
        bytes_sent: payload bytes this rank handed to collectives: the size of every reduced buffer,
            once per reduction (not the algorithm's wire traffic, which depends on the backend).
        wait_s: seconds spent issuing and waiting for blocking collectives.
        fresh_contributions: rounds in which this rank's current model made it into its group's
            reduction (wait-avoiding averagers; synchronous ones leave it at 0).
        stale_contributions: rounds in which an older snapshot was used instead.
        staleness_hist: staleness in rounds -> number of contributions with that staleness.
    """

    global_reductions: int = 0
    local_reductions: int = 0
    bytes_sent: int = 0
    wait_s: float = 0.0
    fresh_contributions: int = 0
    stale_contributions: int = 0
    staleness_hist: dict[int, int] = dataclasses.field(default_factory=dict)

    def record_reduction(self, kind: Reduction, nbytes: int, wait_s: float) -> None:
        """Count one reduction of ``kind`` that sent ``nbytes`` and blocked for ``wait_s`` seconds."""
        if kind == "global":
            self.global_reductions += 1
        elif kind == "local":
            self.local_reductions += 1
        else:
            raise fail("kind", "'local' or 'global'", kind)
        self.bytes_sent += int(nbytes)
        self.wait_s += float(wait_s)

    def record_contribution(self, staleness: int) -> None:
        """Count one contribution that was ``staleness`` rounds old (0: fresh)."""
        check_int("staleness", staleness, 0)
        if staleness == 0:
            self.fresh_contributions += 1
        else:
            self.stale_contributions += 1
        self.staleness_hist[staleness] = self.staleness_hist.get(staleness, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        """A plain, independent copy of the counters (for logging, JSON and checkpoints)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> AveragerStats:
        """Rebuild counters from :meth:`as_dict` output (histogram keys may have become strings in JSON).

        Raises:
            ValueError: if ``state`` lacks a field or has an unknown one.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        if set(state) != names:
            raise ValueError(f"stats: expected the fields {sorted(names)}, found {sorted(state)}")
        values = dict(state)
        values["staleness_hist"] = {int(k): int(v) for k, v in state["staleness_hist"].items()}
        return cls(**values)
