"""The language of a synthetic experiment: its training sentences, fixed evaluation contexts and probe tasks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from datasets import Dataset

from ..synthetic import HMM, PCFG, build_hmm_dataset, build_pcfg_dataset, entropy_bound, make_tokenizer, masked_contexts


@dataclass
class LanguageSetup:
    """A language, its datasets, fixed evaluation contexts and probe tasks."""

    name: str
    language: Any
    tokenizer: Any
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
    hmm_length: int = 24,
    probe_pooling: str = "mean",
    train_columns: Sequence[str] = (),
) -> LanguageSetup:
    """Build the language from ``seed``, its training set and the fixed evaluation material.

    The probe is fitted on ``n_probe`` held-out sentences and scored on ``n_probe`` others; contexts are a third,
    disjoint set so the loss and the trace are measured on sentences the probe never saw either. ``train_columns``
    keeps extra columns of the training sentences (e.g. ``task_a`` for adversarial pre-training, which reads it).
    """
    n_eval = n_contexts + 2 * n_probe
    if name == "pcfg":
        language = PCFG.from_seed(seed)
        data = build_pcfg_dataset(language, n_train, n_eval, seed=seed)
        task_columns = {"A": "task_a", "B": "task_b", "C": "task_c"}
    elif name == "hmm":
        language = HMM.from_seed(seed)
        data = build_hmm_dataset(language, n_train, n_eval, length=hmm_length, seed=seed)
        task_columns = {}
    else:
        raise ValueError(f"unknown language {name!r}; choose 'pcfg' or 'hmm'.")
    evaluation = data["validation"]
    contexts = masked_contexts(evaluation.select(range(n_contexts)), seed=seed + 1)
    probe_fit = evaluation.select(range(n_contexts, n_contexts + n_probe))
    probe_test = evaluation.select(range(n_contexts + n_probe, n_eval))

    def tasks(split: Dataset) -> dict[str, np.ndarray]:
        if name == "pcfg":
            return {task: np.asarray(split[column]) for task, column in task_columns.items()}
        states = np.asarray(split["states"])
        # Task-k: the hidden state at position k, at the start, the middle and the end of the sequence
        return {f"state@{k}": states[:, k] for k in (0, hmm_length // 2, hmm_length - 1)}

    return LanguageSetup(
        name=name,
        language=language,
        tokenizer=make_tokenizer(language.words()),
        train=data["train"].select_columns(["input_ids", "attention_mask", *train_columns]),
        contexts=contexts,
        probe_rows=list(probe_fit["input_ids"]),
        probe_tasks=tasks(probe_fit),
        probe_test_rows=list(probe_test["input_ids"]),
        probe_test_tasks=tasks(probe_test),
        entropy=entropy_bound(language, contexts),
        probe_pooling=probe_pooling,
    )
