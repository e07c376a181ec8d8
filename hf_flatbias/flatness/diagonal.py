"""The diagonal of the Fisher of the pre-training loss: where, parameter by parameter, the paper's trace sits.

``diag F = E_{x,t} E_{y ~ f(x_-t)} (grad_theta log f(x_-t)_y)^2`` elementwise; its sum is the trace
`hf_flatbias.flatness.api.estimate_hessian_trace` estimates. `estimate_fisher_diagonal` takes both from the same
draws: with ``per_sample`` the squared per-sample gradients come from the layer inputs and output gradients
the trace already records (`hf_flatbias.flatness.ghost_diagonal.add_squared_gradients`), with no further backward;
the decoder's own terms are again replaced by their exact expectation over ``y`` (``p_v (1 - p_v) h_i^2``). Nothing
here knows about the Trainer.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..constants import DEFAULT_BATCH_SIZE, DEFAULT_ESTIMATOR, DEFAULT_OUTPUT_PROBE, RECOMMENDED_N_DRAWS
from .api import contexts_to_measure
from .estimators import compute_trace_samples, per_context_estimators
from .groups import GroupOf
from .lm import evaluation_mode, preserved_global_rng
from .results import TraceEstimate, summarize_trace_samples


@dataclass
class FisherDiagonal:
    """The Fisher diagonal over the trainable parameters, with the trace estimate of the same draws.

    Attributes:
        diagonal: parameter name (as in ``model.named_parameters()``) to its diagonal, shaped like the parameter
            (float64, on the parameter's device), averaged over contexts and draws.
        trace: the trace estimate from the same draws (standard error, variance split, and ``by_group``: the split by
            parameter group of `hf_flatbias.flatness.groups`, the decoder's own term apart). The diagonal sums to
            ``trace.mean``.
        by_layer: the diagonal's sum over each module's own parameters (module name to value), in the forward's
            order of `model.named_modules()`; a weight shared by two modules counts once, under its first owner.
    """

    diagonal: dict[str, torch.Tensor]
    trace: TraceEstimate
    by_layer: dict[str, float]

    @property
    def total(self) -> float:
        """The sum of the diagonal (equal to ``trace.mean`` up to rounding)."""
        return float(sum(float(value.sum()) for value in self.diagonal.values()))


def estimate_fisher_diagonal(
    model: nn.Module,
    dataset: Iterable[Mapping[str, Any]],
    *,
    n_contexts: int | None = None,
    n_draws: int = RECOMMENDED_N_DRAWS,
    estimator: str = DEFAULT_ESTIMATOR,
    seed: int = 0,
    batch_size: int | str = DEFAULT_BATCH_SIZE,
    exact_output_expectation: bool = True,
    causal: bool | None = None,
    group_of: GroupOf | None = None,
    output_probe: str = DEFAULT_OUTPUT_PROBE,
) -> FisherDiagonal:
    """Estimate the diagonal of the Fisher of the pre-training loss, and its trace from the same draws.

    Args:
        model, dataset, n_contexts, n_draws, seed, batch_size, exact_output_expectation, causal: as for
            `estimate_hessian_trace` (the same contexts and draws give the same trace).
        estimator: ``"per_sample"`` (default: the squared per-sample gradients from the trace's own backward; dense
            layers cost about one weight gradient per draw more) or ``"naive"`` (one backward per draw, any model).
        output_probe: as for `estimate_hessian_trace`.
        group_of: the grouping rule of ``trace.by_group`` (`hf_flatbias.flatness.groups.default_group_of` by
            default).

    Returns:
        A `FisherDiagonal`. It holds one float64 tensor per parameter: twice the model's float32 size.
    """
    if estimator not in per_context_estimators():
        needed = " or ".join(repr(name) for name in per_context_estimators())
        raise ValueError(f"estimate_fisher_diagonal needs estimator={needed} (got {estimator!r}).")
    start = time.perf_counter()
    params, contexts, indices = contexts_to_measure(model, dataset, n_contexts=n_contexts, causal=causal)
    sums: dict[int, torch.Tensor] = {}
    with evaluation_mode(model), preserved_global_rng():
        samples = compute_trace_samples(
            model,
            contexts,
            indices=indices,
            n_draws=n_draws,
            estimator=estimator,
            seed=seed,
            batch_size=batch_size,
            exact_output_expectation=exact_output_expectation,
            output_probe=output_probe,
            by_group=True if group_of is None else group_of,
            diagonal=sums,
        )
    names = {id(p): name for name, p in model.named_parameters()}
    diagonal = {
        names[id(p)]: sums[id(p)].div_(len(indices)) if id(p) in sums else torch.zeros(p.shape, dtype=torch.float64)
        for p in params
    }
    return FisherDiagonal(
        diagonal=diagonal,
        trace=summarize_trace_samples(samples, seconds=time.perf_counter() - start),
        by_layer=_by_layer(model, diagonal),
    )


def _by_layer(model: nn.Module, diagonal: dict[str, torch.Tensor]) -> dict[str, float]:
    by_layer: dict[str, float] = {}
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        total, found = 0.0, False
        for name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            if id(param) in seen or full not in diagonal:
                continue
            seen.add(id(param))
            total += float(diagonal[full].sum())
            found = True
        if found:
            by_layer[module_name] = total
    return by_layer
