"""The second pass the explicit penalties share: move along the first gradient by ``h``, backward there, restore."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..engines import PerturbableParameters


def finite_difference_pass(
    trainer,
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
    first_gradient = [g.clone() for g in grads]  # perturb() consumes grads
    perturbation = perturbable.perturb(grads, trainer.args.penalty_fd_step)
    if perturbation is None:
        trainer._warn_skipped_perturbation("this micro-batch takes a plain step")
        with trainer._host_metrics_suspended():  # the first pass recorded them
            loss = trainer._scaled_loss(model, inputs, num_items_in_batch)
        trainer._backward(loss)
        trainer._step_deepspeed_after_restore()
        trainer._count_flos_of_extra_pass(inputs)
        return loss.detach()
    try:
        # the norm over every rank's shards when the parameters are sharded
        with trainer._host_metrics_suspended():
            shifted_loss = loss_at_shifted_weights(first_gradient, perturbation.grad_norm)
        trainer._backward(shifted_loss)
    finally:
        perturbation.restore()
    trainer._step_deepspeed_after_restore()
    trainer._count_flos_of_extra_pass(inputs)
    return clean_loss
