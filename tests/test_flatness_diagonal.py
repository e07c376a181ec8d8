"""The Fisher diagonal against references computed independently: a plain backward per draw, the exact Fisher."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from hf_flatbias.flatness import build_masked_contexts, estimate_fisher_diagonal, estimate_hessian_trace
from hf_flatbias.flatness.exact import exact_fisher_diagonal
from tests.helpers.tiny_models import TINY_DECODER, randomize_norms, wide_masked_lm

VOCAB, MASK = 14, 1


def _rows(n_rows, vocab, seed=0):
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n_rows):
        length = int(torch.randint(4, 9, (1,), generator=generator))
        rows.append({"input_ids": torch.randint(2, vocab, (length,), generator=generator).tolist()})
    return rows


def _bert(tied=True):
    return wide_masked_lm(0, vocab_size=VOCAB, tie_word_embeddings=tied)


def _gpt2():
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_embd=8, n_layer=1, n_head=2, n_positions=16, initializer_range=0.4,
        bos_token_id=2, eos_token_id=2, attn_implementation="eager",
    )  # fmt: skip
    return GPT2LMHeadModel(config).eval()


def _llama(tied=True):
    torch.manual_seed(0)
    return randomize_norms(LlamaForCausalLM(LlamaConfig(**TINY_DECODER, tie_word_embeddings=tied))).eval()


MODELS = {"bert_tied": _bert, "bert_untied": lambda: _bert(False), "gpt2": _gpt2, "llama_tied": _llama}


def _contexts(model, n, seed=0):
    causal = not model.config.model_type == "bert"
    rows = _rows(n, model.config.vocab_size, seed)
    return build_masked_contexts(rows, mask_token_id=None if causal else MASK, causal=causal, seed=seed)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_per_sample_diagonal_equals_a_plain_backward_per_draw(name):
    # sampled output terms: draw for draw the squares of the gradients a plain backward gives, tied weights included
    model = MODELS[name]()
    contexts = _contexts(model, 10)
    options = dict(n_draws=3, seed=4, exact_output_expectation=False, batch_size=4)
    fast = estimate_fisher_diagonal(model, contexts, **options)
    reference = estimate_fisher_diagonal(model, contexts, estimator="naive", **options)
    assert fast.diagonal.keys() == reference.diagonal.keys()
    # some entries are zero but for rounding (a key bias: softmax ignores a shift): the scale is the whole diagonal's
    scale = max(float(value.abs().max()) for value in reference.diagonal.values())
    for key, value in reference.diagonal.items():
        torch.testing.assert_close(fast.diagonal[key], value, rtol=1e-4, atol=1e-7 * scale, msg=key)
    # the same draws as the trace: the diagonal sums to it. With the diagonal, the trace's per-sample norms come from
    # the squared per-sample gradients, without it from Gram matrices: two float32 routes to the same numbers
    trace = estimate_hessian_trace(model, contexts, **options)
    assert fast.trace.mean == pytest.approx(trace.mean, rel=1e-6)
    assert fast.trace.stderr == pytest.approx(trace.stderr, rel=1e-5)
    grouped = estimate_hessian_trace(model, contexts, by_group=True, **options).by_group
    for group, part in fast.trace.by_group.items():
        assert part.mean == pytest.approx(grouped[group].mean, rel=1e-5, abs=1e-6 * trace.mean), group
    assert fast.total == pytest.approx(trace.mean, rel=1e-6)


def test_output_layer_diagonal_is_exact_in_expectation():
    # with only the (untied) decoder trainable, its own terms are all there is, and they are taken in expectation:
    # the estimate is the exact Fisher diagonal, whatever the draws
    model = _bert(tied=False)
    decoder = model.get_output_embeddings()
    for param in model.parameters():
        param.requires_grad_(False)
    for param in decoder.parameters():
        param.requires_grad_(True)
    contexts = _contexts(model, 6)
    estimate = estimate_fisher_diagonal(model, contexts, n_draws=1, seed=1)
    exact = exact_fisher_diagonal(model, contexts)
    assert estimate.diagonal.keys() == exact.keys()
    for key, value in exact.items():
        torch.testing.assert_close(estimate.diagonal[key], value, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("name", ["bert_tied", pytest.param("llama_tied", marks=pytest.mark.slow)])
def test_diagonal_converges_to_the_exact_fisher_diagonal(name):
    model = MODELS[name]()
    contexts = _contexts(model, 4)
    estimate = estimate_fisher_diagonal(model, contexts, n_draws=3000, seed=0)
    exact = exact_fisher_diagonal(model, contexts)
    # per layer: the sums are averages of 12,000 draws; 3% is many standard errors for a wrong formula (a missed
    # cross term or factor), a few for the right one (measured 0.1-0.5% on these models)
    for layer, value in estimate.by_layer.items():
        reference = sum(float(exact[f"{layer}.{n}"].sum()) for n, _ in model.get_submodule(layer).named_parameters(
            recurse=False) if f"{layer}.{n}" in exact)  # fmt: skip
        assert value == pytest.approx(reference, rel=0.03, abs=1e-4 * sum(estimate.by_layer.values())), layer
    # elementwise on the largest parameter
    key = max(exact, key=lambda k: exact[k].numel())
    relative = (estimate.diagonal[key] - exact[key]).norm() / exact[key].norm()
    assert relative < 0.05


def test_summaries_add_up_and_bad_estimators_are_refused():
    model = _bert()
    contexts = _contexts(model, 8)
    estimate = estimate_fisher_diagonal(model, contexts, n_draws=2)
    assert sum(estimate.by_layer.values()) == pytest.approx(estimate.total, rel=1e-9)
    assert sum(part.mean for part in estimate.trace.by_group.values()) == pytest.approx(estimate.trace.mean)
    assert "output_layer" in estimate.trace.by_group
    assert set(estimate.diagonal) == {n for n, p in model.named_parameters() if p.requires_grad}
    with pytest.raises(ValueError, match="per_sample"):
        estimate_fisher_diagonal(model, contexts, estimator="hutchinson")


@pytest.mark.parametrize("input_is_left", [False, True])
def test_positions_with_a_zero_output_gradient_are_left_out_of_the_products(input_is_left):
    from hf_flatbias.flatness.ghost import OuterFactors
    from hf_flatbias.flatness.ghost_diagonal import _reaching_positions

    generator = torch.Generator().manual_seed(0)
    inputs, gradient = torch.randn(3, 6, 4, generator=generator), torch.randn(3, 6, 5, generator=generator)
    # sample 0 reaches two positions, sample 1 one, sample 2 none; position 5 of sample 1 has a zero input only
    reaching = torch.tensor([[0, 1, 0, 0, 1, 0], [0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    gradient = gradient * reaching.unsqueeze(2)
    inputs[1, 5] = 0.0
    factors = OuterFactors(left=inputs, right=gradient) if input_is_left else OuterFactors(left=gradient, right=inputs)
    kept = _reaching_positions(factors, input_is_left=input_is_left)
    assert kept.left.shape[1] == kept.right.shape[1] == 2
    full = torch.einsum("btr,btc->brc", factors.left, factors.right)
    torch.testing.assert_close(torch.einsum("btr,btc->brc", kept.left, kept.right), full, rtol=0, atol=0)
    # nothing reaches in any sample: no positions; every position reaches: the same factors
    none = _reaching_positions(OuterFactors(left=torch.zeros(2, 3, 4), right=torch.ones(2, 3, 5)), input_is_left=False)
    assert none.left.shape[1] == 0
    assert _reaching_positions(factors, input_is_left=not input_is_left) is factors
