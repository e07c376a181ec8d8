"""What the estimators return: raw per-unit samples, and the estimate with its error and variance split; the top
eigenvalues, spectral density and SAM sharpness of `hf_flatbias.flatness.spectrum`.

Samples of disjoint subsets of contexts (computed on different processes, say) concatenate before
`summarize_trace_samples` turns them into a `TraceEstimate`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from .robust_summary import MIN_UNITS_FOR_SUMMARY, median_of_means, top_share


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
        median_of_means, median_of_means_groups: the median of the means of that many contiguous groups of
            sampling units (`hf_flatbias.flatness.robust_summary.median_of_means`): a summary a few extreme contexts
            cannot carry; below the mean on a skewed sample, so for ranking and diagnosis, not an unbiased trace.
            ``None`` with fewer than 3 units.
        top_share, top_share_units: the share of the estimate carried by its largest 1% of units (that many;
            `hf_flatbias.flatness.robust_summary.top_share`): about ``top_share_units / units`` when units are alike,
            near 1 when a few contexts make the estimate. ``None`` with fewer than 3 units.
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
    median_of_means: float | None = None
    median_of_means_groups: int | None = None
    top_share: float | None = None
    top_share_units: int | None = None

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
    robust = {}
    if n_units >= MIN_UNITS_FOR_SUMMARY:
        robust["median_of_means"], robust["median_of_means_groups"] = median_of_means(unit_means, weights)
        robust["top_share"], robust["top_share_units"] = top_share(unit_means, weights)
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
        **robust,
    )


# ---------------------------------------------------------------------------------------------------------------------
# beyond the trace: the spectrum and SAM's sharpness (`hf_flatbias.flatness.spectrum`)


@dataclass
class TopEigenvalues:
    """The largest eigenvalues of the Hessian or Fisher of the pre-training loss.

    Attributes:
        eigenvalues: the ``k`` largest (algebraic) Ritz values, largest first.
        residuals: ``||A x - lambda x||`` of each one's unit Ritz vector ``x``, computed with one more product each.
            For a symmetric matrix some eigenvalue lies within the residual of each value.
        matrix: ``"fisher"`` or ``"hessian"``.
        n_contexts: contexts the matrix averages over.
        n_parameters: the dimension (trainable parameters).
        n_matvecs: matrix-vector products spent (Lanczos steps plus the ``k`` residual checks).
        seconds: wall-clock time.
        converged: whether every residual reached ``tol * |eigenvalue|`` within ``max_iterations``.
        product: how the products were formed, ``"exact"`` or ``"finite_difference"`` (whose residuals include the
            products' own error).
    """

    eigenvalues: list[float]
    residuals: list[float]
    matrix: str
    n_contexts: int
    n_parameters: int
    n_matvecs: int
    seconds: float
    converged: bool
    product: str = "exact"

    @property
    def top(self) -> float:
        return self.eigenvalues[0]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SpectralDensity:
    """Stochastic Lanczos quadrature of the eigenvalue density, normalised to integrate to 1 (multiply by
    ``n_parameters`` for eigenvalue counts).

    ``nodes[r]`` and ``weights[r]`` are run ``r``'s Ritz values and the squared first components of their vectors
    (each run's weights sum to 1): the quadrature of ``q^T g(A) q`` for its random unit start ``q``.
    """

    nodes: list[list[float]]
    weights: list[list[float]]
    matrix: str
    n_contexts: int
    n_parameters: int
    n_matvecs: int
    seconds: float

    def smoothed(
        self, grid: torch.Tensor | Sequence[float] | None = None, *, sigma: float | None = None, n_points: int = 512
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(grid, density)``: the Ritz values of every run, each a Gaussian of width ``sigma`` weighted by its
        weight, averaged over runs. ``sigma`` defaults to 1% of the span of the nodes; the default grid spans the
        nodes with ``5 sigma`` on each side."""
        nodes = torch.tensor([x for run in self.nodes for x in run], dtype=torch.float64)
        weights = torch.tensor([w for run in self.weights for w in run], dtype=torch.float64) / len(self.nodes)
        span = float(nodes.max() - nodes.min())
        if sigma is None:
            sigma = 0.01 * span if span > 0 else 1e-3 * max(1.0, float(nodes.abs().max()))
        if sigma <= 0:
            raise ValueError(f"sigma must be > 0 (got {sigma}).")
        if grid is None:
            grid = torch.linspace(float(nodes.min()) - 5 * sigma, float(nodes.max()) + 5 * sigma, n_points)
        grid = torch.as_tensor(grid, dtype=torch.float64)
        return grid, gaussian_mixture(grid, nodes, weights, sigma)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SharpnessEstimate:
    """SAM's sharpness ``L(w + rho g/||g||) - L(w)`` of the pre-training loss, per batch, averaged over batches.

    Attributes:
        mean: the mean over batches.
        stderr: its standard error over batches (``nan`` with one batch).
        rho: the neighbourhood radius.
        adaptive: ASAM's scale-invariant neighbourhood instead of SAM's.
        batch_size: contexts per batch (each batch takes its own ascent step, as in training).
        n_contexts: contexts used.
        seconds: wall-clock time.
        per_batch: the sharpness of each batch.
    """

    mean: float
    stderr: float
    rho: float
    adaptive: bool
    batch_size: int
    n_contexts: int
    seconds: float
    per_batch: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def gaussian_mixture(grid: torch.Tensor, nodes: torch.Tensor, weights: torch.Tensor, sigma: float) -> torch.Tensor:
    """``sum_j weights_j N(grid; nodes_j, sigma^2)``: a weighted set of eigenvalues as a smooth density."""
    z = (grid.reshape(-1, 1) - nodes.reshape(1, -1)) / sigma
    return (torch.exp(-0.5 * z.square()) * weights.reshape(1, -1)).sum(dim=1) / (sigma * math.sqrt(2 * math.pi))
