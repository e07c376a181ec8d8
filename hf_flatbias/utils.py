"""Small helpers shared by the Trainer integration."""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from collections.abc import Iterator

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


def token_weighted_loss(
    logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch: torch.Tensor | int, *, shift: bool = False
) -> torch.Tensor:
    """Cross-entropy summed over the labelled tokens of a micro-batch, divided by the labelled tokens of the update.

    Summed over the micro-batches of an update (and over processes, when ``num_items_in_batch`` counts every
    process's tokens), this is the mean over all the update's tokens, whatever the micro-batches hold: the loss of
    one large batch. transformers' own loss functions do the same for models that route ``num_items_in_batch`` into
    them.

    Args:
        logits: ``(..., vocabulary)`` scores aligned with ``labels``.
        labels: token ids, ``-100`` where nothing is predicted.
        num_items_in_batch: the labelled tokens of the whole update (``labels != -100``, after the shift).
        shift: causal language models predict token ``t + 1`` at position ``t``.
    """
    if shift:
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    total = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).to(logits.device), reduction="sum"
    )
    return total / num_items_in_batch


@contextlib.contextmanager
def without_load_report() -> Iterator[None]:
    """Silence transformers' LOAD REPORT table (missing and unexpected weights) inside the block.

    For loads whose missing and unexpected weights the caller checks itself (a masked-LM checkpoint loaded into a
    classifier always lacks the new head and has an unused LM head): the table would only alarm the user. A raised
    level on the loading logger also makes transformers check the model's tensor-parallel plan and warn that "layers
    were not sharded" on every load, though nothing is sharded here: that logger is raised too.
    """
    loggers = [logging.getLogger(name) for name in ("transformers.modeling_utils", _TENSOR_PARALLEL_LOGGER)]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


_TENSOR_PARALLEL_LOGGER = "transformers.distributed.tensor_parallel"


def quiet_deepspeed_without_accelerator() -> bool:
    """Whether an accelerator is present; without one, tell DeepSpeed the CPU is meant (``DS_ACCELERATOR=cpu``).

    accelerate and transformers import DeepSpeed whenever it is installed, even for runs that never use it, and
    DeepSpeed then warns that it fell back to the CPU. Without an accelerator the CPU is what it would choose anyway;
    naming it only removes the warning. A value the user set is kept.
    """
    available = torch.accelerator.is_available()
    if not available:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return available
