"""Quantization sensitivity of the pre-training loss: how much the loss rises when the weight matrices are rounded to
``bits``-bit integers (round-to-nearest, weight-only "fake" quantization: rounded, then scaled back to floats).

Which weights: the ``weight`` of every `torch.nn.Linear` and `torch.nn.Embedding` module (and transformers'
``Conv1D``, GPT-2's transposed linear layer), each once when tied (BERT's decoder is its word embeddings); with
``include_embeddings=False`` the embeddings and the output embedding (LM head) stay in full precision, as weight-only
LLM quantization usually keeps them. Biases, norms and every other tensor stay as they are.

The scheme: symmetric, restricted range. Each row (output channel: a row of a Linear weight ``(out, in)``, a token's
vector of an Embedding ``(vocab, hidden)``, a column of a ``Conv1D``) is split into groups of ``group_size``
consecutive input entries (the whole row, ``group_size=None``, for per-channel); each group gets the scale
``max|w| / (2^(bits-1) - 1)`` and ``w_q = clamp(round(w / scale), -(2^(bits-1) - 1), 2^(bits-1) - 1) * scale``
(``torch.round``: ties to even; a group of zeros stays zero). Computed in float32 (float64 for a float64 model) and
cast back to the weight's dtype.

The loss is the mean data-label cross-entropy over the contexts; the increase comes with the standard error of the
mean of the per-context differences. The weights are restored bit for bit. Nothing here knows about the Trainer.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ..constants import DEFAULT_BATCH_SIZE
from ..measure_settings import QUANTIZATION_BITS
from .contexts import prepare_contexts
from .lm import check_lm_model, evaluation_mode, preserved_global_rng
from .weight_noise import check_positive_int, mean_and_stderr, per_context_losses

MIN_BITS, MAX_BITS = QUANTIZATION_BITS
DEFAULT_BITS = (8, 4)


@dataclass
class QuantizationPoint:
    """The loss increase at one bit width.

    Attributes:
        bits: the integer width.
        quantized_loss: the mean data-label cross-entropy with the quantized weights.
        loss_increase: ``quantized_loss - base_loss``.
        stderr: the standard error of ``loss_increase`` (of the mean of per-context differences; ``nan`` with one
            context).
        relative_weight_error: ``||W_q - W|| / ||W||`` over all quantized matrices together.
    """

    bits: int
    quantized_loss: float
    loss_increase: float
    stderr: float
    relative_weight_error: float


@dataclass
class QuantizationSensitivity:
    """Round-to-nearest quantization sensitivity of the pre-training loss.

    Attributes:
        points: one `QuantizationPoint` per bit width, in the order asked.
        base_loss: the mean data-label cross-entropy of the unquantized model.
        group_size: input entries sharing a scale; ``None`` for per-channel (one scale per row).
        granularity: ``"per_channel"`` or ``"per_group"``.
        include_embeddings: whether embeddings and the output embedding were quantized too.
        n_tensors: the weight matrices quantized.
        n_quantized_parameters: their entries.
        n_contexts: contexts the loss averages over.
        seconds: wall-clock time.
    """

    points: list[QuantizationPoint]
    base_loss: float
    group_size: int | None
    granularity: str
    include_embeddings: bool
    n_tensors: int
    n_quantized_parameters: int
    n_contexts: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def quantized_weight_matrices(model: nn.Module, *, include_embeddings: bool = True) -> dict[str, nn.Parameter]:
    """The weights `estimate_quantization_sensitivity` quantizes, by the name of their module's ``weight``: Linear,
    Embedding and Conv1D weights, each tied parameter once (under its first name); without the embeddings and the
    output embedding when ``include_embeddings=False``."""
    excluded: set[int] = set()
    if not include_embeddings:
        get_output = getattr(model, "get_output_embeddings", None)
        output = get_output() if callable(get_output) else None
        if output is not None:
            excluded.add(id(output.weight))
        excluded.update(id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding))
    chosen: dict[str, nn.Parameter] = {}
    seen: set[int] = set()
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.Embedding)) and not _is_conv1d(module):
            continue
        weight = getattr(module, "weight", None)
        if not isinstance(weight, nn.Parameter) or weight.dim() != 2 or id(weight) in seen or id(weight) in excluded:
            continue
        seen.add(id(weight))
        chosen[f"{name}.weight" if name else "weight"] = weight
    return chosen


def check_quantization_settings(bits: Any, group_size: Any) -> None:
    """`ValueError` naming the fix for a bit width outside ``MIN_BITS..MAX_BITS`` or a group size that is not a
    positive integer."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(
            f"bits={bits!r} is not supported: round-to-nearest integer quantization takes an integer from {MIN_BITS} "
            f"to {MAX_BITS} (e.g. 8 or 4)."
        )
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1):
        raise ValueError(
            f"group_size={group_size!r} must be a positive integer dividing every quantized matrix's input size "
            "(e.g. 32, 64 or 128), or None for one scale per output channel."
        )


@torch.no_grad()
def round_to_nearest(matrix: torch.Tensor, bits: int, group_size: int | None = None) -> torch.Tensor:
    """Symmetric round-to-nearest fake quantization of a ``(channels, inputs)`` matrix (see the module docstring),
    returned in the matrix's dtype; ``group_size=None`` is one scale per row.

    Raises:
        ValueError: bad ``bits`` or ``group_size``, a group size that does not divide the inputs, or a matrix that is
            not 2-d.
    """
    check_quantization_settings(bits, group_size)
    if matrix.dim() != 2:
        raise ValueError(f"round_to_nearest takes a 2-d (channels, inputs) matrix, got shape {tuple(matrix.shape)}.")
    channels, inputs = matrix.shape
    size = inputs if group_size is None else group_size
    if inputs % size:
        raise ValueError(
            f"group_size={group_size} does not divide the matrix's {inputs} input entries: use a divisor of it, or "
            "group_size=None for one scale per output channel."
        )
    work_dtype = torch.float64 if matrix.dtype == torch.float64 else torch.float32
    groups = matrix.to(work_dtype).reshape(channels, inputs // size, size)
    q_max = 2 ** (bits - 1) - 1
    scale = groups.abs().amax(dim=-1, keepdim=True) / q_max
    safe_scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    quantized = torch.clamp(torch.round(groups / safe_scale), -q_max, q_max) * safe_scale
    return quantized.reshape(channels, inputs).to(matrix.dtype)


def _quantization_targets(
    model: nn.Module, include_embeddings: bool, group_size: int | None
) -> list[tuple[str, nn.Parameter, bool]]:
    """(name, weight, stored transposed) of each matrix to quantize, with the group size checked against each."""
    conv1d_weights = {id(m.weight) for m in model.modules() if _is_conv1d(m)}
    targets = []
    for name, weight in quantized_weight_matrices(model, include_embeddings=include_embeddings).items():
        transposed = id(weight) in conv1d_weights
        inputs = weight.shape[0] if transposed else weight.shape[1]
        if group_size is not None and inputs % group_size:
            raise ValueError(
                f"group_size={group_size} does not divide the {inputs} input entries of {name}: use a divisor of "
                "every quantized matrix's input size, or group_size=None for one scale per output channel."
            )
        targets.append((name, weight, transposed))
    if not targets:
        raise ValueError(
            "The model has no Linear, Embedding or Conv1D weight to quantize"
            + ("" if include_embeddings else " outside its embeddings (pass include_embeddings=True)")
            + "."
        )
    return targets


def estimate_quantization_sensitivity(
    model: nn.Module,
    dataset: Iterable[Mapping[str, Any]],
    bits: int | Sequence[int] = DEFAULT_BITS,
    *,
    group_size: int | None = None,
    include_embeddings: bool = True,
    n_contexts: int | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    causal: bool | None = None,
) -> QuantizationSensitivity:
    """The pre-training loss increase after round-to-nearest quantization of the weight matrices, per bit width.

    Args:
        model: a masked or causal LM.
        dataset: rows with ``input_ids``, ``attention_mask`` and ``labels`` (-100 except the predicted positions).
        bits: one bit width or several (each from 2 to 8); default 8 and 4.
        group_size: input entries per scale (per-group); ``None`` (default): one scale per output channel. Must
            divide the input size of every quantized matrix.
        include_embeddings: quantize the embeddings and the output embedding too (default); ``False`` keeps them in
            full precision.
        n_contexts, batch_size, causal: as for `estimate_weight_noise_sensitivity`.

    Returns:
        A `QuantizationSensitivity`; the model's weights are restored bit for bit.

    Raises:
        ValueError: a bit width outside 2..8, a group size that is not a positive integer or does not divide a
            matrix's input size, a model without an LM head or without a matrix to quantize.
    """
    start_time = time.perf_counter()
    widths = list(bits) if isinstance(bits, (list, tuple, range)) else [bits]
    if not widths:
        raise ValueError("bits is empty: pass a bit width from 2 to 8, or several (e.g. (8, 4)).")
    for width in widths:
        check_quantization_settings(width, group_size)
    check_positive_int("batch_size", batch_size)
    check_lm_model(model)
    targets = _quantization_targets(model, include_embeddings, group_size)
    contexts, n_used = prepare_contexts(model, dataset, n_contexts, causal)
    params = [weight for _, weight, _ in targets]
    points = []
    with evaluation_mode(model), preserved_global_rng(), torch.no_grad():
        base = per_context_losses(model, contexts, n_used, batch_size)
        saved = [p.detach().clone() for p in params]
        weight_norm_sq = sum(float(w.double().square().sum()) for w in saved)
        try:
            for width in widths:
                error_sq = 0.0
                for (_, weight, transposed), original in zip(targets, saved, strict=True):
                    quantized = round_to_nearest(original.t() if transposed else original, width, group_size)
                    quantized = quantized.t() if transposed else quantized
                    error_sq += float((quantized.double() - original.double()).square().sum())
                    weight.copy_(quantized)
                losses = per_context_losses(model, contexts, n_used, batch_size)
                increase, stderr = mean_and_stderr(losses - base)
                points.append(
                    QuantizationPoint(
                        bits=width,
                        quantized_loss=float(losses.mean()),
                        loss_increase=increase,
                        stderr=stderr,
                        relative_weight_error=(error_sq / weight_norm_sq) ** 0.5 if weight_norm_sq > 0 else 0.0,
                    )
                )
                torch._foreach_copy_(params, saved)
        finally:
            torch._foreach_copy_(params, saved)
    return QuantizationSensitivity(
        points=points,
        base_loss=float(base.mean()),
        group_size=group_size,
        granularity="per_channel" if group_size is None else "per_group",
        include_embeddings=include_embeddings,
        n_tensors=len(targets),
        n_quantized_parameters=sum(p.numel() for p in params),
        n_contexts=n_used,
        seconds=time.perf_counter() - start_time,
    )
