"""Functional-SAM (Singh, Mobahi, Agarwala, Dauphin; ICML 2025, arXiv 2502.02407) as two pure tensor functions.

SAM's gradient at ``w + e`` is ``J_F(w + e)^T dL/dF(w + e)`` with ``F`` the logits. By the chain rule it moves along
two paths: the Jacobian changes (the "functional path") and the loss's derivative with respect to the logits changes
(the "logit path"). Functional-SAM keeps only the first: its update direction is ``J_F(w + e)^T dL/dF(w)``, the
gradient of the surrogate ``<F(w + e), stop_grad(dL/dF at w)>``. The surrogate is linear in the cotangent, so the
scaling of the loss (token weighting, accumulation, loss scaling) carries over through the cotangent unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


def logit_cotangent(loss: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """``dL/dF`` at the current weights: the gradient of ``loss`` with respect to ``logits``, detached.

    Only the loss head is differentiated (softmax and cross-entropy), and the graph is kept so that the same loss
    can still be differentiated with respect to the parameters.
    """
    (cotangent,) = torch.autograd.grad(loss, logits, retain_graph=True)
    return cotangent.detach()


def functional_surrogate(logits: torch.Tensor, cotangent: torch.Tensor) -> torch.Tensor:
    """``<F(w + e), c>``: its gradient with respect to the parameters is ``J_F(w + e)^T c``, the Functional-SAM
    direction when ``c`` is `logit_cotangent` at ``w``. Its value means nothing; log the loss at ``w + e`` instead."""
    if logits.shape != cotangent.shape:
        raise ValueError(
            f"The logits at w + e have shape {tuple(logits.shape)} but dL/dF at w has {tuple(cotangent.shape)}: "
            "the two passes must see the same batch."
        )
    return (logits.float() * cotangent.float()).sum()


class FunctionOutputs(Protocol):
    """What a forward gives Functional-SAM: ``dL/dF`` at ``w`` (``cotangent``) and, at ``w + e``, the surrogate whose
    gradient is ``J_F(w + e)^T`` of that cotangent. `Logits` when the forward returns logits;
    `hf_flatbias.sharpness.fused_head.FusedHeadOutputs` when a fused LM head returns only label log-probabilities."""

    def cotangent(self, loss: torch.Tensor) -> Any: ...

    def surrogate(self, cotangent: Any) -> torch.Tensor: ...


@dataclass
class Logits:
    """A forward's logits, as `FunctionOutputs`."""

    logits: torch.Tensor

    def cotangent(self, loss: torch.Tensor) -> torch.Tensor:
        return logit_cotangent(loss, self.logits)

    def surrogate(self, cotangent: torch.Tensor) -> torch.Tensor:
        return functional_surrogate(self.logits, cotangent)
