"""The GLUE tasks this package knows and the ways a checkpoint is fine-tuned on them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# full: every weight trains. linear_cls / linear_tokens: one linear layer on the frozen encoder's [CLS] state or on
# its first token states concatenated (the released run_lp.py probes positions 1..18 this way). pooler_head: a new
# pooler and classifier (two layers) on the frozen encoder.
FINETUNE_MODES = ("full", "linear_cls", "linear_tokens", "pooler_head")
LINEAR_PROBE_MODES = ("linear_cls", "linear_tokens")

# Fine-tuning defaults, here rather than in finetune.py so that `hf-flatbias glue` can show them without importing
# transformers. BERT's GLUE learning rate when every weight trains; a new head on frozen features takes a larger step.
FULL_FINETUNE_LEARNING_RATE = 2e-5
FROZEN_ENCODER_LEARNING_RATE = 1e-3
DEFAULT_SEEDS = (0, 1, 2)
DEFAULT_MAX_LENGTH = 128
"""Tokens per GLUE example (BERT's fine-tuning length)."""
DEFAULT_TRAIN_BATCH_SIZE = 32


@dataclass(frozen=True)
class GlueTask:
    """What fine-tuning needs to know about one GLUE task.

    Attributes:
        name: the task's config name in the ``nyu-mll/glue`` dataset and the ``glue`` metric.
        text_columns: one column (single sentence) or two (sentence pair).
        num_labels: classes, or 1 for STS-B's regression.
        validation_split: the split evaluated (MNLI: the matched validation set).
        main_metric: the score reported per seed.
    """

    name: str
    text_columns: tuple[str, ...]
    num_labels: int
    validation_split: str = "validation"
    main_metric: str = "accuracy"

    @property
    def is_regression(self) -> bool:
        return self.num_labels == 1

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The metrics the ``glue`` metric reports for this task."""
        if self.name == "cola":
            return ("matthews_correlation",)
        if self.name == "stsb":
            return ("pearson", "spearmanr")
        if self.name in ("mrpc", "qqp"):
            return ("accuracy", "f1")
        return ("accuracy",)


GLUE_TASKS: dict[str, GlueTask] = {
    task.name: task
    for task in (
        GlueTask("cola", ("sentence",), 2, main_metric="matthews_correlation"),
        GlueTask("sst2", ("sentence",), 2),
        GlueTask("mrpc", ("sentence1", "sentence2"), 2),
        GlueTask("qqp", ("question1", "question2"), 2),
        GlueTask("stsb", ("sentence1", "sentence2"), 1, main_metric="pearson"),
        GlueTask("mnli", ("premise", "hypothesis"), 3, validation_split="validation_matched"),
        GlueTask("qnli", ("question", "sentence"), 2),
        GlueTask("rte", ("sentence1", "sentence2"), 2),
        GlueTask("wnli", ("sentence1", "sentence2"), 2),
    )
}


def get_glue_task(task: str) -> GlueTask:
    """The [`GlueTask`] named ``task`` (case-insensitive); a clear ``ValueError`` for any other name."""
    key = task.strip().lower().replace("-", "") if isinstance(task, str) else task
    if key not in GLUE_TASKS:
        raise ValueError(f"Unknown GLUE task {task!r}: choose one of {', '.join(GLUE_TASKS)}.")
    return GLUE_TASKS[key]


def parse_glue_tasks(tasks: str | Sequence[str]) -> list[GlueTask]:
    """Tasks from a comma-separated string (``"sst2,qnli,rte"``) or a list; every name is checked before use."""
    names = tasks.split(",") if isinstance(tasks, str) else list(tasks)
    names = [name.strip() for name in names if name.strip()]
    if not names:
        raise ValueError("No GLUE task given: pass e.g. --tasks sst2,qnli,rte.")
    return [get_glue_task(name) for name in names]


def run_folder_name(task: str, mode: str, seed: int) -> str:
    """The folder, under ``finetune_glue``'s ``output_dir``, that one seed's run writes its checkpoints to."""
    return f"{task}-{mode}-seed{seed}"


def is_run_folder_name(name: str) -> bool:
    """Whether ``name`` is one that [`run_folder_name`] gives (for telling a folder of runs from someone's folder)."""
    task, _, rest = name.partition("-")
    mode, _, seed = rest.rpartition("-seed")
    return task in GLUE_TASKS and mode in FINETUNE_MODES and seed.lstrip("-").isdigit()


def resolve_finetune_mode(mode: str) -> str:
    """``mode`` checked against [`FINETUNE_MODES`]: a clear ``ValueError`` for any other name."""
    if mode not in FINETUNE_MODES:
        raise ValueError(f"mode={mode!r} is not supported; choose one of {list(FINETUNE_MODES)}.")
    return mode
