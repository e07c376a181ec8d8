"""``hutchinson``: ``v^T H v`` with random probes ``v`` on the data-label loss of a batch of contexts.

It estimates the Hessian trace of the data loss, which equals the Fisher trace only when the model's conditionals
are the true ones; ``n_draws`` probes per batch, one value each.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..contexts import TraceContexts, context_generator
from ..lm import logits_at_positions
from .base import BatchEstimator

if TYPE_CHECKING:
    from .settings import TraceSettings


class HutchinsonEstimator(BatchEstimator):
    name = "hutchinson"

    def measure_batch(
        self,
        model: nn.Module,
        contexts: TraceContexts,
        indices: Sequence[int],
        params: Sequence[nn.Parameter],
        settings: TraceSettings,
    ) -> torch.Tensor:
        n_draws = settings.n_draws
        grads = data_loss_gradients(model, contexts, indices, params)
        generator = context_generator(settings.seed, indices[0])
        values = torch.empty(1, n_draws, dtype=torch.float64)
        for k in range(n_draws):
            probes = [probe_like(p, settings.probe, generator) for p in params]
            hvp = torch.autograd.grad(
                grads, params, grad_outputs=probes, retain_graph=k < n_draws - 1, allow_unused=True
            )
            quadratic = sum(
                float((v.double() * h.double()).sum()) for v, h in zip(probes, hvp, strict=True) if h is not None
            )
            values[0, k] = quadratic / len(indices)
        return values


def data_loss_gradients(
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


def probe_like(param: nn.Parameter, kind: str, generator: torch.Generator) -> torch.Tensor:
    """Entries of mean 0 and variance 1, so that ``E[v^T H v] = Tr H``; Rademacher ones add the least variance."""
    if kind == "gaussian":
        values = torch.randn(param.shape, generator=generator)
    else:
        values = torch.randint(0, 2, param.shape, generator=generator) * 2 - 1
    return values.to(device=param.device, dtype=param.dtype)


ESTIMATOR = HutchinsonEstimator()
