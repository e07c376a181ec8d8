"""The SAM / ASAM / Functional-SAM step of one micro-batch, per micro-batch or held across the update
(``sam_scope="batch"``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from ...tensors import Perturbation
from ..functional_sam import functional_surrogate
from ..sam import ascent_rows
from .ascent import perturb


@dataclasses.dataclass
class BatchScopeSam:
    """``sam_scope="batch"``: the update's micro-batches until its first step perturbs, then that perturbation,
    held across the update's micro-batches until the last one restores ``w``."""

    micro_batches: list[dict[str, Any]] | None = None
    perturbation: Perturbation | None = None
    #: The loss at ``w`` of each micro-batch not yet stepped (the first pass computed them all).
    clean_losses: list[torch.Tensor] = dataclasses.field(default_factory=list)
    #: Functional-SAM: each of those micro-batches' ``dL/dF`` at ``w``.
    cotangents: list[torch.Tensor] = dataclasses.field(default_factory=list)


def sam_step(trainer, model: nn.Module, inputs: dict[str, Any], num_items_in_batch) -> torch.Tensor:
    """One micro-batch of a SAM/ASAM update: the first gradient, the step to ``w + e``, backward there, ``w``.

    Returns the loss at ``w`` (the first pass), so that ``loss`` means the same for every method; the loss at
    ``w + e`` is logged as ``sam/perturbed_loss``.
    """
    inputs = trainer._start_step(model, inputs)
    batch_sam = trainer._batch_sam
    if trainer.args.sam_scope == "batch":
        if batch_sam.micro_batches is not None:
            micro_batches = [
                trainer._prepare_inputs(trainer._add_values_shared_by_passes(model, batch))
                for batch in batch_sam.micro_batches
            ]
            batch_sam.micro_batches = None
            batch_sam.perturbation, batch_sam.clean_losses, batch_sam.cotangents = perturb(
                trainer, model, micro_batches, num_items_in_batch
            )
        perturbation = batch_sam.perturbation
        clean_loss = batch_sam.clean_losses.pop(0)
        cotangent = batch_sam.cotangents.pop(0) if batch_sam.cotangents else None
        restore_now = trainer.accelerator.sync_gradients
    else:
        perturbation, (clean_loss,), cotangents = perturb(trainer, model, [inputs], num_items_in_batch)
        cotangent = cotangents[0] if cotangents else None
        restore_now = True

    try:
        with trainer._host_metrics_suspended():
            if cotangent is None:
                loss = trainer._scaled_loss(model, inputs, num_items_in_batch)
            else:
                # Functional-SAM: the Jacobian at w + e against dL/dF at w; the loss at w + e is only logged
                loss, logits = trainer._scaled_loss_and_logits(model, inputs, num_items_in_batch)
        trainer._backward(loss if cotangent is None else functional_surrogate(logits, cotangent))
    except BaseException:
        restore_now = True
        raise
    finally:
        if perturbation is not None and restore_now:
            perturbation.restore()
            batch_sam.perturbation = None
    trainer._step_deepspeed_after_restore()
    trainer._record_perturbed_loss(loss)
    fraction = trainer.args.sam_ascent_fraction
    trainer._count_flos_of_extra_pass(inputs if fraction == 1 else ascent_rows(inputs, fraction))
    return clean_loss
