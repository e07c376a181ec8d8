"""Probabilistic context-free grammars in the shape of the paper's synthetic language, with exact conditionals.

The grammar is *levelled*: a root chooses one of several sentence types (level 0); a level-``l`` nonterminal
rewrites into two or more level-``l+1`` nonterminals or, through an optional *lexical rule*, directly into one word;
the last level's nonterminals emit one word each. This module holds the grammar (its checks and rule tables); its
random constructors are in `pcfg_shapes`, sampling in `pcfg_sampling` and exact inference (the inside pass and its
gradient) in `pcfg_inside`, all methods of [`PCFG`].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .pcfg_inside import UNPARSABLE_LABEL, PCFGInside
from .pcfg_sampling import PCFGSample, PCFGSampler, inverse_cdf_table
from .pcfg_shapes import RandomPCFGs
from .tokenizer import MASK_ID, MASKED_WORD, N_SPECIAL

__all__ = ["PCFG", "PCFGSample", "UNPARSABLE_LABEL", "word_ids_to_tokens"]


@dataclass
class PCFG(RandomPCFGs, PCFGSampler, PCFGInside):
    """A levelled PCFG.

    Attributes:
        level_sizes: number of nonterminals per level; level 0 holds the sentence types, the last level the
            preterminals that emit words.
        root_probs: ``(level_sizes[0],)`` probability of each sentence type.
        rules: for each level ``l < len(level_sizes) - 1``, a list over the level's nonterminals of their rules
            ``(children, probability)``; ``children`` index level ``l + 1``.
        emissions: ``(level_sizes[-1], n_words)`` word distribution of each preterminal.
        lexical: optional lexical rules of the levels above the preterminals: ``lexical[l]`` is a
            ``(level_sizes[l], n_words)`` array whose entry ``(A, w)`` is the probability of ``A -> w``. A nonterminal's
            rules and lexical rules sum to 1 together. ``None``: words come from the preterminals only.
    """

    level_sizes: tuple[int, ...]
    root_probs: np.ndarray
    rules: list[list[list[tuple[tuple[int, ...], float]]]]
    emissions: np.ndarray
    lexical: list[np.ndarray] | None = None

    def __post_init__(self) -> None:
        self.level_sizes = tuple(int(s) for s in self.level_sizes)
        self.root_probs = np.asarray(self.root_probs, dtype=np.float64)
        self.emissions = np.asarray(self.emissions, dtype=np.float64)
        if self.lexical is not None:
            self.lexical = [np.asarray(m, dtype=np.float64) for m in self.lexical]
        self._validate()
        self._build_tables()

    def _validate(self) -> None:
        n_levels = len(self.level_sizes)
        if n_levels < 2:
            raise ValueError("A PCFG needs at least two levels: sentence types and preterminals.")
        if self.root_probs.shape != (self.level_sizes[0],) or not np.isclose(self.root_probs.sum(), 1.0):
            raise ValueError("root_probs must have one probability per sentence type and sum to 1.")
        if len(self.rules) != n_levels - 1:
            raise ValueError(f"rules needs one list per level except the preterminals ({n_levels - 1}).")
        if self.emissions.ndim != 2 or self.emissions.shape[0] != self.level_sizes[-1]:
            raise ValueError("emissions must be a (preterminals, words) array with one row per preterminal.")
        if not np.allclose(self.emissions.sum(1), 1.0) or (self.emissions < 0).any():
            raise ValueError("each row of emissions must be a probability distribution over the words.")
        if self.lexical is not None:
            if len(self.lexical) != n_levels - 1:
                raise ValueError(f"lexical needs one array per level except the preterminals ({n_levels - 1}).")
            for level, m in enumerate(self.lexical):
                if m.shape != (self.level_sizes[level], self.n_words) or (m < 0).any():
                    raise ValueError(
                        f"lexical[{level}] must be a non-negative ({self.level_sizes[level]}, {self.n_words}) array."
                    )
        for level, level_rules in enumerate(self.rules):
            if len(level_rules) != self.level_sizes[level]:
                raise ValueError(f"rules[{level}] must list the rules of all {self.level_sizes[level]} nonterminals.")
            for symbol, symbol_rules in enumerate(level_rules):
                if not symbol_rules:
                    raise ValueError(f"nonterminal {symbol} of level {level} has no rule.")
                total = sum(p for _, p in symbol_rules)
                if self.lexical is not None:
                    total += float(self.lexical[level][symbol].sum())
                if not math.isclose(total, 1.0, abs_tol=1e-6):
                    raise ValueError(
                        f"rules (lexical ones included) of nonterminal {symbol} of level {level} sum to {total}, not 1."
                    )
                for children, _ in symbol_rules:
                    if len(children) < 2:
                        # a unary rule would let two nodes span the same words and make span labels ambiguous
                        raise ValueError(f"level {level} has a rule {children} with fewer than 2 children.")
                    if min(children) < 0 or max(children) >= self.level_sizes[level + 1]:
                        raise ValueError(f"rule {children} of level {level} points outside level {level + 1}.")

    def _build_tables(self) -> None:
        """Padded rule tables: inverse CDFs for sampling, deduplicated child tuples for the inside pass."""
        self._rule_children: list[np.ndarray] = []
        self._rule_index: list[np.ndarray] = []
        self._outcome_cdf: list[np.ndarray] = []
        self._unique_children: list[np.ndarray] = []
        self._unique_weights: list[np.ndarray] = []
        self._binary_weights: list[torch.Tensor | None] = []  # (parent, left, right) when all rules are binary
        for level, level_rules in enumerate(self.rules):
            max_len = max(len(c) for sr in level_rules for c, _ in sr)
            max_rules = max(len(sr) for sr in level_rules)
            children, parent, prob = [], [], []
            index = np.zeros((len(level_rules), max_rules), dtype=np.int64)
            # sampling outcomes of a nonterminal: its rules (padded to max_rules), then one lexical rule per word
            n_lexical = 0 if self.lexical is None else self.n_words
            outcome_probs = np.zeros((len(level_rules), max_rules + n_lexical))
            for symbol, symbol_rules in enumerate(level_rules):
                for j, (c, p) in enumerate(symbol_rules):
                    index[symbol, j] = len(children)
                    outcome_probs[symbol, j] = p
                    children.append(list(c) + [-1] * (max_len - len(c)))
                    parent.append(symbol)
                    prob.append(p)
                index[symbol, len(symbol_rules) :] = index[symbol, len(symbol_rules) - 1]
            if self.lexical is not None:
                outcome_probs[:, max_rules:] = self.lexical[level]
            children = np.array(children, dtype=np.int64)
            self._rule_children.append(children)
            self._rule_index.append(index)
            self._outcome_cdf.append(inverse_cdf_table(outcome_probs))
            # rules sharing their children share one span-matrix product in the inside pass
            unique, inverse = np.unique(children, axis=0, return_inverse=True)
            weights = np.zeros((len(unique), len(level_rules)))
            np.add.at(weights, (inverse.reshape(-1), np.array(parent)), np.array(prob))
            self._unique_children.append(unique)
            self._unique_weights.append(weights)
            binary = None
            if unique.shape[1] == 2:
                binary = torch.zeros(len(level_rules), self.level_sizes[level + 1], self.level_sizes[level + 1])
                binary = binary.to(torch.float64)
                binary[:, unique[:, 0], unique[:, 1]] = torch.as_tensor(weights.T)
            self._binary_weights.append(binary)
        self._emission_cdf = inverse_cdf_table(self.emissions)

    # ------------------------------------------------------------------ names
    @property
    def n_words(self) -> int:
        return self.emissions.shape[1]

    @property
    def n_sentence_types(self) -> int:
        return self.level_sizes[0]

    @property
    def n_symbols(self) -> int:
        """Number of nonterminals of all levels: the label space of tasks B and C."""
        return sum(self.level_sizes)

    @property
    def level_offsets(self) -> np.ndarray:
        """Global nonterminal id of the first nonterminal of each level (span labels use global ids)."""
        return np.concatenate([[0], np.cumsum(self.level_sizes)[:-1]])

    @property
    def max_length(self) -> int:
        """Longest sentence the grammar can generate (a fixed width for per-position features)."""
        longest = np.ones(self.level_sizes[-1], dtype=np.int64)
        for level in range(len(self.rules) - 1, -1, -1):
            longest = np.array([max(int(longest[list(c)].sum()) for c, _ in sr) for sr in self.rules[level]])
        return int(longest.max())

    def words(self) -> list[str]:
        return [f"w{i}" for i in range(self.n_words)]

    def symbol_name(self, global_id: int) -> str:
        level = int(np.searchsorted(np.cumsum(self.level_sizes), global_id, side="right"))
        return f"N{level}_{global_id - int(self.level_offsets[level])}"


def word_ids_to_tokens(word_ids: np.ndarray) -> np.ndarray:
    """Word indices (``-2`` masked) to token ids of [`make_tokenizer`] without ``[CLS]``/``[SEP]``."""
    word_ids = np.asarray(word_ids)
    return np.where(word_ids == MASKED_WORD, MASK_ID, word_ids + N_SPECIAL)
