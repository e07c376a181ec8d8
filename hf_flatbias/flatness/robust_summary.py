"""A robust summary of a trace estimate beside its mean: the median of means over groups of sampling units, and the
share of the estimate carried by its largest units (a tail diagnostic).

Per-context Fisher traces are squared gradient norms: a few contexts with huge gradients can dominate a mean over
thousands (two campaign branch traces read 179.7 +- 44.0 and 160.2 +- 36.5 where fresh contexts gave 138.9 +- 4.8 and
125.8 +- 3.5). The median of means moves little when a few units are extreme; on a skewed, non-negative sample it sits
below the mean (each group's mean is skewed too), so it is a diagnostic and a ranking key, not an unbiased trace.

Pure functions of tensors; `hf_flatbias.flatness.results.summarize_trace_samples` puts them on every `TraceEstimate`.
"""

from __future__ import annotations

import math

import torch

DEFAULT_MEDIAN_OF_MEANS_GROUPS = 10
"""Groups of the median of means: up to 4 groups (and so up to 4 extreme units) cannot move the median past the
central groups, while each group still averages n/10 units."""

TOP_SHARE_FRACTION = 0.01
"""The tail diagnostic's top fraction of units: the share of the estimate carried by its largest 1%."""

MIN_UNITS_FOR_SUMMARY = 3
"""Below this many units a median says nothing a mean does not (the median of two groups is their mean)."""


def _check(values: torch.Tensor, weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    values = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
    weights = torch.ones_like(values) if weights is None else torch.as_tensor(weights, dtype=torch.float64).reshape(-1)
    if values.shape != weights.shape:
        raise ValueError(f"values and weights differ in length ({values.numel()} vs {weights.numel()}); pass one each.")
    if values.numel() == 0:
        raise ValueError("no units to summarise; pass at least one value.")
    if bool((weights <= 0).any()):
        raise ValueError("weights must be > 0 (each unit's number of contexts).")
    return values, weights


def median_of_means(
    values: torch.Tensor, weights: torch.Tensor | None = None, n_groups: int = DEFAULT_MEDIAN_OF_MEANS_GROUPS
) -> tuple[float, int]:
    """``(median of the groups' weighted means, groups used)``: the units split in their order into
    ``min(n_groups, len(values))`` contiguous groups of near-equal size (the first ones one larger, as
    ``numpy.array_split`` splits), each group's mean weighted by ``weights`` (contexts per unit), and the median of
    those means (the mean of the two middle ones for an even count, as ``numpy.median``).

    The units come from a seeded random draw of contexts, so contiguous groups are random groups and the summary is
    the same number on every rerun."""
    if isinstance(n_groups, bool) or not isinstance(n_groups, int) or n_groups < 1:
        raise ValueError(f"n_groups must be a whole number >= 1 (got {n_groups!r}); e.g. n_groups=10.")
    values, weights = _check(values, weights)
    used = min(n_groups, values.numel())
    means = torch.stack(
        [
            (v * w).sum() / w.sum()
            for v, w in zip(torch.tensor_split(values, used), torch.tensor_split(weights, used), strict=True)
        ]
    )
    ordered = means.sort().values
    middle = used // 2
    median = ordered[middle] if used % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    return float(median), used


def top_share(
    values: torch.Tensor, weights: torch.Tensor | None = None, fraction: float = TOP_SHARE_FRACTION
) -> tuple[float, int]:
    """``(share, units)``: the share of the estimate's total ``sum |w_u v_u|`` carried by its ``units = max(1,
    ceil(fraction * n))`` largest units. With every unit alike the share is ``units / n`` (about ``fraction``); near 1
    the estimate is a few units' values. Absolute contributions keep it in [0, 1] for signed (Hutchinson)
    estimates; ``nan`` when every unit is 0."""
    if not (isinstance(fraction, float | int) and 0 < fraction <= 1):
        raise ValueError(f"fraction must be a number in (0, 1] (got {fraction!r}); e.g. fraction=0.01.")
    values, weights = _check(values, weights)
    contributions = (values * weights).abs()
    units = max(1, math.ceil(fraction * values.numel() - 1e-9))  # 0.01 * 700 is 7.000000000000001
    total = float(contributions.sum())
    if total == 0:
        return math.nan, units
    return float(contributions.topk(units).values.sum()) / total, units


__all__ = ["DEFAULT_MEDIAN_OF_MEANS_GROUPS", "TOP_SHARE_FRACTION", "median_of_means", "top_share"]
