"""Random [`PCFG`]s, the same for the same arguments: the small default grammar and the shape of the paper's released
grammar."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Self

import numpy as np


class RandomPCFGs:
    """The random constructors of [`PCFG`] (``PCFG.from_seed``, ``PCFG.paper_shaped``)."""

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
    ) -> Self:
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
    ) -> Self:
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
