"""The language of ``hf-flatbias demo``: a small PCFG, its training sentences, fixed evaluation contexts, probe
tasks, and the linear-probe scores of a model on them.

The research recipes (``recipes/research/``) use the paper-shaped language of their `paper_language` instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from datasets import Dataset

from ..probe import extract_features, probe_accuracy
from .data import build_pcfg_dataset, entropy_bound, masked_contexts
from .pcfg import PCFG
from .tokenizer import make_tokenizer

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerFast


@dataclass
class LanguageSetup:
    """A language, its datasets, fixed evaluation contexts and probe tasks."""

    name: str
    language: PCFG
    tokenizer: PreTrainedTokenizerFast
    train: Dataset
    contexts: Dataset
    probe_rows: list[list[int]]
    probe_tasks: dict[str, np.ndarray]
    entropy: float
    probe_test_rows: list[list[int]] = field(default_factory=list)
    probe_test_tasks: dict[str, np.ndarray] = field(default_factory=dict)
    probe_pooling: str = "mean"


def setup_language(
    name: str,
    *,
    n_train: int,
    n_contexts: int,
    n_probe: int,
    seed: int = 0,
    probe_pooling: str = "mean",
) -> LanguageSetup:
    """Build the language from ``seed``, its training set and the fixed evaluation material.

    The probe is fitted on ``n_probe`` held-out sentences and scored on ``n_probe`` others; contexts are a third,
    disjoint set so the loss and the trace are measured on sentences the probe never saw either. ``name`` must be
    ``"pcfg"`` (the HMM set-up went with the retired earlier-protocol recipes).
    """
    n_eval = n_contexts + 2 * n_probe
    if name != "pcfg":
        raise ValueError(f"unknown language {name!r}; the demo's language is 'pcfg'.")
    language = PCFG.from_seed(seed)
    data = build_pcfg_dataset(language, n_train, n_eval, seed=seed)
    evaluation = data["validation"]
    contexts = masked_contexts(evaluation.select(range(n_contexts)), seed=seed + 1)
    probe_fit = evaluation.select(range(n_contexts, n_contexts + n_probe))
    probe_test = evaluation.select(range(n_contexts + n_probe, n_eval))

    def tasks(split: Dataset) -> dict[str, np.ndarray]:
        return {task: np.asarray(split[column]) for task, column in (("A", "task_a"), ("B", "task_b"), ("C", "task_c"))}

    return LanguageSetup(
        name=name,
        language=language,
        tokenizer=make_tokenizer(language.words()),
        train=data["train"].select_columns(["input_ids", "attention_mask"]),
        contexts=contexts,
        probe_rows=list(probe_fit["input_ids"]),
        probe_tasks=tasks(probe_fit),
        probe_test_rows=list(probe_test["input_ids"]),
        probe_test_tasks=tasks(probe_test),
        entropy=entropy_bound(language, contexts),
        probe_pooling=probe_pooling,
    )


def probe_scores(
    model: torch.nn.Module, setup: LanguageSetup, pooling: str | None = None
) -> dict[str, dict[str, float]]:
    """Linear-probe results of each task on the frozen encoder's ``pooling`` features (the setup's by default)."""
    pooling = pooling or setup.probe_pooling
    fit = extract_features(model, setup.probe_rows, pooling=pooling)
    test = extract_features(model, setup.probe_test_rows, pooling=pooling)
    return {
        task: probe_accuracy(fit, labels, test_features=test, test_labels=setup.probe_test_tasks[task]).to_dict()
        for task, labels in setup.probe_tasks.items()
    }
