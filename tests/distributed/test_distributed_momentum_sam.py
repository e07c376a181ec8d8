"""Momentum-SAM on 2 processes (DDP over gloo): the run equals its one-process recurrence on the same global batches
(`reference_momentum_sam` of tests/test_momentum_sam.py, written in plain PyTorch), with AdamW and SGD with momentum,
with gradient accumulation, and after resuming from a checkpoint. The optimizer's state is the same on every rank, so
every rank takes the same perturbation without communication. In float64: in float32 AdamW's update, about
lr * sign(g) where v is small, turns the reduction orders' rounding (DDP's all-reduce against one process's sum) into
differences of 6e-6 after 5 updates (measured), too close to a tolerance that must still tell steps apart; in float64
they are below 1e-12. The launch reuses tests/helpers/distributed_sam_script.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer

from tests.distributed.test_distributed import launch, load, max_difference
from tests.helpers.distributed_sam_script import classification_rows, tiny_classifier
from tests.test_momentum_sam import classifier_loss, reference_momentum_sam, updates_of_rows

pytestmark = pytest.mark.distributed
PER_DEVICE, WORLD, STEPS = 2, 2, 5

ADAMW = {"optim": "adamw_torch", "learning_rate": 0.01, "weight_decay": 0.01}
SGD = {"optim": "sgd", "optim_args": "momentum=0.9", "learning_rate": 0.1}
VARIANTS = {
    "adamw_acc1": {**ADAMW},
    "adamw_acc2": {**ADAMW, "gradient_accumulation_steps": 2},
    "sgd_acc2": {**SGD, "gradient_accumulation_steps": 2},
}
CASES = [
    {
        "name": f"ddp-momentum_sam-{variant}",
        "engine": "ddp",
        "task": "classification_float64",
        "args": {"flatness_method": "momentum_sam", "max_steps": STEPS, **args},
    }
    for variant, args in VARIANTS.items()
] + [
    {
        "name": "ddp-momentum_sam-adamw_acc2-resume",
        "engine": "ddp",
        "task": "classification_float64",
        "args": {"flatness_method": "momentum_sam", "max_steps": STEPS, **VARIANTS["adamw_acc2"]},
        "resume_from_step": 2,
    }
]


def reference(args: dict) -> dict[str, torch.Tensor]:
    model = tiny_classifier().double()
    accumulation = args.get("gradient_accumulation_steps", 1)
    updates = updates_of_rows(
        classification_rows(), steps=STEPS, batch_size=PER_DEVICE * WORLD, accumulation=accumulation
    )
    reference_momentum_sam(
        model,
        updates,
        classifier_loss,
        optimizer="adamw" if args["optim"] == "adamw_torch" else "sgd",
        lr=args["learning_rate"],
        rho=0.05,
        weight_decay=args.get("weight_decay", 0.0),
        decayed=Trainer.get_decay_parameter_names(None, model),
    )
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    return launch("accelerate_cpu_2proc.yaml", CASES, tmp_path_factory.mktemp("momentum_sam_ddp"))


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_ddp_matches_the_one_process_recurrence(ddp_runs, case):
    rank0, rank1 = load(ddp_runs, case["name"], 0), load(ddp_runs, case["name"], 1)
    assert all(torch.equal(rank0["params"][n], rank1["params"][n]) for n in rank0["params"])
    expected = reference(case["args"])
    assert max_difference(rank0["params"], expected) < 1e-12
    if "resume_from_step" in case:  # trained to step 2, saved, resumed from that checkpoint: the same steps
        assert max_difference(rank0["resumed_params"], expected) < 1e-12


def test_the_reference_tells_momentum_sam_from_a_plain_run():
    args = {"flatness_method": "momentum_sam", **VARIANTS["adamw_acc2"]}
    model = tiny_classifier().double()
    updates = updates_of_rows(classification_rows(), steps=STEPS, batch_size=PER_DEVICE * WORLD, accumulation=2)
    reference_momentum_sam(
        model, updates, classifier_loss, optimizer="adamw", lr=0.01, rho=0.0, weight_decay=0.01,
        decayed=Trainer.get_decay_parameter_names(None, model),
    )  # fmt: skip
    plain = {name: p.detach() for name, p in model.named_parameters()}
    assert max_difference(plain, reference(args)) > 1e-4
