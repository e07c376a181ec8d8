"""Rank statistics of the verdicts (`verdicts` reads Spearman correlations of branches through this module)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def spearman(x: Sequence[float | None], y: Sequence[float | None]) -> float | None:
    """Spearman's rank correlation over the pairs where both values are known; None below 3 pairs or when undefined."""
    from scipy.stats import spearmanr

    pairs = [(a, b) for a, b in zip(x, y, strict=True) if a is not None and b is not None]
    if len(pairs) < 3:
        return None
    rho = spearmanr(*zip(*pairs, strict=True)).statistic
    return None if rho is None or not np.isfinite(rho) else float(rho)
