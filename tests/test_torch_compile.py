"""Every flatness method with ``torch_compile=True``: the same parameters as the eager run after 3 updates, or
refused by name when the config is built (``functional_sam``).

The Trainer compiles the model through accelerate (``torch.compile`` on ``accelerator.prepare``); the flatness step
then runs both passes through the compiled module (accelerate's ``unwrap_model`` keeps the compile wrapper), moving
the parameters in place between them. Backend ``aot_eager``: TorchDynamo's capture and guards, AOTAutograd's joint
forward/backward graph and its in-place parameter handling, the parts a flatness step leans on, without inductor's
C++ code generation (on these shared 2-core machines one inductor compile of a tiny function takes over a minute; the
numbers inductor's fused kernels give would differ from eager by float32 rounding, not by the step's logic). In
float64, so that the comparison is of the step and not of rounding: eager and compiled agree to ~1e-15, held to 1e-10.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from hf_flatbias import FlatBiasTrainer
from hf_flatbias.config import TORCH_COMPILE_REFUSALS
from hf_flatbias.sharpness.methods.table import FLATNESS_METHODS
from tests.helpers.tiny_models import classification_rows, flatbias_config, tiny_classifier

METHODS = {
    "none": {"flatness_method": "none"},
    "sam": {"flatness_method": "sam", "sam_rho": 0.05},
    "sam_batch": {"flatness_method": "sam", "sam_rho": 0.05, "sam_scope": "batch"},
    "sam_parameters": {"flatness_method": "sam", "sam_rho": 0.05, "sam_parameters": "classifier.*"},
    "asam": {"flatness_method": "asam", "sam_rho": 0.5},
    "looksam": {"flatness_method": "looksam", "sam_rho": 0.05, "sam_every_k": 2},
    "fisher_penalty": {"flatness_method": "fisher_penalty", "penalty_lambda": 0.1},
    "grad_norm_penalty": {"flatness_method": "grad_norm_penalty", "penalty_lambda": 0.02, "penalty_fd_step": 0.05},
    # five updates: the first, before the optimizer has a momentum, takes no perturbation
    "momentum_sam": {"flatness_method": "momentum_sam", "sam_rho": 0.05, "optim_args": "momentum=0.9", "max_steps": 5},
}


def trained_parameters(tmp_path, monkeypatch, overrides, **compile_args) -> dict[str, torch.Tensor]:
    # transformers puts the backend in os.environ for accelerate; monkeypatch restores it for the next test
    for name in ("ACCELERATE_DYNAMO_BACKEND", "ACCELERATE_DYNAMO_MODE", "ACCELERATE_DYNAMO_USE_DYNAMIC"):
        monkeypatch.delenv(name, raising=False)
    args = flatbias_config(
        tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, **overrides, **compile_args
    )
    trainer = FlatBiasTrainer(model=tiny_classifier().double(), args=args, train_dataset=classification_rows())
    counters["stats"].clear()
    trainer.train()
    if compile_args:  # the run went through TorchDynamo, not silently eager
        assert hasattr(trainer.model_wrapped, "_orig_mod") and counters["stats"]["unique_graphs"] > 0
    module = trainer.accelerator.unwrap_model(trainer.model_wrapped, keep_torch_compile=False)
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def test_every_method_is_tested_here_or_refused_with_compile():
    assert {overrides["flatness_method"] for overrides in METHODS.values()} | set(TORCH_COMPILE_REFUSALS) == set(
        FLATNESS_METHODS
    )


@pytest.mark.parametrize("compile_args", [{"torch_compile": True}, {"torch_compile_backend": "aot_eager"}])
def test_functional_sam_is_refused_with_compile_before_training(tmp_path, compile_args):
    """Its first pass differentiates the loss with respect to the logits the model returns; a compiled forward
    (measured with aot_eager) returns both from one graph, and ``torch.autograd.grad`` found them unconnected."""
    with pytest.raises(ValueError, match="flatness_method='functional_sam' is not supported with torch_compile") as no:
        flatbias_config(tmp_path, flatness_method="functional_sam", **compile_args)
    assert "\n" not in str(no.value) and "torch_compile=False" in str(no.value)


# sam and a penalty run by default; the other methods' compiled steps are the same check, slower
@pytest.mark.parametrize(
    "method",
    [
        name if name in ("none", "sam", "fisher_penalty") else pytest.param(name, marks=pytest.mark.slow)
        for name in METHODS
    ],
)
def test_compiled_training_takes_the_eager_steps(tmp_path, monkeypatch, method):
    torch._dynamo.reset()
    eager = trained_parameters(tmp_path / "eager", monkeypatch, METHODS[method])
    compiled = trained_parameters(
        tmp_path / "compiled", monkeypatch, METHODS[method], torch_compile=True, torch_compile_backend="aot_eager"
    )
    assert eager.keys() == compiled.keys()
    difference = max(float((eager[name] - compiled[name]).abs().max()) for name in eager)
    assert difference < 1e-10
