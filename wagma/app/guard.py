"""A run-time guard: say so, while a run trains and in its summary, when it is not learning or runs staler than
its policy was validated for.

A policy that waits less can lose the model: with gradients or models too stale to learn from, a run ends
with a normal summary and exit status 0, its accuracy at chance. :class:`TrainingGuard` watches what every
step already measures and turns three symptoms into one line each, naming the policy, the measured staleness
and what to try:

- **diverged**: a non-finite training loss;
- **stalled**: the training loss, averaged over windows of ``window`` steps, has not improved on its best by 1 %
  for ``patience`` steps while it is still above half of its reference (a run that has learned and levelled off
  is not stalled), or it has stayed above half of the progress it had made (the best window's drop from the
  reference) for ``patience`` steps (a spike that training recovers from is not a collapse: synchronous SGD with
  momentum 0.9 has one on MNIST/CNN around step 50), or the final test accuracy is at chance level (at most
  1.5 / classes). The reference is the first
  window's mean, or the loss of a model at chance (``chance_loss``, ln C for C classes) when that is lower: a
  loss that explodes at first and then sits at chance level has made no progress;
- **too stale**: the policy's mean staleness (rounds, as the policy reports it; this rank's running mean once
  ``patience`` steps are in, the mean over all ranks at the end) exceeds ``validated_staleness``, set from the
  preset's grid (``benchmarks/results/accuracy/``): 1.1 x the largest run-mean staleness at which the preset held
  its accuracy, kept below any staleness at which it lost it (0.0: none validated, every stale run is flagged).

Each symptom is reported once (a ``logging`` warning on the rank that observes it; the training loop feeds rank
0 while it runs) and all of them end up in ``summary.json`` as ``guard`` (``{"ok": bool, "warnings": [...]}``).
The guard never communicates: ranks need not agree on it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from wagma.checks import check_optional_number

__all__ = ["TrainingGuard"]

_IMPROVEMENT = 0.01  # a window must beat the best by this fraction to count as progress


class TrainingGuard:
    """Watches one rank's training loss and its policy's staleness; collects one warning line per symptom.

    Args:
        policy: the policy's name, as the warning lines give it.
        steps: the run's number of steps (sets the default window and patience).
        validated_staleness: the largest mean staleness (rounds) the policy was validated for; ``None``: no check.
        remedy: what to try, as the warning lines end (``"try ..."``).
        window: steps per loss window (default ``max(10, steps // 20)``).
        patience: steps without a better window before a loss still high is called stalled (default
            ``max(5 * window, steps // 4)``).
        start_step: the first step this attempt runs (a resumed run watches from there).
        chance_loss: the training loss of a model that guesses (``math.log(classes)`` for cross-entropy); ``None``:
            the first window alone is the reference.
    """

    def __init__(
        self,
        policy: str,
        steps: int,
        *,
        validated_staleness: float | None = None,
        remedy: str = "",
        window: int | None = None,
        patience: int | None = None,
        start_step: int = 0,
        chance_loss: float | None = None,
    ) -> None:
        self.validated_staleness = check_optional_number("validated_staleness", validated_staleness, 0)
        self.window = max(10, steps // 20) if window is None else int(window)
        self.patience = max(5 * self.window, steps // 4) if patience is None else int(patience)
        if self.window < 1 or self.patience < 1:
            raise ValueError(f"window and patience: expected integers >= 1, found {self.window} and {self.patience}")
        self.policy = policy
        self.remedy = remedy
        self.chance_loss = chance_loss
        self.warnings: list[str] = []
        self._kinds: set[str] = set()
        self._sum, self._count = 0.0, 0
        self._first: float | None = None
        self._best: float | None = None
        self._best_step = self._start = start_step
        self._above = 0  # consecutive windows that gave back more than half of the progress made
        self._staleness: float | None = None
        self._staleness_max: int | None = None

    @property
    def ok(self) -> bool:
        """Whether no symptom was seen."""
        return not self.warnings

    def observe(self, step: int, loss: float, stats: dict[str, Any] | None = None) -> str | None:
        """Take step ``step``'s training loss and the policy's counters; return a new warning line, if any.

        Args:
            step: the number of completed steps.
            loss: this step's training loss on this rank.
            stats: the policy's ``stats()`` (``staleness``, ``staleness_max`` where it reports them).
        """
        if stats:
            if stats.get("staleness") is not None:
                self._staleness = float(stats["staleness"])
            if stats.get("staleness_max") is not None:
                self._staleness_max = int(stats["staleness_max"])
        if not math.isfinite(loss):
            return self._warn("diverged", f"the training loss is {loss} at step {step}")
        self._sum += loss
        self._count += 1
        new: str | None = None
        if self._count == self.window:
            new = self._window_done(step, self._sum / self._count)
            self._sum, self._count = 0.0, 0
        # The running mean of the first rounds is noisy: judge it once a quarter of the run (patience) is in.
        if (
            self.validated_staleness is not None
            and self._staleness is not None
            and self._staleness > self.validated_staleness
            and step - self._start >= self.patience
        ):
            new = self._warn("stale", f"measured at step {step}") or new
        return new

    def _window_done(self, step: int, mean: float) -> str | None:
        if self._first is None:
            self._first = self._best = mean
            self._best_step = step
            return None
        assert self._best is not None
        if mean < self._best * (1 - _IMPROVEMENT):
            self._best, self._best_step = mean, step
        reference = self._first if self.chance_loss is None else min(self._first, self.chance_loss)
        progress = reference - self._best
        self._above = self._above + 1 if progress > 0.1 * reference and mean >= self._best + 0.5 * progress else 0
        if self._above * self.window >= self.patience:
            return self._warn(
                "stalled",
                f"the training loss rose back to {mean:.3g} and stayed there for "
                f"{self._above * self.window} steps (best {self._best:.3g} at step "
                f"{self._best_step}, first {self._first:.3g})",
            )
        if step - self._best_step >= self.patience and self._best >= 0.5 * reference:
            return self._warn(
                "stalled",
                f"the training loss ({mean:.3g} over the last {self.window} steps, first "
                f"{self._first:.3g}) has not improved since step {self._best_step}",
            )
        return None

    def finish(
        self,
        *,
        staleness: float | None = None,
        staleness_max: int | None = None,
        test_accuracy: float | None = None,
        num_classes: int | None = None,
        steps: int | None = None,
    ) -> list[str]:
        """The run's end: check its final numbers (the mean staleness over the ranks, the final test accuracy)
        and return every warning line."""
        if staleness is not None:
            self._staleness = float(staleness)
        if staleness_max is not None:
            self._staleness_max = int(staleness_max)
        if (
            self.validated_staleness is not None
            and self._staleness is not None
            and self._staleness > self.validated_staleness
        ):
            self._warn("stale", "measured over the run")
        if test_accuracy is not None and num_classes and test_accuracy <= 1.5 / num_classes:
            self._warn(
                "stalled",
                f"the final test accuracy {100 * test_accuracy:.2f} % is at chance level "
                f"({100 / num_classes:.0f} % for {num_classes} classes)" + (f" after {steps} steps" if steps else ""),
            )
        return list(self.warnings)

    def _staleness_text(self) -> str:
        if self._staleness is None:
            return "no staleness reported"
        parts = [] if self._staleness_max is None else [f"max {self._staleness_max}"]
        if self.validated_staleness is not None:
            parts.append(f"validated up to {self.validated_staleness:g}")
        return f"staleness {self._staleness:.2f} rounds" + (f" ({', '.join(parts)})" if parts else "")

    def _warn(self, kind: str, what: str) -> str | None:
        if kind in self._kinds:
            return None
        self._kinds.add(kind)
        label = {"diverged": "diverged", "stalled": "is not learning", "stale": "runs staler than validated"}[kind]
        line = f"{self.policy} {label}: {what}; {self._staleness_text()}" + (
            f"; try {self.remedy}" if self.remedy else ""
        )
        self.warnings.append(line)
        return line

    @staticmethod
    def summary_field(warnings: Sequence[str]) -> dict[str, Any]:
        """``summary.json``'s ``guard`` entry for these warning lines."""
        return {"ok": not warnings, "warnings": list(warnings)}
