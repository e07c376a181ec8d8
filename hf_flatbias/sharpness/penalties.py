"""Explicit flatness penalties and LookSAM as pure tensor functions.

Both penalties are trained without double backward. Their gradient needs a Hessian-vector product ``H v``, taken by
a forward finite difference along the unit vector ``u = v / ||v||``::

    H v ~= ||v|| * (grad L(w + h u) - grad L(w)) / h

so a step costs two forward/backward passes, like SAM: the first gradient at ``w`` (which also gives ``v``) and one
pass at ``w + h u``; double backward would cost about two more backward passes' worth and keep the whole graph of the
first pass alive. Memory: two extra copies of the trainable parameters during the step (the saved weights and
``v``). The known vector ``-c * grad L(w)`` is added to the second pass through a linear term
``<w, -c * grad L(w)>`` (its gradient is the constant vector), so the whole combination reaches ``.grad`` through one
ordinary backward, with accumulation, gradient sync and loss scaling handled by whatever runs that backward.

* Fisher penalty ``lambda * Tr F``, where ``Tr F`` is the mini-batch's sampled-label Fisher trace (the paper's
  flatness measure). With ``y^`` drawn from the model's own prediction at each of the ``N`` labelled positions and
  ``g = grad mean_i -log p(y^_i)``, ``N * ||g||^2`` is an unbiased estimate of the mean per-position Fisher trace:
  ``E_{y ~ p} grad log p(y) = 0``, so the cross terms between positions vanish in expectation. Its gradient (labels
  held fixed) is ``2 lambda N H_y^ g``. The data loss shares the second pass, so its gradient is taken at
  ``w + h u`` rather than ``w``: a shift of order ``h``, the price of not spending a third pass.
* Gradient-norm penalty ``lambda * ||grad L||`` (Zhao, Zhang & Hu, "Penalizing Gradient Norm for Efficiently
  Improving Generalization in Deep Learning", ICML 2022). Its gradient is ``lambda * H g / ||g||``, so the step is
  ``(1 - lambda / h) g(w) + (lambda / h) g(w + h g / ||g||)``; ``lambda = h`` is SAM with ``rho = h``.
* LookSAM (Liu, Mai, Chen, Hsieh & You, "Towards Efficient and Scalable Sharpness-Aware Minimization", CVPR 2022):
  every k-th update is a SAM update, which also stores the direction ``g_v`` of the part of the SAM gradient ``g_s``
  orthogonal to the plain gradient ``g``; the updates in between take one pass and use
  ``g + alpha * ||g|| * g_v / ||g_v||``. Cost per update: 2 passes on SAM updates, 1 (plus a few elementwise
  operations over the parameters) between, so ``1 + 1/k`` plain steps; one parameter-sized buffer holds ``g_v``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..constants import IGNORE_INDEX
from ..tensors import squared_norm


def _at_least_float32(tensor: torch.Tensor) -> torch.Tensor:
    """Half precision goes up to float32; float32 and float64 stay (the finite difference needs every digit)."""
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor


def labelled_logits(logits: torch.Tensor, labels: torch.Tensor, *, shift: bool = False) -> torch.Tensor:
    """The rows of ``logits`` at positions whose label is not ``-100``, as an ``(N, vocabulary)`` tensor.

    Args:
        logits: ``(..., vocabulary)`` scores, aligned with ``labels`` on the leading dimensions.
        labels: the data labels; only their mask (``!= -100``) is used.
        shift: causal language models predict token ``t + 1`` at position ``t``: compare ``logits[:, :-1]`` with
            ``labels[:, 1:]``, as their loss does.
    """
    if shift:
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"The model's logits {tuple(logits.shape)} do not line up with labels {tuple(labels.shape)}: the Fisher "
            "penalty needs one categorical prediction per label (masked/causal LM or single-label classification)."
        )
    return logits[labels != IGNORE_INDEX]


@torch.no_grad()
def sample_model_labels(logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One label per row drawn from the model's own predictive distribution ``softmax(logits)``."""
    probabilities = torch.softmax(logits.detach().float(), dim=-1)  # float32 softmax: draws identical in any dtype
    return torch.multinomial(probabilities, 1, generator=generator).squeeze(-1)


def sampled_label_loss(logits: torch.Tensor, sampled_labels: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of ``sampled_labels``, in float32 or wider so half precision does not round it."""
    return F.cross_entropy(_at_least_float32(logits), sampled_labels, reduction="mean")


def fisher_trace_from_mean_gradient(mean_gradient_sq_norm: float, n_labels: int) -> float:
    """Unbiased sampled-label Fisher trace per position: ``N * ||grad mean_i -log p(y^_i)||^2``."""
    return n_labels * mean_gradient_sq_norm


def fisher_penalty_coefficient(penalty_lambda: float, n_labels: int, grad_norm: float, step: float) -> float:
    """``c`` such that ``c * (grad L(w + h u) - grad L(w))`` approximates ``grad (lambda * N * ||g||^2)``.

    With ``u = g / ||g||``: ``grad(lambda N ||g||^2) = 2 lambda N H g ~= 2 lambda N ||g|| (grad L(w+hu) - g) / h``.
    """
    return 2.0 * penalty_lambda * n_labels * grad_norm / step


def grad_norm_penalty_weights(penalty_lambda: float, step: float) -> tuple[float, float]:
    """Weights ``(a, b)`` of the step ``a * g(w) + b * g(w + h u)`` that follows ``grad(L + lambda ||grad L||)``."""
    ratio = penalty_lambda / step
    return 1.0 - ratio, ratio


def linear_term(params: Sequence[torch.Tensor], vectors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``sum_p <p, v_p>`` with ``v`` held constant: adding it to a loss adds exactly ``v`` to the gradient.

    Its backward is one elementwise multiply per parameter, negligible next to a forward/backward pass.
    """
    terms = [(_at_least_float32(p) * _at_least_float32(v.detach())).sum() for p, v in zip(params, vectors, strict=True)]
    return torch.stack(terms).sum() if terms else torch.zeros(())


def dot(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> torch.Tensor:
    """``<a, b>`` over lists of tensors, accumulated in float32."""
    terms = [(_at_least_float32(x) * _at_least_float32(y)).sum() for x, y in zip(a, b, strict=True)]
    return torch.stack(terms).sum() if terms else torch.zeros(())


@torch.no_grad()
def orthogonal_direction(
    sam_gradient: Sequence[torch.Tensor], gradient: Sequence[torch.Tensor]
) -> list[torch.Tensor] | None:
    """LookSAM's ``g_v / ||g_v||``: the unit part of ``sam_gradient`` orthogonal to ``gradient``.

    Returns ``None`` when either input is zero or not finite, or when the two are parallel (nothing to reuse).
    Only directions matter, so both inputs may carry any positive scale (an fp16 loss scale, 1 / accumulation).
    """
    g_sq = squared_norm(gradient)
    if not torch.isfinite(g_sq) or float(g_sq) == 0.0:
        return None
    along = dot(sam_gradient, gradient) / g_sq
    orthogonal = [
        _at_least_float32(s) - along * _at_least_float32(g) for s, g in zip(sam_gradient, gradient, strict=True)
    ]
    norm = squared_norm(orthogonal).sqrt()
    if not torch.isfinite(norm) or float(norm) == 0.0:
        return None
    return [v.div_(norm) for v in orthogonal]


@torch.no_grad()
def add_looksam_component(grads: Sequence[torch.Tensor], unit_orthogonal: Sequence[torch.Tensor], alpha: float) -> None:
    """In place ``g <- g + alpha * ||g|| * g_v / ||g_v||``: LookSAM's cheap approximation of the SAM gradient."""
    scale = alpha * float(squared_norm(grads).sqrt())
    for grad, direction in zip(grads, unit_orthogonal, strict=True):
        grad.add_(direction.to(grad.dtype), alpha=scale)


__all__ = [
    "add_looksam_component",
    "fisher_penalty_coefficient",
    "fisher_trace_from_mean_gradient",
    "grad_norm_penalty_weights",
    "labelled_logits",
    "linear_term",
    "orthogonal_direction",
    "sample_model_labels",
    "sampled_label_loss",
]
