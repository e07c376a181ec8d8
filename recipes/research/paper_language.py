"""The paper-shaped PCFG protocol's fixed material: training sentences, KL sentences, trace contexts, probe splits.

Everything here depends on the *grammar* seed alone, never on a model seed, so every model trained on one grammar is
measured on the same KL sentences, trace contexts and probe test set (paired comparisons need the same test rows).
Probe labels are the released code's (`PCFG.task_labels`: inside-probability argmax from the sentence alone, not the
generating tree) and probe sentences have at least ``MIN_PROBE_WORDS`` words, as the released
``generate_downstream.py`` keeps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from datasets import Dataset

from hf_flatbias.synthetic import PCFG, make_tokenizer, masked_contexts, sentences_to_dataset

#: the released downstream generator keeps sentences of more than 4 words
MIN_PROBE_WORDS = 5
#: the probe splits: fitted on "fit", regularisation chosen on "validation", scored once on "test"
PROBE_SPLITS = ("fit", "validation", "test")
#: task columns of `PCFG.task_labels` and the names the protocol reports them under
TASKS = {"A": "task_a", "B": "task_b", "C": "task_c"}


@dataclass
class SentenceSet:
    """Sentences as word-id arrays (``-1`` padded), with the released code's task labels when they are probe rows."""

    word_ids: np.ndarray
    lengths: np.ndarray
    labels: dict[str, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.lengths)


@dataclass
class PaperLanguage:
    """A paper-shaped grammar and the material every model trained on it is measured with.

    Attributes:
        grammar: the `PCFG`.
        grammar_seed, shape: what built it (`PCFG.paper_shaped(grammar_seed, **shape)`).
        tokenizer: the word-level tokenizer (word ``i`` is token ``5 + i``).
        train: training rows (``input_ids``, ``attention_mask``).
        kl_sentences: held-out sentences for `measure_saturation`, with ``kl_conditionals`` their exact
            conditionals at every position (computed once here).
        trace_contexts: held-out one-mask contexts for the trace estimators.
        probes: ``{"fit" | "validation" | "test": SentenceSet}`` of sentences with >= ``MIN_PROBE_WORDS`` words.
        width: the grammar's longest sentence, the fixed feature width of every probe.
    """

    grammar: PCFG
    grammar_seed: int
    shape: dict[str, Any]
    tokenizer: Any
    train: Dataset
    kl_sentences: SentenceSet
    kl_conditionals: np.ndarray
    trace_contexts: Dataset
    probes: dict[str, SentenceSet]
    width: int


def _seeds(grammar_seed: int) -> list[int]:
    # data seeds derived from the grammar seed alone: train, KL, trace and probe sentences are disjoint draws
    return [int(s.generate_state(1)[0]) for s in np.random.SeedSequence([grammar_seed, 15]).spawn(4)]


def setup_paper_language(
    grammar_seed: int,
    *,
    n_train: int,
    n_kl: int,
    n_trace: int,
    n_probe: int,
    n_probe_validation: int | None = None,
    shape: dict[str, Any] | None = None,
    with_conditionals: bool = True,
) -> PaperLanguage:
    """Build `PCFG.paper_shaped(grammar_seed, **shape)` and its fixed evaluation material.

    Args:
        grammar_seed: seed of the grammar and of every sentence drawn here (model seeds play no part).
        n_train: training sentences.
        n_kl: held-out sentences the KL is measured on (the paper's protocol: >= 1,000).
        n_trace: held-out one-mask contexts of the trace estimates.
        n_probe: sentences of the probe's fit and test splits each.
        n_probe_validation: sentences of the split the regularisation is chosen on (default ``n_probe // 2``).
        shape: keyword arguments of `PCFG.paper_shaped` other than the seed (candidate grammars of the gate).
        with_conditionals: compute the KL sentences' exact conditionals (skip for a lexical baseline alone).
    """
    if min(n_train, n_kl, n_trace, n_probe) < 1:
        raise ValueError("n_train, n_kl, n_trace and n_probe must all be >= 1.")
    shape = dict(shape or {})
    grammar = PCFG.paper_shaped(grammar_seed, **shape)
    n_validation = max(1, n_probe // 2) if n_probe_validation is None else n_probe_validation
    train_seed, kl_seed, trace_seed, probe_seed = _seeds(grammar_seed)
    train = grammar.sample(n_train, seed=train_seed)
    kl = grammar.sample(n_kl, seed=kl_seed)
    trace = grammar.sample(n_trace, seed=trace_seed)
    sizes = {"fit": n_probe, "validation": n_validation, "test": n_probe}
    needed = sum(sizes.values())
    # draw enough sentences that the >= 5-word filter leaves `needed` of them (about 3 in 4 pass it)
    pool = grammar.sample(2 * needed + 100, seed=probe_seed)
    keep = np.flatnonzero(pool.lengths >= MIN_PROBE_WORDS)
    if len(keep) < needed:
        raise ValueError(f"only {len(keep)} of {len(pool.lengths)} sentences have >= {MIN_PROBE_WORDS} words.")
    keep = keep[:needed]
    labels = grammar.task_labels(pool.word_ids[keep], pool.lengths[keep])
    probes, start = {}, 0
    for name in PROBE_SPLITS:
        rows = slice(start, start + sizes[name])
        probes[name] = SentenceSet(
            word_ids=pool.word_ids[keep][rows],
            lengths=pool.lengths[keep][rows],
            labels={task: labels[column][rows] for task, column in TASKS.items()},
        )
        start += sizes[name]
    kl_set = SentenceSet(kl.word_ids, kl.lengths)
    return PaperLanguage(
        grammar=grammar,
        grammar_seed=grammar_seed,
        shape=shape,
        tokenizer=make_tokenizer(grammar.words()),
        train=sentences_to_dataset(train.word_ids, train.lengths).select_columns(["input_ids", "attention_mask"]),
        kl_sentences=kl_set,
        kl_conditionals=grammar.masked_conditionals(kl.word_ids, kl.lengths) if with_conditionals else np.empty(0),
        trace_contexts=masked_contexts(
            sentences_to_dataset(trace.word_ids, trace.lengths), seed=trace_seed
        ).select_columns(["input_ids", "attention_mask", "labels"]),
        probes=probes,
        width=grammar.max_length,
    )


def task_labelled_train(language: PaperLanguage, n_train: int) -> Dataset:
    """The first ``n_train`` training sentences of ``language`` (the same draw as `setup_paper_language`'s, so the
    same rows) with a ``task_labels`` column ``[A, B, C]``: the probe tasks' labels, -1 for sentences shorter than
    ``MIN_PROBE_WORDS`` (the probes never see those). An adversary on the read-out trains on these."""
    sample = language.grammar.sample(n_train, seed=_seeds(language.grammar_seed)[0])
    labels = language.grammar.task_labels(sample.word_ids, sample.lengths)
    short = sample.lengths < MIN_PROBE_WORDS
    columns = np.stack([np.where(short, -1, labels[column]) for column in TASKS.values()], axis=1)
    rows = sentences_to_dataset(sample.word_ids, sample.lengths, task_labels=columns)
    return rows.select_columns(["input_ids", "attention_mask", "task_labels"])


def task_classes(language: PaperLanguage) -> list[int]:
    """Classes of tasks A, B, C: the sentence types, then every nonterminal (the prefix tasks' label space)."""
    return [language.grammar.n_sentence_types, language.grammar.n_symbols, language.grammar.n_symbols]
