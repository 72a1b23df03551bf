"""Who did not arrive: name the ranks behind a failed step, whatever the averaging policy.

A collective that times out says only that it timed out (gloo), or names a peer only where the policy's
engine knows it. The training loop therefore keeps a roll call in the default process group's c10d store:

- every rank publishes the step it begins (one store ``set`` per step: ``step/<rank>``), and
  :data:`FINAL` as it begins the final phase after the loop (final checkpoint, the policy's finalize, the
  test evaluation: collectives too, where a frozen rank must be named as well);
- a rank whose step fails publishes that (``failed/<rank>``) and waits, at most ``report_s``, for the
  other ranks' reports. Ranks blocked in the same broken collective fail within about the same timeout and
  report at once, so the wait ends early unless a rank really is missing;
- the ranks that sent no report are the ones that did not arrive: dead, frozen (``SIGSTOP``), or stuck
  elsewhere. :meth:`RollCall.failure` returns a ``RuntimeError`` that names them, the step each last
  began, the step this rank failed in, and the original error. When every rank reported, no rank is
  missing: the failure is shared (a checkpoint that no rank could save, say) and its own error is raised
  unchanged.

Keys live under a per-call namespace and are not deleted: a run holds 2 keys per rank.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import logging
import time
from collections.abc import Iterator

import torch.distributed as dist

from wagma.checks import check_number, fail, is_int

__all__ = ["FINAL", "RollCall"]

log = logging.getLogger(__name__)

_calls = itertools.count()  # every rank creates its roll calls in the same order: one namespace each

#: The "step" of the final phase after the training loop (see :meth:`RollCall.begin`).
FINAL = "final"

Step = int | str  # a 0-based step, or FINAL


def _at(step: Step | None) -> str:
    """How a message names a step: ``step 12``, or ``the final phase`` for :data:`FINAL`."""
    if step is None:
        return "step ?"
    return "the final phase (final checkpoint, finalize, test evaluation)" if step == FINAL else f"step {step}"


class RollCall:
    """This rank's entry in the roll call of one training run; collective to create (same order on every rank).

    Args:
        rank: this rank.
        world_size: ranks in the default process group.
        report_s: how long a failing rank waits for the other ranks' failure reports.
        store: where the roll call lives; defaults to the default process group's store.
    """

    def __init__(self, rank: int, world_size: int, *, report_s: float = 3.0, store: dist.Store | None = None) -> None:
        check_number("report_s", report_s, 0)
        base = store if store is not None else dist.distributed_c10d._get_default_store()
        self._store = dist.PrefixStore(f"wagma/roll_call/{next(_calls)}/", base)
        self.rank, self.world_size, self.report_s = rank, world_size, float(report_s)
        self._step: Step | None = None

    def begin(self, step: Step) -> None:
        """Publish that this rank begins ``step`` (0-based, or :data:`FINAL`); :meth:`watching` blames a failure on
        it."""
        if not (step == FINAL or (is_int(step) and step >= 0)):
            raise fail("step", f"an integer >= 0 or {FINAL!r}", step)
        self._step = step
        self._store.set(f"step/{self.rank}", str(step))

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Around the training loop and the final phase: turn an ``Exception`` into :meth:`failure`'s error for the
        step last begun (a step, or :data:`FINAL`)."""
        try:
            yield
        except Exception as err:
            if self._step is None:
                raise
            failure = self.failure(self._step, err)
            if failure is None:  # every rank failed too: the original error says all there is
                raise
            # Logged at once: the exception itself surfaces only after the caller's teardown, and torchrun
            # may stop this process in between, when another rank exits first.
            log.error("%s", failure)
            raise failure from err

    def failure(self, step: Step, error: BaseException) -> RuntimeError | None:
        """Report that ``step`` (or :data:`FINAL`) failed here with ``error``; return the error to raise, naming the
        absent ranks.

        Returns None when every other rank reported a failure as well: none is missing.

        Waits for the other ranks' reports at most ``report_s`` seconds; never raises itself (a store that
        broke as well leaves the ranks unnamed, and the message says so).
        """
        cause = f"{type(error).__name__}: {error}"
        try:
            self._store.set(f"failed/{self.rank}", str(step))
            absent = self._absent()
            last = {r: self._last_step(r) for r in absent}
        except Exception as store_error:  # noqa: BLE001 - the report must not hide the original error
            return RuntimeError(
                f"{_at(step)} failed on rank {self.rank}, and the roll call that names the ranks that did not "
                f"arrive failed too ({type(store_error).__name__}: {store_error}); cause: {cause}"
            )
        if not absent:
            return None
        began = ", ".join(f"rank {r} last began {_at(s)}" for r, s in last.items())
        return RuntimeError(
            f"{_at(step)} failed on rank {self.rank}: rank(s) {absent} did not arrive at {_at(step)} -- they sent "
            f"no failure report within {self.report_s:g} s, so they died, froze (SIGSTOP) or hang elsewhere "
            f"({began}); check those ranks and their hosts; cause here: {cause}"
        )

    def _absent(self) -> list[int]:
        """The ranks whose failure report has not arrived within ``report_s``."""
        keys = {r: f"failed/{r}" for r in range(self.world_size) if r != self.rank}
        deadline = time.monotonic() + self.report_s
        while True:
            missing = [r for r, key in keys.items() if not self._store.check([key])]
            left = deadline - time.monotonic()
            if not missing or left <= 0:
                return missing
            try:  # block on one missing report at a time, never beyond the deadline
                self._store.wait([keys[missing[0]]], datetime.timedelta(seconds=left))
            except Exception:  # noqa: BLE001 - DistStoreError on time: the next look returns
                pass

    def _last_step(self, rank: int) -> Step | None:
        key = f"step/{rank}"
        if not self._store.check([key]):
            return None
        value = self._store.get(key).decode()
        return value if value == FINAL else int(value)
