"""What rank 0 shows while it trains: a live bar on a terminal, a plain line every N steps anywhere else.

A live ``tqdm`` bar redraws itself with carriage returns, which is right on a terminal and garbage in a
log file (one "line" of thousands of redraws). So :class:`Progress` looks at its stream: a terminal
gets the bar (postfix: loss and wait of the latest record); anything else (a log file, CI, a pipe) gets
one line every ``every`` steps and at the last step::

    train step 150/300 (50%) | loss 0.0412 | 12,345 samples/s | test accuracy 96.11 % | ETA 0:00:03

``samples/s`` is the run's throughput (all ranks) since the previous line, the ETA extrapolates this
attempt's mean step rate, and ``test accuracy`` is the latest periodic evaluation, once there is one.
"""

from __future__ import annotations

import datetime
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

from wagma.app.config import ConfigError
from wagma.checks import check_int, fail, is_int

__all__ = ["Progress", "progress_every"]

#: Lines per run when ``progress_every`` is not set: one every tenth of the steps.
DEFAULT_LINES = 10


def progress_every(value: Any, steps: int) -> int:
    """Steps between progress lines: ``value`` (an integer >= 1), or a tenth of ``steps`` when it is None.

    Raises:
        ConfigError: (a ``ValueError``) if ``value`` is neither None nor an integer >= 1.
    """
    if value is None:
        return max(1, round(steps / DEFAULT_LINES))
    if not is_int(value) or value < 1:
        expected = "an integer >= 1 (steps between progress lines) or null (a tenth of the steps)"
        raise ConfigError(f"invalid configuration:\n  - {fail('progress_every', expected, value)}")
    return value


class Progress:
    """Rank 0's progress display for steps ``initial + 1 .. total`` (see the module docstring).

    Call :meth:`update` after every step and :meth:`close` at the end (or use it as a context manager).
    """

    def __init__(
        self,
        *,
        total: int,
        initial: int,
        every: int,
        samples_per_step: int,
        enabled: bool = True,
        stream: TextIO | None = None,
    ) -> None:
        """
        Args:
            total: the run's last step.
            initial: the steps already done (a resumed run's checkpoint step).
            every: steps between lines when the stream is not a terminal (>= 1).
            samples_per_step: examples of one step over all ranks (batch size x world size); 0 when steps vary
                in size (batches by tokens): the line then shows no rate.
            enabled: False shows nothing (other ranks, ``progress=false``).
            stream: where to write; ``sys.stderr`` (as it is now) by default.
        """
        check_int("every", every, minimum=1)
        self._stream = stream if stream is not None else sys.stderr
        self._total, self._initial, self._every = total, initial, every
        self._samples_per_step = samples_per_step
        self._enabled = enabled
        self._bar: Any = None
        if enabled and _isatty(self._stream):
            try:
                from tqdm import tqdm
            except ImportError:  # lines instead of a bar
                pass
            else:
                self._bar = tqdm(
                    total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True, file=self._stream
                )
        self._started = self._last_t = time.perf_counter()
        self._last_done = initial
        self._loss: float | None = None
        self._wait_s: float | None = None
        self._accuracy: float | None = None

    @property
    def live(self) -> bool:
        """Whether a live bar is shown (the stream is a terminal)."""
        return self._bar is not None

    def update(self, done: int, record: Mapping[str, Any] | None = None) -> None:
        """Step ``done`` has finished; ``record`` is the metrics record written at it, if one was."""
        if not self._enabled:
            return
        if record is not None:
            self._loss = record.get("loss", self._loss)
            self._wait_s = record.get("wait_s", self._wait_s)
            self._accuracy = record.get("test_accuracy", self._accuracy)
        if self._bar is not None:
            if record is not None and self._loss is not None and self._wait_s is not None:
                self._bar.set_postfix(loss=f"{self._loss:.3f}", wait_ms=f"{1e3 * self._wait_s:.1f}")
            self._bar.update(1)
        elif (done - self._initial) % self._every == 0 or done == self._total:
            self._stream.write(self._line(done, time.perf_counter()) + "\n")
            self._stream.flush()

    def _line(self, done: int, now: float) -> str:
        parts = [f"train step {done}/{self._total} ({100 * done // max(1, self._total)}%)"]
        if self._loss is not None:
            parts.append(f"loss {self._loss:.4f}")
        if self._samples_per_step and now > self._last_t and done > self._last_done:
            rate = self._samples_per_step * (done - self._last_done) / (now - self._last_t)
            parts.append(f"{rate:,.0f} samples/s")
        if self._accuracy is not None:
            parts.append(f"test accuracy {100 * self._accuracy:.2f} %")
        if done > self._initial:
            eta_s = (self._total - done) * (now - self._started) / (done - self._initial)
            parts.append(f"ETA {datetime.timedelta(seconds=round(eta_s))}")
        self._last_t, self._last_done = now, done
        return " | ".join(parts)

    def close(self) -> None:
        """End the bar (idempotent); lines need no ending."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
