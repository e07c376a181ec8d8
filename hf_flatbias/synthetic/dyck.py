"""Dyck languages: balanced strings over ``k`` bracket pairs, drawn uniformly among those of length ``T``.

Uniform over Dyck words of length ``T`` means uniform over Dyck paths (the up/down shape) times a uniform bracket
type for every opening bracket (closing types follow). Under that distribution ``Pr(x_t = w | x_-t)`` is uniform
over the brackets ``w`` that keep the string balanced. The downstream target of the paper's theorem is the bracket
count (depth) at the masked position.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np


@dataclass
class DyckSample:
    """``word_ids (n, T)``; word ``2i`` opens and ``2i+1`` closes bracket type ``i``."""

    word_ids: np.ndarray


@dataclass
class Dyck:
    """Uniform distribution over balanced strings of ``length`` brackets of ``n_types`` kinds."""

    n_types: int = 2
    length: int = 16

    def __post_init__(self) -> None:
        if self.n_types < 1:
            raise ValueError(f"Dyck needs n_types >= 1, got {self.n_types}.")
        if self.length < 2 or self.length % 2:
            raise ValueError(f"Dyck strings are balanced, so length must be even and >= 2 (got {self.length}).")

    @property
    def n_words(self) -> int:
        return 2 * self.n_types

    def words(self) -> list[str]:
        pairs = ["()", "[]", "{}", "<>"]
        names = []
        for i in range(self.n_types):
            opening, closing = pairs[i] if i < len(pairs) else (f"o{i}", f"c{i}")
            names += [opening, closing]
        return names

    def sample(self, n: int, *, seed: int = 0) -> DyckSample:
        """``n`` strings drawn uniformly, deterministic given ``seed``."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}.")
        rng = np.random.default_rng(seed)
        words = np.empty((n, self.length), dtype=np.int64)
        height = np.zeros(n, dtype=np.int64)
        stacks = np.zeros((n, self.length // 2 + 1), dtype=np.int64)
        for t in range(self.length):
            remaining = self.length - t
            up = _paths(remaining - 1, height + 1)
            down = np.where(height > 0, _paths(remaining - 1, np.maximum(height - 1, 0)), 0)
            go_up = rng.random(n) * (up + down) < up
            bracket = rng.integers(0, self.n_types, n)
            rows = np.arange(n)
            stacks[rows[go_up], height[go_up]] = bracket[go_up]
            closing = stacks[rows, np.maximum(height - 1, 0)]
            words[:, t] = np.where(go_up, 2 * bracket, 2 * closing + 1)
            height = height + np.where(go_up, 1, -1)
        return DyckSample(word_ids=words)

    @staticmethod
    def depth(word_ids: np.ndarray) -> np.ndarray:
        """Number of unmatched opening brackets *before* each position: ``(n, T)``."""
        word_ids = np.asarray(word_ids)
        steps = np.where(word_ids % 2 == 0, 1, -1)
        return np.cumsum(steps, axis=1) - steps

    def is_balanced(self, word_ids: np.ndarray) -> np.ndarray:
        """Whether each row is a Dyck word: ``(n,)`` booleans."""
        out = []
        for row in np.asarray(word_ids):
            stack: list[int] = []
            ok = True
            for w in row:
                if w % 2 == 0:
                    stack.append(int(w) // 2)
                elif not stack or stack.pop() != w // 2:
                    ok = False
                    break
            out.append(ok and not stack)
        return np.array(out)

    def target_conditionals(self, word_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Same as [`masked_conditionals`]: the language interface shared with [`PCFG`] and [`HMM`]."""
        return self.masked_conditionals(word_ids, positions)

    def masked_conditionals(self, word_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Exact ``Pr(x_t = w | x_-t)`` at ``positions[i]`` of row ``i``: ``(n, n_words)``."""
        word_ids = np.asarray(word_ids)
        positions = np.asarray(positions)
        out = np.zeros((len(word_ids), self.n_words))
        for w in range(self.n_words):
            candidate = np.where(word_ids < 0, 0, word_ids)
            candidate[np.arange(len(word_ids)), positions] = w
            out[:, w] = self.is_balanced(candidate)
        return out / out.sum(1, keepdims=True)

    def entropy_bound(self, word_ids: np.ndarray, positions: np.ndarray) -> float:
        """Mean ``-log Pr(x_t | x_-t)`` over one masked position per string: the one-mask MLM loss floor."""
        cond = self.masked_conditionals(word_ids, positions)
        rows = np.arange(len(cond))
        return float(-np.log(cond[rows, np.asarray(word_ids)[rows, positions]]).mean())


@cache
def _path_count(steps: int, height: int) -> int:
    """Paths of ``steps`` +-1 steps from ``height`` to 0 that never go below 0 (ballot numbers)."""
    if height < 0 or height > steps or (steps - height) % 2:
        return 0
    if steps == 0:
        return 1
    return _path_count(steps - 1, height + 1) + (_path_count(steps - 1, height - 1) if height > 0 else 0)


def _paths(steps: int, heights: np.ndarray) -> np.ndarray:
    # Python ints: the counts exceed float precision only far beyond the lengths used here (T <= 32)
    return np.array([float(_path_count(steps, int(h))) for h in heights])
