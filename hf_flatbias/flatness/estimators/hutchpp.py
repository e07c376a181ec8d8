"""``hutchpp``: Hutch++ (`hf_flatbias.flatness.hutchpp`) on the data-label Hessian of a batch, ``n_draws`` products.

A third of the products sketch the dominant eigenvectors, whose part of the trace is then taken exactly, and
Hutchinson's estimator covers the rest: less error than ``hutchinson`` at equal products when a few eigenvalues
dominate. One value per residual probe of a batch (their mean is the batch's estimate, their spread its error), and
``n_draws // 3`` parameter-sized vectors held per batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..contexts import TraceContexts, context_generator
from ..hutchpp import hutchpp_samples
from .base import BatchEstimator
from .hutchinson import data_loss_gradients

if TYPE_CHECKING:
    from .settings import TraceSettings


class HutchppEstimator(BatchEstimator):
    name = "hutchpp"

    def measure_batch(
        self,
        model: nn.Module,
        contexts: TraceContexts,
        indices: Sequence[int],
        params: Sequence[nn.Parameter],
        settings: TraceSettings,
    ) -> torch.Tensor:
        grads = data_loss_gradients(model, contexts, indices, params)
        sizes = [p.numel() for p in params]

        def hessian_times(vector: torch.Tensor) -> torch.Tensor:
            tangents = [piece.reshape(p.shape) for piece, p in zip(vector.split(sizes), params, strict=True)]
            hvp = torch.autograd.grad(grads, params, grad_outputs=tangents, retain_graph=True, allow_unused=True)
            return torch.cat(
                [torch.zeros(p.numel(), dtype=vector.dtype, device=vector.device) if h is None else h.reshape(-1)
                 for p, h in zip(params, hvp, strict=True)]
            )  # fmt: skip

        values = hutchpp_samples(
            hessian_times,
            sum(sizes),
            settings.n_draws,
            generator=context_generator(settings.seed, indices[0]),
            probe=settings.probe,
            dtype=params[0].dtype,
            device=params[0].device,
        )
        # one value per residual probe, each unbiased given the sketch: their mean is Hutch++'s estimate, their spread
        # its error on this batch
        return (values / len(indices)).unsqueeze(0)


ESTIMATOR = HutchppEstimator()
