"""The models GLUE fine-tunes: a sequence classifier built from a checkpoint, and a linear probe on frozen features."""

from __future__ import annotations

import torch

from .tasks import GlueTask, get_glue_task


def load_tokenizer(model_name_or_path: str, tokenizer_name_or_path: str | None = None):
    """``AutoTokenizer`` of a checkpoint, refusing the special-tokens-only tokenizer of a folder without one."""
    from transformers import AutoTokenizer

    from ..flatness.lm import check_tokenizer_fits_model

    source = tokenizer_name_or_path or model_name_or_path
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"No tokenizer could be loaded from {source!r} ({error}). Save one next to the checkpoint or pass "
            "tokenizer_name_or_path (--tokenizer on the command line)."
        ) from error
    check_tokenizer_fits_model(tokenizer, None, source=source)
    return tokenizer


def load_classifier(
    model_name_or_path: str,
    task: str | GlueTask,
    *,
    tokenizer_name_or_path: str | None = None,
    reinitialize_head: bool = False,
):
    """A sequence classifier for ``task`` built from a checkpoint, its tokenizer, and the names of new weights.

    Raises a ``ValueError`` when the checkpoint has no tokenizer (see [`load_tokenizer`]), when its architecture
    has no sequence-classification model, when its encoder weights are missing, or when it already carries a
    classification head with another number of labels (unless ``reinitialize_head``).

    Returns:
        ``(model, tokenizer, new_parameter_names)``: the names of the parameters initialised here rather than read
        from the checkpoint (the head, and BERT's pooler for a masked-LM checkpoint).
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from ..flatness.lm import check_tokenizer_fits_model
    from ..utils import without_load_report

    spec = task if isinstance(task, GlueTask) else get_glue_task(task)
    tokenizer = load_tokenizer(model_name_or_path, tokenizer_name_or_path)
    config = AutoConfig.from_pretrained(model_name_or_path)
    check_tokenizer_fits_model(tokenizer, getattr(config, "vocab_size", None), source=model_name_or_path)
    has_classifier = any(a.endswith("ForSequenceClassification") for a in (config.architectures or []))
    if has_classifier and config.num_labels != spec.num_labels and not reinitialize_head:
        raise ValueError(
            f"{model_name_or_path!r} has a classification head with {config.num_labels} labels but {spec.name} needs "
            f"{spec.num_labels}. Pass reinitialize_head=True (--reinitialize_head) to replace the head, or use a "
            "checkpoint without a classification head."
        )
    config.num_labels = spec.num_labels
    config.problem_type = "regression" if spec.is_regression else "single_label_classification"
    try:
        with without_load_report():  # the missing and unused weights are checked below, with a clearer message
            model, info = AutoModelForSequenceClassification.from_pretrained(
                model_name_or_path, config=config, output_loading_info=True, ignore_mismatched_sizes=reinitialize_head
            )
    except ValueError as error:
        raise ValueError(
            f"{model_name_or_path!r} ({type(config).__name__}) has no sequence-classification architecture in "
            f"transformers: {error}"
        ) from error
    new_names = set(info["missing_keys"]) | {key for key, *_ in info.get("mismatched_keys", ())}
    prefix = f"{model.base_model_prefix}."
    missing_encoder = sorted(n for n in new_names if n.startswith(prefix) and ".pooler." not in n)
    if missing_encoder:
        raise ValueError(
            f"{model_name_or_path!r} lacks encoder weights ({len(missing_encoder)} tensors, e.g. {missing_encoder[0]}):"
            " it is not a pretrained encoder of this architecture; fine-tuning it would start from random weights."
        )
    return model, tokenizer, new_names


def freeze_all_but(model, trainable_names: set[str]) -> int:
    """Freeze every parameter except ``trainable_names`` (a linear probe); returns the trainable parameter count."""
    count = 0
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name in trainable_names)
        count += parameter.numel() if name in trainable_names else 0
    if count == 0:
        raise ValueError("A linear probe needs at least one trainable parameter (the classification head).")
    return count


def probe_parameter_names(model, new_parameter_names: set[str]) -> set[str]:
    """What a linear probe trains: the task head (everything outside the base model) and weights new to it."""
    prefix = f"{model.base_model_prefix}."
    return {name for name, _ in model.named_parameters() if not name.startswith(prefix) or name in new_parameter_names}


class LinearProbeClassifier(torch.nn.Module):
    """One linear layer on the features of a frozen encoder: its ``[CLS]`` state, or its first token states
    concatenated (positions ``1..n_positions``, zeros past the end of a shorter input), as the released ``run_lp.py``.

    The encoder stays in eval mode (frozen features, no dropout) and gets no gradient; dropout applies to the
    features during training only. The forward returns what the Trainer reads: ``loss`` (cross-entropy, or mean
    squared error for one label) and ``logits``.
    """

    def __init__(
        self,
        encoder: torch.nn.Module,
        num_labels: int,
        *,
        features: str = "cls",
        n_positions: int = 18,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        if features not in ("cls", "tokens"):
            raise ValueError(f"features={features!r}: use 'cls' or 'tokens'.")
        if n_positions < 1:
            raise ValueError(f"n_positions must be at least 1, got {n_positions}.")
        self.encoder = encoder.requires_grad_(False)
        self.features = features
        self.n_positions = n_positions
        self.num_labels = num_labels
        hidden = encoder.config.hidden_size
        self.dropout = torch.nn.Dropout(dropout)
        self.classifier = torch.nn.Linear(hidden if features == "cls" else hidden * n_positions, num_labels)

    def train(self, mode: bool = True) -> LinearProbeClassifier:
        super().train(mode)
        self.encoder.eval()
        return self

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None):
        from transformers.modeling_outputs import SequenceClassifierOutput

        with torch.no_grad():
            kwargs = {"token_type_ids": token_type_ids} if token_type_ids is not None else {}
            hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
        if self.features == "cls":
            features = hidden[:, 0]
        else:
            tokens = hidden[:, 1 : 1 + self.n_positions]
            if attention_mask is not None:
                tokens = tokens * attention_mask[:, 1 : 1 + self.n_positions, None].to(tokens.dtype)
            missing = self.n_positions - tokens.shape[1]
            features = torch.nn.functional.pad(tokens, (0, 0, 0, missing)).flatten(1)
        logits = self.classifier(self.dropout(features))
        loss = None
        if labels is not None:
            if self.num_labels == 1:
                loss = torch.nn.functional.mse_loss(logits.squeeze(-1), labels.to(logits.dtype))
            else:
                loss = torch.nn.functional.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)
