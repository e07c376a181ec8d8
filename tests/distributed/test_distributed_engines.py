"""The engine layer of flatness steps, in-process and fast: config checks, ZeRO-3 partition layout, perturb/restore.

The launched end-to-end checks are in test_distributed.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_flatbias.sharpness.engines import PerturbableParameters, ZeroStage3Parameters
from hf_flatbias.sharpness.layouts import perturbable_parameters
from hf_flatbias.sharpness.support import (
    check_deepspeed_supports_penalty,
    check_deepspeed_supports_sam,
    check_fsdp_supports,
    check_requested_engine_is_active,
    requested_engine,
)


def zero_config(stage: int, **zero) -> dict:
    return {"zero_optimization": {"stage": stage, **zero}, "bf16": {"enabled": False}, "fp16": {"enabled": "auto"}}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp32_configs_are_accepted(stage):
    check_deepspeed_supports_sam(zero_config(stage), "global")
    check_deepspeed_supports_sam({}, "global")  # no zero_optimization section: stage 0


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_per_rank_is_accepted_where_ranks_hold_whole_parameters(stage):
    check_deepspeed_supports_sam(zero_config(stage), "per_rank")


@pytest.mark.parametrize(
    "config,perturbation,match",
    [
        ({"bf16": {"enabled": True}}, "global", "bf16.*enabled': false"),
        ({"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}}, "global", "fp16"),
        (zero_config(3), "per_rank", "sam_perturbation='global'"),
        (zero_config(3, offload_param={"device": "nvme"}), "global", "NVMe"),
        (zero_config(3, zero_hpz_partition_size=2), "global", "zero_hpz_partition_size"),
        (zero_config(3, zero_quantized_weights=True), "global", "zero_quantized_weights"),
    ],
)
def test_configs_that_cannot_be_exact_are_rejected(config, perturbation, match):
    with pytest.raises(ValueError, match=match):
        check_deepspeed_supports_sam(config, perturbation)


def fake_zero3_parameter(full: torch.Tensor, rank: int, world_size: int) -> torch.nn.Parameter:
    """Laid out as ZeRO-3 keeps it: empty data, ``ds_tensor`` = this rank's padded slice of the flat tensor."""
    size = math.ceil(full.numel() / world_size)
    padded = torch.zeros(size * world_size)
    padded[: full.numel()] = full.reshape(-1)
    param = torch.nn.Parameter(torch.empty(0))
    param.ds_tensor = padded[rank * size : (rank + 1) * size].clone()
    return param


class CountingOptimizer:
    def __init__(self):
        self.calls = 0

    def empty_partition_cache(self):
        self.calls += 1


def test_zero3_gradient_shards_tile_the_flat_gradient():
    torch.manual_seed(0)
    shapes = [(3, 5), (7,), (1,)]  # 15 and 7 split unevenly over 2 ranks, 1 leaves rank 1 all padding
    full_params = [torch.randn(s) for s in shapes]
    grads = [torch.randn(s) for s in shapes]
    shards = []
    for rank in (0, 1):
        params = [fake_zero3_parameter(p, rank, 2) for p in full_params]
        shards.append(ZeroStage3Parameters(params, CountingOptimizer(), rank=rank).local_gradients(grads))
    for i, grad in enumerate(grads):
        joined = torch.cat([shards[0][i], shards[1][i]])
        assert torch.equal(joined[: grad.numel()], grad.reshape(-1))
        assert torch.count_nonzero(joined[grad.numel() :]) == 0
    squared = sum(float((s**2).sum()) for rank_shards in shards for s in rank_shards)
    assert squared == pytest.approx(sum(float((g**2).sum()) for g in grads), rel=1e-6)


def test_zero3_perturbs_the_partitions_and_drops_gathered_copies_around_each_edit():
    torch.manual_seed(1)
    full = torch.randn(4, 3)
    grad = torch.randn(4, 3)
    param = fake_zero3_parameter(full, rank=0, world_size=1)
    optimizer = CountingOptimizer()
    perturbable = ZeroStage3Parameters([param], optimizer, rank=0)
    before = param.ds_tensor.clone()

    perturbation = perturbable.perturb([grad], rho=0.1)
    assert optimizer.calls == 1
    expected_step = 0.1 * grad.reshape(-1) / grad.norm()
    torch.testing.assert_close(param.ds_tensor - before, expected_step)
    assert perturbation.norm == pytest.approx(0.1, rel=1e-5)

    perturbation.restore()
    assert optimizer.calls == 2
    assert torch.equal(param.ds_tensor, before)


def test_unpartitioned_parameters_are_refused_for_zero3():
    with pytest.raises(ValueError, match="deepspeed.initialize"):
        ZeroStage3Parameters([torch.nn.Parameter(torch.ones(2))], CountingOptimizer(), rank=0)


def test_plain_parameters_move_along_the_normalised_gradient():
    model = torch.nn.Linear(3, 2)
    model.bias.requires_grad_(False)
    perturbable = perturbable_parameters(model)
    assert type(perturbable) is PerturbableParameters and perturbable.params == [model.weight]
    before = model.weight.detach().clone()
    grad = torch.tensor([[3.0, 0.0, 0.0], [0.0, 4.0, 0.0]])
    perturbation = perturbable.perturb([grad.clone()], rho=0.5)
    torch.testing.assert_close(model.weight.detach() - before, 0.5 * grad / 5.0)
    perturbation.restore()
    assert torch.equal(model.weight.detach(), before)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_penalties_run_under_zero_0_to_2(stage):
    check_deepspeed_supports_penalty(zero_config(stage), "fisher_penalty")


@pytest.mark.parametrize(
    "config,match",
    [(zero_config(3), "ZeRO-3"), ({"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}, "fp32 weights")],
)
def test_penalties_refuse_what_they_cannot_do_exactly(config, match):
    with pytest.raises(ValueError, match=match):
        check_deepspeed_supports_penalty(config, "grad_norm_penalty")


@pytest.mark.parametrize("method", ["none", "sam", "asam", "fisher_penalty", "grad_norm_penalty"])
def test_fsdp2_runs_every_method_but_looksam_with_global_perturbation(method):
    check_fsdp_supports(method, "global", fsdp_version=2)


@pytest.mark.parametrize("method", ["sam", "asam"])
def test_fsdp2_runs_sam_and_asam_with_per_rank_perturbation(method):
    check_fsdp_supports(method, "per_rank", fsdp_version=2)


@pytest.mark.parametrize(
    "method,perturbation,version,match",
    [
        ("grad_norm_penalty", "per_rank", 2, "sam_perturbation='global'"),
        ("fisher_penalty", "per_rank", 2, "'sam' and 'asam'"),
        ("looksam", "global", 2, "'sam'"),
        ("sam", "global", 1, "fsdp_version: 2"),
    ],
)
def test_what_fsdp_cannot_do_exactly_is_refused(method, perturbation, version, match):
    with pytest.raises(ValueError, match=match):
        check_fsdp_supports(method, perturbation, fsdp_version=version)


def test_fsdp2_parameters_must_be_sharded():
    from hf_flatbias.sharpness.engines import FullyShardedParameters

    with pytest.raises(ValueError, match="fsdp_version 2"):
        FullyShardedParameters([torch.nn.Parameter(torch.ones(2))])


@pytest.mark.parametrize(
    "environ,fsdp,deepspeed,expected",
    [
        ({}, None, None, None),
        ({"ACCELERATE_USE_FSDP": "true"}, None, None, "FSDP"),
        ({"ACCELERATE_USE_FSDP": "false"}, None, None, None),
        ({}, True, None, "FSDP"),
        ({"ACCELERATE_USE_DEEPSPEED": "1"}, None, None, "DeepSpeed"),
        ({}, None, "ds_config.json", "DeepSpeed"),
    ],
)
def test_the_requested_engine_comes_from_the_launch_or_the_arguments(environ, fsdp, deepspeed, expected):
    assert requested_engine(environ, fsdp=fsdp, deepspeed=deepspeed) == expected


@pytest.mark.parametrize(
    "requested,active,processes",
    [
        (None, "NO", (1, 1)),
        (None, "MULTI_CPU", (2, 2)),
        ("FSDP", "FSDP", (2, 2)),
        ("DeepSpeed", "DEEPSPEED", (2, 2)),
        ("FSDP", "NO", (1, 1)),  # one process trains the same numbers with or without FSDP
        ("DeepSpeed", "NO", (1, 1)),
    ],
)
def test_engines_that_run_as_requested_are_accepted(requested, active, processes):
    accelerate_processes, launched_processes = processes
    check_requested_engine_is_active(
        requested, active, accelerate_processes=accelerate_processes, launched_processes=launched_processes
    )


@pytest.mark.parametrize(
    "requested,active,processes,match",
    [
        ("FSDP", "NO", (1, 2), "FSDP was requested and 2 processes were launched, but accelerate counts 1"),
        ("DeepSpeed", "DEEPSPEED", (1, 2), "DeepSpeed was requested and 2 processes.*use_cpu=True"),
        (None, "NO", (1, 2), "^2 processes were launched.*Set use_cpu=True"),
        ("FSDP", "MULTI_CPU", (2, 2), "FSDP was requested but accelerate runs MULTI_CPU.*use_cpu=False"),
    ],
)
def test_an_engine_accelerate_did_not_start_is_refused_in_one_line(requested, active, processes, match):
    accelerate_processes, launched_processes = processes
    with pytest.raises(ValueError, match=match) as refused:
        check_requested_engine_is_active(
            requested, active, accelerate_processes=accelerate_processes, launched_processes=launched_processes
        )
    assert "\n" not in str(refused.value) and "docs/guides/training.md" in str(refused.value)
