"""What the trace needs from a language model: its LM head, its kind (masked or causal), its logits at chosen
positions, its trainable parameters, a tokenizer that fits it, and a measurement that leaves it as it was."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES
from transformers.trainer_utils import unwrap_peft_model

from ..tensors import trainable_parameters


def is_causal_lm(model: nn.Module | PretrainedConfig) -> bool:
    """Whether the model predicts the next token, its labels shifted inside the forward.

    Causal: a class of transformers' causal-LM auto mapping or named ``...ForCausalLM``, or any model whose config
    says ``is_decoder=True`` (e.g. a BERT built as a decoder). PEFT wrappers are looked through. Given a checkpoint's
    config instead of a model (to choose the class to load), its ``architectures`` decide: all of them causal.
    """
    if isinstance(model, PretrainedConfig):
        config, class_names = model, list(model.architectures or [])
    else:
        base = unwrap_peft_model(model)
        config, class_names = getattr(base, "config", None), [type(base).__name__]
    causal_names = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    causal_class = bool(class_names) and all(n in causal_names or n.endswith("ForCausalLM") for n in class_names)
    return causal_class or bool(getattr(config, "is_decoder", False))


def lm_head_kind(model: nn.Module) -> str | None:
    """``"causal_lm"`` (`is_causal_lm`), ``"masked_lm"`` (a class of transformers' masked-LM auto mapping, or named
    ``...ForMaskedLM`` / ``...ForPreTraining``) or ``None`` (neither, e.g. a classifier). PEFT wrappers are looked
    through. What a model card names as the pre-training objective of a `Trainer` run."""
    if is_causal_lm(model):
        return "causal_lm"
    name = type(unwrap_peft_model(model)).__name__
    if name in set(MODEL_FOR_MASKED_LM_MAPPING_NAMES.values()) or name.endswith(("ForMaskedLM", "ForPreTraining")):
        return "masked_lm"
    return None


def check_lm_model(model: nn.Module) -> nn.Module:
    """The model's output embedding (the decoder to the vocabulary), or a `ValueError` if it has no LM head."""
    get_output = getattr(model, "get_output_embeddings", None)
    decoder = get_output() if callable(get_output) else None
    if decoder is None:
        raise ValueError(
            f"{type(model).__name__} has no language-model head (get_output_embeddings() is None): the trace is "
            "defined on the pre-training loss. Load the checkpoint with AutoModelForMaskedLM or AutoModelForCausalLM."
        )
    return decoder


def output_vocab_size(model: nn.Module) -> int:
    """Rows of the model's output embedding: the token ids it can read and predict."""
    weight = check_lm_model(model).weight
    return getattr(weight, "ds_shape", weight.shape)[0]  # a ZeRO-3 parameter is empty between forwards


def check_tokenizer_fits_model(
    tokenizer: Any,
    vocab_size: int | None,
    *,
    source: str | None = None,
    input_ids: Sequence[Sequence[int]] | None = None,
    text_source: str | None = None,
) -> None:
    """Raise a `ValueError` naming the fix when ``tokenizer`` cannot be the one the model was trained with.

    Refused: a tokenizer of special tokens only (transformers loads a 5-token BERT tokenizer, without a warning,
    from a folder without tokenizer files; every word would become ``[UNK]``), one with more tokens than the model's
    vocabulary (their ids have no embedding), or one with fewer than half as many (another checkpoint's). With
    ``input_ids`` (text this tokenizer encoded), also text that is mostly unknown tokens: English on a model of
    another vocabulary, say, where the trace would be measured on nothing but ``[UNK]``.

    Args:
        tokenizer: a transformers tokenizer.
        vocab_size: the model's vocabulary (`output_vocab_size`, or ``config.vocab_size`` before the model is
            loaded); ``None`` checks the special tokens only.
        source: where the tokenizer was loaded from, for the message.
        input_ids: token ids of the text to be measured; more than half unknown (structure tokens such as
            ``[CLS]`` and padding not counted) is refused.
        text_source: where that text came from, for the message.
    """
    size = len(tokenizer)
    special = set(getattr(tokenizer, "all_special_tokens", []) or [])
    get_vocab = getattr(tokenizer, "get_vocab", None)
    origin = f" loaded from {source!r}" if source else ""
    if callable(get_vocab) and all(token in special for token in get_vocab()):
        problem = f"has only special tokens ({size} entries): the checkpoint has no tokenizer files"
    elif vocab_size is not None and size > vocab_size:
        problem = f"has {size} tokens, more than the model's vocabulary of {vocab_size}"
    elif vocab_size is not None and size < vocab_size // 2:
        problem = f"has {size} tokens, under half the model's vocabulary of {vocab_size}"
    else:
        unknown = _unknown_token_share(tokenizer, input_ids) if input_ids is not None else 0.0
        if unknown <= 0.5:
            return
        text = f"the text of {text_source}" if text_source else "this text"
        raise ValueError(
            f"The tokenizer{origin} does not fit {text}: {unknown:.0%} of its tokens are unknown "
            f"({tokenizer.unk_token}); the model was trained on another vocabulary. Use text in the model's own "
            "language or vocabulary, or a model whose tokenizer covers this text."
        )
    raise ValueError(
        f"The tokenizer{origin} {problem}: tokenizer and model do not belong together. Use the tokenizer the model "
        "was trained with: save it next to the checkpoint (tokenizer.save_pretrained(folder)) or pass its path, or "
        "give data tokenized by it."
    )


def _unknown_token_share(tokenizer: Any, input_ids: Sequence[Sequence[int]]) -> float:
    unknown = getattr(tokenizer, "unk_token_id", None)
    if unknown is None:
        return 0.0  # byte-level tokenizers (GPT-2) represent every text
    structure = set(getattr(tokenizer, "all_special_ids", []) or []) - {unknown}
    counted = [token for row in input_ids for token in row if token not in structure]
    return sum(token == unknown for token in counted) / len(counted) if counted else 0.0


def _lm_head(model: nn.Module, decoder: nn.Module) -> nn.Module:
    """The outermost sub-module that holds the decoder and applies position-wise (e.g. BERT's ``cls``)."""
    base = getattr(model, "base_model", None)
    for _, child in model.named_children():
        if child is base:
            continue
        if child is decoder or any(m is decoder for m in child.modules()):
            return child
    return decoder


@contextlib.contextmanager
def _logits_only_at(model: nn.Module, positions: torch.Tensor) -> Iterator[None]:
    """Run the LM head on the predicted positions of each row only (``positions`` (B,) or (B, P)): the stock forward
    computes logits for every position, most of the cost for a large vocabulary."""
    head = _lm_head(model, check_lm_model(model))
    rows = torch.arange(len(positions), device=positions.device)

    def select(module: nn.Module, args: tuple) -> tuple:
        hidden = args[0]
        if hidden.dim() != 3 or hidden.shape[0] != len(positions):
            raise ValueError(f"unexpected LM-head input of shape {tuple(hidden.shape)}")
        if positions.dim() == 2:
            return (hidden[rows.unsqueeze(1), positions], *args[1:])
        return (hidden[rows, positions].unsqueeze(1), *args[1:])

    handle = head.register_forward_pre_hook(select)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def evaluation_mode(model: nn.Module) -> Iterator[None]:
    """``eval()`` for the measurement, then every sub-module back to its own previous mode."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


@contextlib.contextmanager
def preserved_global_rng() -> Iterator[None]:
    """Leave torch's global CPU (and CUDA) random streams exactly as they were."""
    cpu_state = torch.random.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.random.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)


def measured_parameters(model: nn.Module) -> list[nn.Parameter]:
    """`trainable_parameters`, or a `ValueError` naming the fix when there are none: the trace is over them."""
    params = trainable_parameters(model)
    if not params:
        raise ValueError(
            "The model has no parameter with requires_grad=True: the trace is over trainable parameters. Unfreeze "
            "the parameters to measure (model.requires_grad_(True), or the adapters of a PEFT model)."
        )
    return params


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def logits_at_positions(model: nn.Module, batch: Mapping[str, torch.Tensor], positions: torch.Tensor) -> torch.Tensor:
    """Logits of shape (B, 1, V) at the predicted positions (B,), or (B, P, V) at positions (B, P), with the graph
    kept for differentiation."""
    with _logits_only_at(model, positions):
        logits = model(**batch, use_cache=False).logits if is_causal_lm(model) else model(**batch).logits
    per_row = positions.shape[1] if positions.dim() == 2 else 1
    if logits.dim() != 3 or logits.shape[1] != per_row:
        raise ValueError(
            f"{type(model).__name__} returned logits of shape {tuple(logits.shape)}; expected (B, {per_row}, V)."
        )
    return logits
