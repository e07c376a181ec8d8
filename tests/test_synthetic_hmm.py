"""HMM: forward-backward conditionals and posteriors against enumeration of every hidden path."""

from itertools import product

import numpy as np
import pytest

from hf_flatbias.synthetic import HMM, build_hmm_dataset, entropy_bound, masked_contexts


@pytest.fixture(scope="module")
def small():
    hmm = HMM.from_seed(2, n_states=3, n_words=4, successors=2, words_per_state=3)
    length = 4
    joint = np.zeros((hmm.n_words,) * length)  # Pr(x)
    state_joint = np.zeros((hmm.n_words,) * length + (length, hmm.n_states))  # Pr(x, h_t = h)
    for states in product(range(hmm.n_states), repeat=length):
        p_states = hmm.initial[states[0]] * np.prod(
            [hmm.transition[a, b] for a, b in zip(states, states[1:], strict=False)]
        )
        for words in product(range(hmm.n_words), repeat=length):
            p = p_states * np.prod([hmm.emission[h, w] for h, w in zip(states, words, strict=True)])
            joint[words] += p
            for t, h in enumerate(states):
                state_joint[words + (t, h)] += p
    return hmm, joint, state_joint


def test_conditionals_match_enumeration(small):
    hmm, joint, _ = small
    words = hmm.sample(50, 4, seed=0).word_ids
    cond = hmm.masked_conditionals(words)
    for i, x in enumerate(words):
        for t in range(4):
            index = list(x)
            index[t] = slice(None)
            ref = joint[tuple(index)]
            np.testing.assert_allclose(cond[i, t], ref / ref.sum(), atol=1e-12)
    np.testing.assert_allclose(cond.sum(-1), 1.0, atol=1e-12)


def test_masked_word_is_marginalised(small):
    hmm, joint, _ = small
    x = hmm.sample(1, 4, seed=1).word_ids[0]
    masked = x.copy()
    masked[0] = -2
    ref = joint[:, x[1], :, x[3]].sum(0)
    np.testing.assert_allclose(hmm.masked_conditionals(masked[None])[0, 2], ref / ref.sum(), atol=1e-12)


def test_state_posteriors_match_enumeration(small):
    hmm, joint, state_joint = small
    words = hmm.sample(40, 4, seed=2).word_ids
    post = hmm.state_posteriors(words)
    for i, x in enumerate(words):
        np.testing.assert_allclose(post[i], state_joint[tuple(x)] / joint[tuple(x)], atol=1e-12)


def test_sampler_frequencies_match_enumeration(small):
    hmm, joint, _ = small
    words = hmm.sample(30_000, 4, seed=3).word_ids
    flat = np.ravel_multi_index(words.T, joint.shape)
    freq = np.bincount(flat, minlength=joint.size) / len(flat)
    top = np.argsort(joint.ravel())[-8:]
    se = np.sqrt(joint.ravel()[top] * (1 - joint.ravel()[top]) / len(flat))
    assert np.all(np.abs(freq[top] - joint.ravel()[top]) < 5 * se)


def test_dataset_and_entropy_bound():
    hmm = HMM.from_seed(0)
    ds = build_hmm_dataset(hmm, 32, 200, length=12, seed=0)
    assert len(ds["train"][0]["input_ids"]) == 14 and len(ds["train"][0]["states"]) == 12
    contexts = masked_contexts(ds["validation"], seed=0)
    bound = entropy_bound(hmm, contexts)
    # no predictor can beat the truth, and the truth beats the marginal word distribution by a margin
    marginal = np.full(hmm.n_states, 1 / hmm.n_states) @ hmm.emission
    targets = np.array([r[r != -100][0] for r in map(np.asarray, contexts["labels"])]) - 5
    assert 0 < bound < -np.log(marginal[targets]).mean() - 0.2
    with pytest.raises(ValueError, match="n >= 1"):
        hmm.sample(0, 5)
