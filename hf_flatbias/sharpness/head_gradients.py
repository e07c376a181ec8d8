"""Label log-probabilities of a linear output layer whose gradients are formed in the forward, chunk by chunk.

A fused LM head such as trl's (``ChunkedLogProbFunction``) returns each row's ``log p_i = z_i[y_i] - logsumexp(z_i)``
of the logits ``z = h W^T + b`` without holding them whole, and recomputes them in its backward: per row, one product
for the forward, one again in the backward, then the two gradient products (``h``'s and ``W``'s), four head-sized
multiply-adds. Here each chunk of rows forms, while its logits are at hand, the gradients of ``sum_i log p_i``:

    D_i = onehot(y_i) - softmax(z_i),   dh_i = D_i W,   dW = sum_i D_i^T h_i,   db = sum_i D_i.

The backward only scales them by the incoming ``g_i = dL / d log p_i``: ``g_i dh_i`` is exact for any ``g``, and
``c dW`` whenever every ``g_i`` is the same ``c`` (a loss summed or averaged over tokens, as trl's default SFT loss);
any other ``g`` (per-token weights) has ``dW`` recomputed from the saved inputs, so the answer is exact for every loss.
The forward then costs two products where ``h`` takes no gradient (the first pass of output-layer SAM, whose trunk is
replayed) and three where it does, and the backward none: against the fused head's four per pass. The price is memory
held from the forward to the backward: one head-sized gradient (in float32 at least) and, where ``h`` takes one, a
gradient the size of the rows' hidden states, besides one chunk of logits at a time.

A loss whose ``g_i`` differ between rows and are known only after it is computed (DPO's: each sequence's sign and
sigmoid weight, times beta) has ``dW`` formed in the forward and recomputed in the backward, four products in a
pass without ``h``'s gradient (trl's kernel: three). With ``kept_bytes`` the forward keeps
``-D_i = softmax(z_i) - onehot(y_i)`` instead, chunk by chunk up to that many bytes, and the backward forms every
gradient of those rows from ``-g_i D_i``: one product per gradient, for any ``g``. A pass then costs two products
without ``h``'s gradient and three with it, for any loss; the price is the kept values (rows x vocabulary in the
accumulation dtype) held from the forward to the backward.

Pure: nothing here knows about trainers or trl.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

#: Logits held at once: 2^27 values are 512 MiB in float32, the tile of trl's fused head (4,096 tokens x 32,768).
CHUNK_ELEMENTS = 1 << 27


@dataclass
class LabelLogProbs:
    """Per row: ``log p(y_i)``, and (when asked for) the entropy of ``softmax(z_i)`` and whether ``y_i`` is its first
    argmax (the top-1 prediction), and the mean of its logits."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    #: The mean of each row's logits over the vocabulary (with ``metrics``).
    mean_logits: torch.Tensor | None = None


def label_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    *,
    metrics: bool = False,
    chunk_elements: int = CHUNK_ELEMENTS,
    kept_bytes: int = 0,
) -> LabelLogProbs:
    """``log softmax(hidden @ weight.T + bias)[i, labels[i]]`` for each row, differentiable in ``hidden``, ``weight``
    and ``bias``, with the gradients formed in the forward (see the module); ``metrics`` adds the entropy, the
    top-1 flag and the mean logit, which take no gradient. ``labels`` must all be valid indices (drop ignored rows
    first).

    ``kept_bytes`` > 0 is for losses whose per-row weights differ (see the module): whole chunks of rows, from the
    first, whose ``softmax - onehot`` (in the accumulation dtype) fits in that many bytes keep it to the backward,
    which forms their gradients from it; the other rows form the hidden states' gradient in the forward and
    recompute the head's in the backward.
    """
    if hidden.ndim != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(
            f"label_log_probs takes rows: hidden (rows, width) and labels (rows,), got {tuple(hidden.shape)} and "
            f"{tuple(labels.shape)}."
        )
    grad_enabled = torch.is_grad_enabled()
    needs = tuple(grad_enabled and t is not None and t.requires_grad for t in (hidden, weight, bias))
    # with rows to keep, the weights are taken to differ per row: the head's gradient of the rows not kept is then
    # recomputed in the backward rather than formed in the forward too, even where no chunk fits
    kept_elements = kept_bytes // _dtypes(hidden)[1].itemsize if kept_bytes > 0 else None
    log_probs, entropy, is_top1, mean_logits = _LabelLogProbs.apply(
        hidden, weight, bias, labels, metrics, chunk_elements, kept_elements, needs
    )
    return LabelLogProbs(log_probs, entropy, is_top1, mean_logits)


def _dtypes(hidden: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    device_type = hidden.device.type
    compute = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    return compute, torch.promote_types(compute, torch.float32)


def _chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    chunk_elements: int,
    compute: torch.dtype,
    accumulate: torch.dtype,
) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per chunk of rows: the rows, their hidden states and the head in ``compute``, and their log-softmax in
    ``accumulate`` (a fresh tensor the caller may overwrite)."""
    head = weight.to(compute)
    head_bias = None if bias is None else bias.to(compute)
    rows_per_chunk = max(1, chunk_elements // max(1, weight.shape[0]))
    for start in range(0, hidden.shape[0], rows_per_chunk):
        rows = slice(start, start + rows_per_chunk)
        rows_hidden = hidden[rows].to(compute)
        logits = rows_hidden @ head.T if head_bias is None else torch.addmm(head_bias, rows_hidden, head.T)
        yield rows, rows_hidden, head, torch.log_softmax(logits.to(accumulate), dim=-1)


def _minus_one_hot(probs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``softmax - onehot(y)`` (``-D``, the gradient of ``-log p(y)`` in the logits) in place of ``probs``."""
    probs[torch.arange(labels.numel(), device=labels.device), labels] -= 1.0
    return probs


def _add_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b`` with ``out`` in the accumulation dtype, half-precision factors not rounded first (as trl's
    fused head accumulates)."""
    if out.device.type == "cuda" and a.dtype in (torch.float16, torch.bfloat16):
        torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    else:
        torch.addmm(out, a.to(out.dtype), b.to(out.dtype), out=out)


class _LabelLogProbs(torch.autograd.Function):
    """The forward keeps the gradients of ``-sum_i log p_i`` (``softmax - onehot`` is one elementwise pass fewer than
    its negation), or for the kept rows ``softmax - onehot`` itself; the backward scales them by ``-g``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, metrics, chunk_elements, kept_elements, needs):
        ctx.set_materialize_grads(False)
        need_hidden, need_weight, need_bias = needs
        compute, accumulate = _dtypes(hidden)
        rows_total = hidden.shape[0]
        log_probs = torch.empty(rows_total, dtype=accumulate, device=hidden.device)
        entropy = torch.empty_like(log_probs) if metrics else None
        is_top1 = torch.empty(rows_total, dtype=torch.bool, device=hidden.device) if metrics else None
        mean_logits = _mean_logits(hidden, weight, bias, compute, accumulate) if metrics else None
        grad_hidden = hidden.new_zeros(hidden.shape, dtype=accumulate) if need_hidden else None
        head_in_forward = kept_elements is None
        kept_elements = kept_elements or 0
        grad_weight = weight.new_zeros(weight.shape, dtype=accumulate) if need_weight and head_in_forward else None
        grad_bias = bias.new_zeros(bias.shape, dtype=accumulate) if need_bias and head_in_forward else None
        kept: list[torch.Tensor] = []
        kept_rows = 0
        with torch.autocast(hidden.device.type, enabled=False):
            for rows, rows_hidden, head, log_softmax in _chunks(
                hidden, weight, bias, chunk_elements, compute, accumulate
            ):
                row_labels = labels[rows]
                log_probs[rows] = log_softmax.gather(-1, row_labels.unsqueeze(-1)).squeeze(-1)
                if metrics:
                    # the first argmax of the log-softmax is that of the logits (a constant shift per row)
                    is_top1[rows] = log_softmax.argmax(-1) == row_labels
                    probs = log_softmax.exp()
                    entropy[rows] = -torch.linalg.vecdot(probs, log_softmax)
                elif any(needs):
                    probs = log_softmax.exp_()
                if not any(needs):
                    continue
                excess = _minus_one_hot(probs, row_labels)
                if kept_rows == rows.start and excess.numel() <= kept_elements - kept_rows * weight.shape[0]:
                    kept.append(excess)
                    kept_rows += excess.shape[0]
                    continue
                excess = excess.to(compute)
                if need_hidden:
                    _add_product(grad_hidden[rows], excess, head)
                if grad_weight is not None:
                    _add_product(grad_weight, excess.T, rows_hidden)
                if grad_bias is not None:
                    grad_bias += excess.sum(0, dtype=accumulate)
        ctx.save_for_backward(hidden, weight, bias, labels, grad_hidden, grad_weight, grad_bias, *kept)
        ctx.chunk_elements, ctx.dtypes, ctx.needs = chunk_elements, (compute, accumulate), needs
        ctx.kept_rows, ctx.head_in_forward = kept_rows, head_in_forward
        ctx.mark_non_differentiable(*(t for t in (is_top1, mean_logits) if t is not None))
        return log_probs, entropy, is_top1, mean_logits

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_log_probs, grad_entropy, _grad_is_top1, _grad_mean_logits):
        if grad_entropy is not None:
            raise RuntimeError(
                "label_log_probs: the entropy it returns is a metric and takes no gradient; differentiate a loss of "
                "the log-probabilities only."
            )
        none = (None,) * 5
        if grad_log_probs is None:
            return (None, None, None, *none)
        hidden, weight, bias, labels, grad_hidden, grad_weight, grad_bias, *kept = ctx.saved_tensors
        _, need_weight, need_bias = ctx.needs
        compute, accumulate = ctx.dtypes
        scale = -grad_log_probs.to(accumulate)
        if grad_hidden is not None:
            grad_hidden = grad_hidden * scale.unsqueeze(-1)  # the kept rows' are zeros until formed below
        n = ctx.kept_rows
        if ctx.head_in_forward and (scale.numel() == 0 or bool((scale == scale[0]).all())):
            common = scale[0] if scale.numel() else 0.0
            grad_weight = None if grad_weight is None else grad_weight * common
            grad_bias = None if grad_bias is None else grad_bias * common
        elif need_weight or need_bias:
            # per-row weights on the rows not kept (if any): the head's gradient is recomputed with them
            grad_weight, grad_bias = _weighted_head_gradient(
                hidden[n:], weight, bias, labels[n:], scale[n:], ctx, need_weight=need_weight, need_bias=need_bias
            )
        if kept:
            grad_hidden, grad_weight, grad_bias = _kept_rows_gradients(
                kept, hidden, weight, scale, ctx, grad_hidden, grad_weight, grad_bias
            )
        return (
            None if grad_hidden is None else grad_hidden.to(hidden.dtype),
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            *none,
        )


def _mean_logits(hidden, weight, bias, compute, accumulate) -> torch.Tensor:
    """Each row's mean logit, ``h_i . mean_v(W_v) + mean(b)``: a product with one vector, no pass over the logits."""
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        mean_row = weight.to(compute).to(accumulate).mean(0)
        means = hidden.to(compute).to(accumulate) @ mean_row
        return means if bias is None else means + bias.to(compute).to(accumulate).mean()


def _kept_rows_gradients(kept, hidden, weight, scale, ctx, grad_hidden, grad_weight, grad_bias):
    """The gradients of the kept rows (the first ones) from their ``softmax - onehot`` scaled by ``-g``, added to
    those of the other rows: one product per gradient."""
    need_hidden, need_weight, need_bias = ctx.needs
    compute = ctx.dtypes[0]
    head = weight.to(compute)
    start = 0
    with torch.autocast(hidden.device.type, enabled=False):
        for excess in kept:
            rows = slice(start, start + excess.shape[0])
            start = rows.stop
            # not in place: a graph kept for a second backward would read the scaled values
            weighted = excess * scale[rows].unsqueeze(-1)
            if need_bias:
                grad_bias += weighted.sum(0)
            weighted = weighted.to(compute)
            if need_hidden:
                _add_product(grad_hidden[rows], weighted, head)
            if need_weight:
                _add_product(grad_weight, weighted.T, hidden[rows].to(compute))
    return grad_hidden, grad_weight, grad_bias


def _weighted_head_gradient(hidden, weight, bias, labels, scale, ctx, *, need_weight, need_bias):
    """``sum_i scale_i (softmax_i - onehot_i)^T h_i`` and ``sum_i scale_i (softmax_i - onehot_i)``, recomputed chunk
    by chunk as the forward computed them (in the accumulation dtype)."""
    (compute, accumulate), chunk_elements = ctx.dtypes, ctx.chunk_elements
    grad_weight = weight.new_zeros(weight.shape, dtype=accumulate) if need_weight else None
    grad_bias = bias.new_zeros(bias.shape, dtype=accumulate) if need_bias else None
    with torch.autocast(hidden.device.type, enabled=False):
        for rows, rows_hidden, _, log_softmax in _chunks(hidden, weight, bias, chunk_elements, compute, accumulate):
            weighted = _minus_one_hot(log_softmax.exp_(), labels[rows]).mul_(scale[rows].unsqueeze(-1))
            if need_weight:
                _add_product(grad_weight, weighted.to(compute).T, rows_hidden)
            if need_bias:
                grad_bias += weighted.sum(0)
    return grad_weight, grad_bias
