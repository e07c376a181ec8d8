"""The LookSAM step (Liu et al., CVPR 2022): every ``sam_every_k``-th update is a SAM update and keeps the part of
its gradient orthogonal to the plain gradient; the updates in between add it back (``looksam_alpha``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from ...tensors import perturb_weights, squared_norm, trainable_parameters
from ..engines import PerturbableParameters, average_across_processes
from ..penalties import add_looksam_component, orthogonal_direction


@dataclasses.dataclass
class LookSamState:
    """LookSAM's memory: the plain gradient summed over the current SAM update's micro-batches, and the unit
    direction ``g_v / ||g_v||`` the last SAM update left for the updates in between."""

    plain_gradient: list[torch.Tensor] | None = None
    direction: list[torch.Tensor] | None = None


def looksam_step(trainer, model: nn.Module, inputs: dict[str, Any], num_items_in_batch) -> torch.Tensor:
    """LookSAM: a SAM micro-batch on SAM updates (keeping the first gradient), else a plain one plus reuse."""
    looksam = trainer._looksam
    if not trainer._is_sam_update():
        loss = trainer._plain_training_step(model, inputs, num_items_in_batch)
        if trainer.accelerator.sync_gradients and looksam.direction is not None:
            grads = _grads_materialized(trainable_parameters(trainer.accelerator.unwrap_model(model)))
            add_looksam_component(grads, looksam.direction, trainer.args.looksam_alpha)
        return loss

    inputs = trainer._start_step(model, inputs)
    module = trainer.accelerator.unwrap_model(model)
    params = trainable_parameters(module)
    clean_loss = trainer._scaled_loss(module, inputs, num_items_in_batch)
    grads = trainer._first_gradient(clean_loss, PerturbableParameters(params))
    clean_loss = clean_loss.detach()
    if looksam.plain_gradient is None:
        looksam.plain_gradient = [g.clone() for g in grads]
    else:
        torch._foreach_add_(looksam.plain_gradient, grads)
    perturbation = perturb_weights(params, grads, trainer.args.sam_rho)
    if perturbation is not None:
        trainer._record_perturbation(perturbation, 1)
    try:
        with trainer._host_metrics_suspended():
            loss = trainer._scaled_loss(model, inputs, num_items_in_batch)
        trainer._backward(loss)
    finally:
        if perturbation is not None:
            perturbation.restore()
    if trainer.accelerator.sync_gradients:
        sam_gradient = _grads_materialized(params)
        direction = orthogonal_direction(sam_gradient, looksam.plain_gradient)
        looksam.plain_gradient = None
        if direction is not None:
            if trainer.args.sam_perturbation != "global":
                # Ranks saw different first gradients; one shared direction keeps their later steps identical.
                average_across_processes(direction)
                norm = squared_norm(direction).sqrt()
                torch._foreach_div_(direction, norm)
            looksam.direction = direction
    trainer._record_perturbed_loss(loss)
    trainer._count_flos_of_extra_pass(inputs)
    return clean_loss


def _grads_materialized(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """The parameters' ``.grad`` tensors, zero-filled where a parameter got no gradient."""
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    return [param.grad for param in params]
