"""What the estimators return: raw per-unit samples, and the estimate with its error and variance split.

Samples of disjoint subsets of contexts (computed on different processes, say) concatenate before
`summarize_trace_samples` turns them into a `TraceEstimate`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .spectrum import SharpnessEstimate, TopEigenvalues


@dataclass
class TraceEstimate:
    """An estimate of the Hessian (Fisher) trace averaged over contexts.

    Attributes:
        mean: the estimate.
        stderr: its standard error, from the spread of per-unit means over contexts, so it counts both the
            variation between contexts and the draw noise. With a single unit (one batch of ``hutchinson`` or
            ``hutchpp``, one context) it comes from the spread of that unit's draws (probes): the error of the
            trace of these contexts, not of the population they were drawn from (``stderr_note`` says so); ``nan``
            with a single unit and a single draw (``stderr_note`` says why).
        n_contexts: contexts used.
        n_draws: draws of ``y`` (or of ``v`` for ``hutchinson``) per context.
        estimator: which estimator produced it.
        seconds: wall-clock time of the estimate.
        draw_variance: mean over contexts of the one-draw variance within a context (per-context estimators,
            ``n_draws >= 2``), else ``None``.
        context_variance: variance of the per-context traces between contexts, draw noise removed, else ``None``.
        suggested_n_draws: the draws per context that minimise the error per second,
            ``sqrt(draw_variance / context_variance * forward_cost / draw_cost)``, when it could be measured.
        by_group: with ``by_group`` asked of the estimator, the trace of each parameter group (see
            `hf_flatbias.flatness.groups`) with its standard error, in the forward's order; the means add up to
            ``mean``. ``None`` otherwise.
        stderr_note: ``None`` when ``stderr`` counts both sources of error; otherwise what it leaves out, or why
            it is ``nan``.
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
    by_group: dict[str, GroupTrace] | None = None
    stderr_note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class FlatnessRecord:
    """The latest result of each flatness measure and the training step of the weights it was measured on: what
    `HessianTraceCallback` keeps (``flatness_record``) and the model card reads.

    Attributes:
        trace, trace_step: the latest trace estimate.
        measures: the latest result of each measure beyond the trace taken (``also_measure``), by its name in
            `hf_flatbias.measures.MEASURE_TABLE`; ``measure_steps`` the step of each.

    A measure never taken is absent (the trace ``None``); a step may be ``None`` when it is not known.
    """

    trace: TraceEstimate | None = None
    trace_step: int | None = None
    measures: dict[str, Any] = field(default_factory=dict)
    measure_steps: dict[str, int | None] = field(default_factory=dict)

    def with_measure(self, name: str, result: Any, step: int | None) -> FlatnessRecord:
        """A copy with measure ``name``'s latest result."""
        return replace(self, measures={**self.measures, name: result}, measure_steps={**self.measure_steps, name: step})

    @property
    def top_eigenvalues(self) -> TopEigenvalues | None:
        return self.measures.get("top_eigenvalue")

    @property
    def top_eigenvalues_step(self) -> int | None:
        return self.measure_steps.get("top_eigenvalue")

    @property
    def sam_sharpness(self) -> SharpnessEstimate | None:
        return self.measures.get("sam_sharpness")

    @property
    def sam_sharpness_step(self) -> int | None:
        return self.measure_steps.get("sam_sharpness")


@dataclass
class GroupTrace:
    """One parameter group's share of a trace estimate."""

    mean: float
    stderr: float


@dataclass
class TraceSamples:
    """Raw estimator output over a subset of contexts, before aggregation.

    ``values[u, k]`` is draw ``k`` of sampling unit ``u``, an unbiased estimate of the mean trace over the unit's
    ``weights[u]`` contexts. Samples of disjoint index subsets concatenate (`TraceSamples.cat`). With groups,
    ``group_values[u, k, g]`` is group ``group_names[g]``'s part of ``values[u, k]``.
    """

    values: torch.Tensor
    weights: torch.Tensor
    n_draws: int
    estimator: str
    forward_seconds: float = 0.0
    draw_seconds: float = 0.0
    group_values: torch.Tensor | None = None
    group_names: tuple[str, ...] = ()

    @staticmethod
    def cat(parts: Sequence[TraceSamples]) -> TraceSamples:
        grouped = parts[0].group_values is not None
        return TraceSamples(
            values=torch.cat([p.values for p in parts]),
            weights=torch.cat([p.weights for p in parts]),
            n_draws=parts[0].n_draws,
            estimator=parts[0].estimator,
            forward_seconds=sum(p.forward_seconds for p in parts),
            draw_seconds=sum(p.draw_seconds for p in parts),
            group_values=torch.cat([p.group_values for p in parts]) if grouped else None,
            group_names=parts[0].group_names,
        )


def _weighted_mean_and_stderr(unit_means: torch.Tensor, weights: torch.Tensor) -> tuple[float, float]:
    """The ratio-estimator form: ``std / sqrt(n)`` for equal weights, ``nan`` error with a single unit."""
    n_units = unit_means.numel()
    total_weight = weights.sum()
    mean = float((weights * unit_means).sum() / total_weight)
    if n_units < 2:
        return mean, float("nan")
    spread = (weights.square() * (unit_means - mean).square()).sum() * n_units / (n_units - 1)
    return mean, float(spread.sqrt() / total_weight)


def summarize_trace_samples(samples: TraceSamples, *, seconds: float = float("nan")) -> TraceEstimate:
    """Weighted mean over units and its standard error (the ratio-estimator form; ``std / sqrt(n)`` for equal
    weights). Unit means vary by context and by draw, so the error covers both sources."""
    unit_means = samples.values.double().mean(dim=1)
    weights = samples.weights.double()
    n_units = unit_means.numel()
    mean, stderr = _weighted_mean_and_stderr(unit_means, weights)
    stderr_note = None
    n_draws = samples.values.shape[1]
    if n_units == 1 and n_draws >= 2:
        # one unit: its draws (probes) are independent given its contexts, so their spread is the honest error of
        # the trace of these contexts; the variation between contexts cannot be seen from one unit
        stderr = float(samples.values.double().std() / math.sqrt(n_draws))
        stderr_note = (
            f"from the {n_draws} draws of a single sampling unit ({int(samples.weights.sum())} contexts): the error "
            "of the trace of these contexts only; the variation between contexts is not counted (use a batch "
            "size below the number of contexts for an error that counts it)"
        )
    elif n_units == 1:
        stderr_note = (
            "undefined: a single sampling unit with a single draw; use n_draws >= 2, or a batch size below the "
            "number of contexts"
        )
    by_group = None
    if samples.group_values is not None:
        group_means = samples.group_values.double().mean(dim=1)
        by_group = {
            name: GroupTrace(*_weighted_mean_and_stderr(group_means[:, g], weights))
            for g, name in enumerate(samples.group_names)
        }
        if n_units == 1 and samples.values.shape[1] >= 2:  # as for the total, below
            for g, group in enumerate(by_group.values()):
                draws = samples.group_values[0, :, g].double()
                group.stderr = float(draws.std() / math.sqrt(len(draws)))
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
        by_group=by_group,
        stderr_note=stderr_note,
    )
