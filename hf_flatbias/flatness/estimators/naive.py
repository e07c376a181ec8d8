"""``naive``: one stock forward and one backward per draw and context; the reference loop, exact for any
architecture, and the one `per_sample` checks itself against."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn

from ...tensors import squared_norm
from ..contexts import TraceContexts
from ..distributed import differentiated_parameters
from ..groups import ParameterGroups
from ..lm import check_lm_model
from ..results import TraceSamples
from .base import TraceEstimator
from .output_probes import OutputProbes

if TYPE_CHECKING:
    from .settings import TraceSettings


class NaiveEstimator(TraceEstimator):
    name = "naive"
    per_context = True

    def measure(self, model, contexts, indices, params, settings, *, groups, diagonal, advance) -> TraceSamples:
        parts, group_parts = [], []
        for i in indices:
            drawn = _naive_context(model, contexts, i, params, settings, groups, diagonal).unsqueeze(0)
            parts.append(drawn if groups is None else drawn.sum(dim=2))
            group_parts.append(drawn)
            advance(1)
        return TraceSamples(
            values=torch.cat(parts),
            weights=torch.ones(len(indices)),
            n_draws=settings.n_draws,
            estimator=self.name,
            group_values=torch.cat(group_parts) if groups is not None else None,
            group_names=groups.names if groups is not None else (),
        )


def _naive_context(
    model: nn.Module,
    contexts: TraceContexts,
    index: int,
    params: Sequence[nn.Parameter],
    settings: TraceSettings,
    groups: ParameterGroups | None,
    diagonal: dict[int, torch.Tensor] | None,
) -> torch.Tensor:
    with torch.no_grad():
        logits = model(**contexts.model_inputs([index], model)).logits[0, contexts.positions[index]]
    probs = torch.softmax(logits.double(), dim=-1).unsqueeze(0)
    probes = OutputProbes(probs, [index], settings.n_draws, settings.seed, settings.output_probe)
    cotangents = torch.cat([probes.cotangent(k) for k in range(settings.n_draws)])
    if diagonal is not None and groups is not None:
        # the split and the diagonal come from two passes over the same draws (a reference, not a fast path)
        naive_squared_norms(model, contexts, index, params, cotangents, None, diagonal)
        diagonal = None
    return naive_squared_norms(model, contexts, index, params, cotangents, groups, diagonal)


def naive_squared_norms(
    model: nn.Module,
    contexts: TraceContexts,
    index: int,
    params: Sequence[nn.Parameter],
    cotangents: torch.Tensor,
    groups: ParameterGroups | None = None,
    diagonal: dict[int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One stock forward (logits everywhere) and one backward per cotangent at the logits of the predicted position
    (`hf_flatbias.flatness.estimators.output_probes`; ``e_y - p`` is the gradient of ``log p_y``), (K, V): squared
    norms (K,), or with ``groups`` their split (K, G), the decoder's own term formed from its input and the gradient
    at its output."""
    batch = contexts.model_inputs([index], model)
    values = torch.empty(len(cotangents), *([len(groups)] if groups is not None else []), dtype=torch.float64)
    decoder = check_lm_model(model)
    seen: dict[str, torch.Tensor] = {}

    def record(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        seen["input"], seen["output"] = args[0].detach(), output

    for k, cotangent in enumerate(cotangents):
        handle = decoder.register_forward_hook(record) if groups is not None else None
        try:
            logits = model(**batch).logits[0, contexts.positions[index]]
        finally:
            if handle is not None:
                handle.remove()
        # the gradient of this scalar is J^T c (no graph through the softmax), in at least float32
        dtype = torch.promote_types(logits.dtype, torch.float32)
        projected = (logits.to(dtype) * cotangent.to(device=logits.device, dtype=dtype)).sum()
        if groups is None and diagonal is None:
            values[k] = streamed_squared_norm(projected, differentiated_parameters(model, params)).cpu()
            continue
        if groups is None:
            grads = torch.autograd.grad(projected, params, allow_unused=True)
            values[k] = squared_norm(grads, dtype=torch.float64).cpu()
            if diagonal is not None:
                for param, grad in zip(params, grads, strict=True):
                    if grad is not None:
                        squared = grad.double().square() / len(cotangents)
                        diagonal[id(param)] = diagonal[id(param)] + squared if id(param) in diagonal else squared
            continue
        *grads, grad_output = torch.autograd.grad(projected, [*params, seen["output"]], allow_unused=True)
        values[k] = _naive_group_split(decoder, params, grads, seen["input"], grad_output, groups)
    return values


_SQUARING_CHUNK = 1 << 20


def streamed_squared_norm(output: torch.Tensor, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``||d output / d tensors||^2`` in float64, each tensor's gradient squared and dropped as the backward forms
    it: the gradient is never whole, at most one tensor's at a time (under FSDP2 and ZeRO-3, one module's full
    gradient while the engine holds that module gathered). Sums in the order of ``tensors``.
    Nothing is written to ``.grad``, so the engines' gradient reductions have nothing to reduce."""
    terms: dict[int, torch.Tensor] = {}

    def keep_norm(position: int, grad: torch.Tensor) -> torch.Tensor:
        # float64 a slice at a time: a float64 copy of a 32,000-word embedding's gradient would double its memory
        terms[position] = sum(chunk.double().square().sum() for chunk in grad.reshape(-1).split(_SQUARING_CHUNK))
        # a stride-0 zero of the gradient's shape is what autograd hands back: no memory
        return grad.new_zeros(()).expand_as(grad)

    wanted = [(n, t) for n, t in enumerate(tensors) if t.requires_grad]
    if not wanted or not output.requires_grad:
        return torch.zeros((), dtype=torch.float64)
    handles = [tensor.register_hook(partial(keep_norm, n)) for n, tensor in wanted]
    try:
        torch.autograd.grad(output, [t for _, t in wanted], allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    if not terms:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack([terms[n] for n in sorted(terms)]).sum()


def _naive_group_split(
    decoder: nn.Module,
    params: Sequence[nn.Parameter],
    grads: Sequence[torch.Tensor | None],
    decoder_input: torch.Tensor,
    decoder_grad_output: torch.Tensor,
    groups: ParameterGroups,
) -> torch.Tensor:
    g = decoder_grad_output.double().reshape(-1, decoder_grad_output.shape[-1])
    h = decoder_input.double().reshape(-1, decoder_input.shape[-1])
    own_gradients = {id(decoder.weight): g.T @ h}
    if getattr(decoder, "bias", None) is not None:
        own_gradients[id(decoder.bias)] = g.sum(dim=0)
    split = torch.zeros(len(groups), dtype=torch.float64)
    for param, grad in zip(params, grads, strict=True):
        if grad is None:
            continue
        total = float(grad.double().square().sum())
        own = own_gradients.get(id(param))
        if own is not None:
            own_term = float(own.square().sum())
            split[groups.output_layer] += own_term
            total -= own_term
        split[groups.index_of[id(param)]] += total
    return split


ESTIMATOR = NaiveEstimator()
