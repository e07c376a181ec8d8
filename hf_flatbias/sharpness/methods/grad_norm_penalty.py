"""The ``grad_norm_penalty`` step: the data loss plus ``lambda ||g||`` by a finite difference along ``g``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..layouts import perturbable_parameters
from ..penalties import grad_norm_penalty_weights, linear_term
from .finite_difference import FiniteDifferencePenalty


class GradNormPenalty(FiniteDifferencePenalty):
    """``grad_norm_penalty`` (Zhao et al., ICML 2022)."""

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch) -> torch.Tensor:
        """One micro-batch: ``g`` is the data-loss gradient at ``w``; the second pass weighs the data loss at
        ``w + h u`` and ``<w, g>`` so that the step is ``a g(w) + b g(w + h u)``."""
        host = self.host
        args = host.args
        inputs = host.start_flatness_step(model, inputs)
        module = host.accelerator.unwrap_model(model)
        perturbable = perturbable_parameters(module, host.deepspeed_engine())
        with host.compute_loss_context_manager():
            data_loss = host.compute_loss(module, dict(inputs), num_items_in_batch=num_items_in_batch)
        clean_loss = host.scale_for_accumulation(data_loss.detach(), num_items_in_batch)
        grads = host.first_gradient(data_loss, perturbable)
        del data_loss

        def loss_at_shifted_weights(first_gradient: list[torch.Tensor], grad_norm: float) -> torch.Tensor:
            at_w, at_shifted = grad_norm_penalty_weights(args.penalty_lambda, args.penalty_fd_step)
            with host.compute_loss_context_manager():
                shifted_loss = host.compute_loss(model, dict(inputs), num_items_in_batch=num_items_in_batch)
            linear = linear_term(perturbable.differentiable_tensors, first_gradient)
            combined = at_shifted * shifted_loss + at_w * linear
            host.record_flatness_metric("grad_norm_penalty/grad_norm", grad_norm)
            return host.scale_for_accumulation(combined, num_items_in_batch)

        return self.finite_difference_pass(
            model, inputs, num_items_in_batch, perturbable, grads, loss_at_shifted_weights, clean_loss
        )
