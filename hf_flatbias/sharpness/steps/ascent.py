"""The first pass of the SAM family (SAM, ASAM, Functional-SAM): the first gradient over some micro-batches at
``w``, then the move to ``w + e``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ...flatness.lm import is_causal_lm
from ...tensors import Perturbation
from ..engines import perturbable_parameters
from ..functional_sam import logit_cotangent
from ..sam import adam_preconditioner, ascent_rows


def perturb(
    trainer, model: nn.Module, micro_batches: list[dict[str, Any]], num_items_in_batch
) -> tuple[Perturbation | None, list[torch.Tensor], list[torch.Tensor]]:
    """Compute the first gradient over ``micro_batches`` and move the weights to ``w + e``.

    Returns the perturbation (``None`` when skipped), each micro-batch's loss at ``w``, scaled as
    `Trainer.training_step` scales the loss it returns, and (Functional-SAM only, else empty) each micro-batch's
    ``dL/dF`` at ``w`` of that same scaled loss.
    """
    args = trainer.args
    module = trainer.accelerator.unwrap_model(model)
    params = trainer._sam_parameters(module)
    perturbable = perturbable_parameters(module, trainer._deepspeed_engine(), params=params)
    functional = args.flatness_method == "functional_sam"
    fraction = args.sam_ascent_fraction
    clean_losses: list[torch.Tensor] = []
    cotangents: list[torch.Tensor] = []

    def losses() -> Iterable[torch.Tensor]:
        for batch in micro_batches:
            if functional:
                loss, logits = trainer._scaled_loss_and_logits(module, batch, num_items_in_batch)
                cotangents.append(logit_cotangent(loss, logits))
            elif fraction < 1:
                rows = ascent_rows(batch, fraction)
                loss = trainer._scaled_loss(module, rows, num_items_in_batch)
                clean_losses.append(loss.detach() * ascent_loss_scale(trainer, batch, rows, num_items_in_batch))
                yield loss
                continue
            else:
                loss = trainer._scaled_loss(module, batch, num_items_in_batch)
            clean_losses.append(loss.detach())
            yield loss

    grads = trainer._first_gradient(losses(), perturbable)
    rho = trainer._sam_rho()
    preconditioner = None
    if args.sam_preconditioner == "adam":
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper holds the state
        # at the scale of a whole update's gradient, the scale Adam's second moment was built from
        share = len(micro_batches) / trainer.current_gradient_accumulation_steps
        preconditioner = adam_preconditioner(optimizer, perturbable.params, torch._foreach_div(grads, share))
    perturbation = perturbable.perturb(
        grads,
        rho,
        adaptive=args.flatness_method == "asam",
        eta=args.asam_eta,
        preconditioner=preconditioner,
    )
    if perturbation is None:
        trainer._warn_skipped_perturbation("this step is taken without perturbation")
    else:
        trainer._record_perturbation(perturbation, len(micro_batches))
        trainer._flatness_log.record("sam/rho", rho)
    return perturbation, clean_losses, cotangents


def ascent_loss_scale(trainer, batch: dict[str, Any], rows: dict[str, Any], num_items_in_batch) -> float:
    """What turns the ascent rows' scaled loss into an estimate of the whole micro-batch's: a loss summed over
    the update's labelled tokens (``num_items_in_batch``) scales with the labels counted, a mean does not."""
    if num_items_in_batch is None or not trainer.model_accepts_loss_kwargs or "labels" not in batch:
        return 1.0
    shift = is_causal_lm(trainer.accelerator.unwrap_model(trainer.model))

    def count(labels: torch.Tensor) -> int:
        return int(((labels[..., 1:] if shift else labels) != -100).sum())

    in_rows = count(rows["labels"])
    return count(batch["labels"]) / in_rows if in_rows else 1.0
