"""The ``fisher_penalty`` step: the data loss plus ``lambda Tr(F)``, the Fisher trace of labels sampled from the
model, by a finite difference along their gradient."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from ...flatness.lm import is_causal_lm
from ..layouts import perturbable_parameters
from ..penalties import (
    fisher_penalty_coefficient,
    fisher_trace_from_mean_gradient,
    labelled_logits,
    linear_term,
    sample_model_labels,
    sampled_label_loss,
)
from .base import FlatnessHost
from .finite_difference import FiniteDifferencePenalty


@dataclasses.dataclass
class SampledLabelSource:
    """The Fisher penalty's label draws, from a generator of its own so that they are reproducible whatever else
    consumes the global RNG (dropout)."""

    seed: int
    generator: torch.Generator | None = None
    #: A checkpoint's generator state, applied when the generator is next created on the logits' device.
    restored_state: torch.Tensor | None = None

    def draw(self, logits: torch.Tensor) -> torch.Tensor:
        if self.generator is None or self.generator.device != logits.device:
            self.generator = torch.Generator(device=logits.device).manual_seed(self.seed)
            if self.restored_state is not None:
                self.generator.set_state(self.restored_state)
                self.restored_state = None
        return sample_model_labels(logits, self.generator)

    def state(self) -> torch.Tensor | None:
        return self.generator.get_state() if self.generator is not None else self.restored_state

    def restore(self, state: torch.Tensor | None) -> None:
        self.generator = None
        self.restored_state = state


class FisherPenalty(FiniteDifferencePenalty):
    """``fisher_penalty``: its label draws come from a generator of its own, seeded per process (ranks draw
    different labels for their different rows, reproducibly) and checkpointed."""

    checkpointed_state = "the Fisher penalty's label draws"

    def __init__(self, host: FlatnessHost):
        super().__init__(host)
        self.sampled_labels = SampledLabelSource(seed=host.args.seed + 7919 * host.args.process_index)

    def state_dict(self) -> dict[str, Any]:
        return {"label_generator": self.sampled_labels.state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampled_labels.restore(state.get("label_generator"))

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch) -> torch.Tensor:
        """One micro-batch: ``g`` is the gradient of the loss of labels sampled from the model at ``w``; the second
        pass adds ``c * (sampled-label loss - <w, g>)`` to the data loss at ``w + h u``."""
        host = self.host
        args = host.args
        inputs = host.start_flatness_step(model, inputs)
        labels = inputs.get("labels")
        if labels is None:
            raise ValueError(
                "flatness_method='fisher_penalty' needs 'labels' in every batch (-100 where nothing is predicted), "
                "e.g. from DataCollatorForLanguageModeling."
            )
        module = host.accelerator.unwrap_model(model)
        perturbable = perturbable_parameters(module, host.deepspeed_engine())
        with host.compute_loss_context_manager():
            data_loss, outputs = host.loss_and_outputs(module, inputs, num_items_in_batch)
        clean_loss = host.scale_for_accumulation(data_loss.detach(), num_items_in_batch)
        logits = _labelled_logits(module, outputs, labels)
        sampled = self.sampled_labels.draw(logits)
        n_labels = sampled.numel()
        if args.sam_perturbation == "global":
            # g is averaged over ranks, so the trace estimate counts every rank's labels.
            n_labels = int(host.accelerator.reduce(torch.tensor(n_labels, device=logits.device), "sum"))
        direction_loss = sampled_label_loss(logits, sampled)
        del outputs, logits, data_loss
        grads = host.first_gradient(direction_loss, perturbable)
        del direction_loss

        def loss_at_shifted_weights(first_gradient: list[torch.Tensor], grad_norm: float) -> torch.Tensor:
            coefficient = fisher_penalty_coefficient(args.penalty_lambda, n_labels, grad_norm, args.penalty_fd_step)
            with host.compute_loss_context_manager():
                shifted_loss, outputs = host.loss_and_outputs(model, inputs, num_items_in_batch)
                shifted_direction_loss = sampled_label_loss(_labelled_logits(module, outputs, labels), sampled)
            penalty_part = coefficient * (
                shifted_direction_loss - linear_term(perturbable.differentiable_tensors, first_gradient)
            )
            host.record_flatness_metric("fisher_penalty/trace", fisher_trace_from_mean_gradient(grad_norm**2, n_labels))
            accumulation = host.current_gradient_accumulation_steps
            return host.scale_for_accumulation(shifted_loss, num_items_in_batch) + penalty_part / accumulation

        return self.finite_difference_pass(
            model, inputs, num_items_in_batch, perturbable, grads, loss_at_shifted_weights, clean_loss
        )


def _labelled_logits(module: nn.Module, outputs: Any, labels: torch.Tensor) -> torch.Tensor:
    logits = outputs.get("logits") if isinstance(outputs, dict) else None
    if logits is None:
        raise ValueError(
            "flatness_method='fisher_penalty' needs the model output to carry 'logits' (a ModelOutput or dict)."
        )
    return labelled_logits(logits, labels, shift=is_causal_lm(module))
