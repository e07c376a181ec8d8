"""Masked contexts: one predicted position per context, seeded, the right token masked and labelled."""

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM

from hf_flatbias.constants import IGNORE_INDEX
from hf_flatbias.flatness.contexts import TraceContexts, build_masked_contexts

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


def test_token_type_ids_go_from_the_rows_through_the_contexts_to_the_model():
    rows = [{**row, "token_type_ids": [0] * 3 + [1] * (len(row["input_ids"]) - 3)} for row in ROWS]
    contexts = build_masked_contexts(rows, mask_token_id=MASK, n_contexts=5, special_token_ids=[CLS, SEP, PAD])
    assert [c["token_type_ids"] for c in contexts] == [rows[i % 2]["token_type_ids"] for i in range(5)]
    assert all("token_type_ids" not in c for c in build_masked_contexts(ROWS, mask_token_id=MASK))

    model = BertForMaskedLM(
        BertConfig(vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8)
    )
    inputs = TraceContexts.from_rows(contexts, causal=False).model_inputs([0, 1], model)
    # trimmed after the last attended token (6 of row 0's 8), then padded to the longest
    assert inputs["token_type_ids"].tolist() == [rows[0]["token_type_ids"][:6], rows[1]["token_type_ids"] + [0] * 2]
    assert inputs["token_type_ids"].dtype == torch.long


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
