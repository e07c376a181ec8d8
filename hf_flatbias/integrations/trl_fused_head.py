"""The adapter between trl's fused LM head (``trl.trainer.utils.add_fused_lm_head``) and the flatness steps, kept
apart because part of it is read from trl's code rather than from a public hook.

trl 1.16 offers ``add_fused_lm_head(model, outputs=...)``, whose fused forward computes the head's log-probabilities
in a kernel of its own, with no hook to score the head another way. So:

* `fused_forward_without_metrics` uses the public part: the ``outputs`` trl's kernel computes;
* `forward_with_head_gradients` re-implements that fused forward (backbone, label shift, mask, loss, the fields of
  ``FusedCausalLMOutput``) around `hf_flatbias.sharpness.head_gradients.label_log_probs`. It was written from
  `TRL_FUSED_HEAD_READ`'s trl release; on any trl whose ``add_fused_lm_head`` differs from that one,
  `why_head_gradients_stay_in_backward` says so and the trainers keep trl's own fused head (slower, never wrong),
  and tests/test_trl_fused_head.py fails naming the installed trl, so that the adapter is read again.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
import trl
from torch import nn
from trl.trainer.utils import FusedCausalLMOutput, add_fused_lm_head

from ..sharpness.head_gradients import label_log_probs

TRL_FUSED_HEAD_READ = {
    "trl": "1.16.0",
    "add_fused_lm_head_sha256": "422d009f04b66659982f9545a90d560bdcc27fde3268de203d0c5c6d1449d211",
}
"""The trl release `forward_with_head_gradients` mirrors, and the SHA-256 of its ``add_fused_lm_head``'s source."""


@functools.cache
def fused_head_differs() -> str | None:
    """Why the installed trl's ``add_fused_lm_head`` is not the one `forward_with_head_gradients` mirrors, as a clause
    for a message; ``None`` when it is (its source hashes to `TRL_FUSED_HEAD_READ`'s)."""
    try:
        source = inspect.getsource(add_fused_lm_head)
    except (OSError, TypeError):
        source = ""
    if hashlib.sha256(source.encode()).hexdigest() == TRL_FUSED_HEAD_READ["add_fused_lm_head_sha256"]:
        return None
    return (
        f"trl {trl.__version__}'s add_fused_lm_head differs from trl {TRL_FUSED_HEAD_READ['trl']}'s, whose fused "
        "forward hf_flatbias's head mirrors"
    )


#: Fields of trl's fused LM head output that only its trainers' metrics read (entropy, logits/*, token accuracy).
_METRIC_ONLY_FIELDS = ("entropy", "mean_logits", "is_top1")
#: Config fields with which trl's fused head transforms the logits (soft-capping, a scale) before the softmax.
_LOGIT_TRANSFORMS = (
    "final_logit_softcapping",
    "logit_scale",
    "output_multiplier",
    "lm_head_multiplier",
    "logits_scaling",
)


def fused_forward_without_metrics(model: nn.Module, loss_fields: tuple[str, ...]) -> Callable[..., Any] | None:
    """A forward for ``model``, which trl gave its fused LM head, whose head computes only ``loss_fields`` (besides
    the log-probabilities, always computed) and returns zeros for the fields only metrics read; ``None`` when
    ``model`` has no fused head. The log-probabilities and their gradient are those of trl's forward bit for bit: the
    kernel folds the optional fields beside them, never into them. ``model.forward`` is left as it was."""
    fused_forward = model.__dict__.get("forward")
    if fused_forward is None or "fused_lm_head" not in getattr(fused_forward, "__code__", type(None)).co_varnames:
        return None
    add_fused_lm_head(model, outputs=("log_probs", *loss_fields))
    lean_forward = model.forward
    model.forward = fused_forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        outputs = lean_forward(*args, **kwargs)
        if kwargs.get("fused_lm_head"):
            for name in _METRIC_ONLY_FIELDS:
                if getattr(outputs, name, None) is None:
                    dtype = torch.bool if name == "is_top1" else outputs.log_probs.dtype
                    setattr(
                        outputs,
                        name,
                        torch.zeros(outputs.log_probs.shape, dtype=dtype, device=outputs.log_probs.device),
                    )
        return outputs

    return forward


def why_head_gradients_stay_in_backward(model: nn.Module) -> str | None:
    """Why `forward_with_head_gradients` would not compute what trl's fused forward of ``model`` computes, as a clause
    for a message; ``None`` when it would. trl's SFT gives the head temperature 1 and no float32 cast."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    differs = fused_head_differs()
    if differs is not None:
        return differs
    text_config = model.config.get_text_config()
    transforms = [name for name in _LOGIT_TRANSFORMS if getattr(text_config, name, None) is not None]
    if transforms:
        return f"the model's config transforms the logits ({', '.join(transforms)}), which that head does not model"
    if getattr(text_config, "output_router_logits", False):
        return "the model's router logits are requested (a mixture of experts), which that head does not return"
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        return f"the output layer is a {type(head).__name__}, not a torch.nn.Linear"
    if is_deepspeed_zero3_enabled():
        return "DeepSpeed ZeRO-3 partitions the output layer, which that head would read whole"
    return None


def forward_with_head_gradients(
    model: nn.Module, metrics: Callable[[], bool], kept_bytes: int = 0
) -> Callable[..., Any]:
    """A forward for ``model``, which trl gave its fused LM head, whose fused path (``fused_lm_head=True``) returns
    what trl's returns, the head's label log-probabilities from `label_log_probs` (gradients formed in the forward,
    or with ``kept_bytes`` > 0 from ``softmax - onehot`` kept to the backward for up to that many bytes of rows; only
    the trained positions scored), with the entropy, mean-logit and top-1 fields where ``metrics()`` says so at the
    call (zeros elsewhere). For the models `why_head_gradients_stay_in_backward` accepts; ``model.forward`` is left
    as it was and answers every other call."""
    fused_forward = model.forward

    def forward(*args: Any, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            return fused_forward(
                *args, labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch, **kwargs
            )
        kwargs["use_cache"] = False
        last_hidden = model.base_model(*args, **kwargs).last_hidden_state
        if shift_labels is None:
            hidden, labels = last_hidden[:, :-1], labels[:, 1:]
        else:  # pre-shifted (context parallelism): every position is scored as is
            hidden, labels = last_hidden, shift_labels
        head = model.get_output_embeddings()
        hidden, labels = hidden.to(head.weight.device), labels.to(head.weight.device)
        mask = labels != -100
        with_metrics = metrics()
        rows = label_log_probs(
            hidden[mask], head.weight, head.bias, labels[mask], metrics=with_metrics, kept_bytes=kept_bytes
        )

        def per_position(values: torch.Tensor) -> torch.Tensor:
            # keeps the loss connected to the model when no label is trained: a differentiable zero
            return values.new_zeros(mask.shape).masked_scatter(mask, values)

        log_probs = per_position(rows.log_probs)
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        zeros = torch.zeros(mask.shape, dtype=log_probs.dtype, device=mask.device)
        return FusedCausalLMOutput(
            loss=-log_probs.sum() / count,
            log_probs=log_probs,
            entropy=per_position(rows.entropy) if with_metrics else zeros,
            mean_logits=per_position(rows.mean_logits) if with_metrics else zeros,
            is_top1=per_position(rows.is_top1) if with_metrics else zeros.bool(),
            label_mask=mask,
        )

    return forward
