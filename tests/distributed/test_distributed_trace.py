"""Sharing the trace estimate across processes, in-process parts (the launched checks are in test_distributed.py)."""

from __future__ import annotations

import pytest
import torch

from hf_flatbias.flatness.api import estimate_hessian_trace
from hf_flatbias.flatness.distributed import share_of_contexts
from tests.helpers.distributed_sam_script import masked_rows, tiny_masked_lm


@pytest.mark.parametrize("n,world_size", [(7, 2), (8, 2), (5, 3), (1, 2)])
def test_shares_cover_every_context_once(n, world_size):
    indices = list(range(10, 10 + n))
    shares = [share_of_contexts(indices, rank, world_size, lockstep=False) for rank in range(world_size)]
    measured = sorted(i for share in shares for i in share.indices[: share.n_measured])
    assert measured == indices
    # rank r measures positions r, r + world_size, ... : what gather_trace_samples puts back in order
    for rank, share in enumerate(shares):
        assert share.indices == indices[rank::world_size]


@pytest.mark.parametrize("n,world_size", [(7, 2), (5, 3), (1, 2)])
def test_lockstep_shares_have_equal_length_and_measure_each_context_once(n, world_size):
    indices = list(range(n))
    shares = [share_of_contexts(indices, rank, world_size, lockstep=True) for rank in range(world_size)]
    assert len({len(share.indices) for share in shares}) == 1
    assert sorted(i for share in shares for i in share.indices[: share.n_measured]) == indices


def test_one_process_across_processes_is_the_plain_estimate():
    plain = estimate_hessian_trace(tiny_masked_lm(), masked_rows(), n_draws=2, batch_size=2)
    shared = estimate_hessian_trace(tiny_masked_lm(), masked_rows(), n_draws=2, batch_size=2, across_processes=True)
    assert shared.mean == plain.mean and shared.stderr == plain.stderr


def pretend_zero3_partitioned(model: torch.nn.Module) -> torch.nn.Module:
    for param in model.parameters():
        param.ds_tensor = param.detach().reshape(-1)
    return model


def test_partitioned_model_needs_every_process():
    with pytest.raises(ValueError, match="across_processes=True"):
        estimate_hessian_trace(pretend_zero3_partitioned(tiny_masked_lm()), masked_rows(), n_draws=1)


@pytest.mark.parametrize(
    "settings,match",
    [
        ({"estimator": "hutchinson"}, "parameter-sized on every rank"),
        ({"estimator": "hutchpp", "n_draws": 3}, "parameter-sized on every rank"),
        ({"estimator": "naive", "by_group": True}, "whole gradient"),
    ],
)
def test_what_a_sharded_model_cannot_measure_is_refused_before_any_pass(settings, match):
    from hf_flatbias.flatness import TraceContexts, compute_trace_samples

    model = pretend_zero3_partitioned(tiny_masked_lm())
    model.forward = None  # any pass would fail on this, not with the refusal
    with pytest.raises(ValueError, match=match):
        compute_trace_samples(model, TraceContexts.from_rows(masked_rows(), causal=False), **settings)


def test_the_fisher_diagonal_of_a_sharded_model_is_refused():
    from hf_flatbias.flatness import TraceContexts, compute_trace_samples

    model = pretend_zero3_partitioned(tiny_masked_lm())
    with pytest.raises(ValueError, match="Fisher diagonal"):
        compute_trace_samples(model, TraceContexts.from_rows(masked_rows(), causal=False), diagonal={})


def test_streamed_squared_norm_is_the_squared_norm_of_the_gradient():
    """Each tensor's gradient squared as it forms, tied weights' uses summed first: the plain gradient's norm."""
    from hf_flatbias.flatness.estimators.naive import streamed_squared_norm
    from hf_flatbias.tensors import squared_norm
    from tests.helpers.distributed_sam_script import causal_rows, tiny_causal_lm_float64

    model = tiny_causal_lm_float64()
    model.config.tie_word_embeddings = True
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    params = [p for p in model.parameters() if p.requires_grad]
    row = causal_rows()[0]
    logits = model(input_ids=row["input_ids"][None]).logits[0, 3]
    log_prob = torch.log_softmax(logits, dim=-1)[5]
    reference = squared_norm(torch.autograd.grad(log_prob, params, retain_graph=True), dtype=torch.float64)
    streamed = streamed_squared_norm(log_prob, params)
    assert float(streamed) == pytest.approx(float(reference), rel=1e-13)
    assert all(p.grad is None for p in params)
