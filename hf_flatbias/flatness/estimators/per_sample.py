"""``per_sample`` (the default): per-context squared gradient norms for a whole batch of contexts from one forward
and one backward per draw, with ghost norms (`hf_flatbias.flatness.ghost`).

The LM head runs only at the predicted position, and the output layer's own term is replaced by its exact expectation
over ``y`` (``(1 - ||p||^2)(||h||^2 + 1)``), which removes most of the draw noise at no cost. The first batch of the
first estimate on a model is checked against a plain backward (`naive`), so that a parameter the hooks cannot see fails
loudly; the check runs again whenever the model's structure (its parameters, their shapes, dtypes, devices and
``requires_grad``, its hooks, its mode) or the measured parameters change (`model_signature`).
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..contexts import TraceContexts, sequence_units
from ..distributed import Zero3BackwardHooks
from ..ghost import GhostNormRecorder
from ..ghost_diagonal import add_squared_gradients
from ..groups import ParameterGroups
from ..lm import check_lm_model, logits_at_positions
from ..results import TraceSamples
from .base import TraceEstimator, length_sorted_batches, resolved_batch_size
from .naive import naive_squared_norms
from .output_probes import OutputProbes

if TYPE_CHECKING:
    from .settings import TraceSettings


class PerSampleEstimator(TraceEstimator):
    name = "per_sample"
    per_context = True

    def measure(self, model, contexts, indices, params, settings, *, groups, diagonal, advance) -> TraceSamples:
        units = sequence_units(contexts, indices, settings.positions_per_sequence)
        carriers = [_carrier(contexts, unit) for unit in units]
        unit_of_carrier = dict(zip(carriers, units, strict=True))
        carrier_batches = length_sorted_batches(
            contexts, carriers, resolved_batch_size(model, contexts, carriers, settings)
        )
        batches = [[unit_of_carrier[c] for c in batch] for batch in carrier_batches]
        forward_seconds = draw_seconds = 0.0
        parts, group_parts = [], []
        signature = model_signature(model, params)
        validate = _CHECKED.get(model) != signature
        for batch in batches:
            values, group_values, forward_s, draw_s = _per_sample_batch(
                model, contexts, batch, params, settings, validate=validate, groups=groups, diagonal=diagonal
            )
            if validate:  # the check passed (it raises otherwise): not again on this model as it is
                _CHECKED[model] = signature
                validate = False
            parts.append(values)
            group_parts.append(group_values)
            forward_seconds += forward_s
            draw_seconds += draw_s
            advance(sum(len(unit) for unit in batch))
        # back from length order to the callers' order
        position_of = {carrier: n for n, carrier in enumerate(c for batch in carrier_batches for c in batch)}
        order = [position_of[c] for c in carriers]
        return TraceSamples(
            values=torch.cat(parts)[order],
            weights=torch.tensor([float(len(unit)) for unit in units]),
            n_draws=settings.n_draws,
            estimator=self.name,
            forward_seconds=forward_seconds,
            draw_seconds=draw_seconds,
            group_values=torch.cat(group_parts)[order] if groups is not None else None,
            group_names=groups.names if groups is not None else (),
        )


_CHECKED: weakref.WeakKeyDictionary[nn.Module, tuple] = weakref.WeakKeyDictionary()
"""The `model_signature` under which each model last passed the check against a plain backward."""


def model_signature(model: nn.Module, params: Sequence[nn.Parameter]) -> tuple:
    """What the one-context check against a plain backward depends on, cheap to form (no pass): every parameter's
    name, identity, shape, dtype, device and ``requires_grad``, which of them are measured, every module's class,
    mode and registered hooks (a hook may use a weight outside its module), and the global module hooks.

    A model whose signature is unchanged since it passed the check is not checked again; any change (a layer added,
    resized or frozen, a hook registered, another dtype) checks it again on the next estimate."""
    measured = frozenset(id(p) for p in params)
    parameters = tuple(
        (name, id(p), tuple(p.shape), p.dtype, p.device, p.requires_grad, id(p) in measured)
        for name, p in model.named_parameters(remove_duplicate=False)
    )
    modules = tuple(
        (
            name,
            type(module),
            module.training,
            tuple(module._forward_hooks),
            tuple(module._forward_pre_hooks),
            tuple(module._backward_hooks),
            tuple(getattr(module, "_backward_pre_hooks", {})),
        )
        for name, module in model.named_modules(remove_duplicate=False)
    )
    global_hooks = tuple(
        tuple(getattr(torch.nn.modules.module, name, {}))
        for name in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks")
    )
    return (type(model), len(measured), parameters, modules, global_hooks)


def forget_self_checks() -> None:
    """Check every model against a plain backward again on its next `per_sample` estimate."""
    _CHECKED.clear()


def _carrier(contexts: TraceContexts, unit: Sequence[int]) -> int:
    """The context of a unit whose input holds every other's (a causal LM's longest prefix of their row)."""
    return max(unit, key=lambda i: contexts.positions[i])


def _per_sample_batch(
    model: nn.Module,
    contexts: TraceContexts,
    units: Sequence[Sequence[int]],
    params: Sequence[nn.Parameter],
    settings: TraceSettings,
    *,
    validate: bool,
    groups: ParameterGroups | None,
    diagonal: dict[int, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor | None, float, float]:
    """Per-unit values (B, n_draws), the mean over each unit's contexts (positions of one row, read from one forward
    and one backward per draw), their split by group (B, n_draws, G) or ``None``, and the seconds of the forward and
    of the draws."""
    n_draws = settings.n_draws
    start = time.perf_counter()
    carriers = [_carrier(contexts, unit) for unit in units]
    batch = contexts.model_inputs(carriers, model)
    width = max(len(unit) for unit in units)
    # a short unit's spare slots repeat its carrier's position with a zero cotangent and no output term
    slot_positions = [[contexts.positions[i] for i in unit] + [contexts.positions[c]] * (width - len(unit))
                      for unit, c in zip(units, carriers, strict=True)]  # fmt: skip
    positions = torch.tensor(slot_positions, device=batch["input_ids"].device)
    real_slots = torch.tensor([[s < len(unit) for s in range(width)] for unit in units], device=positions.device)
    flat_indices = [i for unit in units for i in unit]
    unit_sizes = torch.tensor([float(len(unit)) for unit in units], dtype=torch.float64)
    decoder = check_lm_model(model)
    recorder = GhostNormRecorder(model, params, keep_outputs_of=(decoder,))
    recorder.batch_size = len(units)
    zero3_hooks = Zero3BackwardHooks(model)
    with recorder:
        logits = logits_at_positions(model, batch, positions)
    zero3_hooks.snapshot()
    slot_probs = torch.softmax(logits.detach().double(), dim=-1)
    probs = slot_probs[real_slots]
    probes = OutputProbes(probs, flat_indices, n_draws, settings.seed, settings.output_probe)
    decoder_call = next((c for c in recorder.calls if c.module is decoder and _are_the_logits(c.output, logits)), None)
    use_expectation = settings.exact_output_expectation and decoder_call is not None
    if use_expectation:
        # E ||c||^2 = Tr(diag(p) - pp^T) = 1 - ||p||^2 for either cotangent, times what multiplies the output gradient
        # in the decoder's own term
        # in the decoder's own term; the cross terms between independent slots have mean zero
        multiplier = torch.zeros(real_slots.shape, dtype=torch.float64, device=probs.device)
        if recorder.measures(decoder, "weight"):
            multiplier += decoder_call.inputs.double().square().sum(dim=2)
        if recorder.measures(decoder, "bias"):
            multiplier += 1.0
        slot_terms = (1.0 - slot_probs.square().sum(dim=2)) * multiplier
        expected_output_term = (slot_terms * real_slots).sum(dim=1)
        if diagonal is not None:
            _add_expected_output_diagonal(diagonal, decoder, decoder_call, probs, {id(p) for p in params})
    forward_seconds = time.perf_counter() - start

    start = time.perf_counter()
    values = torch.empty(len(units), n_draws, dtype=torch.float64)
    group_values = None if groups is None else torch.empty(len(units), n_draws, len(groups), dtype=torch.float64)
    for k in range(n_draws):
        cotangent = probes.cotangent(k)
        grad_logits = _at_slots(cotangent.to(logits.dtype), real_slots)
        if validate and k == 0:
            zero3_hooks.rearm()
            recorder.check_unsupported_unused(logits, grad_logits)
            if probes.kind != "label" or width > 1:
                # the check is of a sampled label's gradient at one position, as its tests measure its power (a draw
                # of signs can hide a missed term that a label shows): one more backward, once per model
                labelled = _at_slots(probes.first_label_cotangents().to(logits.dtype), real_slots)
                at_carrier = torch.zeros_like(labelled)
                carrier_slots = [unit.index(c) for unit, c in zip(units, carriers, strict=True)]
                at_carrier[torch.arange(len(units)), carrier_slots] = labelled[torch.arange(len(units)), carrier_slots]
                _validate_by_backward(model, contexts, carriers, params, logits, at_carrier, recorder, zero3_hooks)
                validate = False
        zero3_hooks.rearm()
        retain_graph = k < n_draws - 1 or validate
        if diagonal is None and not validate:
            # each layer's terms formed as its output gradient arrives: the gradients at every layer output are never
            # held together
            by_parameter, own = recorder.streamed_squared_norm_terms(
                logits, grad_logits, decoder_call, own_terms=not use_expectation, retain_graph=retain_graph
            )
        else:
            recorder.gradients_at_outputs(logits, grad_logits, retain_graph=retain_graph)
            if diagonal is not None:
                # the per-sample norms come from the same squares as the diagonal: no Gram matrices
                by_parameter, own = add_squared_gradients(
                    recorder, diagonal, weight=1.0 / n_draws, split_self_terms_of=decoder_call,
                    own_in_diagonal=not use_expectation,
                )  # fmt: skip
            else:
                by_parameter, own = recorder.squared_norm_terms(decoder_call, own_terms=not use_expectation)
        output_term = expected_output_term if use_expectation else own
        if groups is not None:
            split = _sum_by_group(by_parameter, groups, len(units), own.device)
            split[:, groups.output_layer] += output_term
            group_values[:, k] = split.cpu()
            values[:, k] = group_values[:, k].sum(dim=1)
        else:
            values[:, k] = (sum(by_parameter.values(), torch.zeros_like(own)) + output_term).cpu()
        if validate and k == 0:  # one position per unit here: the draw itself is a sampled label's
            _validate_against_autograd(model, contexts, carriers[0], params, cotangent[:1], recorder)
            validate = False
        # this draw's gradients at every layer output (about one activation's worth) go before the next backward
        # forms its own
        recorder.set_grad_outputs([None] * len(recorder.calls))
    # a unit's sum over its positions, as the mean trace per position (the unit's weight is its size)
    values /= unit_sizes.unsqueeze(1)
    if group_values is not None:
        group_values /= unit_sizes.reshape(-1, 1, 1)
    return values, group_values, forward_seconds, time.perf_counter() - start


def _at_slots(slot_values: torch.Tensor, real_slots: torch.Tensor) -> torch.Tensor:
    """(n, V) values of the real slots, in order, as (B, P, V) with zeros in the spare slots."""
    placed = slot_values.new_zeros(*real_slots.shape, slot_values.shape[-1])
    placed[real_slots] = slot_values
    return placed


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


def _are_the_logits(output: torch.Tensor | None, logits: torch.Tensor) -> bool:
    """Whether the decoder's output is the model's logits, or an identity of them (ZeRO-3 wraps module outputs in
    autograd functions that pass values through): the output expectation holds only then, not after a softcap or a
    scale."""
    if output is logits:
        return True
    return output is not None and output.shape == logits.shape and torch.equal(output.detach(), logits.detach())


def _sum_by_group(
    by_parameter: dict[int, torch.Tensor], groups: ParameterGroups, batch_size: int, device: torch.device
) -> torch.Tensor:
    split = torch.zeros(batch_size, len(groups), dtype=torch.float64, device=device)
    for key, value in by_parameter.items():
        split[:, groups.index_of[key]] += value
    return split


def _validate_by_backward(
    model: nn.Module,
    contexts: TraceContexts,
    indices: Sequence[int],
    params: Sequence[nn.Parameter],
    logits: torch.Tensor,
    cotangents: torch.Tensor,
    recorder: GhostNormRecorder,
    zero3_hooks: Zero3BackwardHooks,
) -> None:
    """`_validate_against_autograd` of the cotangents (B, P, V), nonzero at the slot of context ``indices[b]`` of each
    row only, from a backward of their own that keeps the graph."""
    zero3_hooks.rearm()
    recorder.gradients_at_outputs(logits, cotangents, retain_graph=True)
    try:
        reference_cotangent = cotangents[0].sum(dim=0, keepdim=True)  # the one nonzero slot of row 0
        _validate_against_autograd(model, contexts, indices[0], params, reference_cotangent, recorder)
    finally:
        recorder.set_grad_outputs([None] * len(recorder.calls))


def _validate_against_autograd(
    model: nn.Module,
    contexts: TraceContexts,
    index: int,
    params: Sequence[nn.Parameter],
    cotangent: torch.Tensor,
    recorder: GhostNormRecorder,
) -> None:
    """Compare the ghost norm of one context with a plain backward: catches a parameter the hooks cannot see (e.g.
    a weight reused outside its module) instead of returning a silently wrong trace."""
    ghost = float(recorder.squared_norms()[0])
    reference = float(naive_squared_norms(model, contexts, index, params, cotangent)[0])
    # both sides are rounded in the parameters' dtype: bfloat16's 8-bit mantissa moves them apart by ~0.2%
    precise = all(p.dtype in (torch.float32, torch.float64) for p in params)
    tolerance = 1e-3 if precise else 2e-2
    if not (math.isfinite(ghost) and math.isfinite(reference)):  # no parameter is missed: nothing is finite
        raise ValueError(
            f"The gradient of the loss is not finite on {type(model).__name__} (its squared norm is {reference:.6g} "
            "on the first context): the checkpoint's weights or the data give non-finite logits; check the "
            "checkpoint (a diverged run?) and the data."
        )
    if not math.isclose(ghost, reference, rel_tol=tolerance, abs_tol=1e-6 * max(1.0, abs(reference))):
        unsupported = f" Parameters outside those layers: {recorder.unsupported[:8]}." if recorder.unsupported else ""
        raise ValueError(
            f"Per-sample gradient norms do not match a plain backward on {type(model).__name__} ({ghost:.6g} vs "
            f"{reference:.6g}): estimator='per_sample' sees the parameters of Linear, Conv1D, Embedding, LayerNorm "
            f"and elementwise norm layers used inside those layers only.{unsupported} Use estimator='naive' (exact "
            "for any model, slower), or freeze the other parameters (requires_grad=False) to leave them out of the "
            "trace."
        )


ESTIMATOR = PerSampleEstimator()
