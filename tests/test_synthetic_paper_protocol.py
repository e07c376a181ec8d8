"""The paper's synthetic protocol: lexical rules, the released code's labels, exact conditionals at every position,
the paper-shaped grammar and the saturation measure, each against an independent reference."""

from collections import defaultdict
from itertools import product

import numpy as np
import pytest
import torch
from research.saturation import (
    SATURATED_KL,
    measure_saturation,
    model_masked_log_probs,
    saturation,
)
from transformers.modeling_outputs import MaskedLMOutput

from hf_flatbias.synthetic import PCFG, pcfg_sampling
from hf_flatbias.synthetic.data import OracleMLM
from hf_flatbias.synthetic.tokenizer import CLS_ID, MASK_ID, N_SPECIAL, SEP_ID


def lexical_grammar() -> PCFG:
    # lexical rules above the preterminals (a one-word sentence type too), a ternary sentence rule and binary levels
    return PCFG(
        level_sizes=(2, 2, 3),
        root_probs=[0.85, 0.15],  # skewed, so that leaving the prior out (task A) changes some argmaxes
        rules=[
            [[((0, 1), 0.7), ((1, 1), 0.3)], [((1, 0), 0.5), ((0, 0, 1), 0.4)]],
            [[((0, 1), 0.3), ((2, 2), 0.3)], [((1, 2), 0.8), ((2, 0), 0.2)]],
        ],
        emissions=[[0.5, 0.5, 0.0], [0.0, 0.3, 0.7], [0.2, 0.0, 0.8]],
        lexical=[[[0.0, 0.0, 0.0], [0.0, 0.1, 0.0]], [[0.25, 0.0, 0.15], [0.0, 0.0, 0.0]]],
    )


def derivations(g: PCFG, level: int, symbol: int):
    """Every (words, probability) that ``symbol`` of ``level`` derives, by explicit recursion over its rules."""
    last = len(g.level_sizes) - 1
    word_probs = g.emissions[symbol] if level == last else g.lexical[level][symbol]
    for w, p in enumerate(word_probs):
        if p > 0:
            yield (w,), p
    if level == last:
        return
    for children, p_rule in g.rules[level][symbol]:
        for parts in product(*(list(derivations(g, level + 1, c)) for c in children)):
            words, prob = (), p_rule
            for w, p in parts:
                words += w
                prob *= p
            yield words, prob


@pytest.fixture(scope="module")
def brute():
    """Per global symbol, the probability of each word string it derives; and the sentence distribution."""
    g = lexical_grammar()
    derived = []
    for level, size in enumerate(g.level_sizes):
        for symbol in range(size):
            table = defaultdict(float)
            for words, p in derivations(g, level, symbol):
                table[words] += p
            derived.append(dict(table))
    joint = defaultdict(float)
    for t, p_root in enumerate(g.root_probs):
        for words, p in derived[t].items():
            joint[words] += p_root * p
    return g, derived, dict(joint)


def test_lexical_grammar_enumeration_is_a_distribution_and_matches_the_inside_pass(brute):
    g, _, joint = brute
    assert sum(joint.values()) == pytest.approx(1.0, abs=1e-12)
    assert (1,) in joint  # the one-word sentence from the sentence type's lexical rule
    sentences = sorted(joint, key=lambda s: -joint[s])[:300]
    np.testing.assert_allclose(g.sentence_probability(sentences), [joint[s] for s in sentences], rtol=1e-10)


def test_task_labels_equal_brute_force_argmax_over_parses(brute):
    g, derived, joint = brute
    sentences = sorted(joint, key=lambda s: -joint[s])[:300]
    likelihood = np.array([[derived[t].get(s, 0.0) for t in range(g.n_sentence_types)] for s in sentences])
    np.testing.assert_allclose(g.sentence_type_likelihood(sentences), likelihood, rtol=1e-10, atol=1e-300)
    labels = g.task_labels(sentences)
    np.testing.assert_array_equal(labels["task_a"], likelihood.argmax(1))
    assert (likelihood.argmax(1) != (likelihood * g.root_probs).argmax(1)).any()  # the test sees a prior
    for column, k in (("task_b", 4), ("task_c", 2)):
        inside = np.array([[table.get(s[:k], 0.0) if len(s) >= k else 0.0 for table in derived] for s in sentences])
        np.testing.assert_allclose(g.prefix_inside(sentences, prefix_length=k), inside, rtol=1e-10, atol=1e-300)
        expected = np.where(inside.max(1) > 0, inside.argmax(1), 0)
        np.testing.assert_array_equal(labels[column], expected)
        assert (inside.max(1) == 0).any() and (inside.max(1) > 0).any()  # both the fallback and real labels occur


def test_conditionals_at_every_position_equal_brute_force_over_the_word(brute):
    g, _, joint = brute
    sentences = sorted(joint, key=lambda s: -joint[s])[:200]
    cond = g.masked_conditionals(sentences)
    for i, s in enumerate(sentences):
        for t in range(len(s)):
            ref = np.array([joint.get(s[:t] + (w,) + s[t + 1 :], 0.0) for w in range(g.n_words)])
            np.testing.assert_allclose(cond[i, t], ref / ref.sum(), atol=1e-12)
        assert np.all(cond[i, len(s) :] == 0)


def test_sampler_with_lexical_rules_matches_enumeration(brute):
    g, derived, joint = brute
    n = 40_000
    sample = g.sample(n, seed=2)
    counts = defaultdict(int)
    for words in sample.sentences():
        counts[tuple(int(w) for w in words)] += 1
    assert set(counts) <= set(joint)
    for words, p in sorted(joint.items(), key=lambda kv: -kv[1])[:12]:
        assert abs(counts[words] / n - p) < 5 * np.sqrt(p * (1 - p) / n)
    # the generating type derives the sentence; tree span labels name a symbol deriving the prefix
    for i, words in enumerate(sample.sentences()[:2000]):
        key = tuple(int(w) for w in words)
        assert derived[sample.sentence_type[i]].get(key, 0.0) > 0
        for k in (2, 4):
            label = sample.span_labels[k][i]
            if label >= 0:
                assert derived[label].get(key[:k], 0.0) > 0


def test_chunked_sampling_concatenates_consistently(monkeypatch):
    g = PCFG.paper_shaped(1, n_words=30, binary_rules_per_symbol=5, symbols_per_level=4, n_sentence_types=3)
    monkeypatch.setattr(pcfg_sampling, "_SAMPLE_CHUNK", 7)
    sample = g.sample(20, seed=0)
    assert sample.word_ids.shape[0] == 20 and len(sample.lengths) == 20
    np.testing.assert_array_equal((sample.word_ids >= 0).sum(1), sample.lengths)
    assert (g.sentence_probability(sample.sentences()) > 0).all()
    assert all(len(v) == 20 for v in sample.span_labels.values())


def test_paper_shaped_grammar_has_the_released_shape():
    g = PCFG.paper_shaped(0)
    assert g.level_sizes == (9, 10, 10, 10, 10) and g.n_words == 200 and g.n_symbols == 49
    type_children = [sr[0][0] for sr in g.rules[0]]
    assert all(len(sr) == 1 and len(sr[0][0]) == 2 for sr in g.rules[0]) and len(set(type_children)) == 9
    assert not g.lexical[0].any()
    for level in (1, 2, 3):
        for symbol, symbol_rules in enumerate(g.rules[level]):
            assert len(symbol_rules) == 20 and len({c for c, _ in symbol_rules}) == 20
            assert all(len(c) == 2 for c, _ in symbol_rules)
            assert (g.lexical[level][symbol] > 0).sum() == 1
            assert 0.04 <= g.lexical[level][symbol].sum() <= 0.42
    emitters = (g.emissions > 0).sum(0) + sum((m > 0).sum(0) for m in g.lexical)
    assert emitters.min() >= 2 and emitters.max() <= 8
    assert g.max_length == 16
    sample = g.sample(20_000, seed=0)
    assert sample.lengths.min() >= 2 and sample.lengths.max() <= 16
    assert sample.lengths.max() > 12 and (sample.lengths <= 4).any()


def test_grammar_seed_is_separate_from_the_data_seed():
    a, b, c = PCFG.paper_shaped(3), PCFG.paper_shaped(3), PCFG.paper_shaped(4)
    np.testing.assert_array_equal(a.emissions, b.emissions)
    assert a.rules == b.rules and not np.array_equal(a.emissions, c.emissions)
    np.testing.assert_array_equal(a.sample(100, seed=0).word_ids, b.sample(100, seed=0).word_ids)
    assert not np.array_equal(a.sample(100, seed=0).word_ids[:, :2], a.sample(100, seed=1).word_ids[:, :2])


def test_paper_shaped_conditionals_equal_ratios_of_sentence_probabilities():
    # the gradient shortcut against plain forward passes with the word at t substituted, on the real shape
    g = PCFG.paper_shaped(0)
    sample = g.sample(6, seed=5)
    cond = g.masked_conditionals(sample.word_ids, sample.lengths)
    for i, words in enumerate(sample.sentences()):
        for t in {0, len(words) // 2, len(words) - 1}:
            variants = np.repeat(words[None], g.n_words, axis=0)
            variants[:, t] = np.arange(g.n_words)
            p = g.sentence_probability(variants)
            np.testing.assert_allclose(cond[i, t], p / p.sum(), rtol=1e-9, atol=1e-15)


def cky_labels(g: PCFG, words) -> tuple[int, int, int]:
    """Task labels by a plain CKY chart over the rule list (the released code's algorithm), for the test only."""
    offsets = g.level_offsets
    last = len(g.level_sizes) - 1
    n = len(words)
    chart = [[defaultdict(float) for _ in range(n + 1)] for _ in range(n + 1)]
    for t, w in enumerate(words):
        for level, size in enumerate(g.level_sizes):
            probs = g.emissions if level == last else g.lexical[level]
            for s in range(size):
                if probs[s, w] > 0:
                    chart[t][t + 1][offsets[level] + s] += probs[s, w]
    for width in range(2, n + 1):
        for i in range(n - width + 1):
            j = i + width
            for k in range(i + 1, j):
                for level in range(last):
                    for s, symbol_rules in enumerate(g.rules[level]):
                        for (left, right), p in symbol_rules:
                            a = chart[i][k].get(offsets[level + 1] + left, 0.0)
                            b = chart[k][j].get(offsets[level + 1] + right, 0.0)
                            if a and b:
                                chart[i][j][offsets[level] + s] += p * a * b

    def best(cell, candidates):
        scores = [cell.get(c, 0.0) for c in candidates]
        return int(np.argmax(scores)) if max(scores) > 0 else 0

    everything = range(g.n_symbols)
    return (
        best(chart[0][n], range(g.n_sentence_types)),
        best(chart[0][4], everything) if n >= 4 else 0,
        best(chart[0][2], everything),
    )


def test_paper_shaped_labels_equal_a_plain_cky_chart():
    g = PCFG.paper_shaped(2)
    sample = g.sample(200, seed=1)
    keep = [i for i in range(200) if 5 <= sample.lengths[i] <= 8][:6]
    sentences = [sample.sentences()[i] for i in keep]
    labels = g.task_labels(sentences)
    for i, words in enumerate(sentences):
        assert cky_labels(g, [int(w) for w in words]) == (
            labels["task_a"][i],
            labels["task_b"][i],
            labels["task_c"][i],
        )


def test_invalid_lexical_rules_fail_early():
    g = lexical_grammar()
    with pytest.raises(ValueError, match="sum to"):
        PCFG(g.level_sizes, g.root_probs, g.rules, g.emissions, lexical=[np.zeros((2, 3)), np.zeros((2, 3))])
    with pytest.raises(ValueError, match="lexical\\[1\\]"):
        PCFG(g.level_sizes, g.root_probs, g.rules, g.emissions, lexical=[g.lexical[0], np.zeros((3, 3))])
    with pytest.raises(ValueError, match="n_sentence_types"):
        PCFG.paper_shaped(0, n_sentence_types=101)


# ---------------------------------------------------------------------------------------------------- saturation
class FixedLogitsMLM(torch.nn.Module):
    """A masked LM whose logits at a masked position depend only on the position: outputs known in advance."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(table, requires_grad=False)  # (positions, vocabulary)

    def forward(self, input_ids, attention_mask=None, **_):
        logits = self.table[: input_ids.shape[1]].expand(input_ids.shape[0], -1, -1)
        return MaskedLMOutput(logits=logits)


@pytest.fixture(scope="module")
def held_out():
    g = PCFG.paper_shaped(1, n_words=30, binary_rules_per_symbol=6, symbols_per_level=5, n_sentence_types=4)
    sample = g.sample(40, seed=3)
    return g, sample.word_ids, sample.lengths, g.masked_conditionals(sample.word_ids, sample.lengths)


def test_kl_equals_exact_loss_minus_entropy_floor(held_out):
    g, word_ids, lengths, cond = held_out
    table = torch.randn(g.max_length + 2, N_SPECIAL + g.n_words, generator=torch.Generator().manual_seed(0))
    result = measure_saturation(FixedLogitsMLM(table), word_ids, cond, lengths, n_bootstrap=200)
    # independent reference: soft-label cross-entropy of the logits at each masked token, minus the exact entropy
    losses, entropies = [], []
    for i, n in enumerate(lengths):
        for t in range(n):
            target = torch.zeros(N_SPECIAL + g.n_words, dtype=torch.float64)
            target[N_SPECIAL:] = torch.as_tensor(cond[i, t])
            losses.append(torch.nn.functional.cross_entropy(table[t + 1].double()[None], target[None]).item())
            p = cond[i, t][cond[i, t] > 0]
            entropies.append(float(-(p * np.log(p)).sum()))
    assert result.n_positions == len(losses) == lengths.sum()
    assert result.cross_entropy == pytest.approx(np.mean(losses), rel=1e-9)
    assert result.entropy == pytest.approx(np.mean(entropies), rel=1e-9)
    assert result.kl == pytest.approx(np.mean(losses) - np.mean(entropies), rel=1e-9)
    assert result.ci_low <= result.kl <= result.ci_high and result.kl > 1.0 and not result.saturated


def test_uniform_model_kl_is_log_vocabulary_minus_entropy_and_oracle_kl_is_zero(held_out):
    g, word_ids, lengths, cond = held_out
    uniform = FixedLogitsMLM(torch.zeros(g.max_length + 2, N_SPECIAL + g.n_words))
    result = measure_saturation(uniform, word_ids, cond, lengths, n_bootstrap=200)
    assert result.cross_entropy == pytest.approx(np.log(N_SPECIAL + g.n_words), rel=1e-12)
    assert result.kl == pytest.approx(np.log(N_SPECIAL + g.n_words) - result.entropy, rel=1e-12)
    oracle = OracleMLM(g)
    oracle.register_parameter("anchor", torch.nn.Parameter(torch.zeros(1)))  # gives the device to read
    exact = measure_saturation(oracle, word_ids[:8], cond[:8], lengths[:8], n_bootstrap=200)
    assert abs(exact.kl) < 1e-5 and exact.saturated and exact.kl <= SATURATED_KL


def test_masked_rows_put_the_mask_at_each_position(held_out):
    g, word_ids, lengths, _ = held_out
    seen = []

    class Recorder(FixedLogitsMLM):
        def forward(self, input_ids, attention_mask=None, **kw):
            seen.append((input_ids.clone(), attention_mask.clone()))
            return super().forward(input_ids, attention_mask, **kw)

    model_masked_log_probs(Recorder(torch.zeros(g.max_length + 2, N_SPECIAL + g.n_words)), word_ids[:5], lengths[:5])
    rows = torch.cat([torch.nn.functional.pad(r, (0, g.max_length + 2 - r.shape[1])) for r, _ in seen])
    assert len(rows) == lengths[:5].sum()
    assert (
        (rows[:, 0] == CLS_ID).all() and ((rows == MASK_ID).sum(1) == 1).all() and ((rows == SEP_ID).sum(1) == 1).all()
    )
    expected = set()
    for i in range(5):
        for t in range(lengths[i]):
            row = [CLS_ID, *(word_ids[i, : lengths[i]] + N_SPECIAL), SEP_ID]
            row[t + 1] = MASK_ID
            expected.add(tuple(row))
    assert {tuple(int(x) for x in r if x != 0) for r in rows} == expected
    assert all(((ids != 0) == mask.bool()).all() for ids, mask in seen)


def test_bootstrap_interval_resamples_sentences_and_narrows_with_more():
    rng = np.random.default_rng(0)
    n, t, v = 400, 6, 5
    p = rng.dirichlet(np.ones(v), size=(n, t))
    log_q = np.log(rng.dirichlet(np.ones(v) * 5, size=(n, t)))
    lengths = rng.integers(1, t + 1, size=n)
    full = saturation(p, log_q, lengths, n_bootstrap=500)
    small = saturation(p[:50], log_q[:50], lengths[:50], n_bootstrap=500)
    assert full.ci_low < full.kl < full.ci_high
    assert full.ci_high - full.ci_low < small.ci_high - small.ci_low
    # positions past each sentence's end are ignored, whatever they hold
    garbage = log_q.copy()
    garbage[np.arange(t)[None, :] >= lengths[:, None]] = -1e9
    assert saturation(p, garbage, lengths, n_bootstrap=10).kl == pytest.approx(full.kl, rel=1e-12)
    with pytest.raises(ValueError, match="lengths"):
        saturation(p, log_q, np.full(n, t + 1))
