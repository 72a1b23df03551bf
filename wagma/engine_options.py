"""The options every engine round runs under, checked once (:class:`RoundOptions`).

Both engines of :mod:`wagma.engine` take these, and the application checks its configs with the same functions
(:func:`check_max_lead`, :func:`check_progress_nice`), so a value is refused with one message wherever it comes from.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Literal

from wagma.checks import check_choice, check_int, fail, is_int

__all__ = [
    "SYNCS",
    "TRIGGERS",
    "RoundOptions",
    "Sync",
    "Trigger",
    "check_max_lead",
    "check_progress_nice",
    "check_timeout",
]

Trigger = Literal["any", "initiator"]
Sync = Literal["barrier", "wait_avoiding"]
#: How a sync round runs: "barrier" (blocking, fresh tensors of all ranks) or "wait_avoiding" (triggered by
#: the first arrival like the group rounds; a late rank contributes its last published tensor).
SYNCS: tuple[str, ...] = ("barrier", "wait_avoiding")
#: Who starts a round: "any" (the first rank to arrive) or "initiator" (one rank per round, drawn from the seed).
TRIGGERS: tuple[str, ...] = ("any", "initiator")


def check_progress_nice(value: object, name: str = "progress_nice") -> int:
    """Return ``value`` if it is a valid ``progress_nice`` (an integer in [0, 19]), else raise ``ValueError``."""
    return check_int(name, value, 0, 19)


def check_max_lead(value: object, sync_period: int, name: str = "max_lead") -> int:
    """Return ``value`` if it is a valid ``max_lead`` for ``sync_period`` (an integer in [0, sync_period]).

    A blocking sync round needs the fresh tensor, so the thread can never lead by more; under
    ``sync="wait_avoiding"`` ``max_lead`` is the staleness bound, kept within the sync period.
    """
    if not is_int(value) or not 0 <= value <= max(sync_period, 0):
        raise fail(name, f"an integer in [0, sync_period={sync_period}]", value, "no thread leads past a sync round")
    return value


def check_timeout(value: object, name: str = "timeout") -> datetime.timedelta:
    """Return ``value`` if it is a positive ``datetime.timedelta``, else raise ``ValueError``."""
    if not isinstance(value, datetime.timedelta) or value.total_seconds() <= 0:
        raise fail(name, "a positive datetime.timedelta", value)
    return value


@dataclasses.dataclass(frozen=True)
class RoundOptions:
    """How an engine's rounds run, the same on every rank; checked once, when it is made (``ValueError``).

    Both engines take these fields as keywords and keep them as ``engine.options``; a caller that checks its own
    configuration (the application, a hook) can make one to check the values before any engine exists.

    Attributes:
        sync_period: rounds k with ``k % (sync_period + 1) == sync_period`` are blocking global
            allreduces of fresh tensors (0: every round). Bounds staleness.
        max_lead: how many rounds the progress thread may run ahead of its main thread (0: it waits
            for the main thread every round). Defaults to ``sync_period``; each round of lead can
            hold one result buffer until the main thread consumes it. It bounds staleness: a rank's
            contribution to round k is its call ``k - max_lead`` or newer, on every round.
        sync: ``"barrier"`` (sync rounds block until every rank's fresh tensor is in) or
            ``"wait_avoiding"`` (sync rounds are global rounds run like the group rounds: no rank waits
            for another to arrive; the staleness bound ``max_lead`` holds for them too).
        timeout: bound of every wait: collectives, store calls, and the main thread's wait for a result.
        trigger: ``"any"`` (the first rank to arrive triggers the round: WAGMA, eager-SGD solo) or
            ``"initiator"`` (one rank per round, drawn from ``seed`` identically on every rank,
            triggers it by its arrival alone: eager-SGD majority).
        seed: seed of the initiator draw.
        start_round: the round of the first call (to resume a run: every rank passes the same value).
        progress_nice: CPU tensors on Linux: run the progress thread, and the threads of the engine's gloo
            communicators, this many nice levels below the calling thread (0: the same priority; at most 19).
            Where ranks share cores, their compute then goes first and the exchanges fill the idle time, which
            pays when no one waits for the exchange at once (``submit`` now, ``collect`` a step later); an
            exchange someone waits for can take longer. Ignored for CUDA tensors, whose collectives run on the GPU.
    """

    sync_period: int
    max_lead: int = None  # type: ignore[assignment]  # None until __post_init__ makes it sync_period
    sync: Sync = "barrier"
    trigger: Trigger = "any"
    timeout: datetime.timedelta = datetime.timedelta(minutes=5)
    seed: int = 0
    start_round: int = 0
    progress_nice: int = 0

    def __post_init__(self) -> None:
        check_int("sync_period", self.sync_period, 0)
        if self.max_lead is None:
            object.__setattr__(self, "max_lead", self.sync_period)
        check_max_lead(self.max_lead, self.sync_period)
        check_choice("sync", self.sync, SYNCS)
        check_choice("trigger", self.trigger, TRIGGERS)
        check_int("start_round", self.start_round, 0)
        check_timeout(self.timeout)
        check_progress_nice(self.progress_nice)
        object.__setattr__(self, "seed", int(self.seed))
