"""enlarge: the large model must compute the small model's function; impossible shapes must be refused early."""

import pytest
import torch
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForPreTraining,
    BertForSequenceClassification,
    BertModel,
    GPT2Config,
    GPT2ForSequenceClassification,
    GPT2LMHeadModel,
    GPT2Model,
    RobertaConfig,
)

from hf_flatbias.enlarge import check_enlargeable, enlarge

VOCAB = 37


def bert_config(**overrides):
    sizes = dict(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=24,
        num_labels=3,
    )
    return BertConfig(**{**sizes, **overrides})


def gpt2_config(**overrides):
    sizes = dict(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=24, bos_token_id=0, eos_token_id=0)
    sizes["num_labels"] = 3
    sizes["pad_token_id"] = 0
    return GPT2Config(**{**sizes, **overrides})


@pytest.fixture(autouse=True)
def _seeded_initialisation():
    """Models are built from the global RNG: seed it so each test's weights do not depend on the tests before it."""
    torch.manual_seed(0)


def randomized(model, seed=0):
    """Freshly initialised LayerNorms are (1, 0) and biases 0: perturb everything so no term hides behind a default."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    return model.eval()


BERT_TARGETS = {
    "same": {},
    "wider, more heads": dict(hidden_size=32, num_attention_heads=4, intermediate_size=48),
    "wider heads": dict(hidden_size=32, num_attention_heads=2, intermediate_size=24),
    "deeper": dict(num_hidden_layers=5),
    "everything": dict(
        hidden_size=64, num_attention_heads=8, intermediate_size=96, num_hidden_layers=3, max_position_embeddings=48
    ),
}

GPT2_TARGETS = {
    "same": {},
    "wider, more heads": dict(n_embd=32, n_head=4),
    "wider heads, wider MLP": dict(n_embd=32, n_head=2, n_inner=128),
    "deeper": dict(n_layer=4),
    "everything": dict(n_embd=64, n_head=8, n_inner=192, n_layer=3, n_positions=48),
}


def bert_inputs(seed=1):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (3, 11), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, 8:] = 0
    token_type_ids = torch.randint(0, 2, input_ids.shape, generator=generator)
    return dict(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)


@pytest.mark.parametrize("target", list(BERT_TARGETS), ids=list(BERT_TARGETS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bert_mlm_logits_unchanged(target, dtype):
    small = randomized(BertForMaskedLM(bert_config()).to(dtype))
    large = enlarge(small, bert_config(**BERT_TARGETS[target]))
    inputs = bert_inputs()
    with torch.no_grad():
        expected, got = small(**inputs).logits, large(**inputs).logits
    tolerance = 1e-5 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=0)
    assert large.cls.predictions.decoder.weight is large.bert.embeddings.word_embeddings.weight
    assert large.config.hidden_size == bert_config(**BERT_TARGETS[target]).hidden_size
    assert not large.training


@pytest.mark.parametrize("target", list(GPT2_TARGETS), ids=list(GPT2_TARGETS))
def test_gpt2_causal_lm_logits_unchanged(target):
    small = randomized(GPT2LMHeadModel(gpt2_config()))
    large = enlarge(small, gpt2_config(**GPT2_TARGETS[target]))
    input_ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(large(input_ids).logits, small(input_ids).logits, atol=1e-5, rtol=0)
        # The loss too, which is what a Hessian trace differentiates.
        torch.testing.assert_close(
            large(input_ids, labels=input_ids).loss, small(input_ids, labels=input_ids).loss, atol=1e-6, rtol=0
        )
    assert large.lm_head.weight is large.transformer.wte.weight


def test_gpt2_without_attention_scaling_keeps_logits():
    """With scale_attn_weights=False the longer head must be compensated by 1/m, not 1/sqrt(m)."""
    small = randomized(GPT2LMHeadModel(gpt2_config(scale_attn_weights=False)))
    large = enlarge(small, gpt2_config(scale_attn_weights=False, n_embd=48, n_head=2, n_layer=3))
    input_ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(large(input_ids).logits, small(input_ids).logits, atol=1e-5, rtol=0)


def test_untied_decoder_keeps_logits():
    small = randomized(BertForMaskedLM(bert_config(tie_word_embeddings=False)))
    large = enlarge(small, bert_config(tie_word_embeddings=False, hidden_size=32, num_attention_heads=4))
    assert large.cls.predictions.decoder.weight is not large.bert.embeddings.word_embeddings.weight
    with torch.no_grad():
        torch.testing.assert_close(large(**bert_inputs()).logits, small(**bert_inputs()).logits, atol=1e-5, rtol=0)


def test_bert_hidden_states_are_stacked_copies():
    small = randomized(BertModel(bert_config()))
    large = enlarge(
        small, bert_config(hidden_size=48, num_attention_heads=6, intermediate_size=72, num_hidden_layers=4)
    )
    with torch.no_grad():
        expected = small(**bert_inputs()).last_hidden_state
        got = large(**bert_inputs()).last_hidden_state
    torch.testing.assert_close(got, expected.repeat(1, 1, 3), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "model_class, config_factory, target",
    [
        (BertForSequenceClassification, bert_config, dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=3)),
        (BertForPreTraining, bert_config, dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=3)),
        (GPT2ForSequenceClassification, gpt2_config, dict(n_embd=32, n_head=4, n_layer=3)),
    ],
    ids=["bert-classification", "bert-pretraining", "gpt2-classification"],
)
def test_classification_heads_keep_logits(model_class, config_factory, target):
    small = randomized(model_class(config_factory()))
    large = enlarge(small, config_factory(**target))
    inputs = bert_inputs() if config_factory is bert_config else {"input_ids": bert_inputs()["input_ids"].clamp(min=1)}
    with torch.no_grad():
        small_out, large_out = small(**inputs), large(**inputs)
    names = ["prediction_logits", "seq_relationship_logits"] if model_class is BertForPreTraining else ["logits"]
    for name in names:
        torch.testing.assert_close(getattr(large_out, name), getattr(small_out, name), atol=1e-5, rtol=0)


def test_gpt2_base_model_hidden_states_are_stacked_copies():
    small = randomized(GPT2Model(gpt2_config()))
    large = enlarge(small, gpt2_config(n_embd=32, n_head=4, n_layer=3))
    input_ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = small(input_ids).last_hidden_state
        torch.testing.assert_close(large(input_ids).last_hidden_state, expected.repeat(1, 1, 2), atol=1e-5, rtol=0)


def test_added_layers_are_zero_and_source_is_untouched():
    small = randomized(BertForMaskedLM(bert_config()))
    before = {name: tensor.clone() for name, tensor in small.state_dict().items()}
    large = enlarge(small, bert_config(num_hidden_layers=4))
    for name, tensor in small.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    new_layer = large.bert.encoder.layer[3]
    for name, parameter in new_layer.named_parameters():
        if "LayerNorm" not in name:
            assert torch.count_nonzero(parameter) == 0, name
    # Same architecture, same parameter count as a model built directly from the target config.
    assert large.num_parameters() == BertForMaskedLM(bert_config(num_hidden_layers=4)).num_parameters()


def test_keeps_training_mode_and_dtype():
    small = randomized(GPT2LMHeadModel(gpt2_config())).double().train()
    large = enlarge(small, gpt2_config(n_layer=3))
    assert large.training
    assert next(large.parameters()).dtype == torch.float64


@pytest.mark.parametrize(
    "target, message",
    [
        (dict(hidden_size=24, num_attention_heads=2), "hidden_size=24 must be a positive integer multiple of"),
        (dict(hidden_size=8, num_attention_heads=1), "hidden_size=8 must be a positive integer multiple"),
        (dict(intermediate_size=36), "intermediate size=36 must be a positive integer multiple"),
        (dict(hidden_size=32, num_attention_heads=1), "num_attention_heads=1 must be"),
        (dict(hidden_size=32, num_attention_heads=3), "num_attention_heads=3 must be"),
        (dict(hidden_size=16, num_attention_heads=4), "head dimension=4 must be"),
        (dict(num_hidden_layers=1), "enlarge only adds layers"),
        (dict(vocab_size=VOCAB + 1), "vocab_size"),
        (dict(max_position_embeddings=12), "max_position_embeddings=12 is smaller"),
        (dict(hidden_act="relu"), "hidden_act"),
        (dict(layer_norm_eps=1e-5), "layer_norm_eps"),
    ],
)
def test_bad_target_shapes_are_rejected(target, message):
    small = BertForMaskedLM(bert_config())
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        enlarge(small, bert_config(**target))


def test_other_family_is_rejected():
    with pytest.raises(ValueError, match="only grows a model within its own family"):
        check_enlargeable(bert_config(), gpt2_config())
    with pytest.raises(ValueError, match="enlarge supports model_type"):
        check_enlargeable(RobertaConfig(vocab_size=VOCAB, hidden_size=16, num_attention_heads=2), bert_config())


def test_squared_gradients_matrices_kept_written_vectors_divided():
    """The documented effect on the trace: per-sample squared gradients of matrices are unchanged, those of
    parameters written k times (embeddings, LayerNorms) are divided by k, unreplicated ones are unchanged."""
    small = randomized(BertForMaskedLM(bert_config()).double())
    large = enlarge(small, bert_config(hidden_size=32, num_attention_heads=4, intermediate_size=48))
    inputs = bert_inputs()
    labels = torch.full_like(inputs["input_ids"], -100)
    labels[:, 4] = inputs["input_ids"][:, 4]

    def squared_gradients(model):
        model.zero_grad()
        model(**inputs, labels=labels).loss.backward()
        return {name: float((p.grad**2).sum()) for name, p in model.named_parameters()}

    before, after = squared_gradients(small), squared_gradients(large)
    matrices = [n for n in before if n.startswith("bert.encoder") and n.endswith("dense.weight")]
    matrices += [n for n in before if n.endswith(("query.weight", "key.weight", "value.weight"))]
    assert sum(after[n] for n in matrices) == pytest.approx(sum(before[n] for n in matrices), rel=1e-9)
    for name in ("bert.embeddings.word_embeddings.weight", "bert.embeddings.LayerNorm.weight"):
        assert after[name] == pytest.approx(before[name] / 2, rel=1e-9), name
    assert after["cls.predictions.bias"] == pytest.approx(before["cls.predictions.bias"], rel=1e-9)
