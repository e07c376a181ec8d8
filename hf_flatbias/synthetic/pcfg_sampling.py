"""Sampling from a [`PCFG`]: every sentence of a batch is expanded one level at a time with numpy (a word chosen by
a lexical rule is carried down as a placeholder so that words stay in order), so a million sentences take seconds.
The labels of the downstream tasks come from the generating tree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .tokenizer import PAD_WORD

#: sentences expanded at once by [`PCFGSampler.sample`]
_SAMPLE_CHUNK = 500_000


@dataclass
class PCFGSample:
    """Sentences drawn from a [`PCFG`] together with the labels of the downstream tasks.

    Attributes:
        word_ids: ``(n, max_length)`` word indices, ``-1`` after each sentence's end.
        lengths: ``(n,)`` number of words of each sentence.
        sentence_type: ``(n,)`` task A, the index of the root's child (the sentence type).
        span_labels: ``{k: (n,)}`` global nonterminal id of the node spanning exactly the first ``k`` words in the
            generating tree (tasks B for ``k=4`` and C for ``k=2``), ``-1`` where no node spans them.
    """

    word_ids: np.ndarray
    lengths: np.ndarray
    sentence_type: np.ndarray
    span_labels: dict[int, np.ndarray] = field(default_factory=dict)

    def sentences(self) -> list[np.ndarray]:
        return [row[:n] for row, n in zip(self.word_ids, self.lengths, strict=True)]


class PCFGSampler:
    """The sampling methods of [`PCFG`], which builds the inverse-CDF tables they draw from (``_build_tables``)."""

    def sample(self, n: int, *, seed: int = 0, span_label_lengths: Sequence[int] = (2, 4)) -> PCFGSample:
        """Draw ``n`` sentences, deterministic given ``seed``, with their task labels from the generating tree.

        Args:
            n: number of sentences.
            seed: seed of the draws.
            span_label_lengths: ``k`` for which to record the nonterminal spanning the first ``k`` words.
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}.")
        rng = np.random.default_rng(seed)
        # chunks bound the memory of the level-wise expansion; one rng keeps the draws deterministic
        parts = [
            self._sample_chunk(min(_SAMPLE_CHUNK, n - start), rng, span_label_lengths)
            for start in range(0, n, _SAMPLE_CHUNK)
        ]
        if len(parts) == 1:
            return parts[0]
        width = max(p.word_ids.shape[1] for p in parts)
        word_ids = np.full((n, width), PAD_WORD, dtype=np.int64)
        start = 0
        for p in parts:
            word_ids[start : start + len(p.lengths), : p.word_ids.shape[1]] = p.word_ids
            start += len(p.lengths)
        return PCFGSample(
            word_ids=word_ids,
            lengths=np.concatenate([p.lengths for p in parts]),
            sentence_type=np.concatenate([p.sentence_type for p in parts]),
            span_labels={k: np.concatenate([p.span_labels[k] for p in parts]) for k in parts[0].span_labels},
        )

    def _sample_chunk(self, n: int, rng: np.random.Generator, span_label_lengths: Sequence[int]) -> PCFGSample:
        types = np.searchsorted(np.cumsum(self.root_probs), rng.random(n) * self.root_probs.sum(), side="right")
        symbols = np.minimum(types, self.level_sizes[0] - 1)
        # a node whose symbol is -1 stands for a word already chosen by a lexical rule above it (kept in `word`)
        word = np.full(n, -1, dtype=np.int64)
        sentence = np.arange(n)
        level_symbols, level_parents = [symbols], [None]
        for level in range(len(self.rules)):
            u = rng.random(len(symbols))
            active = symbols >= 0
            outcome = np.full(len(symbols), -1, dtype=np.int64)
            outcome[active] = _draw(self._outcome_cdf[level], symbols[active], u[active])
            n_rule_slots = self._rule_index[level].shape[1]
            expands = active & (outcome < n_rule_slots)
            rule = self._rule_index[level][symbols[expands], outcome[expands]]
            width = self._rule_children[level].shape[1]
            child_symbols = np.full((len(symbols), width), -1, dtype=np.int64)
            child_symbols[expands] = self._rule_children[level][rule]
            valid = child_symbols >= 0
            valid[~expands, 0] = True  # a word passes down as one placeholder child
            chosen_word = np.where(active & ~expands, outcome - n_rule_slots, word)
            parents = np.repeat(np.arange(len(symbols)), valid.sum(1))
            symbols = child_symbols[valid]
            word = chosen_word[parents]
            sentence = sentence[parents]
            level_symbols.append(symbols)
            level_parents.append(parents)
        u = rng.random(len(symbols))
        active = symbols >= 0
        words = word.copy()
        words[active] = _draw(self._emission_cdf, symbols[active], u[active])
        lengths = np.bincount(sentence, minlength=n)
        word_start = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        word_ids = np.full((n, int(lengths.max())), PAD_WORD, dtype=np.int64)
        position = np.arange(len(words)) - word_start[sentence]
        word_ids[sentence, position] = words

        # span of every node: lengths bottom-up, starts from the running total within each level
        span_labels = {int(k): np.full(n, -1, dtype=np.int64) for k in span_label_lengths}
        node_length = np.ones(len(symbols), dtype=np.int64)
        offsets = self.level_offsets
        for level in range(len(self.level_sizes) - 1, -1, -1):
            node_sentence = _node_sentences(level_parents, level, n)
            global_start = np.cumsum(node_length) - node_length
            start = global_start - word_start[node_sentence]
            # going upwards, so a higher node spanning the same words overwrites a lower one
            for k, labels in span_labels.items():
                hit = (start == 0) & (node_length == k) & (level_symbols[level] >= 0)
                labels[node_sentence[hit]] = level_symbols[level][hit] + offsets[level]
            if level > 0:
                node_length = np.bincount(
                    level_parents[level], weights=node_length, minlength=len(level_symbols[level - 1])
                )
                node_length = node_length.astype(np.int64)
        return PCFGSample(word_ids=word_ids, lengths=lengths, sentence_type=types, span_labels=span_labels)


def inverse_cdf_table(probs: np.ndarray) -> np.ndarray:
    """Row-wise CDFs for [`_draw`]: normalised, and exactly 1 from each row's last possible outcome on."""
    cdf = np.cumsum(probs, axis=1) / probs.sum(1, keepdims=True)
    last = probs.shape[1] - 1 - np.argmax(probs[:, ::-1] > 0, axis=1)
    cdf[np.arange(probs.shape[1])[None, :] >= last[:, None]] = 1.0
    return cdf


def _draw(cdf: np.ndarray, rows: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse-CDF draws ``min{j : cdf[rows[i], j] > u[i]}`` for uniforms ``u`` in [0, 1), without a dense compare.

    Row ``r``'s entries are shifted by ``r`` so one sorted array serves every row and ``searchsorted`` does the rest.
    """
    width = cdf.shape[1]
    flat = (cdf + np.arange(len(cdf))[:, None]).ravel()
    return np.searchsorted(flat, rows + u, side="right") - rows * width


def _node_sentences(level_parents: list, level: int, n: int) -> np.ndarray:
    sentence = np.arange(n)
    for lv in range(1, level + 1):
        sentence = sentence[level_parents[lv]]
    return sentence
