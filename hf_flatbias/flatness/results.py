"""What the estimators return: raw per-unit samples, and the estimate with its error and variance split.

Samples of disjoint subsets of contexts (computed on different processes, say) concatenate before
`summarize_trace_samples` turns them into a `TraceEstimate`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass
class TraceEstimate:
    """An estimate of the Hessian (Fisher) trace averaged over contexts.

    Attributes:
        mean: the estimate.
        stderr: its standard error, from the spread of per-unit means over contexts, so it counts both the
            variation between contexts and the draw noise; ``nan`` with a single unit.
        n_contexts: contexts used.
        n_draws: draws of ``y`` (or of ``v`` for ``hutchinson``) per context.
        estimator: which estimator produced it.
        seconds: wall-clock time of the estimate.
        draw_variance: mean over contexts of the one-draw variance within a context (per-context estimators,
            ``n_draws >= 2``), else ``None``.
        context_variance: variance of the per-context traces between contexts, draw noise removed, else ``None``.
        suggested_n_draws: the draws per context that minimise the error per second,
            ``sqrt(draw_variance / context_variance * forward_cost / draw_cost)``, when it could be measured.
    """

    mean: float
    stderr: float
    n_contexts: int
    n_draws: int
    estimator: str
    seconds: float
    draw_variance: float | None = None
    context_variance: float | None = None
    suggested_n_draws: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TraceSamples:
    """Raw estimator output over a subset of contexts, before aggregation.

    ``values[u, k]`` is draw ``k`` of sampling unit ``u``, an unbiased estimate of the mean trace over the unit's
    ``weights[u]`` contexts. Samples of disjoint index subsets concatenate (`TraceSamples.cat`).
    """

    values: torch.Tensor
    weights: torch.Tensor
    n_draws: int
    estimator: str
    forward_seconds: float = 0.0
    draw_seconds: float = 0.0

    @staticmethod
    def cat(parts: Sequence[TraceSamples]) -> TraceSamples:
        return TraceSamples(
            values=torch.cat([p.values for p in parts]),
            weights=torch.cat([p.weights for p in parts]),
            n_draws=parts[0].n_draws,
            estimator=parts[0].estimator,
            forward_seconds=sum(p.forward_seconds for p in parts),
            draw_seconds=sum(p.draw_seconds for p in parts),
        )


def summarize_trace_samples(samples: TraceSamples, *, seconds: float = float("nan")) -> TraceEstimate:
    """Weighted mean over units and its standard error (the ratio-estimator form; ``std / sqrt(n)`` for equal
    weights). Unit means vary by context and by draw, so the error covers both sources."""
    unit_means = samples.values.double().mean(dim=1)
    weights = samples.weights.double()
    n_units = unit_means.numel()
    total_weight = weights.sum()
    mean = float((weights * unit_means).sum() / total_weight)
    if n_units >= 2:
        spread = (weights.square() * (unit_means - mean).square()).sum() * n_units / (n_units - 1)
        stderr = float(spread.sqrt() / total_weight)
    else:
        stderr = float("nan")
    draw_variance = context_variance = suggested = None
    per_context_units = bool((samples.weights == 1).all())
    if per_context_units and samples.values.shape[1] >= 2 and n_units >= 2:
        draw_variance = float(samples.values.double().var(dim=1).mean())
        context_variance = max(float(unit_means.var()) - draw_variance / samples.values.shape[1], 0.0)
        if samples.forward_seconds > 0 and samples.draw_seconds > 0 and context_variance > 0:
            forward_per_context = samples.forward_seconds / n_units
            draw_per_context = samples.draw_seconds / (n_units * samples.values.shape[1])
            ratio = draw_variance / context_variance * forward_per_context / draw_per_context
            suggested = max(1, round(math.sqrt(ratio)))
    return TraceEstimate(
        mean=mean,
        stderr=stderr,
        n_contexts=int(samples.weights.sum()),
        n_draws=samples.n_draws,
        estimator=samples.estimator,
        seconds=seconds,
        draw_variance=draw_variance,
        context_variance=context_variance,
        suggested_n_draws=suggested,
    )
