"""Hidden Markov models: sampler, exact masked-token conditionals by forward-backward, hidden-state tasks.

``Pr(x_t = w | x_-t)`` is proportional to ``sum_h Pr(h_t = h, x_<t) * E[h, w] * Pr(x_>t | h_t = h)``: the forward
message before position ``t`` pushed through one transition, times the backward message at ``t``. Messages are
renormalised at every step, which rescales each position's conditional by a constant and so leaves it unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .tokenizer import MASKED_WORD


@dataclass
class HMMSample:
    """``word_ids`` and ``states``, both ``(n, length)``; task-k labels are ``states[:, k]``."""

    word_ids: np.ndarray
    states: np.ndarray


@dataclass
class HMM:
    """A discrete HMM with ``initial (H,)``, ``transition (H, H)`` (rows: from) and ``emission (H, V)``."""

    initial: np.ndarray
    transition: np.ndarray
    emission: np.ndarray

    def __post_init__(self) -> None:
        self.initial = np.asarray(self.initial, dtype=np.float64)
        self.transition = np.asarray(self.transition, dtype=np.float64)
        self.emission = np.asarray(self.emission, dtype=np.float64)
        h = len(self.initial)
        if self.transition.shape != (h, h) or self.emission.shape[0] != h:
            raise ValueError("HMM: transition must be (H, H) and emission (H, V) for H = len(initial).")
        for name, m in (("initial", self.initial), ("transition", self.transition), ("emission", self.emission)):
            if (m < 0).any() or not np.allclose(m.sum(-1), 1.0):
                raise ValueError(f"HMM: every row of {name} must be a probability distribution.")

    @classmethod
    def from_seed(
        cls,
        seed: int = 0,
        *,
        n_states: int = 10,
        n_words: int = 40,
        successors: int = 3,
        words_per_state: int = 8,
        concentration: float = 1.0,
    ) -> HMM:
        """A random sparse HMM: each state moves to ``successors`` states and emits ``words_per_state`` words.

        Word sets overlap across states, so a word alone does not reveal its state: the hidden-state tasks need the
        context, as the paper's HMM tasks do.
        """
        if not 1 <= successors <= n_states or not 1 <= words_per_state <= n_words:
            raise ValueError("HMM.from_seed: need 1 <= successors <= n_states and 1 <= words_per_state <= n_words.")
        rng = np.random.default_rng(seed)
        transition = np.zeros((n_states, n_states))
        emission = np.zeros((n_states, n_words))
        for h in range(n_states):
            transition[h, rng.choice(n_states, successors, replace=False)] = rng.dirichlet(
                np.full(successors, concentration)
            )
            emission[h, rng.choice(n_words, words_per_state, replace=False)] = rng.dirichlet(
                np.full(words_per_state, concentration)
            )
        for w in np.flatnonzero(emission.sum(0) == 0):
            h = int(rng.integers(n_states))
            emission[h, w] = emission[h].max()
            emission[h] /= emission[h].sum()
        return cls(initial=np.full(n_states, 1.0 / n_states), transition=transition, emission=emission)

    @property
    def n_states(self) -> int:
        return len(self.initial)

    @property
    def n_words(self) -> int:
        return self.emission.shape[1]

    def words(self) -> list[str]:
        return [f"w{i}" for i in range(self.n_words)]

    def sample(self, n: int, length: int, *, seed: int = 0) -> HMMSample:
        """``n`` sequences of ``length`` words, deterministic given ``seed`` (vectorised over sequences)."""
        if n < 1 or length < 1:
            raise ValueError(f"HMM.sample needs n >= 1 and length >= 1, got n={n}, length={length}.")
        rng = np.random.default_rng(seed)
        trans_cdf = np.cumsum(self.transition, 1)
        emit_cdf = np.cumsum(self.emission, 1)
        states = np.empty((n, length), dtype=np.int64)
        states[:, 0] = _draw(np.broadcast_to(np.cumsum(self.initial), (n, self.n_states)), rng)
        for t in range(1, length):
            states[:, t] = _draw(trans_cdf[states[:, t - 1]], rng)
        words = _draw(emit_cdf[states.reshape(-1)], rng).reshape(n, length)
        return HMMSample(word_ids=words, states=states)

    def _messages(self, word_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Normalised ``prior_t(h) ~ Pr(h_t, x_<t)`` and ``back_t(h) ~ Pr(x_>t | h_t)``, each ``(n, T, H)``."""
        word_ids = np.asarray(word_ids)
        if word_ids.ndim != 2:
            raise ValueError("word_ids must be a 2-D (n, T) array.")
        if ((word_ids < 0) & (word_ids != MASKED_WORD)).any() or word_ids.max() >= self.n_words:
            raise ValueError(f"word_ids must lie in [0, {self.n_words}) or be {MASKED_WORD} (masked).")
        n, length = word_ids.shape
        like = self._likelihoods(word_ids)  # (n, T, H)
        prior = np.empty((n, length, self.n_states))
        back = np.empty_like(prior)
        prior[:, 0] = self.initial
        for t in range(1, length):
            post = prior[:, t - 1] * like[:, t - 1]
            post /= post.sum(1, keepdims=True)
            prior[:, t] = post @ self.transition
        back[:, -1] = 1.0
        for t in range(length - 2, -1, -1):
            msg = (like[:, t + 1] * back[:, t + 1]) @ self.transition.T
            back[:, t] = msg / msg.sum(1, keepdims=True)
        return prior, back

    def _likelihoods(self, word_ids: np.ndarray) -> np.ndarray:
        like = self.emission.T[np.maximum(word_ids, 0)]
        like[word_ids == MASKED_WORD] = 1.0  # a masked word is marginalised
        return like

    def masked_conditionals(self, word_ids: np.ndarray) -> np.ndarray:
        """Exact ``Pr(x_t = w | x_-t)`` at every position: ``(n, T, n_words)``.

        Entries equal to ``-2`` are masked and marginalised; the conditional at a position never depends on the
        word at that position, so one ``-2`` at ``t`` gives the MLM's target distribution at ``t``.
        """
        prior, back = self._messages(word_ids)
        unnormalised = (prior * back) @ self.emission
        return unnormalised / unnormalised.sum(-1, keepdims=True)

    def state_posteriors(self, word_ids: np.ndarray) -> np.ndarray:
        """``Pr(h_t = h | x)`` at every position: ``(n, T, H)``; its max is the Bayes accuracy of task-t."""
        prior, back = self._messages(word_ids)
        like = self._likelihoods(np.asarray(word_ids))
        post = prior * like * back
        return post / post.sum(-1, keepdims=True)

    def target_conditionals(self, word_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """``Pr(x_t = . | x_-t)`` at ``positions[i]`` of sequence ``i``: ``(n, n_words)``."""
        word_ids = np.asarray(word_ids)
        return self.masked_conditionals(word_ids)[np.arange(len(word_ids)), np.asarray(positions)]

    def entropy_bound(self, word_ids: np.ndarray, positions: np.ndarray) -> float:
        """Mean ``-log Pr(x_t | x_-t)`` (nats) over one position per sequence: the one-mask MLM loss floor."""
        word_ids = np.asarray(word_ids)
        cond = self.masked_conditionals(word_ids)
        rows = np.arange(len(word_ids))
        return float(-np.log(cond[rows, positions, word_ids[rows, positions]]).mean())


def _draw(cdf_rows: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One categorical draw per row of cumulative probabilities (inverse CDF)."""
    u = rng.random(len(cdf_rows)) * cdf_rows[:, -1]
    return np.minimum((u[:, None] > cdf_rows).sum(1), cdf_rows.shape[1] - 1)
