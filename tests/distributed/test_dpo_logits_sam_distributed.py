"""Output-layer SAM in trl's DPO under DDP (2 CPU processes over gloo), the policy's trunk run once per micro-batch
and the reference model's log-probabilities computed once per micro-batch: equal to one process on the same global
batch, and to the plain-PyTorch two-forward SAM on that batch.

DPO's loss is the mean over a micro-batch's pairs, and every rank holds the same number of pairs, so DDP's average
of the ranks' gradients is the gradient of the mean over both ranks' pairs: the loss of one process whose
micro-batches hold both ranks' rows, with no correction (no token count crosses the ranks, unlike SFT). SAM's
perturbation is that global gradient's. Measured with a deliberate fault (float64, 2 updates): each rank perturbing
by its own head gradient (``sam_perturbation="per_rank"``) misses the one process by 1.9e-3 (accumulation 1) and
2.3e-3 (2).

trl's fused LM head accumulates in float32 whatever the model's dtype; its rounding depends on the rows a process
holds, and left in place it puts 2 processes 1.2e-8 from 1 (float64, accumulation 1, 2 updates): both runs here
compute that head from the full logits in float64 (`fused_head_in_model_dtype`), and then agree to 2e-16. The
plain-PyTorch reference (`tests.test_trl.dpo_loss_function`) takes its log-softmax in float32, so it is held to
1e-6 (measured 1.5-1.6e-8).

One launch of `tests/helpers/distributed_sam_script.py` runs both cases; the one-process runs are trained here.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("trl")

from tests.distributed.test_distributed import PER_DEVICE, launch, load, max_difference  # noqa: E402
from tests.helpers.distributed_sam_script import (
    base_arguments,
    dpo_trainer,
    fused_head_in_model_dtype,
    trained_parameters,
)  # noqa: E402
from tests.test_logits_sam import reference_head_sam_sgd  # noqa: E402
from tests.test_trl import dpo_loss_function, fresh_model, updates_of  # noqa: E402

pytestmark = pytest.mark.distributed

STEPS = 2  # 16 pairs: 2 updates of 2 micro-batches of 2 pairs on each of 2 ranks
CASES = [
    {
        "name": f"ddp-dpo-head_sam_acc{k}",
        "engine": "ddp",
        "kind": "dpo",
        "args": {"sam_parameters": "output_layer", "max_steps": STEPS, "gradient_accumulation_steps": k},
    }
    for k in (1, 2)
]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    return launch("accelerate_cpu_2proc.yaml", CASES, tmp_path_factory.mktemp("dpo_logits_ddp"))


def one_process_run(tmp_path, case: dict) -> dict[str, dict[str, torch.Tensor]]:
    """The same arguments in this process with both ranks' rows in each micro-batch: the initial and trained
    weights, and the plain-PyTorch two-forward SAM's on the micro-batches its dataloader yields."""
    values = base_arguments(str(tmp_path))
    values.update(case["args"], per_device_train_batch_size=2 * PER_DEVICE)
    with fused_head_in_model_dtype():
        trainer = dpo_trainer(values)
        initial = trained_parameters(fresh_model(trainer))
        loss = dpo_loss_function(fresh_model(trainer).eval(), beta=trainer.args.beta)
        reference = reference_head_sam_sgd(fresh_model(trainer), updates_of(trainer), loss)
        trainer.train()
    weights = {
        "initial": initial,
        "trained": trained_parameters(trainer.model),
        "reference": trained_parameters(reference),
    }
    return weights


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_two_processes_equal_one_process_on_the_global_batch(launched, case, tmp_path):
    two = [load(launched, case["name"], rank)["params"] for rank in (0, 1)]
    one = one_process_run(tmp_path, case)
    micro_batches = STEPS * case["args"]["gradient_accumulation_steps"]
    for rank in (0, 1):
        result = json.loads((launched / f"{case['name']}.rank{rank}.json").read_text())
        assert result["world_size"] == 2
        assert result["first_layer_forwards"] == micro_batches, "one policy trunk forward per micro-batch"
    differences = {name: max_difference(two[0], one[name]) for name in ("trained", "reference", "initial")}
    assert max_difference(two[0], two[1]) == 0.0
    assert differences["trained"] < 1e-10
    assert differences["reference"] < 1e-6
    assert differences["initial"] > 1e-3, "the steps moved the weights"
