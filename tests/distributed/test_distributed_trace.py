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
