"""What the explicit penalties share: a second pass that moves along the first gradient by ``h``, takes the
backward of the penalty's loss there, and restores ``w``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..engines import PerturbableParameters
from .base import FlatnessMethod


class FiniteDifferencePenalty(FlatnessMethod):
    """A penalty whose gradient is a finite difference along the first gradient (`hf_flatbias.sharpness.penalties`):
    a subclass computes the first gradient and the loss at the shifted weights, this class runs the shift."""

    def finite_difference_pass(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        num_items_in_batch,
        perturbable: PerturbableParameters,
        grads: list[torch.Tensor],
        loss_at_shifted_weights: Callable[[list[torch.Tensor], float], torch.Tensor],
        clean_loss: torch.Tensor,
    ) -> torch.Tensor:
        """A penalty's second pass: move to ``w + h g / ||g||``, backward ``loss_at_shifted_weights``, restore ``w``.

        A zero or non-finite ``g`` gives no direction: the micro-batch then takes a plain step.
        """
        host = self.host
        first_gradient = [g.clone() for g in grads]  # perturb() consumes grads
        perturbation = perturbable.perturb(grads, host.args.penalty_fd_step)
        if perturbation is None:
            host.warn_skipped_perturbation("this micro-batch takes a plain step")
            with host.host_metrics_suspended():  # the first pass recorded them
                loss = host.scaled_loss(model, inputs, num_items_in_batch)
            host.flatness_backward(loss)
            host.step_deepspeed_after_restore()
            host.count_flos_of_extra_pass(inputs)
            return loss.detach()
        try:
            # the norm over every rank's shards when the parameters are sharded
            with host.host_metrics_suspended():
                shifted_loss = loss_at_shifted_weights(first_gradient, perturbation.grad_norm)
            host.flatness_backward(shifted_loss)
        finally:
            perturbation.restore()
        host.step_deepspeed_after_restore()
        host.count_flos_of_extra_pass(inputs)
        return clean_loss
