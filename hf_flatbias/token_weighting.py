"""The loss of language-model heads that ignore ``num_items_in_batch`` (BERT), weighted by token over the whole
update as transformers weights it for the models that use ``num_items_in_batch``.

transformers 5 assumes any forward with ``**kwargs`` normalises by ``num_items_in_batch`` and then skips the division
by the accumulation steps; for models that ignore it the gradient grows k-fold with k steps.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import Trainer
from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES
from transformers.trainer_utils import unwrap_peft_model

from .flatness.lm import is_causal_lm
from .utils import forward_normalizes_by_num_items, token_weighted_loss


class TokenWeightedLossMixin:
    """``compute_loss`` for a `Trainer` subclass, token-weighted over the update for the LM heads that need it; the
    host's own ``compute_loss`` for every other model. Call ``_fix_loss_scaling_for_models_ignoring_num_items`` once
    ``Trainer.__init__`` has run."""

    def _fix_loss_scaling_for_models_ignoring_num_items(self) -> None:
        # Masked and causal LM heads get the token-weighted loss transformers gives the models that do normalise
        # (see compute_loss); any other such model falls back to the mean of micro-batch means.
        self._token_weighted_loss = False
        if not (self.model_accepts_loss_kwargs and forward_normalizes_by_num_items(self.model) is False):
            return
        module = unwrap_peft_model(self.model)
        is_causal = is_causal_lm(module)
        is_language_model = is_causal or module._get_name() in MODEL_FOR_MASKED_LM_MAPPING_NAMES.values()
        # One micro-batch on one process: the model's own mean is already the token-weighted loss, bit for bit.
        split_update = self.args.gradient_accumulation_steps > 1 or self.args.world_size > 1
        loss_is_ours = (
            self.compute_loss_func is None
            and self.label_smoother is None
            and _compute_loss_owner(type(self)) is Trainer
        )
        if is_language_model and split_update and loss_is_ours:
            self._token_weighted_loss = True
            # Count the labels the loss uses: the loop counts labels[..., 1:] only for losses it knows shift.
            self._loss_shifts_labels = is_causal
        else:
            self.model_accepts_loss_kwargs = False

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """`Trainer.compute_loss`, token-weighted over the whole update for LM heads that ignore
        ``num_items_in_batch`` (BERT): the summed cross-entropy of the micro-batch over the update's labelled tokens,
        as transformers computes it for the models that use ``num_items_in_batch``. Accumulation ``k x b`` then
        trains exactly as one batch of ``k * b``, also across processes."""
        if not self._token_weighted_loss or num_items_in_batch is None or "labels" not in inputs:
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        labels = inputs["labels"]
        outputs = model(**{name: value for name, value in inputs.items() if name != "labels"})
        logits = outputs.get("logits") if isinstance(outputs, dict) else None
        if logits is None:
            raise ValueError(
                "The token-weighted loss needs the model output to carry 'logits'; pass compute_loss_func or override "
                "compute_loss to train this model with its own loss."
            )
        loss = token_weighted_loss(logits, labels, num_items_in_batch, shift=self._loss_shifts_labels)
        if self.args.average_tokens_across_devices:
            # num_items_in_batch counts every process's tokens and DDP averages the gradients: undo the average,
            # as Trainer.compute_loss does.
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        return (loss, outputs) if return_outputs else loss


def _compute_loss_owner(trainer_class: type) -> type:
    """The class whose ``compute_loss`` the mixin's own falls back to: `Trainer` unless the host trainer (trl's
    `SFTTrainer`, a user's subclass) computes the loss its own way."""
    return next(
        owner
        for owner in trainer_class.__mro__
        if owner is not TokenWeightedLossMixin and "compute_loss" in vars(owner)
    )
