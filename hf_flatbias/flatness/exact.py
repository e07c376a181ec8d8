"""Exact traces for small models: the references the estimators are checked against.

- `exact_fisher_trace`: ``mean over contexts of sum_y p_y ||grad log p_y||^2``, summing over the whole vocabulary
  (one backward per vocabulary entry and context) instead of sampling ``y``.
- `exact_hessian_trace`: the trace of the Hessian of the mean data-label loss, one second-order backward per
  parameter. With labels drawn from the model, its expectation over the labels is the Fisher trace
  (``E_y[-grad^2 log p_y] = E_y[grad log p_y grad log p_y^T]``); per context, ``sum_y p_y Tr H_y = Tr F`` exactly.

Both use the stock forward (logits at every position), independent of the estimators' shortcuts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..tensors import squared_norm
from .contexts import TraceContexts
from .lm import check_lm_model, evaluation_mode, is_causal_lm, measured_parameters, preserved_global_rng

MAX_EXACT_HESSIAN_PARAMETERS = 20_000


def _contexts(model: nn.Module, dataset: Iterable[Mapping[str, Any]], causal: bool | None) -> TraceContexts:
    check_lm_model(model)
    return TraceContexts.from_rows(dataset, causal=is_causal_lm(model) if causal is None else causal)


def per_context_fisher_traces(
    model: nn.Module, dataset: Iterable[Mapping[str, Any]], *, causal: bool | None = None
) -> torch.Tensor:
    """``sum_y p_y ||grad_theta log p_y||^2`` for every context (labelled position), in float64."""
    contexts = _contexts(model, dataset, causal)
    params = measured_parameters(model)
    traces = torch.empty(len(contexts), dtype=torch.float64)
    with evaluation_mode(model), preserved_global_rng(), torch.enable_grad():
        for index in range(len(contexts)):
            logits = model(**contexts.model_inputs([index], model)).logits[0, contexts.positions[index]]
            log_probs = torch.log_softmax(logits.double(), dim=-1)
            probs = log_probs.detach().exp()
            total = torch.zeros((), dtype=torch.float64)
            for label in range(log_probs.shape[0]):
                grads = torch.autograd.grad(log_probs[label], params, retain_graph=True, allow_unused=True)
                total += probs[label].cpu() * squared_norm(grads, dtype=torch.float64).cpu()
            traces[index] = total
    return traces


def exact_fisher_trace(model: nn.Module, dataset: Iterable[Mapping[str, Any]], *, causal: bool | None = None) -> float:
    """The paper's measure without sampling: the Fisher trace averaged over the contexts of ``dataset`` (rows as
    for `estimate_hessian_trace`). Costs one backward per vocabulary entry and context: small models only."""
    return float(per_context_fisher_traces(model, dataset, causal=causal).mean())


def exact_hessian_trace(model: nn.Module, dataset: Iterable[Mapping[str, Any]], *, causal: bool | None = None) -> float:
    """Trace of the Hessian of the mean cross-entropy of the rows' labels, over the trainable parameters.

    One backward through the gradient per parameter, so only for models up to
    ``MAX_EXACT_HESSIAN_PARAMETERS`` parameters.
    """
    contexts = _contexts(model, dataset, causal)
    params = measured_parameters(model)
    n_params = sum(p.numel() for p in params)
    if n_params > MAX_EXACT_HESSIAN_PARAMETERS:
        raise ValueError(
            f"exact_hessian_trace differentiates once per parameter; {n_params} parameters is more than "
            f"{MAX_EXACT_HESSIAN_PARAMETERS}. Use estimate_hessian_trace(..., estimator='hutchinson') instead."
        )
    indices = list(range(len(contexts)))
    with evaluation_mode(model), preserved_global_rng(), torch.enable_grad(), sdpa_kernel(SDPBackend.MATH):
        all_logits = model(**contexts.model_inputs(indices, model)).logits
        rows = torch.arange(len(indices), device=all_logits.device)
        positions = torch.tensor(contexts.positions, device=all_logits.device)
        targets = torch.tensor(contexts.targets, device=all_logits.device)
        loss = torch.nn.functional.cross_entropy(all_logits[rows, positions].double(), targets)
        grads = torch.autograd.grad(loss, params, create_graph=True)
        trace = 0.0
        for param, grad in zip(params, grads, strict=True):
            trace += _hessian_diagonal_sum(param, grad)
    return trace


def _hessian_diagonal_sum(param: nn.Parameter, grad: torch.Tensor) -> float:
    """Sum of the Hessian's diagonal entries of one parameter: backward through ``grad`` with unit vectors, a chunk
    at a time (vmapped), falling back to one backward per entry where an operation has no batching rule."""
    n = param.numel()
    total = 0.0
    for start in range(0, n, 256):
        stop = min(start + 256, n)
        units = torch.zeros(stop - start, n, dtype=grad.dtype, device=grad.device)
        units[torch.arange(stop - start), torch.arange(start, stop)] = 1.0
        try:
            (rows,) = torch.autograd.grad(
                grad,
                param,
                grad_outputs=units.reshape(stop - start, *param.shape),
                retain_graph=True,
                is_grads_batched=True,
            )
            total += float(rows.reshape(stop - start, n)[torch.arange(stop - start), torch.arange(start, stop)].sum())
        except RuntimeError:
            flat = grad.reshape(-1)
            for entry in range(start, stop):
                (row,) = torch.autograd.grad(flat[entry], param, retain_graph=True, allow_unused=True)
                if row is not None:
                    total += float(row.reshape(-1)[entry])
    return total


def exact_fisher_diagonal(
    model: nn.Module, dataset: Iterable[Mapping[str, Any]], *, causal: bool | None = None
) -> dict[str, torch.Tensor]:
    """The Fisher diagonal without sampling, ``mean over contexts of sum_y p_y (grad log p_y)^2`` elementwise, per
    trainable parameter name (float64): one backward per vocabulary entry and context, small models only."""
    contexts = _contexts(model, dataset, causal)
    params = measured_parameters(model)
    names = {id(p): name for name, p in model.named_parameters()}
    diagonal = {names[id(p)]: torch.zeros(p.shape, dtype=torch.float64) for p in params}
    with evaluation_mode(model), preserved_global_rng(), torch.enable_grad():
        for index in range(len(contexts)):
            logits = model(**contexts.model_inputs([index], model)).logits[0, contexts.positions[index]]
            log_probs = torch.log_softmax(logits.double(), dim=-1)
            probs = log_probs.detach().exp()
            for label in range(log_probs.shape[0]):
                grads = torch.autograd.grad(log_probs[label], params, retain_graph=True, allow_unused=True)
                for param, grad in zip(params, grads, strict=True):
                    if grad is not None:
                        diagonal[names[id(param)]] += probs[label].cpu() * grad.double().cpu().square() / len(contexts)
    return diagonal
