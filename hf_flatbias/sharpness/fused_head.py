"""Functional-SAM through a fused LM head: ``dL/dF`` and the surrogate's gradient computed in row chunks from the
hidden states, so that no ``(tokens, vocabulary)`` logits tensor is ever held whole.

A fused head (trl's ``add_fused_lm_head``) returns each trained token's label log-probability
``log p_i = F_i[y_i] - logsumexp(F_i)`` of the logits ``F = h W^T + b``, computed in tiles. A loss that reads the logits
only through these log-probabilities has ``dL/dF_i = a_i (onehot(y_i) - softmax(F_i))`` with ``a_i = dL/d log p_i``:
per row one scalar, the clean hidden state ``h_i(w)`` and the clean head ``W(w), b(w)`` recompute it chunk by chunk.

The surrogate ``S = <F(w + e), C>`` (``C`` the cotangent at ``w``) is bilinear in the hidden states ``H`` and the head
``W`` at ``w + e``: its gradient is ``J_H^T (C W) + J_W^T (C^T H) + J_b^T (C^T 1)``, so
``<H, sg(C W)> + <W, sg(C^T H)> + <b, sg(C^T 1)>`` (``sg``: stop-gradient) has the same gradient with respect to every
parameter (the trunk through ``H``; the head, tied or not, directly). The three stopped products are accumulated one
chunk of rows at a time, without gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Rows of logits materialised at once: 4,096 rows of a 128k vocabulary are 2 GiB in float32.
CHUNK_ROWS = 4096


@dataclass
class FusedHeadCotangent:
    """``dL/dF`` at ``w`` of the trained rows, kept as what recomputes it: ``a_i``, ``y_i``, ``h_i(w)``, ``W(w)``."""

    hidden: torch.Tensor  # (rows, hidden) at w, detached
    labels: torch.Tensor  # (rows,)
    scale: torch.Tensor  # (rows,) dL/d log p_i
    log_probs: torch.Tensor  # (rows,) the head's log p_i at w, to check that F = h W^T + b is what it scored
    weight: torch.Tensor  # (vocabulary, hidden) W(w), a copy
    bias: torch.Tensor | None


def fused_head_cotangent(
    loss: torch.Tensor,
    log_probs: torch.Tensor,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    head: torch.nn.Module,
) -> FusedHeadCotangent:
    """``dL/dF`` at ``w`` for the rows ``mask`` selects, from the head's per-token ``log_probs`` (one per row of
    ``hidden``, aligned with ``labels``). The graph is kept so that ``loss`` can still be differentiated."""
    (scale,) = torch.autograd.grad(loss, log_probs, retain_graph=True)
    bias = head.bias
    return FusedHeadCotangent(
        hidden=hidden[mask].detach(),
        labels=labels[mask],
        scale=scale[mask].detach(),
        log_probs=log_probs[mask].detach(),
        # W(w): copied when a step may move it, the one extra copy of the head the step holds
        weight=_kept(head.weight),
        bias=None if bias is None else _kept(bias),
    )


def _kept(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone() if tensor.requires_grad else tensor.detach()


def _cotangent_rows(cotangent: FusedHeadCotangent, rows: slice, dtype: torch.dtype) -> torch.Tensor:
    """``C`` for ``rows`` in ``dtype``: ``a_i (onehot(y_i) - softmax(h_i W^T + b))`` at ``w``."""
    logits = cotangent.hidden[rows].to(dtype) @ cotangent.weight.to(dtype).T
    if cotangent.bias is not None:
        logits += cotangent.bias.to(dtype)
    labels = cotangent.labels[rows]
    log_softmax = torch.log_softmax(logits, dim=-1)
    scored = log_softmax.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    if not torch.allclose(scored, cotangent.log_probs[rows].to(dtype), rtol=1e-4, atol=1e-4):
        raise ValueError(
            "flatness_method='functional_sam': the fused LM head's log-probabilities are not those of h W^T + b (a "
            "temperature, logit soft-capping or a logit scale transforms the logits), which the chunked cotangent "
            "does not model; use 'sam' with this model."
        )
    rows_c = log_softmax.exp_().neg_()
    rows_c[torch.arange(labels.numel(), device=labels.device), labels] += 1.0
    return rows_c.mul_(cotangent.scale[rows].to(dtype).unsqueeze(-1))


def fused_head_surrogate(
    hidden: torch.Tensor, head: torch.nn.Module, cotangent: FusedHeadCotangent, *, chunk_rows: int = CHUNK_ROWS
) -> torch.Tensor:
    """A scalar whose gradient is ``J_F(w + e)^T C``: ``hidden`` the trained rows' hidden states at ``w + e`` (in the
    graph), ``head`` the LM head at ``w + e``. Its value means nothing; log the loss at ``w + e`` instead."""
    if hidden.shape != cotangent.hidden.shape:
        raise ValueError(
            f"The hidden states at w + e have shape {tuple(hidden.shape)} but those at w "
            f"{tuple(cotangent.hidden.shape)}: the two passes must see the same batch."
        )
    weight, bias = head.weight, head.bias
    dtype = torch.promote_types(hidden.dtype, torch.float32)  # half-precision rows are summed in float32
    with torch.no_grad():
        at_perturbed = hidden.detach().to(dtype)
        head_weight = weight.detach().to(dtype)
        grad_hidden = torch.empty_like(at_perturbed)
        grad_weight = torch.zeros_like(head_weight)
        grad_bias = None if bias is None else torch.zeros_like(bias, dtype=dtype)
        for start in range(0, hidden.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            c = _cotangent_rows(cotangent, rows, dtype)
            grad_hidden[rows] = c @ head_weight
            grad_weight.addmm_(c.T, at_perturbed[rows])
            if grad_bias is not None:
                grad_bias += c.sum(0)
    surrogate = (hidden.to(dtype) * grad_hidden).sum()
    if weight.requires_grad:
        surrogate = surrogate + (weight.to(dtype) * grad_weight).sum()
    if bias is not None and bias.requires_grad:
        surrogate = surrogate + (bias.to(dtype) * grad_bias).sum()
    return surrogate


@dataclass
class FusedHeadOutputs:
    """A fused-head forward as Functional-SAM reads it (see `hf_flatbias.sharpness.functional_sam.FunctionOutputs`):
    the hidden states each label is predicted from, the labels, which of them are trained, the head's log-probabilities
    of them, and the head."""

    hidden: torch.Tensor  # (..., hidden), aligned with labels
    labels: torch.Tensor
    mask: torch.Tensor
    log_probs: torch.Tensor
    head: torch.nn.Module

    def cotangent(self, loss: torch.Tensor) -> FusedHeadCotangent:
        return fused_head_cotangent(loss, self.log_probs, self.hidden, self.labels, self.mask, self.head)

    def surrogate(self, cotangent: FusedHeadCotangent) -> torch.Tensor:
        return fused_head_surrogate(self.hidden[self.mask], self.head, cotangent)
