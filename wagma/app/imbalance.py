"""Load-imbalance injectors: make some ranks slower, the way the papers measure wait-avoidance.

Every rank builds the same injector (same arguments) and calls it once per training step, before the
step's compute; it sleeps this rank's delay for that step and returns the seconds it slept. Delays come
from generators seeded with ``(seed, step[, rank])``: all ranks agree on who is delayed without
communicating, and a resumed run delays exactly the ranks the uninterrupted run would have.

- ``none``: never sleeps.
- ``random_k``: each step, ``k`` ranks drawn with the shared seed sleep ``delay_s`` (the papers' method:
  2 of 64 ranks, 320 ms, about one step time).
- ``persistent``: the listed ranks are ``factor`` times slower. They sleep ``(factor - 1) * base_s`` when
  ``base_s`` is given, otherwise ``(factor - 1) *`` the compute time the loop passes in (the loop passes
  the previous step's measured local compute time, so the first step sleeps nothing).
- ``heavy_tail``: every rank sleeps a fresh lognormal or Pareto (Lomax) draw each step, capped at ``max_s``.

:meth:`Imbalance.expected_mean_delay_s` is the no-wait ideal's extra cost per step (a perfectly
wait-avoiding method pays the mean delay); :meth:`Imbalance.expected_max_delay_s` is what synchronous
SGD pays (every step waits for the slowest rank).
"""

from __future__ import annotations

import abc
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from wagma.checks import check_choice, check_int, check_number, check_optional_number, fail

__all__ = [
    "HeavyTail",
    "Imbalance",
    "KNOWN_IMBALANCES",
    "NoImbalance",
    "Persistent",
    "RandomK",
    "build_imbalance",
]


class Imbalance(abc.ABC):
    """An injector: ``delay_s(step, compute_s)`` says how long this rank sleeps at ``step``.

    Protocol: construct it identically on every rank (only ``rank`` differs), call it once per step with
    the step number and the rank's measured compute time; it sleeps and returns the seconds slept.
    ``delay_s`` is pure (no sleeping, no state), so it can be queried for any step on any rank.
    """

    name: str = ""

    def __init__(self, rank: int, world_size: int) -> None:
        self.world_size = check_int("world_size", world_size, 1)
        self.rank = check_int("rank", rank, 0, world_size - 1)

    @abc.abstractmethod
    def delay_s(self, step: int, compute_s: float = 0.0) -> float:
        """Seconds this rank is to sleep at ``step`` (``compute_s``: its measured compute time)."""

    @abc.abstractmethod
    def expected_mean_delay_s(self, compute_s: float = 0.0) -> float:
        """Expected delay per step averaged over ranks: the extra cost a no-wait method pays."""

    @abc.abstractmethod
    def expected_max_delay_s(self, compute_s: float = 0.0) -> float:
        """Expected largest delay over ranks per step: the extra cost synchronous SGD pays."""

    def __call__(self, step: int, compute_s: float = 0.0) -> float:
        """Sleep this rank's delay for ``step``; return the seconds actually slept."""
        delay = self.delay_s(step, compute_s)
        if delay <= 0.0:
            return 0.0
        start = time.perf_counter()
        time.sleep(delay)
        return time.perf_counter() - start


class NoImbalance(Imbalance):
    """No injected delay."""

    name = "none"

    def delay_s(self, step: int, compute_s: float = 0.0) -> float:
        return 0.0

    def expected_mean_delay_s(self, compute_s: float = 0.0) -> float:
        return 0.0

    def expected_max_delay_s(self, compute_s: float = 0.0) -> float:
        return 0.0


class RandomK(Imbalance):
    """Each step, ``k`` of the ranks sleep ``delay_s``; a generator seeded ``(seed, step)`` draws which."""

    name = "random_k"

    def __init__(self, rank: int, world_size: int, *, k: int, delay_s: float, seed: int = 0) -> None:
        super().__init__(rank, world_size)
        if not 0 <= int(k) <= world_size:
            raise fail("imbalance.k", f"0 <= k <= the world size {world_size} (random_k)", k)
        self.k, self.delay, self.seed = int(k), check_number("imbalance.delay_s", delay_s, 0), int(seed)

    def delayed_ranks(self, step: int) -> frozenset[int]:
        """The ranks that sleep at ``step``; the same set on every rank."""
        rng = np.random.Generator(np.random.PCG64([self.seed, step]))
        return frozenset(int(r) for r in rng.choice(self.world_size, size=self.k, replace=False))

    def delay_s(self, step: int, compute_s: float = 0.0) -> float:
        return self.delay if self.rank in self.delayed_ranks(step) else 0.0

    def expected_mean_delay_s(self, compute_s: float = 0.0) -> float:
        return self.k * self.delay / self.world_size

    def expected_max_delay_s(self, compute_s: float = 0.0) -> float:
        return self.delay if self.k > 0 else 0.0


class Persistent(Imbalance):
    """The listed ranks are ``factor`` times slower, every step.

    With ``base_s`` they sleep ``(factor - 1) * base_s``; without it, ``(factor - 1) * compute_s``.
    """

    name = "persistent"

    def __init__(
        self, rank: int, world_size: int, *, ranks: Sequence[int], factor: float, base_s: float | None = None
    ) -> None:
        super().__init__(rank, world_size)
        slow = [int(r) for r in ranks]
        if any(not 0 <= r < world_size for r in slow) or len(set(slow)) != len(slow):
            raise fail("imbalance.ranks", f"distinct ranks in [0, {world_size}) (persistent)", slow)
        self.ranks, self.factor = frozenset(slow), check_number("imbalance.factor", factor, 1)  # a slowdown
        # null in its preset, so the config's type check (wagma.app.config) cannot tell it takes a number
        self.base_s = check_optional_number("imbalance.base_s", base_s, 0)

    def _extra(self, compute_s: float) -> float:
        base = self.base_s if self.base_s is not None else max(0.0, compute_s)
        return (self.factor - 1.0) * base

    def delay_s(self, step: int, compute_s: float = 0.0) -> float:
        return self._extra(compute_s) if self.rank in self.ranks else 0.0

    def expected_mean_delay_s(self, compute_s: float = 0.0) -> float:
        return len(self.ranks) * self._extra(compute_s) / self.world_size

    def expected_max_delay_s(self, compute_s: float = 0.0) -> float:
        return self._extra(compute_s) if self.ranks else 0.0


class HeavyTail(Imbalance):
    """Every rank sleeps a heavy-tailed random delay each step, drawn with a generator seeded ``(seed, step, rank)``.

    ``lognormal``: ``scale_s * exp(shape * Z)``, Z standard normal (``scale_s`` is the median).
    ``pareto``: ``scale_s * L``, L Lomax (Pareto II) with tail index ``shape`` (mean ``scale_s / (shape - 1)``).
    Draws are capped at ``max_s`` (null: uncapped) so one draw cannot stall a run.
    """

    name = "heavy_tail"
    _MC_DRAWS = 20_000  # rows of the Monte Carlo estimate of the expected delays

    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        distribution: str = "lognormal",
        scale_s: float,
        shape: float,
        max_s: float | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(rank, world_size)
        check_choice("imbalance.distribution", distribution, ("lognormal", "pareto"))
        self.scale = check_number("imbalance.scale_s", scale_s, 0)
        self.shape = check_number("imbalance.shape", shape, 0, above=True)
        self.cap = check_optional_number("imbalance.max_s", max_s, 0)
        if distribution == "pareto" and shape <= 1 and max_s is None:
            raise ValueError(f"an uncapped Pareto delay with shape={shape} <= 1 has an infinite mean; set max_s")
        self.distribution = distribution
        self.seed = int(seed)

    def _draw(self, rng: np.random.Generator, size: int | tuple[int, ...] | None = None) -> Any:
        if self.distribution == "lognormal":
            x = self.scale * np.exp(self.shape * rng.standard_normal(size))
        else:
            x = self.scale * rng.pareto(self.shape, size)
        return x if self.cap is None else np.minimum(x, self.cap)

    def delay_s(self, step: int, compute_s: float = 0.0) -> float:
        return float(self._draw(np.random.Generator(np.random.PCG64([self.seed, step, self.rank]))))

    def _monte_carlo(self) -> np.ndarray:
        rng = np.random.Generator(np.random.PCG64([self.seed, 2**32 - 1]))
        return self._draw(rng, (self._MC_DRAWS, self.world_size))

    def expected_mean_delay_s(self, compute_s: float = 0.0) -> float:
        if self.cap is None:  # closed forms
            if self.distribution == "lognormal":
                return self.scale * float(np.exp(self.shape**2 / 2))
            return self.scale / (self.shape - 1.0)
        return float(self._monte_carlo().mean())

    def expected_max_delay_s(self, compute_s: float = 0.0) -> float:
        """Monte Carlo estimate over 20,000 simulated steps (deterministic)."""
        return float(self._monte_carlo().max(axis=1).mean())


_IMBALANCES: dict[str, type[Imbalance]] = {cls.name: cls for cls in (NoImbalance, RandomK, Persistent, HeavyTail)}
KNOWN_IMBALANCES: tuple[str, ...] = tuple(sorted(_IMBALANCES))


def build_imbalance(cfg: Mapping[str, Any], rank: int, world_size: int) -> Imbalance:
    """Build the injector ``cfg["name"]`` with the remaining entries of ``cfg`` as its arguments.

    Raises:
        ValueError: for an unknown name, a missing or unexpected argument, or an invalid value.
    """
    args = dict(cfg)
    name = args.pop("name", None)
    if name not in _IMBALANCES:
        raise ValueError(f"unknown imbalance {name!r}; known imbalances: {', '.join(KNOWN_IMBALANCES)}")
    try:
        return _IMBALANCES[name](rank, world_size, **args)
    except TypeError as exc:
        raise ValueError(f"bad arguments for imbalance {name!r}: {exc}") from exc
