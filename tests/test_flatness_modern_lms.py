"""per_sample on today's decoder families (RMSNorm, Gemma's (1 + weight) norm and scaled embeddings, rotary
embeddings, grouped-query attention, gated MLPs, tied and untied heads) against the naive loop and exact traces."""

import pytest
import torch
from torch import nn
from transformers import (
    GemmaConfig,
    GemmaForCausalLM,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from hf_flatbias.flatness import TraceContexts, compute_trace_samples, estimate_hessian_trace
from hf_flatbias.flatness.contexts import build_masked_contexts
from hf_flatbias.flatness.exact import exact_fisher_trace
from tests.helpers.tiny_models import TINY_DECODER, randomize_norms

VOCAB = 16
DECODER = TINY_DECODER  # vocabulary of VOCAB words


BUILDERS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**DECODER)),
    "llama_tied": lambda: LlamaForCausalLM(LlamaConfig(**DECODER, tie_word_embeddings=True)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**DECODER, sliding_window=4)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**DECODER)),
    # tied head, embeddings scaled by sqrt(hidden), RMSNorm with (1 + weight)
    "gemma": lambda: GemmaForCausalLM(GemmaConfig(**DECODER, head_dim=4)),
    "gpt_neox": lambda: GPTNeoXForCausalLM(
        GPTNeoXConfig(**{**DECODER, "num_attention_heads": 2, "num_key_value_heads": None})
    ),
}


def _model(name, seed=0):
    torch.manual_seed(seed)
    return randomize_norms(BUILDERS[name]()).eval()


def _rows(n, seed=0):
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(4, 9, (1,), generator=generator))
        rows.append({"input_ids": torch.randint(2, VOCAB, (length,), generator=generator).tolist()})
    return build_masked_contexts(rows, mask_token_id=None, causal=True, seed=seed)


def _draws(model, rows, estimator, **kwargs):
    contexts = TraceContexts.from_rows(rows, causal=True)
    return compute_trace_samples(model, contexts, n_draws=2, estimator=estimator, seed=3, **kwargs).values


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_per_sample_equals_the_naive_loop_draw_for_draw(name):
    model, rows = _model(name), _rows(10)
    naive = _draws(model, rows, "naive")
    ghost = _draws(model, rows, "per_sample", batch_size=4, exact_output_expectation=False)
    torch.testing.assert_close(ghost, naive, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_per_sample_is_within_four_standard_errors_of_the_exact_trace(name):
    for seed in range(3):
        model, rows = _model(name, seed), _rows(24, seed)
        exact = exact_fisher_trace(model, rows)
        estimate = estimate_hessian_trace(model, rows, n_draws=4, seed=seed, batch_size=8)
        assert 0 < estimate.stderr < 0.8 * exact
        assert abs(estimate.mean - exact) / estimate.stderr < 4, (seed, estimate.mean, exact, estimate.stderr)


@pytest.mark.parametrize("name", ["llama", "gemma"])
def test_only_norm_weights_trainable(name):
    """Once an internal autograd error; now the norms alone are measured, equal to the loop and the exact trace."""
    model, rows = _model(name), _rows(12)
    for param_name, p in model.named_parameters():
        p.requires_grad_("norm" in param_name)
    naive = _draws(model, rows, "naive")
    ghost = _draws(model, rows, "per_sample", batch_size=5)
    torch.testing.assert_close(ghost, naive, rtol=1e-4, atol=1e-8)
    assert ghost.mean() > 0
    estimate = estimate_hessian_trace(model, rows, n_draws=4)
    assert abs(estimate.mean - exact_fisher_trace(model, rows)) < 4 * estimate.stderr


class _ShiftedScaleNorm(nn.Module):
    """Looks like an RMSNorm (one vector parameter) but feature i is scaled by weight i-1: not elementwise."""

    def __init__(self, hidden):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, hidden))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight.roll(1)


class _MatrixGate(nn.Module):
    """A learned square matrix applied by hand, outside any Linear."""

    def __init__(self, hidden):
        super().__init__()
        self.gate = nn.Parameter(torch.eye(hidden) + 0.1)

    def forward(self, x):
        return x @ self.gate


class _CountScaledEmbedding(nn.Embedding):
    """An embedding subclass whose output is not a constant multiple of its lookup."""

    def forward(self, ids):
        return super().forward(ids) * (1.0 + ids.unsqueeze(-1).float() / VOCAB)


def test_modules_it_cannot_follow_are_refused_by_name():
    rows = _rows(4)
    model = _model("llama")
    model.model.layers[1].post_attention_layernorm = _ShiftedScaleNorm(8)
    with pytest.raises(
        ValueError, match=r"model\.layers\.1\.post_attention_layernorm\.weight.*not depend.*elementwise"
    ):
        estimate_hessian_trace(model, rows, n_draws=1)
    model = _model("llama")
    model.model.layers[0].mlp.act_fn = nn.Sequential(_MatrixGate(12), nn.SiLU())
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.act_fn\.0\.gate.*estimator='naive'"):
        estimate_hessian_trace(model, rows, n_draws=1)
    model = _model("llama")
    embedding = _CountScaledEmbedding(VOCAB, 8, padding_idx=0)
    embedding.weight = model.model.embed_tokens.weight
    model.model.embed_tokens = embedding
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight.*constant times its lookup"):
        estimate_hessian_trace(model, rows, n_draws=1)
    # the same modules frozen are left out of the trace, and the rest is measured
    for p in model.model.embed_tokens.parameters():
        p.requires_grad_(False)
    assert estimate_hessian_trace(model, rows, n_draws=1).mean > 0
