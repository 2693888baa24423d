"""Repeated A/B benchmark runs that a drifting machine load cannot bias, and their statistics.

``abba_order`` interleaves two (or more) units as A B | B A | A B | B A ...: each repeat runs every
unit once, in order on even repeats and reversed on odd ones, so a load that rises or falls
linearly over the run weighs on each unit equally over every two repeats. The units of one repeat
run next to each other, so their ratio (``paired_ratios``) is the comparison with the least drift.

Invariants:
- every unit runs exactly once per repeat; over an even number of repeats each unit holds every
  position in the order equally often;
- ``spread`` and ``paired_ratios`` refuse empty input and report the median, min and max of what
  they are given; the bootstrap interval is seeded, so a report is reproducible.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

BOOTSTRAP_SAMPLES = 2000


def abba_order(units: Sequence[T], repeats: int) -> list[list[T]]:
    """Per repeat, the units in the order to run them: as given on even repeats, reversed on odd."""
    if repeats < 1:
        raise ValueError(f"repeats {repeats}: must be >= 1")
    if not units:
        raise ValueError("abba_order: no units to order")
    return [list(units) if r % 2 == 0 else list(reversed(units)) for r in range(repeats)]


@dataclass(frozen=True)
class Spread:
    """One arm's per-repeat values of a figure: their median, min and max."""

    values: tuple[float, ...]
    median: float
    min: float
    max: float

    def as_dict(self) -> dict[str, Any]:
        return {"median": self.median, "min": self.min, "max": self.max, "values": list(self.values)}


def spread(values: Sequence[float]) -> Spread:
    """The median, min and max of one arm's per-repeat values."""
    if not values:
        raise ValueError("spread: no values")
    return Spread(tuple(values), statistics.median(values), min(values), max(values))


def bootstrap_median_interval(
    values: Sequence[float], level: float = 0.95, samples: int = BOOTSTRAP_SAMPLES, seed: int = 0
) -> tuple[float, float]:
    """A percentile bootstrap interval of the median of ``values`` (seeded: reproducible). With
    few values it is no wider than their range; read it with the min and max beside it."""
    if not values:
        raise ValueError("bootstrap_median_interval: no values")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level {level}: must be in (0, 1)")
    rng = random.Random(seed)
    n = len(values)
    medians = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(samples))
    lo = medians[int((1.0 - level) / 2.0 * (samples - 1))]
    hi = medians[int((1.0 + level) / 2.0 * (samples - 1))]
    return lo, hi


@dataclass(frozen=True)
class PairedRatio:
    """Per repeat, one arm's figure over another's in the same repeat, and the median of those
    ratios with its min, max and 95 % bootstrap interval."""

    per_repeat: tuple[float, ...]
    median: float
    min: float
    max: float
    bootstrap95: tuple[float, float]

    def as_dict(self) -> dict[str, Any]:
        return {
            "per_repeat": list(self.per_repeat),
            "median": self.median,
            "min": self.min,
            "max": self.max,
            "bootstrap95": list(self.bootstrap95),
        }


def paired_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> PairedRatio:
    """``numerators[r] / denominators[r]`` per repeat ``r`` (the two arms of the same repeat)."""
    if len(numerators) != len(denominators):
        raise ValueError(f"paired_ratios: {len(numerators)} numerators for {len(denominators)} denominators")
    if not numerators:
        raise ValueError("paired_ratios: no pairs")
    bad = [r for r, d in enumerate(denominators) if d <= 0]
    if bad:
        raise ValueError(f"paired_ratios: repeats {bad} have a denominator <= 0")
    ratios = tuple(n / d for n, d in zip(numerators, denominators, strict=True))
    return PairedRatio(
        ratios, statistics.median(ratios), min(ratios), max(ratios), bootstrap_median_interval(ratios)
    )
