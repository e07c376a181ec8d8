"""The trace split by parameter group: groups add up to the total, match exact per-group Fisher traces computed here
(the decoder's own use given its own parameter copies), and per_sample's split equals the naive loop's draw for draw."""

import pytest
import torch
from torch.func import functional_call
from transformers import LlamaConfig, LlamaForCausalLM

from hf_flatbias.flatness import TraceContexts, compute_trace_samples, estimate_hessian_trace
from hf_flatbias.flatness.contexts import build_masked_contexts
from hf_flatbias.flatness.lm import is_causal_lm
from tests.helpers.tiny_models import TINY_DECODER, randomize_norms, wide_masked_lm

VOCAB, MASK = 16, 1


def _llama(seed, tied=False):
    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY_DECODER, "vocab_size": VOCAB}, tie_word_embeddings=tied)
    return randomize_norms(LlamaForCausalLM(config)).eval()


def _bert(seed):
    return wide_masked_lm(seed, vocab_size=VOCAB, num_hidden_layers=2)


def _llama_group(name):
    if name.startswith("model.embed_tokens."):
        return "embeddings"
    if name.startswith("model.layers."):
        return f"block.{name.split('.')[2]}"
    if name.startswith("model.norm."):
        return "final_norm"
    assert name.startswith("lm_head."), name
    return "output_layer"


def _bert_group(name):
    if name.startswith("bert.embeddings."):
        return "embeddings"
    if name.startswith("bert.encoder.layer."):
        return f"block.{name.split('.')[3]}"
    assert name.startswith("cls."), name
    return "head"


MODELS = {
    # builder, decoder module name, expected groups (in order), rule naming each parameter's group
    "llama": (_llama, "lm_head", ["embeddings", "block.0", "block.1", "final_norm", "output_layer"], _llama_group),
    "llama_tied": (
        lambda seed: _llama(seed, tied=True),
        "lm_head",
        ["embeddings", "block.0", "block.1", "final_norm", "output_layer"],
        _llama_group,
    ),
    "bert": (
        _bert,
        "cls.predictions.decoder",
        ["embeddings", "block.0", "block.1", "head", "output_layer"],
        _bert_group,
    ),
}


def _rows(n, causal, seed):
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(4, 9, (1,), generator=generator))
        rows.append({"input_ids": torch.randint(3, VOCAB, (length,), generator=generator).tolist()})
    return build_masked_contexts(rows, mask_token_id=None if causal else MASK, causal=causal, seed=seed)


def _exact_group_traces(model, rows, decoder_name, group_of):
    """Mean over contexts of ``sum_y p_y ||grad_G log p_y||^2`` per group G.

    Every parameter name, tied ones included, gets its own leaf (functional_call without weight tying), so the
    gradient the decoder receives from its own use is a plain gradient: that squared norm is the output-layer term;
    the rest of a tied matrix's squared norm (its other use and the cross term) stays in its owner's group."""
    contexts = TraceContexts.from_rows(rows, causal=is_causal_lm(model))
    names = list(model.named_parameters(remove_duplicate=False))
    owner = {id(p): name for name, p in model.named_parameters()}
    totals: dict[str, float] = {}
    for index in range(len(contexts)):
        leaves = {name: p.detach().clone().requires_grad_(True) for name, p in names}
        outputs = functional_call(model, leaves, (), contexts.model_inputs([index], model), tie_weights=False)
        log_probs = torch.log_softmax(outputs.logits[0, contexts.positions[index]].double(), dim=-1)
        for label in range(VOCAB):
            grads = torch.autograd.grad(log_probs[label], list(leaves.values()), retain_graph=True, allow_unused=True)
            full, own = {}, {}
            for (name, p), g in zip(names, grads, strict=True):
                g = torch.zeros_like(p, dtype=torch.float64) if g is None else g.double()
                full[id(p)] = full.get(id(p), 0) + g
                if name.startswith(decoder_name + "."):
                    own[id(p)] = own.get(id(p), 0) + g
            weight = float(log_probs[label].detach().exp()) / len(contexts)
            for key, g in full.items():
                rest = float(g.square().sum()) - (float(own[key].square().sum()) if key in own else 0.0)
                group = group_of(owner[key])
                totals[group] = totals.get(group, 0.0) + weight * rest
            own_term = sum(float(g.square().sum()) for g in own.values())
            totals["output_layer"] = totals.get("output_layer", 0.0) + weight * own_term
    return totals


@pytest.mark.parametrize("name", sorted(MODELS))
def test_groups_match_exact_per_group_fisher_traces_and_sum_to_the_total(name):
    builder, decoder_name, expected_groups, group_of = MODELS[name]
    for seed in range(2):
        model = builder(seed)
        rows = _rows(16, is_causal_lm(model), seed)
        exact = _exact_group_traces(model, rows, decoder_name, group_of)
        estimate = estimate_hessian_trace(model, rows, n_draws=4, seed=seed, batch_size=6, by_group=True)
        assert list(estimate.by_group) == expected_groups
        assert sum(g.mean for g in estimate.by_group.values()) == pytest.approx(estimate.mean, rel=1e-12)
        for group, part in estimate.by_group.items():
            assert part.stderr > 0, group
            assert abs(part.mean - exact[group]) < 4 * part.stderr, (seed, group, part.mean, exact[group], part.stderr)
        assert sum(exact.values()) == pytest.approx(sum(exact[g] for g in expected_groups), abs=1e-9)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_per_sample_split_equals_the_naive_loop_draw_for_draw(name):
    builder = MODELS[name][0]
    model = builder(3)
    rows = _rows(9, is_causal_lm(model), 3)
    contexts = TraceContexts.from_rows(rows, causal=is_causal_lm(model))
    naive = compute_trace_samples(model, contexts, n_draws=2, estimator="naive", seed=1, by_group=True)
    ghost = compute_trace_samples(
        model, contexts, n_draws=2, seed=1, batch_size=4, by_group=True, exact_output_expectation=False
    )
    assert ghost.group_names == naive.group_names
    torch.testing.assert_close(ghost.group_values, naive.group_values, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(ghost.group_values.sum(dim=2), ghost.values, rtol=1e-12, atol=0)
    # the split leaves the total as it was without it
    plain = compute_trace_samples(model, contexts, n_draws=2, seed=1, batch_size=4, exact_output_expectation=False)
    torch.testing.assert_close(ghost.values, plain.values, rtol=1e-10, atol=1e-12)


def test_a_grouping_function_and_the_opt_in():
    model = _bert(0)
    rows = _rows(8, False, 0)
    assert estimate_hessian_trace(model, rows).by_group is None
    estimate = estimate_hessian_trace(
        model, rows, by_group=lambda name: "attention" if ".attention." in name else "rest", n_draws=2
    )
    assert list(estimate.by_group) == ["rest", "attention", "output_layer"]
    assert sum(g.mean for g in estimate.by_group.values()) == pytest.approx(estimate.mean, rel=1e-12)
    with pytest.raises(ValueError, match="by_group needs a per-context estimator"):
        estimate_hessian_trace(model, rows, estimator="summed", by_group=True)
