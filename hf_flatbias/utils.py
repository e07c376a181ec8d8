"""Small helpers shared by the Trainer integration."""

from __future__ import annotations

import inspect

import torch
from transformers.trainer_utils import unwrap_peft_model


def forward_normalizes_by_num_items(model: torch.nn.Module) -> bool | None:
    """Whether the model's forward uses ``num_items_in_batch`` when computing its loss.

    transformers decides that a model normalises its loss by ``num_items_in_batch`` whenever ``forward`` accepts
    ``**kwargs``. Many models (BERT among them) accept them and still average with their own ``CrossEntropyLoss``;
    the Trainer then skips its division by the accumulation steps and the gradient grows with accumulation. Models
    that do normalise route the kwargs into ``self.loss_function``. Returns ``None`` when the source is unavailable.
    """
    forward = type(unwrap_peft_model(model)).forward
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return None
    return "loss_function" in source or "num_items_in_batch" in source
