"""Masked contexts: one predicted position per context, seeded, the right token masked and labelled."""

import pytest

from hf_flatbias.constants import IGNORE_INDEX
from hf_flatbias.flatness.contexts import build_masked_contexts

MASK, CLS, SEP, PAD = 4, 2, 3, 0
ROWS = [
    {"input_ids": [CLS, 10, 11, 12, 13, SEP, PAD, PAD], "attention_mask": [1, 1, 1, 1, 1, 1, 0, 0]},
    {"input_ids": [CLS, 20, 21, SEP], "attention_mask": [1, 1, 1, 1]},
]


def _labelled(context):
    return [t for t, label in enumerate(context["labels"]) if label != IGNORE_INDEX]


def test_masked_lm_contexts_mask_one_ordinary_token_and_label_it():
    contexts = build_masked_contexts(ROWS, mask_token_id=MASK, n_contexts=40, special_token_ids=[CLS, SEP, PAD])
    assert len(contexts) == 40
    chosen = set()
    for index, context in enumerate(contexts):
        original = ROWS[index % 2]
        (position,) = _labelled(context)
        assert original["attention_mask"][position] == 1
        assert original["input_ids"][position] not in (CLS, SEP, PAD)
        assert context["labels"][position] == original["input_ids"][position]
        assert context["input_ids"][position] == MASK
        others = [t for t in range(len(original["input_ids"])) if t != position]
        assert [context["input_ids"][t] for t in others] == [original["input_ids"][t] for t in others]
        assert context["attention_mask"] == original["attention_mask"]
        chosen.add((index % 2, position))
    # every ordinary position of both rows gets picked somewhere in 40 draws
    assert chosen == {(0, 1), (0, 2), (0, 3), (0, 4), (1, 1), (1, 2)}


def test_contexts_depend_only_on_the_seed():
    first = build_masked_contexts(ROWS, mask_token_id=MASK, n_contexts=20, seed=3)
    assert first == build_masked_contexts(ROWS, mask_token_id=MASK, n_contexts=20, seed=3)
    assert first != build_masked_contexts(ROWS, mask_token_id=MASK, n_contexts=20, seed=4)
    # context i does not depend on how many contexts were asked for
    assert first[:5] == build_masked_contexts(ROWS, mask_token_id=MASK, n_contexts=5, seed=3)


def test_causal_contexts_keep_the_tokens_and_never_predict_the_first():
    contexts = build_masked_contexts(ROWS, mask_token_id=None, causal=True, n_contexts=30)
    for index, context in enumerate(contexts):
        original = ROWS[index % 2]
        (position,) = _labelled(context)
        assert position >= 1
        assert context["input_ids"] == original["input_ids"]
        assert context["labels"][position] == original["input_ids"][position]


def test_bad_rows_raise_clear_errors():
    with pytest.raises(ValueError, match="mask_token_id"):
        build_masked_contexts(ROWS, mask_token_id=None)
    with pytest.raises(ValueError, match="no position that can be predicted"):
        build_masked_contexts([{"input_ids": [CLS, SEP]}], mask_token_id=MASK, special_token_ids=[CLS, SEP])
    with pytest.raises(ValueError, match="no rows"):
        build_masked_contexts([], mask_token_id=MASK)
