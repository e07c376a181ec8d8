"""Probabilistic context-free grammars in the shape of the paper's synthetic language, with exact conditionals.

The grammar is *levelled*: a root chooses one of several sentence types (level 0); a level-``l`` nonterminal
rewrites into two or more level-``l+1`` nonterminals or, through an optional *lexical rule*, directly into one word;
the last level's nonterminals emit one word each. Sampling expands every sentence of a batch one level at a time with
numpy (a word chosen by a lexical rule is carried down as a placeholder so that words stay in order), so a million
sentences take seconds.

Exact inference uses one observation: the inside probability ``Z(x)`` of a sentence is linear in the one-hot vector
of the word at every position, so the derivative of ``Z`` with respect to that vector at ``(t, w)`` is
``Pr(x_-t, x_t = w)``, whatever word stands at ``t``. One inside pass plus one backward pass therefore gives the
masked-token conditional ``Pr(x_t = w | x_-t)`` at *every* position at once. The inside pass itself is written
with span matrices: ``M_A[i, j]`` is the inside probability of nonterminal ``A`` over words ``[i, j)``, and a rule
``A -> B C D`` contributes ``p * (M_B @ M_C @ M_D)``, the matrix product summing over the split points.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .tokenizer import MASK_ID, MASKED_WORD, N_SPECIAL, PAD_WORD


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


@dataclass
@dataclass
class PCFG:
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

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_seed(
        cls,
        seed: int = 0,
        *,
        n_sentence_types: int = 4,
        level_sizes: Sequence[int] = (8, 8, 12),
        n_words: int = 40,
        rules_per_symbol: int = 3,
        sentence_lengths: Sequence[int] = (2, 3, 4, 5, 6),
        rule_lengths: Sequence[Sequence[int]] | None = None,
        words_per_preterminal: int = 6,
        concentration: float = 1.0,
    ) -> PCFG:
        """A random grammar, the same for the same arguments.

        The default has 4 sentence types, each rewriting into 2-6 level-1 nonterminals; levels 1 and 2 are binary, so
        a level-1 node always spans 4 words and a level-2 node 2 words: sentences have 8-24 words and the paper's
        tasks B (nonterminal over the first 4 words) and C (over the first 2) are defined for every sentence. Each
        preterminal emits ``words_per_preterminal`` words drawn from a shared vocabulary, so words are ambiguous and
        the conditionals need the context.

        Args:
            seed: seed of the grammar's random draws.
            n_sentence_types: number of sentence types (classes of task A).
            level_sizes: number of nonterminals of each level below the sentence types; the last are preterminals.
            n_words: vocabulary size.
            rules_per_symbol: rules of each nonterminal.
            sentence_lengths: possible numbers of children of a sentence type's rules.
            rule_lengths: possible numbers of children of the rules of each level below the sentence types
                (``len(level_sizes) - 1`` entries); default binary.
            words_per_preterminal: size of each preterminal's word set.
            concentration: Dirichlet concentration of rule and emission probabilities (smaller: more skewed).
        """
        level_sizes = tuple(int(s) for s in level_sizes)
        if len(level_sizes) < 1:
            raise ValueError("level_sizes needs at least one level (the preterminals).")
        if rule_lengths is None:
            rule_lengths = [(2,)] * (len(level_sizes) - 1)
        if len(rule_lengths) != len(level_sizes) - 1:
            raise ValueError(
                f"rule_lengths needs one entry per level below the sentence types except the preterminals "
                f"({len(level_sizes) - 1}), got {len(rule_lengths)}."
            )
        if not 1 <= words_per_preterminal <= n_words:
            raise ValueError(f"words_per_preterminal must be in [1, n_words={n_words}], got {words_per_preterminal}.")
        rng = np.random.default_rng(seed)
        sizes = (int(n_sentence_types), *level_sizes)
        lengths_per_level = [tuple(sentence_lengths), *(tuple(r) for r in rule_lengths)]
        rules: list[list[list[tuple[tuple[int, ...], float]]]] = []
        for level, lengths in enumerate(lengths_per_level):
            n_children = sizes[level + 1]
            level_rules = []
            for _ in range(sizes[level]):
                probs = rng.dirichlet(np.full(rules_per_symbol, concentration))
                symbol_rules = []
                seen: set[tuple[int, ...]] = set()
                for p in probs:
                    while True:
                        k = int(rng.choice(lengths))
                        children = tuple(int(c) for c in rng.integers(0, n_children, size=k))
                        if children not in seen:
                            seen.add(children)
                            break
                    symbol_rules.append((children, float(p)))
                level_rules.append(symbol_rules)
            rules.append(level_rules)
        emissions = np.zeros((sizes[-1], n_words))
        for p in range(sizes[-1]):
            words = rng.choice(n_words, size=words_per_preterminal, replace=False)
            emissions[p, words] = rng.dirichlet(np.full(words_per_preterminal, concentration))
        # every word must be emitted by some preterminal, or its token would be dead weight in the vocabulary
        unused = np.flatnonzero(emissions.sum(0) == 0)
        for w in unused:
            p = int(rng.integers(sizes[-1]))
            emissions[p, w] = emissions[p].max()
            emissions[p] /= emissions[p].sum()
        root_probs = rng.dirichlet(np.full(sizes[0], 4.0 * concentration))
        return cls(level_sizes=sizes, root_probs=root_probs, rules=rules, emissions=emissions)

    @classmethod
    def paper_shaped(
        cls,
        seed: int = 0,
        *,
        n_sentence_types: int = 9,
        n_levels: int = 4,
        symbols_per_level: int = 10,
        binary_rules_per_symbol: int = 20,
        lexical_mass: tuple[float, float] = (0.04, 0.42),
        n_words: int = 200,
        emitters_per_word: tuple[int, int] = (2, 8),
        concentration: float = 1.0,
    ) -> PCFG:
        """A random grammar with the shape of the paper's released grammar (``pcfg/rule_deep_mlm.txt``).

        The released grammar has 9 sentence types, each with one rule into two level-1 symbols; 4 levels of 10
        symbols; every symbol of levels 1-3 has 18-20 distinct binary rules into the next level plus one lexical rule
        carrying 4-42% of its mass; the last level emits words; 200 words, each emitted by 1-8 nonterminals (5 of them
        by one only; the default ``emitters_per_word`` here is 2-8). Sentences therefore have 2 to ``2 ** n_levels``
        (16) words. The same arguments give the same grammar; ``seed`` is the grammar's own seed, independent of any
        data or model seed.

        Args:
            seed: seed of the grammar's random draws.
            n_sentence_types: number of sentence types (classes of task A); each gets a distinct pair of level-1
                symbols.
            n_levels: levels of symbols below the sentence types; the last are the preterminals.
            symbols_per_level: symbols of each of those levels.
            binary_rules_per_symbol: distinct binary rules of each non-preterminal symbol.
            lexical_mass: range of the uniform draw of each non-preterminal symbol's lexical-rule probability.
            n_words: vocabulary size.
            emitters_per_word: range (inclusive) of the number of nonterminals that emit each word, lexical rules
                included.
            concentration: Dirichlet concentration of the rule and emission probabilities (smaller: more skewed).
        """
        if n_levels < 1 or symbols_per_level < 1:
            raise ValueError(f"n_levels and symbols_per_level must be >= 1, got {n_levels} and {symbols_per_level}.")
        if not 1 <= n_sentence_types <= symbols_per_level**2:
            raise ValueError(
                f"n_sentence_types must be in [1, symbols_per_level ** 2 = {symbols_per_level**2}] (each type needs "
                f"its own pair of level-1 symbols), got {n_sentence_types}."
            )
        if not 1 <= binary_rules_per_symbol <= symbols_per_level**2:
            raise ValueError(
                f"binary_rules_per_symbol must be in [1, symbols_per_level ** 2 = {symbols_per_level**2}] (rules are "
                f"distinct pairs), got {binary_rules_per_symbol}."
            )
        low_mass, high_mass = lexical_mass
        if not 0 <= low_mass <= high_mass < 1:
            raise ValueError(f"lexical_mass must satisfy 0 <= low <= high < 1, got {lexical_mass}.")
        low_emitters, high_emitters = emitters_per_word
        if not 1 <= low_emitters <= high_emitters:
            raise ValueError(f"emitters_per_word must satisfy 1 <= low <= high, got {emitters_per_word}.")
        rng = np.random.default_rng(seed)
        sizes = (int(n_sentence_types), *([int(symbols_per_level)] * n_levels))
        n_pairs = symbols_per_level**2

        def distinct_pairs(k: int) -> list[tuple[int, int]]:
            return [divmod(int(p), symbols_per_level) for p in rng.choice(n_pairs, size=k, replace=False)]

        rules = [[[(pair, 1.0)] for pair in distinct_pairs(n_sentence_types)]]
        lexical = [np.zeros((n_sentence_types, n_words))]
        n_upper = symbols_per_level * (n_levels - 1)
        # each symbol above the preterminals has one lexical rule, to a word of its own while there are enough words
        lexical_words = rng.choice(n_words, size=n_upper, replace=n_upper > n_words)
        for level in range(1, n_levels):
            level_rules = []
            level_lexical = np.zeros((symbols_per_level, n_words))
            for symbol in range(symbols_per_level):
                mass = rng.uniform(low_mass, high_mass)
                probs = rng.dirichlet(np.full(binary_rules_per_symbol, concentration)) * (1.0 - mass)
                level_rules.append(
                    [(pair, float(p)) for pair, p in zip(distinct_pairs(len(probs)), probs, strict=True)]
                )
                level_lexical[symbol, lexical_words[(level - 1) * symbols_per_level + symbol]] = mass
            rules.append(level_rules)
            lexical.append(level_lexical)
        # the preterminals make up each word's remaining emitters
        emits = np.zeros((symbols_per_level, n_words), dtype=bool)
        lexical_count = np.bincount(lexical_words, minlength=n_words)
        for w in range(n_words):
            n_emitters = int(rng.integers(low_emitters, high_emitters + 1)) - int(lexical_count[w])
            n_emitters = min(max(n_emitters, 1 if lexical_count[w] == 0 else 0), symbols_per_level)
            emits[rng.choice(symbols_per_level, size=n_emitters, replace=False), w] = True
        for p in np.flatnonzero(~emits.any(1)):
            emits[p, rng.integers(n_words)] = True
        emissions = np.zeros((symbols_per_level, n_words))
        for p in range(symbols_per_level):
            words = np.flatnonzero(emits[p])
            emissions[p, words] = rng.dirichlet(np.full(len(words), concentration))
        root_probs = rng.dirichlet(np.full(n_sentence_types, 4.0 * concentration))
        return cls(level_sizes=sizes, root_probs=root_probs, rules=rules, emissions=emissions, lexical=lexical)

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
            self._outcome_cdf.append(_inverse_cdf_table(outcome_probs))
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
        self._emission_cdf = _inverse_cdf_table(self.emissions)

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

    # ------------------------------------------------------------------ sampling
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

    # ------------------------------------------------------------------ exact inference
    def _inside(self, word_ids: torch.Tensor, lengths: torch.Tensor, *, track: bool = False):
        """Inside probabilities of a padded batch.

        Returns ``(Z (b,), word indicator (b, T, n_words), span matrices per level (b, n_l, T+1, T+1),
        Pr(x | sentence type) (b, n_types))``. With ``track`` the indicator requires grad and the span matrices retain
        theirs: the gradient of ``Z`` is the outside probability of everything.
        """
        b = word_ids.shape[0]
        indicator = torch.nn.functional.one_hot(word_ids.clamp(min=0), self.n_words).to(torch.float64)
        # a masked position is marginalised over all words, a padding position matches none
        indicator = torch.where((word_ids == MASKED_WORD)[..., None], torch.ones_like(indicator), indicator)
        indicator = torch.where((word_ids == PAD_WORD)[..., None], torch.zeros_like(indicator), indicator)
        if track:
            indicator.requires_grad_(True)
        n_levels = len(self.level_sizes)
        spans: list[torch.Tensor] = [None] * n_levels
        for level in range(n_levels - 1, -1, -1):
            matrices = None
            if level < n_levels - 1:
                matrices = self._combine_children(level, spans[level + 1])
            word_probs = self.emissions if level == n_levels - 1 else None
            if level < n_levels - 1 and self.lexical is not None and self.lexical[level].any():
                word_probs = self.lexical[level]
            if word_probs is not None:
                leaf = indicator @ torch.as_tensor(word_probs.T)  # (b, T, n_l): probability of A -> x_t
                diagonal = torch.diag_embed(leaf.permute(0, 2, 1), offset=1)  # spans [t, t+1)
                matrices = diagonal if matrices is None else matrices + diagonal
            if track:
                matrices.retain_grad()
            spans[level] = matrices
        likelihood = spans[0][torch.arange(b), :, 0, lengths]  # (b, n_types)
        z = likelihood @ torch.as_tensor(self.root_probs)
        return z, indicator, spans, likelihood

    def _combine_children(self, level: int, child: torch.Tensor) -> torch.Tensor:
        """Inside span matrices of level ``level`` from its rules over the span matrices ``child`` of the next."""
        binary = self._binary_weights[level]
        if binary is not None:
            # contracting the rule tensor with the right child first leaves one large matrix product per sentence
            right = torch.einsum("abc,nckj->nabkj", binary, child)
            return torch.einsum("nbik,nabkj->naij", child, right)
        children = torch.as_tensor(self._unique_children[level])
        rule_lengths = (children >= 0).sum(1)
        product = child[:, children[:, 0]]
        for j in range(1, children.shape[1]):
            has_child = rule_lengths > j
            if bool(has_child.all()):
                product = product @ child[:, children[:, j]]
            else:
                extended = product[:, has_child] @ child[:, children[has_child, j]]
                product = product.clone()
                product[:, has_child] = extended
        return torch.einsum("brij,rp->bpij", product, torch.as_tensor(self._unique_weights[level]))

    @staticmethod
    def _as_batch(word_ids, lengths=None) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(word_ids, (list, tuple)) and word_ids and not np.isscalar(word_ids[0]):
            t_max = max(len(s) for s in word_ids)
            padded = np.full((len(word_ids), t_max), PAD_WORD, dtype=np.int64)
            for i, s in enumerate(word_ids):
                padded[i, : len(s)] = s
            word_ids = padded
        ids = torch.as_tensor(np.asarray(word_ids), dtype=torch.long)
        if ids.ndim == 1:
            ids = ids[None]
        if lengths is None:
            lengths = (ids != PAD_WORD).sum(1)
        lengths = torch.as_tensor(np.asarray(lengths), dtype=torch.long)
        if (ids[:, : int(lengths.max())] == PAD_WORD).sum() != (lengths.max() - lengths).sum():
            raise ValueError("word_ids must be padded with -1 only after each sentence's last word.")
        return ids, lengths

    def _length_batches(self, word_ids, lengths, batch_size: int, min_width: int = 0):
        """``(rows, word ids cut to the batch's longest sentence, lengths)`` over batches of similar length.

        Sorting by length keeps the cubic inside pass from paying for the longest sentence in every batch.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        ids, lengths = self._as_batch(word_ids, lengths)
        order = np.argsort(lengths.numpy(), kind="stable")
        for start in range(0, len(order), batch_size):
            rows = torch.as_tensor(order[start : start + batch_size])
            chunk, chunk_lengths = ids[rows], lengths[rows]
            width = max(int(chunk_lengths.max()), min_width)
            if width > chunk.shape[1]:
                chunk = torch.nn.functional.pad(chunk, (0, width - chunk.shape[1]), value=PAD_WORD)
            yield rows.numpy(), chunk[:, :width], chunk_lengths

    def sentence_probability(self, word_ids, lengths=None, *, batch_size: int = 256) -> np.ndarray:
        """``Pr(x)`` of each sentence (``-2`` entries are marginalised over all words)."""
        out = np.zeros(len(self._as_batch(word_ids, lengths)[0]))
        for rows, chunk, chunk_lengths in self._length_batches(word_ids, lengths, batch_size):
            with torch.no_grad():
                out[rows] = self._inside(chunk, chunk_lengths)[0].numpy()
        return out

    def masked_conditionals(self, word_ids, lengths=None, *, batch_size: int = 256) -> np.ndarray:
        """Exact ``Pr(x_t = w | x_-t)`` for every position ``t`` and word ``w``.

        Args:
            word_ids: ``(n, T)`` word indices padded with ``-1`` (or a list of sentences); entries equal to ``-2``
                are masked and marginalised, so a sentence with one ``-2`` at ``t`` gives the MLM's target
                distribution at ``t``, and the conditional at an observed position ignores that position's word.
            lengths: ``(n,)`` sentence lengths; inferred from the padding when omitted.
            batch_size: sentences per inside pass (memory grows as ``batch * rules * T^2``).

        Returns:
            ``(n, T, n_words)`` float64 array; rows of padding positions are zero.
        """
        ids, _ = self._as_batch(word_ids, lengths)
        out = np.zeros((len(ids), ids.shape[1], self.n_words))
        for rows, chunk, chunk_lengths in self._length_batches(word_ids, lengths, batch_size):
            # outside probabilities are gradients of the inside pass: needed even when called under no_grad
            with torch.enable_grad():
                z, indicator, _, _ = self._inside(chunk, chunk_lengths, track=True)
                if not torch.all(z > 0):
                    raise ValueError("some sentences have probability 0 under this grammar: they cannot come from it.")
                (joint,) = torch.autograd.grad(z.sum(), indicator)  # Pr(x_-t, x_t = w)
            total = joint.sum(-1, keepdim=True)
            cond = torch.where(total > 0, joint / total.clamp(min=1e-300), torch.zeros_like(joint))
            out[rows, : chunk.shape[1]] = cond.numpy()
        return out

    def span_label_posterior(self, word_ids, lengths=None, *, span_length: int, batch_size: int = 256) -> np.ndarray:
        """``Pr(a node labelled A spans the first span_length words | x)`` for every global nonterminal ``A``.

        This is the parse-based definition of tasks B and C: the label is well defined for a sentence when the
        posterior puts (almost) all its mass on one nonterminal.

        Returns:
            ``(n, sum(level_sizes))`` array; a row sums to the probability that the span is a constituent at all.
        """
        out = np.zeros((len(self._as_batch(word_ids, lengths)[0]), self.n_symbols))
        offsets = self.level_offsets
        for rows, chunk, chunk_lengths in self._length_batches(word_ids, lengths, batch_size, min_width=span_length):
            with torch.enable_grad():
                z, _, spans, _ = self._inside(chunk, chunk_lengths, track=True)
                z.sum().backward()
            for level, m in enumerate(spans):
                joint = (m * m.grad)[:, :, 0, span_length]
                if level == 0:
                    # a sentence type spans the first words only when it spans the whole sentence
                    joint = joint * (chunk_lengths == span_length)[:, None]
                post = joint / z[:, None]
                out[rows, offsets[level] : offsets[level] + self.level_sizes[level]] = post.detach().numpy()
        return out

    def sentence_type_likelihood(self, word_ids, lengths=None, *, batch_size: int = 256) -> np.ndarray:
        """``Pr(x | sentence type)`` of each sentence and type: ``(n, n_types)``, the root's prior left out."""
        out = np.zeros((len(self._as_batch(word_ids, lengths)[0]), self.n_sentence_types))
        for rows, chunk, chunk_lengths in self._length_batches(word_ids, lengths, batch_size):
            with torch.no_grad():
                out[rows] = self._inside(chunk, chunk_lengths)[3].numpy()
        return out

    def sentence_type_posterior(self, word_ids, lengths=None, *, batch_size: int = 256) -> np.ndarray:
        """``Pr(sentence type | x)``: the parse-based label of task A."""
        joint = self.sentence_type_likelihood(word_ids, lengths, batch_size=batch_size) * self.root_probs
        return joint / joint.sum(1, keepdims=True)

    def prefix_inside(self, word_ids, lengths=None, *, prefix_length: int, batch_size: int = 256) -> np.ndarray:
        """Inside probability of every nonterminal over the first ``prefix_length`` words alone: ``(n, n_symbols)``.

        No outside term: the rest of the sentence is ignored, as in the released code's ``inside_partial``. Columns
        are global nonterminal ids; a sentence shorter than ``prefix_length`` gets a row of zeros.
        """
        return self._inside_summaries(word_ids, lengths, (prefix_length,), batch_size)[1][0]

    def _inside_summaries(
        self, word_ids, lengths, prefix_lengths: Sequence[int], batch_size: int
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """``Pr(x | sentence type)`` and the prefix inside probabilities of each ``k``, from one inside pass."""
        if any(k < 1 for k in prefix_lengths):
            raise ValueError(f"prefix lengths must be >= 1, got {list(prefix_lengths)}.")
        n = len(self._as_batch(word_ids, lengths)[0])
        likelihood = np.zeros((n, self.n_sentence_types))
        prefixes = [np.zeros((n, self.n_symbols)) for _ in prefix_lengths]
        widest = max(prefix_lengths, default=0)
        for rows, chunk, chunk_lengths in self._length_batches(word_ids, lengths, batch_size, min_width=widest):
            with torch.no_grad():
                _, _, spans, chunk_likelihood = self._inside(chunk, chunk_lengths)
            likelihood[rows] = chunk_likelihood.numpy()
            for out, k in zip(prefixes, prefix_lengths, strict=True):
                out[rows] = torch.cat([m[:, :, 0, k] for m in spans], dim=1).numpy()
        return likelihood, prefixes

    def task_labels(
        self, word_ids, lengths=None, *, prefix_lengths: dict[str, int] | None = None, batch_size: int = 256
    ) -> dict[str, np.ndarray]:
        """The released code's downstream labels, from the sentence alone (not from the tree that generated it).

        * ``task_a``: the sentence type ``T`` maximising ``Pr(x | T)`` (no prior), the released ``inside``.
        * ``task_b`` / ``task_c``: the global nonterminal id with the largest inside probability over the first 4 / 2
          words alone, over all nonterminals; ``UNPARSABLE_LABEL`` (the first sentence type, ``S1`` in the released
          code) when no nonterminal derives those words. This is the released ``inside_partial``.

        Ties go to the lowest id, as ``max`` over the released code's ordered dictionary does.

        Args:
            word_ids, lengths: sentences as for [`masked_conditionals`] (no masked entries).
            prefix_lengths: ``{column: k}`` of the prefix tasks; default ``{"task_b": 4, "task_c": 2}``.
        """
        if prefix_lengths is None:
            prefix_lengths = {"task_b": 4, "task_c": 2}
        likelihood, prefixes = self._inside_summaries(word_ids, lengths, list(prefix_lengths.values()), batch_size)
        labels = {"task_a": likelihood.argmax(1)}
        for column, inside in zip(prefix_lengths, prefixes, strict=True):
            labels[column] = np.where(inside.max(1) > 0, inside.argmax(1), UNPARSABLE_LABEL)
        return labels

    def target_conditionals(self, word_ids, positions, lengths=None) -> np.ndarray:
        """``Pr(x_t = . | x_-t)`` at ``positions[i]`` of sentence ``i``: ``(n, n_words)``."""
        ids, lengths = self._as_batch(word_ids, lengths)
        rows = torch.arange(len(ids))
        return self.masked_conditionals(ids, lengths)[rows.numpy(), np.asarray(positions)]

    def entropy_bound(self, word_ids, positions, lengths=None, *, batch_size: int = 256) -> float:
        """Mean of ``-log Pr(x_t | x_-t)`` over the given (sentence, position) pairs, in nats.

        With one masked position per sentence this is the smallest expected MLM loss any model can reach on those
        contexts (it equals the conditional entropy in expectation): the saturation regime's floor.
        """
        ids, lengths = self._as_batch(word_ids, lengths)
        positions = np.asarray(positions)
        cond = self.masked_conditionals(ids, lengths, batch_size=batch_size)
        rows = np.arange(len(ids))
        p = cond[rows, positions, ids.numpy()[rows, positions]]
        return float(-np.log(p).mean())


#: label of tasks B/C when no nonterminal derives the prefix (the released code falls back to ``S1``)
UNPARSABLE_LABEL = 0
#: sentences expanded at once by [`PCFG.sample`]
_SAMPLE_CHUNK = 500_000


def _inverse_cdf_table(probs: np.ndarray) -> np.ndarray:
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


def word_ids_to_tokens(word_ids: np.ndarray) -> np.ndarray:
    """Word indices (``-2`` masked) to token ids of [`make_tokenizer`] without ``[CLS]``/``[SEP]``."""
    word_ids = np.asarray(word_ids)
    return np.where(word_ids == MASKED_WORD, MASK_ID, word_ids + N_SPECIAL)
