"""Functional-SAM and the Adam-preconditioned perturbation on 2 processes (DDP over gloo, DeepSpeed ZeRO-2/3).

BERT's masked LM on rows whose micro-batches and ranks hold unequal label counts: the update's loss is weighted by its
tokens over both ranks, so the run must equal the one-process step on the same 8 rows per micro-batch
(`reference_sam_lm` of tests/test_sam_variants.py, written in plain PyTorch). The launch reuses
tests/helpers/distributed_sam_script.py.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.distributed.test_distributed import launch, load, max_difference
from tests.helpers.distributed_sam_script import token_weighted_rows
from tests.helpers.tiny_models import tiny_mlm
from tests.test_sam_variants import reference_sam_lm

pytestmark = pytest.mark.distributed
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
PER_DEVICE, WORLD, STEPS = 2, 2, 3

VARIANTS = {
    "functional_micro_acc2": {"flatness_method": "functional_sam", "gradient_accumulation_steps": 2},
    "functional_batch_acc2": {
        "flatness_method": "functional_sam",
        "sam_scope": "batch",
        "gradient_accumulation_steps": 2,
    },
    "functional_precond_acc2": {
        "flatness_method": "functional_sam",
        "sam_preconditioner": "adam",
        "optim": "adamw_torch",
        "learning_rate": 1e-2,
        "gradient_accumulation_steps": 2,
    },
    "sam_precond_batch_acc2": {
        "sam_preconditioner": "adam",
        "sam_scope": "batch",
        "optim": "adamw_torch",
        "learning_rate": 1e-2,
        "gradient_accumulation_steps": 2,
    },
}
DDP_CASES = [{"name": f"ddp-{v}", "engine": "ddp", "task": "masked_lm", "args": a} for v, a in VARIANTS.items()]
DEEPSPEED_CASES = [
    {
        "name": f"{engine}-functional_batch_acc2",
        "engine": engine,
        "task": "masked_lm",
        "args": VARIANTS["functional_batch_acc2"],
    }
    for engine in ("zero2", "zero3")
] + [
    {
        "name": "zero2-precond-rejected",
        "engine": "zero2",
        "task": "masked_lm",
        "args": VARIANTS["functional_precond_acc2"],
    }
]


def reference(args: dict) -> dict[str, torch.Tensor]:
    model = tiny_mlm()
    lr = args.get("learning_rate", 0.1)
    optimizer = None
    if args.get("sam_preconditioner") == "adam":
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    reference_sam_lm(
        model,
        token_weighted_rows(),
        steps=STEPS,
        batch_size=PER_DEVICE * WORLD,
        accumulation=args["gradient_accumulation_steps"],
        lr=lr,
        rho=0.05,
        scope=args.get("sam_scope", "micro_batch"),
        causal=False,
        functional=args.get("flatness_method") == "functional_sam",
        optimizer=optimizer,
        precondition=args.get("sam_preconditioner") == "adam",
    )
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    return launch("accelerate_cpu_2proc.yaml", DDP_CASES, tmp_path_factory.mktemp("sam_variants_ddp"))


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory):
    return launch("accelerate_cpu_2proc.yaml", DEEPSPEED_CASES, tmp_path_factory.mktemp("sam_variants_deepspeed"))


@pytest.mark.parametrize("case", DDP_CASES, ids=[c["name"] for c in DDP_CASES])
def test_ddp_matches_the_one_process_reference(ddp_runs, case):
    rank0, rank1 = load(ddp_runs, case["name"], 0), load(ddp_runs, case["name"], 1)
    assert all(torch.equal(rank0["params"][n], rank1["params"][n]) for n in rank0["params"])
    assert max_difference(rank0["params"], reference(case["args"])) < 1e-5


def test_the_reference_tells_functional_sam_from_sam():
    functional = reference(VARIANTS["functional_batch_acc2"])
    sam = reference({**VARIANTS["functional_batch_acc2"], "flatness_method": "sam"})
    assert max_difference(functional, sam) > 1e-5


@pytest.mark.deepspeed
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")
@pytest.mark.parametrize("engine", ["zero2", "zero3"])
def test_deepspeed_functional_sam_matches_the_reference(deepspeed_runs, engine):
    params = load(deepspeed_runs, f"{engine}-functional_batch_acc2")["params"]
    assert max_difference(params, reference(VARIANTS["functional_batch_acc2"])) < 1e-5


@pytest.mark.deepspeed
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")
def test_deepspeed_refuses_the_adam_preconditioner(deepspeed_runs):
    error = (deepspeed_runs / "zero2-precond-rejected.rank0.error").read_text()
    assert "sam_preconditioner='adam' is not supported with DeepSpeed" in error
