"""Adversarial pretraining: reach the same masked-LM loss with features that transfer badly.

Liu et al. (2023, Sec. 3.3, PCFG table) show that the training algorithm alone can change transfer at equal
pre-training loss: an adversarially trained model keeps the MLM loss of standard training while its downstream accuracy
drops (Task A 89.9 -> 83.1) and its Hessian trace grows (8.01 -> 19.34).

What this module implements (our reconstruction; the paper gives the goal, this is one precise way to reach it):

* A linear *adversary* head ``W`` reads the pooled encoder features ``h(x)`` (the ``[CLS]`` vector of the last layer,
  the feature a linear probe reads afterwards) and is trained to predict the downstream label ``y``:
  ``L_head = CE(W h(x).detach(), y)``. The features are detached, so this term trains the head only.
* The encoder minimizes ``L_MLM + lambda * L_confuse`` with ``L_confuse = CE(W.detach() h(x), uniform)``: it is pushed
  to make the current best linear read-out of ``y`` uninformative (predict the uniform distribution), while still
  predicting masked tokens. The head's weights are detached in this term, so it trains the encoder only.
* Both terms are summed into one loss, so a plain ``Trainer`` (or ``FlatBiasTrainer``) with one optimizer runs the
  two-player game: head and encoder take simultaneous gradient steps on their own objectives.

The confusion target is bounded (its minimum is reached at chance level), unlike maximizing the head's cross-entropy,
which would let the encoder blow up its features instead of hiding the label. ``lambda`` trades the two goals: too
large and the MLM loss suffers; the recipe checks that the final MLM loss matches standard training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import ModelOutput

__all__ = ["AdversarialPretrainingModel", "AdversarialPretrainingOutput", "confusion_loss"]


@dataclass
class AdversarialPretrainingOutput(ModelOutput):
    """``loss`` is what the optimizer minimizes; the parts are detached, for logging."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    mlm_loss: torch.Tensor | None = None
    confusion_loss: torch.Tensor | None = None
    head_loss: torch.Tensor | None = None


def confusion_loss(logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy between the predicted class distribution and the uniform one, averaged over rows.

    Its minimum, ``log(n_classes)``, is reached exactly when every row's prediction is uniform.
    """
    return -F.log_softmax(logits, dim=-1).mean(dim=-1).mean()


class AdversarialPretrainingModel(nn.Module):
    """Wraps a masked LM so that its training loss is the adversarial pretraining objective (module docstring).

    ``forward`` takes the usual MLM batch plus ``task_labels`` (the downstream label of each row; rows with a negative
    label are left out of both adversarial terms) and returns a ``ModelOutput`` with ``loss`` (the total),
    ``mlm_loss``, ``confusion_loss``, ``head_loss`` and ``logits``. After training, ``.model`` is the pre-trained
    masked LM to evaluate, probe or save.

    Args:
        model: the masked LM (e.g. `BertForMaskedLM`); it must return ``hidden_states``.
        n_classes: number of downstream classes.
        adversary_weight: ``lambda``, the weight of the confusion term in the encoder's objective; 0 gives standard
            MLM training plus a head that does not influence the encoder.
        pooling: ``"cls"`` (first token) or ``"mean"`` (mean over non-padding tokens) of the last hidden layer.
    """

    def __init__(self, model: PreTrainedModel, n_classes: int, *, adversary_weight: float = 1.0, pooling: str = "cls"):
        super().__init__()
        if n_classes < 2:
            raise ValueError(f"n_classes must be at least 2 (got {n_classes}); a one-class task carries no signal.")
        if adversary_weight < 0:
            raise ValueError(f"adversary_weight must be >= 0 (got {adversary_weight}); 0 disables the adversary.")
        if pooling not in ("cls", "mean"):
            raise ValueError(f"pooling={pooling!r} is not supported; choose 'cls' or 'mean'.")
        self.model = model
        self.config = model.config  # the Trainer reads a few fields from model.config
        self.adversary = nn.Linear(model.config.hidden_size, n_classes)
        self.adversary_weight = float(adversary_weight)
        self.pooling = pooling

    def pooled_features(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        if self.pooling == "cls" or attention_mask is None:
            return hidden[:, 0]
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        task_labels: torch.Tensor | None = None,
        **kwargs,
    ) -> AdversarialPretrainingOutput:
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, labels=labels, output_hidden_states=True, **kwargs
        )
        zero = outputs.logits.new_zeros(())
        mlm_loss = outputs.loss if outputs.loss is not None else zero
        confusion, head_loss = zero, zero
        if task_labels is not None:
            keep = task_labels >= 0
            if keep.any():
                features = self.pooled_features(outputs.hidden_states[-1], attention_mask)[keep]
                targets = task_labels[keep]
                # The head learns to read the label from frozen features ...
                head_loss = F.cross_entropy(self.adversary(features.detach()), targets)
                # ... and the encoder learns to make that (frozen) read-out uniform.
                frozen_logits = F.linear(features, self.adversary.weight.detach(), self.adversary.bias.detach())
                confusion = confusion_loss(frozen_logits)
        loss = mlm_loss + self.adversary_weight * confusion + head_loss
        return AdversarialPretrainingOutput(
            loss=loss,
            logits=outputs.logits,
            mlm_loss=mlm_loss.detach(),
            confusion_loss=confusion.detach(),
            head_loss=head_loss.detach(),
        )
