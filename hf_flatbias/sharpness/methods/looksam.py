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
from .base import FlatnessHost, FlatnessMethod


@dataclasses.dataclass
class LookSamMemory:
    """LookSAM's memory: the plain gradient summed over the current SAM update's micro-batches, and the unit
    direction ``g_v / ||g_v||`` the last SAM update left for the updates in between."""

    plain_gradient: list[torch.Tensor] | None = None
    direction: list[torch.Tensor] | None = None


class LookSam(FlatnessMethod):
    """LookSAM: a SAM micro-batch on SAM updates (keeping the first gradient), else a plain one plus reuse.

    Its direction is checkpointed: a resumed run reuses the direction the last SAM update before the save left.
    """

    checkpointed_state = "LookSAM's direction"

    def __init__(self, host: FlatnessHost):
        super().__init__(host)
        self.memory = LookSamMemory()

    def state_dict(self) -> dict[str, Any]:
        return {"looksam_direction": self.memory.direction}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        direction = state.get("looksam_direction")
        if direction is not None:
            direction = [tensor.to(self.host.args.device) for tensor in direction]
        self.memory.direction = direction

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch) -> torch.Tensor:
        host = self.host
        memory = self.memory
        if not host.is_sam_update():
            loss = host.plain_training_step(model, inputs, num_items_in_batch)
            if host.accelerator.sync_gradients and memory.direction is not None:
                grads = _grads_materialized(trainable_parameters(host.accelerator.unwrap_model(model)))
                add_looksam_component(grads, memory.direction, host.args.looksam_alpha)
            return loss

        inputs = host.start_flatness_step(model, inputs)
        module = host.accelerator.unwrap_model(model)
        params = trainable_parameters(module)
        clean_loss = host.scaled_loss(module, inputs, num_items_in_batch)
        grads = host.first_gradient(clean_loss, PerturbableParameters(params))
        clean_loss = clean_loss.detach()
        if memory.plain_gradient is None:
            memory.plain_gradient = [g.clone() for g in grads]
        else:
            torch._foreach_add_(memory.plain_gradient, grads)
        perturbation = perturb_weights(params, grads, host.args.sam_rho)
        if perturbation is not None:
            host.record_perturbation(perturbation, 1)
        try:
            with host.host_metrics_suspended():
                loss = host.scaled_loss(model, inputs, num_items_in_batch)
            host.flatness_backward(loss)
        finally:
            if perturbation is not None:
                perturbation.restore()
        if host.accelerator.sync_gradients:
            sam_gradient = _grads_materialized(params)
            direction = orthogonal_direction(sam_gradient, memory.plain_gradient)
            memory.plain_gradient = None
            if direction is not None:
                if host.args.sam_perturbation != "global":
                    # Ranks saw different first gradients; one shared direction keeps their later steps identical.
                    average_across_processes(direction)
                    norm = squared_norm(direction).sqrt()
                    torch._foreach_div_(direction, norm)
                memory.direction = direction
        host.record_perturbed_loss(loss)
        host.count_flos_of_extra_pass(inputs)
        return clean_loss


def _grads_materialized(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """The parameters' ``.grad`` tensors, zero-filled where a parameter got no gradient."""
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    return [param.grad for param in params]
