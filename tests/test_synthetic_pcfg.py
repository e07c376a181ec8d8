"""PCFG: exact inference against brute-force enumeration of every derivation of a tiny grammar."""

from collections import defaultdict
from itertools import product

import numpy as np
import pytest

from hf_flatbias.synthetic import PCFG, build_pcfg_dataset, entropy_bound, make_tokenizer, masked_contexts
from hf_flatbias.synthetic.data import OracleMLM


def tiny_grammar() -> PCFG:
    # two sentence types over a level whose rules have 2 or 3 children: spans of the first 2 / 4 words vary
    return PCFG(
        level_sizes=(2, 2, 3),
        root_probs=[0.6, 0.4],
        rules=[
            [[((0, 1), 0.7), ((1, 1), 0.3)], [((1, 0), 0.5), ((0, 0, 1), 0.5)]],
            [[((0, 1), 0.4), ((2, 2, 0), 0.6)], [((1, 2), 0.8), ((2, 0), 0.2)]],
        ],
        emissions=[[0.5, 0.5, 0.0], [0.0, 0.3, 0.7], [0.2, 0.0, 0.8]],
    )


def enumerate_derivations(g: PCFG):
    """Every (words, probability, sentence type, constituents) of the grammar, by explicit recursion."""
    offsets = g.level_offsets

    def expand(level, symbol):
        if level == len(g.level_sizes) - 1:
            for w, p in enumerate(g.emissions[symbol]):
                if p > 0:
                    yield (w,), p, [(0, 1, offsets[level] + symbol)]
            return
        for children, p_rule in g.rules[level][symbol]:
            for parts in product(*(list(expand(level + 1, c)) for c in children)):
                words, prob, spans, start = (), p_rule, [], 0
                for w, p, sp in parts:
                    spans += [(a + start, b + start, s) for a, b, s in sp]
                    words += w
                    prob *= p
                    start += len(w)
                yield words, prob, spans + [(0, start, offsets[level] + symbol)]

    for sentence_type, p_root in enumerate(g.root_probs):
        for words, p, spans in expand(0, sentence_type):
            yield words, p_root * p, sentence_type, spans


@pytest.fixture(scope="module")
def tiny():
    g = tiny_grammar()
    joint = defaultdict(float)
    type_joint = defaultdict(lambda: np.zeros(g.level_sizes[0]))
    span_joint = {k: defaultdict(lambda: np.zeros(sum(g.level_sizes))) for k in (2, 4)}
    for words, p, sentence_type, spans in enumerate_derivations(g):
        joint[words] += p
        type_joint[words][sentence_type] += p
        for k in (2, 4):
            for a, b, s in spans:
                if a == 0 and b == k:
                    span_joint[k][words][s] += p
    return g, dict(joint), type_joint, span_joint


def test_brute_force_enumeration_is_a_distribution(tiny):
    _, joint, _, _ = tiny
    assert sum(joint.values()) == pytest.approx(1.0, abs=1e-12)


def test_sentence_probability_matches_enumeration(tiny):
    g, joint, _, _ = tiny
    sentences = list(joint)[:200]
    np.testing.assert_allclose(g.sentence_probability(sentences), [joint[s] for s in sentences], rtol=1e-10)


def test_masked_conditionals_match_enumeration_and_sum_to_one(tiny):
    g, joint, _, _ = tiny
    sentences = list(joint)[:150]
    cond = g.masked_conditionals(sentences)
    for i, s in enumerate(sentences):
        for t in range(len(s)):
            ref = np.array([joint.get(s[:t] + (w,) + s[t + 1 :], 0.0) for w in range(g.n_words)])
            np.testing.assert_allclose(cond[i, t], ref / ref.sum(), atol=1e-12)
        np.testing.assert_allclose(cond[i, : len(s)].sum(-1), 1.0, atol=1e-12)
        assert np.all(cond[i, len(s) :] == 0)


def test_two_masks_marginalise_the_other_position(tiny):
    g, joint, _, _ = tiny
    s = next(x for x in joint if len(x) >= 5)
    masked = list(s)
    masked[1] = -2
    cond = g.masked_conditionals([masked])[0, 3]
    ref = np.zeros(g.n_words)
    for w3 in range(g.n_words):
        for w1 in range(g.n_words):
            x = list(s)
            x[1], x[3] = w1, w3
            ref[w3] += joint.get(tuple(x), 0.0)
    np.testing.assert_allclose(cond, ref / ref.sum(), atol=1e-12)


def test_task_posteriors_match_brute_force_parse(tiny):
    g, joint, type_joint, span_joint = tiny
    sentences = list(joint)[:200]
    np.testing.assert_allclose(
        g.sentence_type_posterior(sentences), [type_joint[s] / joint[s] for s in sentences], atol=1e-12
    )
    for k in (2, 4):
        post = g.span_label_posterior(sentences, span_length=k)
        np.testing.assert_allclose(post, [span_joint[k][s] / joint[s] for s in sentences], atol=1e-12)


def test_sampler_frequencies_and_labels_match_enumeration(tiny):
    g, joint, type_joint, span_joint = tiny
    sample = g.sample(40_000, seed=3)
    counts = defaultdict(int)
    for words in sample.sentences():
        counts[tuple(int(w) for w in words)] += 1
    for words, p in sorted(joint.items(), key=lambda kv: -kv[1])[:10]:
        se = np.sqrt(p * (1 - p) / 40_000)
        assert abs(counts[words] / 40_000 - p) < 5 * se
    # every sampled label is one the brute-force parse gives positive probability, and undefined spans are -1
    for i, words in enumerate(sample.sentences()[:2000]):
        key = tuple(int(w) for w in words)
        assert type_joint[key][sample.sentence_type[i]] > 0
        for k in (2, 4):
            label = sample.span_labels[k][i]
            if label >= 0:
                assert span_joint[k][key][label] > 0
            else:
                assert span_joint[k][key].sum() == 0 or span_joint[k][key].sum() < joint[key] - 1e-15


def test_sampling_is_deterministic_and_seed_dependent():
    g = PCFG.from_seed(1)
    a, b, c = g.sample(50, seed=0), g.sample(50, seed=0), g.sample(50, seed=1)
    np.testing.assert_array_equal(a.word_ids, b.word_ids)
    assert not np.array_equal(a.word_ids[:, :8], c.word_ids[:, :8])
    np.testing.assert_array_equal(PCFG.from_seed(1).emissions, g.emissions)


def test_default_grammar_tasks_are_well_defined():
    g = PCFG.from_seed(0)
    sample = g.sample(150, seed=0)
    assert 8 <= sample.lengths.min() and sample.lengths.max() <= 24
    for k in (2, 4):
        assert (sample.span_labels[k] >= 0).all()
        post = g.span_label_posterior(sample.word_ids, sample.lengths, span_length=k)
        # the span is always a constituent and the parse recovers the generating label almost always
        np.testing.assert_allclose(post.sum(1), 1.0, atol=1e-9)
        assert (post.argmax(1) == sample.span_labels[k]).mean() > 0.9
    assert (g.sentence_type_posterior(sample.word_ids, sample.lengths).argmax(1) == sample.sentence_type).mean() > 0.9


def test_dataset_tokenizer_roundtrip_and_contexts():
    g = PCFG.from_seed(0)
    ds = build_pcfg_dataset(g, 64, 32, seed=5)
    assert ds["train"]["input_ids"] == build_pcfg_dataset(g, 64, 32, seed=5)["train"]["input_ids"]
    tok = make_tokenizer(g.words())
    row = ds["train"][0]
    text = tok.decode(row["input_ids"], skip_special_tokens=True)
    assert tok(text)["input_ids"] == row["input_ids"]
    contexts = masked_contexts(ds["validation"], seed=0)
    for ids, labels, original in zip(
        contexts["input_ids"], contexts["labels"], ds["validation"]["input_ids"], strict=True
    ):
        assert sum(i == tok.mask_token_id for i in ids) == 1
        (pos,) = [i for i, lab in enumerate(labels) if lab != -100]
        assert ids[pos] == tok.mask_token_id and labels[pos] == original[pos] and 0 < pos < len(ids) - 1


def test_oracle_attains_the_entropy_bound_which_beats_unigram():
    import torch

    g = PCFG.from_seed(0)
    ds = build_pcfg_dataset(g, 200, 128, seed=0)
    contexts = masked_contexts(ds["validation"], seed=1)
    bound = entropy_bound(g, contexts)
    tok = make_tokenizer(g.words())
    batch = tok.pad({"input_ids": contexts["input_ids"]}, return_tensors="pt")
    labels = torch.full_like(batch["input_ids"], -100)
    for i, lab in enumerate(contexts["labels"]):
        labels[i, : len(lab)] = torch.as_tensor(lab)
    loss = OracleMLM(g)(batch["input_ids"], labels=labels).loss.item()
    assert loss == pytest.approx(bound, abs=1e-5)
    # the unigram predictor (word marginals from training data) is worse: the language needs context
    counts = np.bincount(np.concatenate([np.asarray(r[1:-1]) - 5 for r in ds["train"]["input_ids"]]), minlength=40)
    unigram = (counts + 1) / (counts + 1).sum()
    targets = np.array([lab[lab != -100][0] for lab in labels.numpy()]) - 5
    assert bound < -np.log(unigram[targets]).mean() - 0.5


def test_bad_grammars_are_rejected():
    with pytest.raises(ValueError, match="fewer than 2 children"):
        PCFG(level_sizes=(1, 1), root_probs=[1.0], rules=[[[((0,), 1.0)]]], emissions=[[1.0]])
    with pytest.raises(ValueError, match="sum to"):
        PCFG(level_sizes=(1, 1), root_probs=[1.0], rules=[[[((0, 0), 0.5)]]], emissions=[[1.0]])
    with pytest.raises(ValueError, match="rule_lengths"):
        PCFG.from_seed(0, level_sizes=(4, 4), rule_lengths=[(2,), (2,)])


def test_masked_word_collator_masks_exactly_one_word_by_default():
    from hf_flatbias.synthetic import MaskedWordCollator
    from hf_flatbias.synthetic.tokenizer import CLS_ID, MASK_ID, PAD_ID, SEP_ID

    rows = [{"input_ids": [CLS_ID, 7, 8, 9, SEP_ID], "task_a": 1}, {"input_ids": [CLS_ID, 6, SEP_ID], "task_a": 0}]
    seen = set()
    collate = MaskedWordCollator(seed=1, task_column="task_a")
    for _ in range(40):
        out = collate(rows)
        assert out["input_ids"][1, 3:].tolist() == [PAD_ID, PAD_ID]
        assert out["attention_mask"].tolist() == [[1] * 5, [1, 1, 1, 0, 0]]
        assert ((out["labels"] != -100).sum(1) == 1).all()  # the paper's one-mask objective
        assert ((out["input_ids"] == MASK_ID) == (out["labels"] != -100)).all()
        assert out["labels"][1, 1] == 6  # the only word of row 2
        seen.add(int((out["labels"][0] != -100).nonzero()))
    assert seen == {1, 2, 3}  # every word of row 1 gets masked, never [CLS]/[SEP]
    assert out["task_labels"].tolist() == [1, 0]
    everything = MaskedWordCollator(1.0)(rows)
    assert everything["input_ids"][0].tolist() == [CLS_ID, MASK_ID, MASK_ID, MASK_ID, SEP_ID]
    with pytest.raises(ValueError, match="mask_probability"):
        MaskedWordCollator(1.5)


def test_masked_word_collator_returns_contiguous_tensors():
    """Models call labels.view(-1): a padded batch built by a transpose must not hand them a transposed tensor."""
    from hf_flatbias.synthetic import MaskedWordCollator

    rows = [{"input_ids": [2, 10, 11, 3]}, {"input_ids": [2, 12, 3]}, {"input_ids": [2, 13, 14, 15, 3]}]
    batch = MaskedWordCollator()(rows)
    assert all(tensor.is_contiguous() for tensor in batch.values())
    batch["labels"].view(-1)


def test_masked_word_collator_pads_labelled_contexts_as_they_are_with_one_label_each():
    from hf_flatbias.constants import IGNORE_INDEX
    from hf_flatbias.synthetic import MaskedWordCollator

    contexts = masked_contexts(build_pcfg_dataset(PCFG.from_seed(0), 1, 12, seed=0)["validation"], seed=1)
    batch = MaskedWordCollator()(list(contexts))
    lengths = [len(row) for row in contexts["input_ids"]]
    assert len(set(lengths)) > 1  # the padding is exercised
    assert batch["input_ids"].shape == (len(contexts), max(lengths))
    for i, (row, labels) in enumerate(zip(contexts["input_ids"], contexts["labels"], strict=True)):
        assert batch["input_ids"][i, : len(row)].tolist() == row and batch["labels"][i, : len(row)].tolist() == labels
        assert batch["attention_mask"][i].tolist() == [1] * len(row) + [0] * (max(lengths) - len(row))
        assert (batch["labels"][i, len(row) :] == IGNORE_INDEX).all()
        assert int((batch["labels"][i] != IGNORE_INDEX).sum()) == 1
