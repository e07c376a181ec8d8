"""Confidence intervals shared by GLUE and the probes: Student-t intervals of a mean over seeds, paired
differences over the same seeds, and Wilson intervals of an accuracy."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Interval:
    """A mean over ``n`` values with its two-sided confidence interval ``[low, high]`` (Student t)."""

    estimate: float
    low: float
    high: float
    n: int
    confidence: float = 0.95

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0


def t_half_width(standard_error: float | np.ndarray, df: int, confidence: float = 0.95) -> float | np.ndarray:
    """Half the width of a two-sided Student-t interval: ``t_{(1 + confidence) / 2, df} * standard_error``. The one
    place the t quantile is taken: `mean_interval` with ``df = n - 1``, and any estimate whose standard error and
    degrees of freedom come from elsewhere (a two-way design, a jackknife)."""
    from scipy.stats import t

    return float(t.ppf(0.5 + confidence / 2, df=df)) * standard_error


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> Interval:
    """The mean of ``values`` with its Student-t confidence interval (``nan`` bounds for fewer than two values)."""
    array = np.asarray(values, dtype=np.float64)
    if array.size == 0:
        raise ValueError("mean_interval needs at least one value.")
    mean = float(array.mean())
    if array.size < 2:
        return Interval(mean, float("nan"), float("nan"), 1, confidence)
    # t * s before / sqrt(n): the order the committed research verdicts were computed in, so they recompute exactly
    half = float(t_half_width(array.std(ddof=1), array.size - 1, confidence) / math.sqrt(array.size))
    return Interval(mean, mean - half, mean + half, int(array.size), confidence)


def paired_difference(scores_a: Sequence[float], scores_b: Sequence[float], confidence: float = 0.95) -> Interval:
    """Mean of ``a - b`` over paired runs (the same seed: head initialisation and data order) with its t-interval.

    Pairing removes what the seed does to both checkpoints alike, so a gap smaller than either one's spread over
    seeds can still be resolved.
    """
    a, b = np.asarray(scores_a, dtype=np.float64), np.asarray(scores_b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"Paired scores need the same seeds: got {a.size} and {b.size} values.")
    return mean_interval(a - b, confidence)


def wilson_interval(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (stays inside [0, 1] and behaves near 0 and 1)."""
    if trials <= 0:
        raise ValueError("wilson_interval needs trials >= 1.")
    from scipy.stats import norm

    z = float(norm.ppf(0.5 + confidence / 2))
    p = successes / trials
    denominator = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denominator
    return max(0.0, centre - half), min(1.0, centre + half)
