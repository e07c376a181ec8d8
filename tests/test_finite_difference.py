"""Finite-difference curvature products (`hf_flatbias.flatness.finite_difference`) against the exact ones, and the
settings that choose them. The sharded runs are in `tests/distributed/test_sharded_curvature.py`."""

from __future__ import annotations

import pytest
import torch

from hf_flatbias.flatness.beyond_trace import critical_sharpness
from hf_flatbias.flatness.contexts import TraceContexts
from hf_flatbias.flatness.curvature import CurvatureOperator
from hf_flatbias.flatness.finite_difference import FiniteDifferenceOperator, default_finite_difference_step
from hf_flatbias.flatness.lm import evaluation_mode, measured_parameters
from hf_flatbias.flatness.parameter_space import parameter_space
from hf_flatbias.flatness.spectrum import estimate_top_eigenvalues
from hf_flatbias.measures import MeasureSettings
from tests.helpers.distributed_sam_script import causal_rows, tiny_causal_lm


@pytest.mark.parametrize("matrix", ["hessian", "fisher"])
def test_finite_difference_product_is_near_the_exact_one(matrix):
    model = tiny_causal_lm()
    contexts = TraceContexts.from_rows(causal_rows(), causal=True)
    n = len(contexts)
    with evaluation_mode(model):
        exact = CurvatureOperator(model, contexts, n, measured_parameters(model), matrix=matrix, batch_size=3)
        space = parameter_space(model)
        step = default_finite_difference_step(torch.float32)
        fd = FiniteDifferenceOperator(
            model, contexts, list(range(n)), n, n, space, matrix=matrix, batch_size=3, step=step
        )
        v = torch.randn(exact.dimension, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        v /= v.norm()
        reference, approximate = exact(v), fd(v)
    # along a random vector: 1.9e-3 (Hessian) and 1.5e-3 (Fisher) at h = 3e-4 in float32 (benchmarks/RESULTS.md)
    error = float((approximate - reference).norm() / reference.norm())
    assert error < 5e-3
    # a step far from the chosen one is far worse: the measurement that chose it can tell them apart
    with evaluation_mode(model):
        coarse = FiniteDifferenceOperator(
            model, contexts, list(range(n)), n, n, space, matrix=matrix, batch_size=3, step=0.3
        )
        assert float((coarse(v) - reference).norm() / reference.norm()) > 2 * error


def test_weights_come_back_bit_for_bit_after_products():
    model = tiny_causal_lm()
    before = [p.detach().clone() for p in model.parameters()]
    estimate_top_eigenvalues(model, causal_rows(), matrix="hessian", product="finite_difference", max_iterations=4)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize("matrix", ["hessian", "fisher"])
def test_finite_difference_top_eigenvalue_agrees_with_exact(matrix):
    rows = causal_rows()
    exact = estimate_top_eigenvalues(tiny_causal_lm(), rows, matrix=matrix, product="exact", tol=1e-6)
    fd = estimate_top_eigenvalues(tiny_causal_lm(), rows, matrix=matrix, product="finite_difference", tol=1e-6)
    assert fd.product == "finite_difference" and exact.product == "exact"
    # measured 9e-5 (Hessian) and 8e-6 (Fisher) at the default h
    assert fd.top == pytest.approx(exact.top, rel=5e-4)
    auto = estimate_top_eigenvalues(tiny_causal_lm(), rows, matrix=matrix, max_iterations=3)
    assert auto.product == "exact"  # whole parameters on one process


def test_bad_product_settings_are_refused_before_any_pass():
    model, rows = tiny_causal_lm(), causal_rows()
    with pytest.raises(ValueError, match="product='bogus'"):
        estimate_top_eigenvalues(model, rows, product="bogus")
    with pytest.raises(ValueError, match="finite_difference_step must be"):
        estimate_top_eigenvalues(model, rows, product="finite_difference", finite_difference_step=-1.0)
    for param in model.parameters():  # looks partitioned by ZeRO-3
        param.ds_tensor = param.detach().reshape(-1)
    with pytest.raises(ValueError, match="product='finite_difference'"):
        estimate_top_eigenvalues(model, rows, product="exact")
    with pytest.raises(ValueError, match="eigenvalue_product"):
        MeasureSettings(eigenvalue_product="double")
    with pytest.raises(ValueError, match="eigenvalue_fd_step"):
        MeasureSettings(eigenvalue_fd_step=0.0)
    with pytest.raises(ValueError, match="critical_direction"):
        MeasureSettings(critical_direction="adam")


class _DeepSpeedLikeOptimizer(torch.optim.SGD):
    """An optimizer from DeepSpeed's package that is not ZeRO's (as BF16_Optimizer at stage 0), as far as the measure
    can tell."""


_DeepSpeedLikeOptimizer.__module__ = "deepspeed.runtime.bf16_optimizer"


class _OffloadedZeroOptimizer:
    """What the measure reads of a ZeRO-2 optimizer whose state is offloaded (``offload_optimizer``)."""

    def __init__(self, inner: torch.optim.Optimizer):
        self.optimizer = inner
        self.single_partition_of_fp32_groups: list[torch.Tensor] = []
        self.cpu_offload = True


_OffloadedZeroOptimizer.__module__ = "deepspeed.runtime.zero.stage_1_and_2"


@pytest.mark.parametrize(
    "wrap,message",
    [
        (lambda model: _DeepSpeedLikeOptimizer(model.parameters(), lr=0.1), "needs ZeRO stage 1, 2 or 3"),
        (lambda model: _OffloadedZeroOptimizer(torch.optim.AdamW(model.parameters())), "offload_optimizer"),
    ],
)
def test_critical_sharpness_refuses_what_it_cannot_propose_under_deepspeed_before_computing(wrap, message):
    """DeepSpeed's ZeRO-1/2/3 update is proposed (`tests/distributed/test_sharded_curvature.py`); another DeepSpeed
    optimizer or an offloaded ZeRO one is refused, naming the fix, before any gradient; along -g it still measures."""
    model = tiny_causal_lm()
    optimizer = wrap(model)
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    with pytest.raises(ValueError, match=message) as refused:
        critical_sharpness(
            model, causal_rows(), n_contexts=4, settings=MeasureSettings(), batch_size=4, optimizer=optimizer
        )
    assert "critical_direction='gradient_descent'" in str(refused.value) and not forwards
    descent = MeasureSettings(critical_direction="gradient_descent")
    along_g = critical_sharpness(
        model, causal_rows(), n_contexts=4, settings=descent, batch_size=4, optimizer=optimizer
    )
    plain = critical_sharpness(model, causal_rows(), n_contexts=4, settings=MeasureSettings(), batch_size=4)
    assert along_g.direction == plain.direction == "gradient_descent"
    assert along_g.per_batch == plain.per_batch


def _zero3_trainer(model: torch.nn.Module, optimizer: object | None = None):
    from types import SimpleNamespace

    plugin = SimpleNamespace(deepspeed_config={"zero_optimization": {"stage": 3}})
    return SimpleNamespace(
        accelerator=SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin)),
        model=model,
        args=SimpleNamespace(world_size=2),
        optimizer=optimizer,
    )


def test_callback_takes_the_sharded_measures_under_zero3_and_refuses_the_rest_at_the_start():
    from hf_flatbias.callbacks import HessianTraceCallback

    trainer = _zero3_trainer(tiny_causal_lm())
    descent = {"critical_direction": "gradient_descent"}
    accepted = HessianTraceCallback(also_measure=("top_eigenvalue", "critical_sharpness"), measure_settings=descent)
    accepted.bind_trainer(trainer)
    accepted._check_engine_supports_estimator()
    whole = HessianTraceCallback(also_measure=("top_eigenvalue", "weight_noise"))
    whole.bind_trainer(trainer)
    with pytest.raises(ValueError, match=r"\['weight_noise'\]\) does not support a sharded model"):
        whole._check_engine_supports_estimator()
    along_optimizer = HessianTraceCallback(also_measure=("critical_sharpness",))
    along_optimizer.bind_trainer(trainer)
    along_optimizer._check_engine_supports_estimator()  # ZeRO's update is proposed
    model = tiny_causal_lm()
    along_optimizer.bind_trainer(_zero3_trainer(model, _OffloadedZeroOptimizer(torch.optim.AdamW(model.parameters()))))
    with pytest.raises(ValueError, match="offload_optimizer.*critical_direction"):
        along_optimizer._check_engine_supports_estimator()
