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

from collections.abc import Sequence
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

    ``forward`` takes the usual MLM batch plus ``task_labels`` (the downstream label of each row, ``(batch,)``, or one
    column per task, ``(batch, n_tasks)``; negative labels are left out of both adversarial terms) and returns a
    ``ModelOutput`` with ``loss`` (the total), ``mlm_loss``, ``confusion_loss``, ``head_loss`` and ``logits``. After
    training, ``.model`` is the pre-trained masked LM to evaluate, probe or save.

    Args:
        model: the masked LM (e.g. `BertForMaskedLM`); it must return ``hidden_states``.
        n_classes: number of downstream classes, or one number per task (one head each; their terms are summed).
        adversary_weight: ``lambda``, the weight of the confusion term in the encoder's objective; 0 gives standard
            MLM training plus heads that do not influence the encoder.
        pooling: what the heads read from the last hidden layer: ``"cls"`` (first token), ``"mean"`` (mean over
            non-padding tokens) or ``"concat"`` (the first ``width`` positions concatenated, padding zeroed: the
            fixed-width read-out `hf_flatbias.probe.extract_features` gives a probe).
        width: token positions of ``"concat"``.
        read_unmasked: the heads read the sentence with its masked words put back (from ``labels``), as a probe
            reads it afterwards, in a second forward pass; otherwise they read the masked training input.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        n_classes: int | Sequence[int],
        *,
        adversary_weight: float = 1.0,
        pooling: str = "cls",
        width: int | None = None,
        read_unmasked: bool = False,
    ):
        super().__init__()
        classes = [n_classes] if isinstance(n_classes, int) else list(n_classes)
        if not classes or min(classes) < 2:
            raise ValueError(
                f"every task needs at least 2 classes (got {n_classes}); a one-class task carries no signal."
            )
        if adversary_weight < 0:
            raise ValueError(f"adversary_weight must be >= 0 (got {adversary_weight}); 0 disables the adversary.")
        if pooling not in ("cls", "mean", "concat"):
            raise ValueError(f"pooling={pooling!r} is not supported; choose 'cls', 'mean' or 'concat'.")
        if (pooling == "concat") != (width is not None) or (width is not None and width < 1):
            raise ValueError(f"pooling='concat' needs a width >= 1 and no other pooling takes one (got {width}).")
        self.model = model
        self.config = model.config  # the Trainer reads a few fields from model.config
        features = model.config.hidden_size * (width or 1)
        self.heads = nn.ModuleList(nn.Linear(features, n) for n in classes)
        self.adversary_weight = float(adversary_weight)
        self.pooling = pooling
        self.width = width
        self.read_unmasked = read_unmasked

    @property
    def adversary(self) -> nn.Linear:
        """The head of a single-task adversary."""
        if len(self.heads) != 1:
            raise AttributeError(f"this adversary has {len(self.heads)} heads; index .heads instead.")
        return self.heads[0]

    def pooled_features(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        if self.pooling == "cls":
            return hidden[:, 0]
        mask = (
            torch.ones(hidden.shape[:2], dtype=hidden.dtype, device=hidden.device)
            if attention_mask is None
            else attention_mask.to(hidden.dtype)
        ).unsqueeze(-1)
        if self.pooling == "mean":
            return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        if hidden.shape[1] > self.width:
            raise ValueError(f"a batch of {hidden.shape[1]} tokens is wider than the adversary's width {self.width}.")
        zeroed = F.pad(hidden * mask, (0, 0, 0, self.width - hidden.shape[1]))
        return zeroed.flatten(1)

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
            columns = task_labels.unsqueeze(1) if task_labels.dim() == 1 else task_labels
            if columns.shape[1] != len(self.heads):
                raise ValueError(
                    f"task_labels has {columns.shape[1]} tasks but the adversary has {len(self.heads)} heads."
                )
            hidden = outputs.hidden_states[-1]
            if self.read_unmasked and labels is not None:
                clean = torch.where(labels >= 0, labels, input_ids)
                hidden = self.model(input_ids=clean, attention_mask=attention_mask, output_hidden_states=True)
                hidden = hidden.hidden_states[-1]
            features = self.pooled_features(hidden, attention_mask)
            for head, targets in zip(self.heads, columns.unbind(1), strict=True):
                keep = targets >= 0
                if not keep.any():
                    continue
                # the head learns to read the label from frozen features ...
                head_loss = head_loss + F.cross_entropy(head(features[keep].detach()), targets[keep])
                # ... and the encoder learns to make that (frozen) read-out uniform
                frozen_logits = F.linear(features[keep], head.weight.detach(), head.bias.detach())
                confusion = confusion + confusion_loss(frozen_logits)
        loss = mlm_loss + self.adversary_weight * confusion + head_loss
        return AdversarialPretrainingOutput(
            loss=loss,
            logits=outputs.logits,
            mlm_loss=mlm_loss.detach(),
            confusion_loss=confusion.detach(),
            head_loss=head_loss.detach(),
        )
