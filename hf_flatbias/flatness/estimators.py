"""Estimators of the paper's flatness measure, the trace of the Hessian of the pre-training loss.

Liu et al. (2023, App. B.1) measure ``Tr(H) = E_{x,t} E_{y ~ f(x_-t)} ||grad_theta log f(x_-t)_y||^2``: the trace of the
Fisher information, with ``y`` drawn from the model's own prediction at one masked position per context. It equals
the Hessian trace of the loss when the model outputs the true conditionals.

Estimators (``estimator=``):

- ``"per_sample"`` (default): per-context squared gradient norms for a whole batch of contexts from one forward and
  one backward per draw, with ghost norms (`hf_flatbias.flatness.ghost`); the LM head runs only at the predicted
  position, and the output layer's own term is replaced by its exact expectation over ``y``
  (``(1 - ||p||^2)(||h||^2 + 1)``), which removes most of the draw noise at no cost.
- ``"summed"``: ``||sum of the sampled-label gradients||^2 / count`` over a batch; unbiased because the score has
  mean zero, but the cross terms add variance.
- ``"hutchinson"``: ``v^T H v`` with random probes ``v`` (Rademacher by default, ``probe="gaussian"`` for standard
  normal entries) on the loss of the *data* labels of single-position contexts. It estimates the Hessian trace of the
  data loss, which equals the Fisher trace only when the model's conditionals are the true ones. The paper's released
  code measures a related quantity with one Gaussian probe per batch of multi-mask sequences, over every parameter but
  the output layer's bias and the pooler: `hf_flatbias.flatness.released_code` implements exactly that one.
- ``"hutchpp"``: Hutch++ (`hf_flatbias.flatness.hutchpp`) on the same Hessian, ``n_draws`` products per batch: a
  third sketch the dominant eigenvectors, whose part of the trace is then taken exactly, and Hutchinson's estimator
  covers the rest; less error than ``hutchinson`` at equal products when a few eigenvalues dominate, one value per
  batch, and ``n_draws // 3`` parameter-sized vectors held per batch.
- ``"naive"``: one forward and backward per draw; the reference loop, exact for any architecture.

Every estimator first produces `TraceSamples`: values per sampling unit (a context, or a batch of contexts for
``summed``/``hutchinson``) over a subset of context indices. Units can be computed on different processes and
concatenated before `summarize_trace_samples` turns them into a `TraceEstimate`; each context's random draws depend
only on ``(seed, context index)``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm.auto import tqdm

from ..constants import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_ESTIMATOR,
    ESTIMATORS,
    HUTCHINSON_PROBES,
    RECOMMENDED_N_DRAWS,
    TRACE_SYMBOLS,
)
from ..tensors import squared_norm
from .contexts import TraceContexts, context_generator
from .ghost import GhostNormRecorder, add_squared_gradients
from .groups import GroupOf, ParameterGroups, parameter_groups
from .hutchpp import hutchpp_trace
from .lm import check_lm_model, logits_at_positions, measured_parameters, output_vocab_size
from .memory import auto_batch_size
from .results import TraceSamples


def sample_labels(probs: torch.Tensor, indices: Sequence[int], n_draws: int, seed: int) -> torch.Tensor:
    """(B, n_draws) labels, row ``b`` drawn from ``probs[b]`` with the generator of context ``indices[b]``."""
    uniforms = torch.stack(
        [torch.rand(n_draws, generator=context_generator(seed, i), dtype=torch.float64) for i in indices]
    ).to(probs.device)
    cdf = probs.double().cumsum(dim=1)
    labels = torch.searchsorted(cdf, uniforms * cdf[:, -1:])
    return labels.clamp_(max=probs.shape[1] - 1)


def _check_vocabulary(model: nn.Module, contexts: TraceContexts, indices: Sequence[int]) -> None:
    vocab_size = output_vocab_size(model)
    largest = max(max(int(contexts.input_ids[i].max()), contexts.targets[i]) for i in indices)
    if largest >= vocab_size:
        raise ValueError(
            f"Token id {largest} is outside the model's vocabulary of {vocab_size}: the data was tokenized with a "
            "different tokenizer than the model's. Tokenize with the model's own tokenizer."
        )


# ---------------------------------------------------------------------------------------------------------------------
# estimators over a subset of contexts


def _per_sample_batch(
    model: nn.Module,
    contexts: TraceContexts,
    indices: Sequence[int],
    params: Sequence[nn.Parameter],
    n_draws: int,
    seed: int,
    exact_output_expectation: bool,
    validate: bool,
    groups: ParameterGroups | None = None,
    diagonal: dict[int, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, float, float]:
    start = time.perf_counter()
    batch = contexts.model_inputs(indices, model)
    positions = torch.tensor([contexts.positions[i] for i in indices], device=batch["input_ids"].device)
    recorder = GhostNormRecorder(model, params)
    recorder.batch_size = len(indices)
    with recorder:
        logits = logits_at_positions(model, batch, positions)
    probs = torch.softmax(logits.detach()[:, 0].double(), dim=-1)
    labels = sample_labels(probs, indices, n_draws, seed)
    outputs = recorder.outputs()
    decoder = check_lm_model(model)
    decoder_call = next((c for c in recorder.calls if c.module is decoder and _are_the_logits(c.output, logits)), None)
    use_expectation = exact_output_expectation and decoder_call is not None
    trainable = {id(p) for p in params}
    if use_expectation:
        # E_y ||e_y - p||^2 = 1 - ||p||^2, times what multiplies the output gradient in the decoder's own term
        multiplier = torch.zeros(len(indices), dtype=torch.float64, device=probs.device)
        if id(decoder.weight) in trainable:
            multiplier += decoder_call.inputs.double().square().sum(dim=(1, 2))
        if getattr(decoder, "bias", None) is not None and id(decoder.bias) in trainable:
            multiplier += 1.0
        expected_output_term = (1.0 - probs.square().sum(dim=1)) * multiplier
        if diagonal is not None:
            _add_expected_output_diagonal(diagonal, decoder, decoder_call, probs, trainable)
    forward_seconds = time.perf_counter() - start

    start = time.perf_counter()
    values = torch.empty(len(indices), n_draws, dtype=torch.float64)
    group_values = None if groups is None else torch.empty(len(indices), n_draws, len(groups), dtype=torch.float64)
    for k in range(n_draws):
        cotangent = -probs.clone()
        cotangent[torch.arange(len(indices)), labels[:, k]] += 1.0
        grad_logits = cotangent.to(logits.dtype).unsqueeze(1)
        if validate and k == 0:
            recorder.check_unsupported_unused(logits, grad_logits)
        # no recorded output: none of the parameters reaches the logits, and every norm is zero
        grads = (
            torch.autograd.grad(
                logits, outputs, grad_outputs=grad_logits, retain_graph=k < n_draws - 1 or validate, allow_unused=True
            )
            if outputs
            else []
        )
        recorder.set_grad_outputs(grads)
        if diagonal is not None:
            add_squared_gradients(
                recorder,
                diagonal,
                weight=1.0 / n_draws,
                exclude_self_terms_of=decoder_call if use_expectation else None,
            )
        if groups is not None:
            by_parameter, own = recorder.squared_norm_terms(decoder_call, own_terms=not use_expectation)
            split = _sum_by_group(by_parameter, groups, len(indices), own.device)
            split[:, groups.output_layer] += expected_output_term if use_expectation else own
            group_values[:, k] = split.cpu()
            values[:, k] = group_values[:, k].sum(dim=1)
        elif use_expectation:
            values[:, k] = (recorder.squared_norms(exclude_self_terms_of=decoder_call) + expected_output_term).cpu()
        else:
            values[:, k] = recorder.squared_norms().cpu()
        if validate and k == 0:
            _validate_against_autograd(model, contexts, indices[0], params, int(labels[0, 0]), recorder)
            validate = False
    for call in recorder.calls:  # drop references to the graph
        call.grad_output = None
    return values, group_values, forward_seconds, time.perf_counter() - start


def _add_expected_output_diagonal(
    diagonal: dict[int, torch.Tensor],
    decoder: nn.Module,
    decoder_call,
    probs: torch.Tensor,
    trainable: set[int],
) -> None:
    """The decoder's own terms of the diagonal in expectation over ``y``: ``E_y (e_y - p)_v^2 = p_v (1 - p_v)``, times
    ``h_i^2`` for the weight (its input ``h`` at the one predicted position) and 1 for the bias, summed over the
    batch."""
    variance = probs * (1.0 - probs)  # (B, V)
    parts = []
    if id(decoder.weight) in trainable:
        inputs = decoder_call.inputs.double().reshape(len(probs), -1)
        parts.append((decoder.weight, variance.T @ inputs.square()))
    if getattr(decoder, "bias", None) is not None and id(decoder.bias) in trainable:
        parts.append((decoder.bias, variance.sum(dim=0)))
    for param, value in parts:
        if id(param) not in diagonal:
            diagonal[id(param)] = torch.zeros(param.shape, dtype=torch.float64, device=value.device)
        diagonal[id(param)] += value


def _are_the_logits(output: torch.Tensor, logits: torch.Tensor) -> bool:
    """Whether the decoder's output is the model's logits, or an identity of them (ZeRO-3 wraps module outputs in
    autograd functions that pass values through): the output expectation holds only then, not after a softcap or a
    scale."""
    if output is logits:
        return True
    return output.shape == logits.shape and torch.equal(output.detach(), logits.detach())


def _sum_by_group(
    by_parameter: dict[int, torch.Tensor], groups: ParameterGroups, batch_size: int, device: torch.device
) -> torch.Tensor:
    split = torch.zeros(batch_size, len(groups), dtype=torch.float64, device=device)
    for key, value in by_parameter.items():
        split[:, groups.index_of[key]] += value
    return split


def _validate_against_autograd(
    model: nn.Module,
    contexts: TraceContexts,
    index: int,
    params: Sequence[nn.Parameter],
    label: int,
    recorder: GhostNormRecorder,
) -> None:
    """Compare the ghost norm of one context with a plain backward: catches a parameter the hooks cannot see (e.g.
    a weight reused outside its module) instead of returning a silently wrong trace."""
    ghost = float(recorder.squared_norms()[0])
    reference = float(_naive_squared_norms(model, contexts, index, params, torch.tensor([label]))[0])
    if not math.isclose(ghost, reference, rel_tol=1e-3, abs_tol=1e-6 * max(1.0, abs(reference))):
        unsupported = f" Parameters outside those layers: {recorder.unsupported[:8]}." if recorder.unsupported else ""
        raise ValueError(
            f"Per-sample gradient norms do not match a plain backward on {type(model).__name__} ({ghost:.6g} vs "
            f"{reference:.6g}): estimator='per_sample' sees the parameters of Linear, Conv1D, Embedding, LayerNorm "
            f"and elementwise norm layers used inside those layers only.{unsupported} Use estimator='naive' (exact "
            "for any model, slower), or freeze the other parameters (requires_grad=False) to leave them out of the "
            "trace."
        )


def _naive_squared_norms(
    model: nn.Module,
    contexts: TraceContexts,
    index: int,
    params: Sequence[nn.Parameter],
    labels: torch.Tensor,
    groups: ParameterGroups | None = None,
    diagonal: dict[int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One stock forward (logits everywhere) and one backward per label: squared norms (K,), or with ``groups``
    their split (K, G), the decoder's own term formed from its input and the gradient at its output."""
    batch = contexts.model_inputs([index], model)
    values = torch.empty(len(labels), *([len(groups)] if groups is not None else []), dtype=torch.float64)
    decoder = check_lm_model(model)
    seen: dict[str, torch.Tensor] = {}

    def record(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        seen["input"], seen["output"] = args[0].detach(), output

    for k, label in enumerate(labels.tolist()):
        handle = decoder.register_forward_hook(record) if groups is not None else None
        try:
            logits = model(**batch).logits[0, contexts.positions[index]]
        finally:
            if handle is not None:
                handle.remove()
        log_prob = torch.log_softmax(logits.float(), dim=-1)[label]
        if groups is None:
            grads = torch.autograd.grad(log_prob, params, allow_unused=True)
            values[k] = squared_norm(grads, dtype=torch.float64).cpu()
            if diagonal is not None:
                for param, grad in zip(params, grads, strict=True):
                    if grad is not None:
                        squared = grad.double().square() / len(labels)
                        diagonal[id(param)] = diagonal[id(param)] + squared if id(param) in diagonal else squared
            continue
        *grads, grad_output = torch.autograd.grad(log_prob, [*params, seen["output"]], allow_unused=True)
        values[k] = _naive_group_split(decoder, params, grads, seen["input"], grad_output, groups)
    return values


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


def _naive_context(
    model: nn.Module,
    contexts: TraceContexts,
    index: int,
    params: Sequence[nn.Parameter],
    n_draws: int,
    seed: int,
    groups: ParameterGroups | None = None,
    diagonal: dict[int, torch.Tensor] | None = None,
) -> torch.Tensor:
    with torch.no_grad():
        logits = model(**contexts.model_inputs([index], model)).logits[0, contexts.positions[index]]
    probs = torch.softmax(logits.double(), dim=-1).unsqueeze(0)
    labels = sample_labels(probs, [index], n_draws, seed)[0]
    if diagonal is not None and groups is not None:
        # the split and the diagonal come from two passes over the same labels (a reference, not a fast path)
        _naive_squared_norms(model, contexts, index, params, labels, None, diagonal)
        diagonal = None
    return _naive_squared_norms(model, contexts, index, params, labels, groups, diagonal)


def _summed_batch(
    model: nn.Module,
    contexts: TraceContexts,
    indices: Sequence[int],
    params: Sequence[nn.Parameter],
    n_draws: int,
    seed: int,
) -> torch.Tensor:
    batch = contexts.model_inputs(indices, model)
    positions = torch.tensor([contexts.positions[i] for i in indices], device=batch["input_ids"].device)
    logits = logits_at_positions(model, batch, positions)
    probs = torch.softmax(logits.detach()[:, 0].double(), dim=-1)
    labels = sample_labels(probs, indices, n_draws, seed)
    # gradient of sum_k log p(y_k) with respect to the logits: sum_k e_{y_k} - K p
    cotangent = -n_draws * probs
    cotangent.scatter_add_(1, labels, torch.ones_like(labels, dtype=cotangent.dtype))
    grads = torch.autograd.grad(logits, params, grad_outputs=cotangent.to(logits.dtype).unsqueeze(1), allow_unused=True)
    return (squared_norm(grads, dtype=torch.float64) / (len(indices) * n_draws)).reshape(1, 1).cpu()


def _data_loss_gradients(
    model: nn.Module, contexts: TraceContexts, indices: Sequence[int], params: Sequence[nn.Parameter]
) -> tuple[torch.Tensor, ...]:
    """Gradients of the summed data-label loss of ``indices`` with their graph, for Hessian-vector products."""
    batch = contexts.model_inputs(indices, model)
    positions = torch.tensor([contexts.positions[i] for i in indices], device=batch["input_ids"].device)
    targets = torch.tensor([contexts.targets[i] for i in indices], device=positions.device)
    # The fused CPU attention kernels have no double backward; the math kernel computes the same function.
    with sdpa_kernel(SDPBackend.MATH):
        logits = logits_at_positions(model, batch, positions)[:, 0]
    loss = torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum")
    return torch.autograd.grad(loss, params, create_graph=True)


def _hutchinson_batch(
    model: nn.Module,
    contexts: TraceContexts,
    indices: Sequence[int],
    params: Sequence[nn.Parameter],
    n_draws: int,
    seed: int,
    probe: str,
) -> torch.Tensor:
    grads = _data_loss_gradients(model, contexts, indices, params)
    generator = context_generator(seed, indices[0])
    values = torch.empty(1, n_draws, dtype=torch.float64)
    for k in range(n_draws):
        probes = [_probe(p, probe, generator) for p in params]
        hvp = torch.autograd.grad(grads, params, grad_outputs=probes, retain_graph=k < n_draws - 1, allow_unused=True)
        quadratic = sum(
            float((v.double() * h.double()).sum()) for v, h in zip(probes, hvp, strict=True) if h is not None
        )
        values[0, k] = quadratic / len(indices)
    return values


def _hutchpp_batch(
    model: nn.Module,
    contexts: TraceContexts,
    indices: Sequence[int],
    params: Sequence[nn.Parameter],
    n_draws: int,
    seed: int,
    probe: str,
) -> torch.Tensor:
    """Hutch++ on the batch's data-label Hessian with ``n_draws`` products: one value per batch."""
    grads = _data_loss_gradients(model, contexts, indices, params)
    sizes = [p.numel() for p in params]

    def hessian_times(vector: torch.Tensor) -> torch.Tensor:
        tangents = [piece.reshape(p.shape) for piece, p in zip(vector.split(sizes), params, strict=True)]
        hvp = torch.autograd.grad(grads, params, grad_outputs=tangents, retain_graph=True, allow_unused=True)
        return torch.cat(
            [torch.zeros(p.numel(), dtype=vector.dtype, device=vector.device) if h is None else h.reshape(-1)
             for p, h in zip(params, hvp, strict=True)]
        )  # fmt: skip

    value = hutchpp_trace(
        hessian_times,
        sum(sizes),
        n_draws,
        generator=context_generator(seed, indices[0]),
        probe=probe,
        dtype=params[0].dtype,
        device=params[0].device,
    )
    return torch.tensor([[value / len(indices)]], dtype=torch.float64)


def _probe(param: nn.Parameter, kind: str, generator: torch.Generator) -> torch.Tensor:
    """Entries of mean 0 and variance 1, so that ``E[v^T H v] = Tr H``; Rademacher ones add the least variance."""
    if kind == "gaussian":
        values = torch.randn(param.shape, generator=generator)
    else:
        values = torch.randint(0, 2, param.shape, generator=generator) * 2 - 1
    return values.to(device=param.device, dtype=param.dtype)


def _length_sorted_batches(contexts: TraceContexts, indices: Sequence[int], batch_size: int) -> list[list[int]]:
    ordered = sorted(indices, key=lambda i: len(contexts.input_ids[i]))
    return [ordered[start : start + batch_size] for start in range(0, len(ordered), batch_size)]


def check_estimator_arguments(estimator: str, n_draws: int, batch_size: int | str, probe: str = "rademacher") -> None:
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator={estimator!r} is not supported; choose one of {list(ESTIMATORS)}.")
    if probe not in HUTCHINSON_PROBES:
        raise ValueError(f"probe={probe!r} is not supported; choose one of {list(HUTCHINSON_PROBES)}.")
    if probe != "rademacher" and estimator not in ("hutchinson", "hutchpp"):
        raise ValueError(
            f"probe={probe!r} applies to estimator='hutchinson' or 'hutchpp' only (got estimator={estimator!r})."
        )
    if not isinstance(n_draws, int) or n_draws < 1:
        raise ValueError(f"n_draws must be an integer >= 1 (got {n_draws!r}); {RECOMMENDED_N_DRAWS} is usually best.")
    if batch_size != "auto" and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be an integer >= 1 or 'auto' (got {batch_size!r}).")


def compute_trace_samples(
    model: nn.Module,
    contexts: TraceContexts,
    *,
    indices: Sequence[int] | None = None,
    n_draws: int = RECOMMENDED_N_DRAWS,
    estimator: str = DEFAULT_ESTIMATOR,
    seed: int = 0,
    batch_size: int | str = DEFAULT_BATCH_SIZE,
    exact_output_expectation: bool = True,
    probe: str = "rademacher",
    by_group: bool | GroupOf = False,
    progress: bool = False,
    diagonal: dict[int, torch.Tensor] | None = None,
) -> TraceSamples:
    """Estimator values for the contexts ``indices`` (all by default), to be concatenated and summarized.

    The model must already be in the mode it is measured in (see `estimate_hessian_trace`). A process measuring a
    share of the contexts passes its own ``indices``; draws depend only on ``(seed, index)``. ``progress`` shows a
    bar over these contexts, with its time left, on stderr. ``diagonal`` (``per_sample`` and ``naive``), a dict to
    fill: ``diagonal[id(p)]`` accumulates, for every measured parameter ``p``, the sum over these contexts of the
    mean over draws of the squared sampled-label gradient, elementwise (float64), from the same draws as the values
    (`hf_flatbias.flatness.diagonal`).
    """
    check_estimator_arguments(estimator, n_draws, batch_size, probe)
    indices = list(range(len(contexts))) if indices is None else list(indices)
    if not indices:
        raise ValueError("compute_trace_samples got no context indices.")
    check_lm_model(model)
    _check_vocabulary(model, contexts, indices)
    if diagonal is not None and estimator not in ("per_sample", "naive"):
        raise ValueError(f"The Fisher diagonal needs estimator='per_sample' or 'naive' (got {estimator!r}).")
    params = measured_parameters(model)
    groups = _groups(model, params, estimator, by_group)
    forward_seconds = draw_seconds = 0.0
    parts, group_parts = [], []
    bar = tqdm(
        total=len(indices), desc=f"{TRACE_SYMBOLS[estimator]} ({estimator})", unit="context", disable=not progress
    )
    with torch.enable_grad(), bar:
        if estimator == "naive":
            for i in indices:
                drawn = _naive_context(model, contexts, i, params, n_draws, seed, groups, diagonal).unsqueeze(0)
                parts.append(drawn if groups is None else drawn.sum(dim=2))
                group_parts.append(drawn)
                bar.update(1)
            weights = torch.ones(len(indices))
        else:
            if batch_size == "auto":
                batch_size = auto_batch_size(model, contexts, indices)
            batches = _length_sorted_batches(contexts, indices, batch_size)
            weights = torch.ones(len(indices))
            for number, group in enumerate(batches):
                if estimator == "per_sample":
                    values, group_values, forward_s, draw_s = _per_sample_batch(
                        model,
                        contexts,
                        group,
                        params,
                        n_draws,
                        seed,
                        exact_output_expectation,
                        validate=number == 0,
                        groups=groups,
                        diagonal=diagonal,
                    )
                    parts.append(values)
                    group_parts.append(group_values)
                    forward_seconds += forward_s
                    draw_seconds += draw_s
                elif estimator == "summed":
                    parts.append(_summed_batch(model, contexts, group, params, n_draws, seed))
                elif estimator == "hutchpp":
                    parts.append(_hutchpp_batch(model, contexts, group, params, n_draws, seed, probe))
                else:
                    parts.append(_hutchinson_batch(model, contexts, group, params, n_draws, seed, probe))
                bar.update(len(group))
            if estimator == "per_sample":
                # back from length order to the callers' order
                position_of = {index: n for n, index in enumerate(i for group in batches for i in group)}
                order = [position_of[i] for i in indices]
                parts = [torch.cat(parts)[order]]
                if groups is not None:
                    group_parts = [torch.cat(group_parts)[order]]
            else:
                weights = torch.tensor([float(len(group)) for group in batches])
    return TraceSamples(
        values=torch.cat(parts),
        weights=weights,
        n_draws=n_draws,
        estimator=estimator,
        forward_seconds=forward_seconds,
        draw_seconds=draw_seconds,
        group_values=torch.cat(group_parts) if groups is not None else None,
        group_names=groups.names if groups is not None else (),
    )


def _groups(
    model: nn.Module, params: Sequence[nn.Parameter], estimator: str, by_group: bool | GroupOf
) -> ParameterGroups | None:
    if by_group is False:
        return None
    if estimator not in ("per_sample", "naive"):
        raise ValueError(
            f"by_group needs a per-context estimator ('per_sample' or 'naive'), got estimator={estimator!r}."
        )
    return parameter_groups(model, params, None if by_group is True else by_group)
