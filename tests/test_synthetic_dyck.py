"""Dyck: uniform sampling, membership, conditionals and the bracket-count target, against enumeration."""

from collections import Counter
from itertools import product

import numpy as np
import pytest

from hf_flatbias.synthetic import Dyck, build_dyck_dataset, entropy_bound, masked_contexts


def all_dyck_words(n_types: int, length: int) -> list[tuple[int, ...]]:
    words = []
    for candidate in product(range(2 * n_types), repeat=length):
        stack = []
        for w in candidate:
            if w % 2 == 0:
                stack.append(w)
            elif not stack or stack.pop() != w - 1:
                break
        else:
            if not stack:
                words.append(candidate)
    return words


def test_sampler_is_uniform_over_dyck_words():
    dyck = Dyck(n_types=2, length=6)
    support = all_dyck_words(2, 6)  # 5 shapes x 2^3 bracket types = 40 words
    assert len(support) == 40
    sample = dyck.sample(40_000, seed=0).word_ids
    counts = Counter(map(tuple, sample))
    assert set(counts) == set(support)
    expected = 40_000 / 40
    assert max(abs(c - expected) for c in counts.values()) < 5 * np.sqrt(expected)


def test_membership_depth_and_conditionals():
    dyck = Dyck(n_types=2, length=8)
    sample = dyck.sample(200, seed=1).word_ids
    assert dyck.is_balanced(sample).all()
    assert not dyck.is_balanced(np.array([[0, 3, 2, 1, 0, 1, 0, 1]]))[0]
    np.testing.assert_array_equal(Dyck.depth(np.array([[0, 2, 3, 1]])), [[0, 1, 2, 1]])
    support = set(all_dyck_words(2, 8))
    positions = np.random.default_rng(0).integers(0, 8, len(sample))
    cond = dyck.masked_conditionals(sample, positions)
    for x, t, c in zip(sample, positions, cond, strict=True):
        ref = np.array([tuple(x[:t]) + (w,) + tuple(x[t + 1 :]) in support for w in range(4)], dtype=float)
        np.testing.assert_allclose(c, ref / ref.sum())


def test_dataset_contexts_and_bound():
    dyck = Dyck(n_types=2, length=10)
    ds = build_dyck_dataset(dyck, 16, 64, seed=0)
    contexts = masked_contexts(ds["validation"], seed=0)
    # a single masked bracket is determined by its partner, so the floor is exactly zero
    assert entropy_bound(dyck, contexts) == pytest.approx(0.0, abs=1e-12)
    assert (
        ds["validation"][0]["depth"] == Dyck.depth(np.array([ds["validation"][0]["input_ids"][1:-1]]) - 5)[0].tolist()
    )
    with pytest.raises(ValueError, match="even"):
        Dyck(n_types=1, length=7)
