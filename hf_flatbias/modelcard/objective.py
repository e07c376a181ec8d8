"""What a run trained, and so what its card's loss and trace are: the objectives a card names, and
`what_was_trained`, the one place that tells them from the trainer, the model's head, the PEFT state and where the
loss came from.

Pure: no torch, no transformers, no trainer; the caller (`flatness_card_from_trainer`) reads those duck-typed and
passes plain values, so the decision is tested on its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Objective:
    """How a card names what was trained: the Hub's task (``model-index``), the loss, the tokens it is taken on, and
    whether it is a pre-training loss (the paper's measure is defined on that one)."""

    task_type: str
    task_name: str
    loss_name: str
    trained_tokens: str
    pretraining: bool = False
    loss_key: str = "pretraining_loss"
    """The card's key of its loss (``flatness.<loss_key>``, its source under ``<loss_key>_source``)."""


OBJECTIVES: dict[str, Objective] = {
    "masked_lm": Objective(
        "fill-mask", "Masked language modeling (pre-training)", "Pre-training loss (masked LM)", "masked tokens", True
    ),
    "causal_lm": Objective(
        "text-generation",
        "Causal language modeling (pre-training)",
        "Pre-training loss (next token)",
        "every token",
        True,
    ),
    "sft": Objective(
        "text-generation", "Supervised fine-tuning", "SFT loss on every token", "every token", loss_key="sft_loss"
    ),
    "sft_completion_only": Objective(
        "text-generation",
        "Supervised fine-tuning (completion-only loss)",
        "SFT loss on completions",
        "completions",
        loss_key="sft_loss",
    ),
    "sft_assistant_only": Objective(
        "text-generation",
        "Supervised fine-tuning (assistant-only loss)",
        "SFT loss on assistant turns",
        "assistant turns",
        loss_key="sft_loss",
    ),
    "dpo": Objective(
        "text-generation",
        "Direct preference optimization",
        "DPO preference loss",
        "chosen and rejected responses",
        loss_key="dpo_loss",
    ),
}
"""The objectives a card names (its ``flatness.objective``)."""

UNKNOWN_OBJECTIVE = Objective(
    "other", "Training objective not recorded", "Loss (objective not recorded)", "tokens not recorded"
)
"""What a card says when it does not record its objective (cards written before the field existed)."""

LEGACY_LOSS_KEY = "pretraining_loss"
"""The key every card's loss had before it was named by its objective; read when the objective's key is absent."""


def loss_key(objective: str | None) -> str:
    """The card's key of the loss of ``objective`` (a key of `OBJECTIVES`; ``None``: not recorded)."""
    return OBJECTIVES.get(objective or "", UNKNOWN_OBJECTIVE).loss_key


TRACE_OBJECTIVES: dict[str, str] = {
    "masked_position": "the token at one masked position per context",
    "next_token": "the next token at one position per context",
    "next_token_trained": "the next token at one position per context where the fine-tuning loss trains",
    "next_token_chosen": (
        "the next token at one position of the chosen response per preference pair (the prompt and the chosen "
        "response as context, measured on the policy; the reference model is not measured)"
    ),
}
"""What the trace's contexts predict (its ``flatness.trace_objective``), as the card says it."""

TRACE_OBJECTIVE_LABELS: dict[str, str] = {
    "masked_position": "masked position",
    "next_token": "next token",
    "next_token_trained": "next token at trained positions",
    "next_token_chosen": "next token on chosen responses",
}
"""The same, short: the name of the trace's ``model-index`` metric."""

UNKNOWN_TRACE_OBJECTIVE = "the token at one position per context (masked or next: not recorded on this card)"

LOSS_SOURCES: dict[str, str] = {"eval": "held-out evaluation", "train": "training, last logged"}
"""Where a card's loss came from (``flatness.pretraining_loss_source``), as the card says it."""

# the trl trainers whose objective the card can name; any other trl trainer's is left unknown
_TRL_KINDS = {"DPOTrainer": "dpo", "SFTTrainer": "sft"}


@dataclasses.dataclass(frozen=True)
class TrainedAs:
    """`what_was_trained`'s answer, in the card's fields: ``objective`` (a key of `OBJECTIVES`, ``None`` when it
    cannot be told), ``trace_objective`` (a key of `TRACE_OBJECTIVES`), ``loss_source`` (``"eval"``, ``"train"`` or
    ``None``), ``adapter`` (the PEFT method, e.g. ``"LORA"``) and ``base_model`` (the model the adapters sit on)."""

    objective: str | None
    trace_objective: str | None
    loss_source: str | None = None
    adapter: str | None = None
    base_model: str | None = None


def trainer_kind(trainer_class: type) -> str:
    """``"dpo"``, ``"sft"``, ``"other_trl"`` (another trl trainer) or ``"trainer"``, read from the class's MRO by
    name (trl need not be importable)."""
    for klass in trainer_class.__mro__:
        if klass.__name__ in _TRL_KINDS and klass.__module__.startswith("trl"):
            return _TRL_KINDS[klass.__name__]
    if any(klass.__module__.split(".")[0] == "trl" for klass in trainer_class.__mro__):
        return "other_trl"
    return "trainer"


def what_was_trained(
    trainer_class: type,
    lm_head: str | None,
    *,
    trained_masks: Sequence[str] = (),
    peft_config: Any = None,
    loss_source: str | None = None,
) -> TrainedAs:
    """What a run trained and measured, from plain facts about it.

    Args:
        trainer_class: the trainer's class: trl's ``SFTTrainer``/``DPOTrainer`` (or a subclass, as
            `FlatBiasSFTTrainer` is) fine-tune; a ``Trainer`` pre-trains the model's own LM objective.
        lm_head: ``"masked_lm"`` or ``"causal_lm"`` (what the model's head predicts, from its class and config, as
            `HessianTraceCallback` decides it), ``None`` when the model is neither.
        trained_masks: for SFT, the loss masks in force: ``"completion"`` (completion-only loss) and/or
            ``"assistant"`` (assistant-only loss).
        peft_config: the active adapter's PEFT config (read duck-typed: ``peft_type``, ``base_model_name_or_path``),
            ``None`` without PEFT.
        loss_source: ``"eval"`` or ``"train"``, where the card's loss was read.

    A plain ``Trainer`` on a model that is no LM, or a trl trainer other than SFT and DPO, gives ``objective=None``:
    the card then says the objective is not recorded rather than name a wrong one.
    """
    if loss_source not in (None, *LOSS_SOURCES):
        raise ValueError(f"loss_source={loss_source!r}; expected one of {[*LOSS_SOURCES]} or None.")
    kind = trainer_kind(trainer_class)
    if kind == "dpo":
        objective, trace_objective = "dpo", "next_token_chosen"
    elif kind == "sft":
        if "assistant" in trained_masks:
            objective = "sft_assistant_only"
        elif "completion" in trained_masks:
            objective = "sft_completion_only"
        else:
            objective = "sft"
        trace_objective = "next_token_trained"
    elif kind == "trainer" and lm_head in ("masked_lm", "causal_lm"):
        objective = lm_head
        trace_objective = "masked_position" if lm_head == "masked_lm" else "next_token"
    else:
        objective, trace_objective = None, None
    adapter = base_model = None
    if peft_config is not None:
        peft_type = getattr(peft_config, "peft_type", None)
        adapter = str(getattr(peft_type, "value", peft_type)) if peft_type is not None else "unknown"
        base_model = getattr(peft_config, "base_model_name_or_path", None) or None
    return TrainedAs(objective, trace_objective, loss_source, adapter, base_model)


__all__ = [
    "LOSS_SOURCES",
    "OBJECTIVES",
    "TRACE_OBJECTIVES",
    "TRACE_OBJECTIVE_LABELS",
    "UNKNOWN_OBJECTIVE",
    "UNKNOWN_TRACE_OBJECTIVE",
    "Objective",
    "TrainedAs",
    "trainer_kind",
    "what_was_trained",
]
