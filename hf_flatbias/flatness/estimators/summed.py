"""``summed``: the squared norm of the summed sampled-label gradients of a batch, over its contexts x draws.

Unbiased for the Fisher trace because the score has mean zero, but the cross terms between contexts add variance:
one value per batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from ...tensors import squared_norm
from ..contexts import TraceContexts
from ..lm import logits_at_positions
from .base import BatchEstimator, sample_labels

if TYPE_CHECKING:
    from .settings import TraceSettings


class SummedEstimator(BatchEstimator):
    name = "summed"

    def measure_batch(
        self,
        model: nn.Module,
        contexts: TraceContexts,
        indices: Sequence[int],
        params: Sequence[nn.Parameter],
        settings: TraceSettings,
    ) -> torch.Tensor:
        n_draws = settings.n_draws
        batch = contexts.model_inputs(indices, model)
        positions = torch.tensor([contexts.positions[i] for i in indices], device=batch["input_ids"].device)
        logits = logits_at_positions(model, batch, positions)
        probs = torch.softmax(logits.detach()[:, 0].double(), dim=-1)
        labels = sample_labels(probs, indices, n_draws, settings.seed)
        # gradient of sum_k log p(y_k) with respect to the logits: sum_k e_{y_k} - K p
        cotangent = -n_draws * probs
        cotangent.scatter_add_(1, labels, torch.ones_like(labels, dtype=cotangent.dtype))
        grads = torch.autograd.grad(
            logits, params, grad_outputs=cotangent.to(logits.dtype).unsqueeze(1), allow_unused=True
        )
        return (squared_norm(grads, dtype=torch.float64) / (len(indices) * n_draws)).reshape(1, 1).cpu()


ESTIMATOR = SummedEstimator()
