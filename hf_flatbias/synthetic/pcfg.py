"""Probabilistic context-free grammars in the shape of the paper's synthetic language, with exact conditionals.

The grammar is *levelled*: a root chooses one of several sentence types (level 0); a level-``l`` nonterminal
rewrites into two or more level-``l+1`` nonterminals; the last level's nonterminals emit one word each. Sampling
expands every sentence of a batch one level at a time with numpy, so 100k sentences take seconds.

Exact inference uses one observation: the inside probability ``Z(x)`` of a sentence is linear in the emission
vector ``leaf[t, p] = Pr(word x_t | preterminal p)`` at every position, so the derivative ``dZ/dleaf[t, p]`` is the
outside probability of ``p`` over the span ``[t, t+1)``. One inside pass plus one backward pass therefore gives the
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
class PCFG:
    """A levelled PCFG.

    Attributes:
        level_sizes: number of nonterminals per level; level 0 holds the sentence types, the last level the
            preterminals that emit words.
        root_probs: ``(level_sizes[0],)`` probability of each sentence type.
        rules: for each level ``l < len(level_sizes) - 1``, a list over the level's nonterminals of their rules
            ``(children, probability)``; ``children`` index level ``l + 1``.
        emissions: ``(level_sizes[-1], n_words)`` word distribution of each preterminal.
    """

    level_sizes: tuple[int, ...]
    root_probs: np.ndarray
    rules: list[list[list[tuple[tuple[int, ...], float]]]]
    emissions: np.ndarray

    def __post_init__(self) -> None:
        self.level_sizes = tuple(int(s) for s in self.level_sizes)
        self.root_probs = np.asarray(self.root_probs, dtype=np.float64)
        self.emissions = np.asarray(self.emissions, dtype=np.float64)
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

    def _validate(self) -> None:
        n_levels = len(self.level_sizes)
        if n_levels < 2:
            raise ValueError("A PCFG needs at least two levels: sentence types and preterminals.")
        if self.root_probs.shape != (self.level_sizes[0],) or not np.isclose(self.root_probs.sum(), 1.0):
            raise ValueError("root_probs must have one probability per sentence type and sum to 1.")
        if len(self.rules) != n_levels - 1:
            raise ValueError(f"rules needs one list per level except the preterminals ({n_levels - 1}).")
        for level, level_rules in enumerate(self.rules):
            if len(level_rules) != self.level_sizes[level]:
                raise ValueError(f"rules[{level}] must list the rules of all {self.level_sizes[level]} nonterminals.")
            for symbol, symbol_rules in enumerate(level_rules):
                if not symbol_rules:
                    raise ValueError(f"nonterminal {symbol} of level {level} has no rule.")
                total = sum(p for _, p in symbol_rules)
                if not math.isclose(total, 1.0, abs_tol=1e-6):
                    raise ValueError(f"rules of nonterminal {symbol} of level {level} sum to {total}, not 1.")
                for children, _ in symbol_rules:
                    if len(children) < 2:
                        # a unary rule would let two nodes span the same words and make span labels ambiguous
                        raise ValueError(f"level {level} has a rule {children} with fewer than 2 children.")
                    if min(children) < 0 or max(children) >= self.level_sizes[level + 1]:
                        raise ValueError(f"rule {children} of level {level} points outside level {level + 1}.")
        if self.emissions.shape[0] != self.level_sizes[-1] or not np.allclose(self.emissions.sum(1), 1.0):
            raise ValueError("emissions must have one row per preterminal, each summing to 1.")

    def _build_tables(self) -> None:
        """Padded rule tables for vectorised sampling (inverse CDF per parent)."""
        self._rule_children: list[np.ndarray] = []
        self._rule_parent: list[np.ndarray] = []
        self._rule_prob: list[np.ndarray] = []
        self._rule_cdf: list[np.ndarray] = []
        self._rule_index: list[np.ndarray] = []
        for level_rules in self.rules:
            max_len = max(len(c) for sr in level_rules for c, _ in sr)
            max_rules = max(len(sr) for sr in level_rules)
            children, parent, prob = [], [], []
            index = np.zeros((len(level_rules), max_rules), dtype=np.int64)
            cdf = np.ones((len(level_rules), max_rules))
            for symbol, symbol_rules in enumerate(level_rules):
                ps = np.array([p for _, p in symbol_rules])
                cdf[symbol, : len(ps)] = np.cumsum(ps) / ps.sum()
                for j, (c, p) in enumerate(symbol_rules):
                    index[symbol, j] = len(children)
                    children.append(list(c) + [-1] * (max_len - len(c)))
                    parent.append(symbol)
                    prob.append(p)
                index[symbol, len(symbol_rules) :] = index[symbol, len(symbol_rules) - 1]
            self._rule_children.append(np.array(children, dtype=np.int64))
            self._rule_parent.append(np.array(parent, dtype=np.int64))
            self._rule_prob.append(np.array(prob))
            self._rule_cdf.append(cdf)
            self._rule_index.append(index)
        self._emission_cdf = np.cumsum(self.emissions, axis=1)
        self._emission_cdf[:, -1] = 1.0

    # ------------------------------------------------------------------ names
    @property
    def n_words(self) -> int:
        return self.emissions.shape[1]

    @property
    def n_sentence_types(self) -> int:
        return self.level_sizes[0]

    @property
    def level_offsets(self) -> np.ndarray:
        """Global nonterminal id of the first nonterminal of each level (span labels use global ids)."""
        return np.concatenate([[0], np.cumsum(self.level_sizes)[:-1]])

    def words(self) -> list[str]:
        return [f"w{i}" for i in range(self.n_words)]

    def symbol_name(self, global_id: int) -> str:
        level = int(np.searchsorted(np.cumsum(self.level_sizes), global_id, side="right"))
        return f"N{level}_{global_id - int(self.level_offsets[level])}"

    # ------------------------------------------------------------------ sampling
    def sample(self, n: int, *, seed: int = 0, span_label_lengths: Sequence[int] = (2, 4)) -> PCFGSample:
        """Draw ``n`` sentences, deterministic given ``seed``, with their task labels.

        Args:
            n: number of sentences.
            seed: seed of the draws.
            span_label_lengths: ``k`` for which to record the nonterminal spanning the first ``k`` words.
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}.")
        rng = np.random.default_rng(seed)
        types = np.searchsorted(np.cumsum(self.root_probs), rng.random(n) * self.root_probs.sum(), side="right")
        symbols = np.minimum(types, self.level_sizes[0] - 1)
        sentence = np.arange(n)
        level_symbols, level_parents = [symbols], [None]
        for level in range(len(self.rules)):
            u = rng.random(len(symbols))
            choice = (u[:, None] > self._rule_cdf[level][symbols]).sum(1)
            rule = self._rule_index[level][symbols, np.minimum(choice, self._rule_index[level].shape[1] - 1)]
            children = self._rule_children[level][rule]
            valid = children >= 0
            parents = np.repeat(np.arange(len(symbols)), valid.sum(1))
            symbols = children[valid]
            sentence = sentence[parents]
            level_symbols.append(symbols)
            level_parents.append(parents)
        u = rng.random(len(symbols))
        words = (u[:, None] > self._emission_cdf[symbols]).sum(1)
        words = np.minimum(words, self.n_words - 1)
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
                hit = (start == 0) & (node_length == k)
                labels[node_sentence[hit]] = level_symbols[level][hit] + offsets[level]
            if level > 0:
                node_length = np.bincount(
                    level_parents[level], weights=node_length, minlength=len(level_symbols[level - 1])
                )
                node_length = node_length.astype(np.int64)
        return PCFGSample(word_ids=word_ids, lengths=lengths, sentence_type=types, span_labels=span_labels)

    # ------------------------------------------------------------------ exact inference
    def _inside(self, word_ids: torch.Tensor, lengths: torch.Tensor, *, keep_spans: bool = False):
        """Inside probabilities. Returns ``(Z (b,), leaf (b, T, n_pre) with grad, span matrices per level)``."""
        b, t_max = word_ids.shape
        emissions = torch.as_tensor(self.emissions, dtype=torch.float64)
        observed = word_ids.clamp(min=0)
        leaf = emissions.T[observed]  # (b, T, n_pre)
        leaf = torch.where((word_ids == MASKED_WORD)[..., None], torch.ones_like(leaf), leaf)
        leaf = torch.where((word_ids == PAD_WORD)[..., None], torch.zeros_like(leaf), leaf)
        leaf = leaf.detach().requires_grad_(True)
        bottom = torch.diag_embed(leaf.permute(0, 2, 1), offset=1)  # (b, n_pre, T+1, T+1): spans [t, t+1)
        spans = [None] * len(self.level_sizes)
        spans[-1] = bottom
        if keep_spans:
            bottom.retain_grad()
        for level in range(len(self.level_sizes) - 2, -1, -1):
            child = spans[level + 1]
            children = torch.as_tensor(self._rule_children[level])
            rule_lengths = (children >= 0).sum(1)
            product = child[:, children[:, 0]]
            for j in range(1, children.shape[1]):
                has_child = rule_lengths > j
                extended = product[:, has_child] @ child[:, children[has_child, j]]
                product = product.clone()
                product[:, has_child] = extended
            weights = torch.zeros(len(children), self.level_sizes[level], dtype=torch.float64)
            weights[torch.arange(len(children)), torch.as_tensor(self._rule_parent[level])] = torch.as_tensor(
                self._rule_prob[level]
            )
            spans[level] = torch.einsum("brij,rp->bpij", product, weights)
            if keep_spans:
                spans[level].retain_grad()
        root = torch.as_tensor(self.root_probs, dtype=torch.float64)
        whole = spans[0][torch.arange(b), :, 0, lengths]  # (b, n_types)
        z = whole @ root
        return z, leaf, spans, whole * root

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

    def sentence_probability(self, word_ids, lengths=None, *, batch_size: int = 256) -> np.ndarray:
        """``Pr(x)`` of each sentence (``-2`` entries are marginalised over all words)."""
        ids, lengths = self._as_batch(word_ids, lengths)
        out = []
        for s in range(0, len(ids), batch_size):
            with torch.no_grad():
                z, *_ = self._inside(ids[s : s + batch_size], lengths[s : s + batch_size])
            out.append(z.numpy())
        return np.concatenate(out)

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
        ids, lengths = self._as_batch(word_ids, lengths)
        emissions = torch.as_tensor(self.emissions, dtype=torch.float64)
        out = np.zeros((len(ids), ids.shape[1], self.n_words))
        for s in range(0, len(ids), batch_size):
            chunk, chunk_len = ids[s : s + batch_size], lengths[s : s + batch_size]
            t = int(chunk_len.max())
            # outside probabilities are gradients of the inside pass: needed even when called under no_grad
            with torch.enable_grad():
                z, leaf, _, _ = self._inside(chunk[:, :t], chunk_len)
                if not torch.all(z > 0):
                    raise ValueError("some sentences have probability 0 under this grammar: they cannot come from it.")
                (outside,) = torch.autograd.grad(z.sum(), leaf)
            unnormalised = outside @ emissions  # (b, t, n_words)
            total = unnormalised.sum(-1, keepdim=True)
            cond = torch.where(total > 0, unnormalised / total.clamp(min=1e-300), torch.zeros_like(unnormalised))
            out[s : s + len(chunk), :t] = cond.detach().numpy()
        return out

    def span_label_posterior(self, word_ids, lengths=None, *, span_length: int, batch_size: int = 256) -> np.ndarray:
        """``Pr(a node labelled A spans the first span_length words | x)`` for every global nonterminal ``A``.

        This is the parse-based definition of tasks B and C: the label is well defined for a sentence when the
        posterior puts (almost) all its mass on one nonterminal.

        Returns:
            ``(n, sum(level_sizes))`` array; a row sums to the probability that the span is a constituent at all.
        """
        ids, lengths = self._as_batch(word_ids, lengths)
        out = np.zeros((len(ids), sum(self.level_sizes)))
        offsets = self.level_offsets
        for s in range(0, len(ids), batch_size):
            chunk, chunk_len = ids[s : s + batch_size], lengths[s : s + batch_size]
            t = max(int(chunk_len.max()), span_length)
            if t > chunk.shape[1]:
                chunk = torch.nn.functional.pad(chunk, (0, t - chunk.shape[1]), value=PAD_WORD)
            with torch.enable_grad():
                z, _, spans, _ = self._inside(chunk[:, :t], chunk_len, keep_spans=True)
                z.sum().backward()
            for level, m in enumerate(spans):
                joint = (m * m.grad)[:, :, 0, span_length]
                if level == 0:
                    # a sentence type spans the first words only when it spans the whole sentence
                    joint = joint * (chunk_len == span_length)[:, None]
                post = joint / z[:, None]
                out[s : s + len(chunk), offsets[level] : offsets[level] + self.level_sizes[level]] = post.detach()
        return out

    def sentence_type_posterior(self, word_ids, lengths=None, *, batch_size: int = 256) -> np.ndarray:
        """``Pr(sentence type | x)``: the parse-based label of task A."""
        ids, lengths = self._as_batch(word_ids, lengths)
        out = []
        for s in range(0, len(ids), batch_size):
            with torch.no_grad():
                z, _, _, joint = self._inside(ids[s : s + batch_size], lengths[s : s + batch_size])
            out.append((joint / z[:, None]).numpy())
        return np.concatenate(out)

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


def _node_sentences(level_parents: list, level: int, n: int) -> np.ndarray:
    sentence = np.arange(n)
    for lv in range(1, level + 1):
        sentence = sentence[level_parents[lv]]
    return sentence


def word_ids_to_tokens(word_ids: np.ndarray) -> np.ndarray:
    """Word indices (``-2`` masked) to token ids of [`make_tokenizer`] without ``[CLS]``/``[SEP]``."""
    word_ids = np.asarray(word_ids)
    return np.where(word_ids == MASKED_WORD, MASK_ID, word_ids + N_SPECIAL)
