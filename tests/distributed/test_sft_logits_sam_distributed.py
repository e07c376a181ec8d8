"""Output-layer SAM in trl's SFT under DDP (2 CPU processes over gloo), the trunk run once per micro-batch and the
head's gradients formed in its forward (`hf_flatbias.sharpness.head_gradients.label_log_probs`, never trl's fused
kernel): equal to one process on the same global batch, and to the plain-PyTorch two-forward SAM on that batch.

The completion-only loss is summed over a micro-batch's trained tokens and divided by ``num_items_in_batch``, which
the Trainer counts over every rank's micro-batches of the update (``average_tokens_across_devices``, on by default);
trl then multiplies the loss by the number of processes, because DDP averages the ranks' gradients. So each update's
gradient is the global batch's summed token loss over its global token count: the loss of one process whose
micro-batches hold both ranks' rows, with no correction, and SAM's perturbation is that global gradient's. Measured
with deliberate faults (float64, 2 updates): the ranks' token counts kept rank-local
(``average_tokens_across_devices=False``) miss the one process by 1.3e-2 (accumulation 1) and 1.6e-3 (2), so the
ranks' micro-batches do hold unequal trained tokens; the head's first gradient left unaveraged across the ranks
(each rank perturbing by its own) by 3.0e-3 and 1.2e-3; the fault-free run by 3e-17.

Under ZeRO-3 the head's gradients stay in trl's head (the trunk is still replayed), which the launched script computes
from float64 logits (`fused_head_in_model_dtype`: trl's kernel accumulates in float32). DeepSpeed keeps the
optimizer's master weights in float32 and writes them back into the float64 model, so the trained weights are
float32 numbers (checked) and the one process without an engine is a float64 trajectory: they differ by float32
rounding, measured 1.05e-7 (accumulation 1) and 9.5e-8 (2), 1.19e-7 after rounding the one process's weights to
float32, against 1.3e-2 and 3.0e-3 for the DDP faults above. They are held to 2 float32 units of each tensor's
largest weight per update (4; measured 0.76 and 0.75). The fault of each rank perturbing the head by its own rows'
gradient is also computed in this process, as the plain-PyTorch reference with each micro-batch cut into its ranks'
rows (`per_rank_perturbation`; under DDP it lands where the launched fault run did, 3.0e-3 and 1.2e-3 from the
2 processes): the ZeRO-3 weights are 8.1e4 and 3.2e4 units from it (3.0e-3 and 1.2e-3), and the test asserts more
than 100 times the tolerance, so it can fail. (A one-process ZeRO-3 reference is not reachable here: the launched
script's one-process start leaves the parameters unpartitioned, and trl's head then fails on ``ds_status``.)

One launch of `tests/helpers/distributed_sam_script.py` per engine runs its cases; the one-process runs are trained
here.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

pytest.importorskip("trl")

from tests.distributed.test_distributed import (  # noqa: E402
    PER_DEVICE,
    assert_float32_master_rounding_apart,
    float32_units_apart,
    launch,
    load,
    logits_sam_cases,
    max_difference,
    per_rank_perturbation,
)
from tests.helpers.distributed_sam_script import (  # noqa: E402
    base_arguments,
    sft_trainer,
    trained_parameters,
)
from tests.helpers.trl_heads import head_paths_counted  # noqa: E402
from tests.test_logits_sam import reference_head_sam_sgd  # noqa: E402
from tests.test_trl import fresh_model, sft_loss, updates_of  # noqa: E402

pytestmark = pytest.mark.distributed

STEPS = 2  # test_trl's 16 rows: 2 updates of 2 micro-batches of 2 rows on each of 2 ranks
CASES = logits_sam_cases("sft", "ddp", STEPS)
ZERO3_CASES = logits_sam_cases("sft", "zero3", STEPS)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    return launch("accelerate_cpu_2proc.yaml", CASES, tmp_path_factory.mktemp("sft_logits_ddp"))


@pytest.fixture(scope="module")
def launched_zero3(tmp_path_factory):
    return launch("accelerate_cpu_2proc.yaml", ZERO3_CASES, tmp_path_factory.mktemp("sft_logits_zero3"))


def one_process_run(
    tmp_path, case: dict, *, per_rank_fault: bool = False
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, int]]:
    """The same arguments in this process with both ranks' rows in each micro-batch: the initial and trained
    weights, the plain-PyTorch two-forward SAM's on the micro-batches its dataloader yields, and the head paths it
    ran; with ``per_rank_fault``, also that reference with a deliberate fault (`per_rank_perturbation`)."""
    values = base_arguments(str(tmp_path))
    values.update(case["args"], per_device_train_batch_size=2 * PER_DEVICE)
    with head_paths_counted() as counts:
        trainer = sft_trainer(values)
        initial = trained_parameters(fresh_model(trainer))
        reference = reference_head_sam_sgd(fresh_model(trainer), updates_of(trainer), sft_loss)
        if per_rank_fault:
            fault = reference_head_sam_sgd(fresh_model(trainer), per_rank_perturbation(updates_of(trainer)), sft_loss)
        trainer.train()
    weights = {
        "initial": initial,
        "trained": trained_parameters(trainer.model),
        "reference": trained_parameters(reference),
    }
    if per_rank_fault:
        weights["per_rank_fault"] = trained_parameters(fault)
    return weights, counts


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_two_processes_equal_one_process_on_the_global_batch(launched, case, tmp_path):
    two = [load(launched, case["name"], rank)["params"] for rank in (0, 1)]
    one, counts = one_process_run(tmp_path, case)
    micro_batches = STEPS * case["args"]["gradient_accumulation_steps"]
    both_passes = {"head_gradient_forwards": 2 * micro_batches, "trl_kernel_calls": 0}
    assert {key: counts[key] for key in both_passes} == both_passes, (
        "the one process formed the head's gradients in its forward"
    )
    for rank in (0, 1):
        result = json.loads((launched / f"{case['name']}.rank{rank}.json").read_text())
        assert result["world_size"] == 2
        assert result["first_layer_forwards"] == micro_batches, "one trunk forward per micro-batch on each rank"
        assert {key: result[key] for key in both_passes} == both_passes, "each rank ran the head-gradient path"
    assert max_difference(two[0], two[1]) == 0.0
    differences = {name: max_difference(two[0], one[name]) for name in ("trained", "reference", "initial")}
    assert max_difference(one["trained"], one["reference"]) < 1e-12
    assert differences["trained"] < 1e-10
    assert differences["reference"] < 1e-10
    assert differences["initial"] > 1e-3, "the steps moved the weights"


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
@pytest.mark.parametrize("case", ZERO3_CASES, ids=[case["name"] for case in ZERO3_CASES])
def test_zero3_two_processes_equal_one_process_up_to_float32_master_weights(launched_zero3, case, tmp_path):
    two = [load(launched_zero3, case["name"], rank)["params"] for rank in (0, 1)]
    one, _ = one_process_run(tmp_path, case, per_rank_fault=True)
    micro_batches = STEPS * case["args"]["gradient_accumulation_steps"]
    trl_head = {"head_gradient_forwards": 0, "trl_kernel_calls": 2 * micro_batches}
    for rank in (0, 1):
        result = json.loads((launched_zero3 / f"{case['name']}.rank{rank}.json").read_text())
        assert result["world_size"] == 2
        assert result["first_layer_forwards"] == micro_batches, "one trunk forward per micro-batch on each rank"
        assert {key: result[key] for key in trl_head} == trl_head, "each rank fell back to trl's head"
    assert max_difference(two[0], two[1]) == 0.0
    assert_float32_master_rounding_apart(two[0], one["trained"], STEPS)
    # the fault run (each rank perturbing by its own rows), in this process: 8.1e4 and 3.2e4 units (measured)
    assert float32_units_apart(two[0], one["per_rank_fault"]) > 100 * 2 * STEPS, "the tolerance tells the fault apart"
    assert max_difference(two[0], one["initial"]) > 1e-3, "the steps moved the weights"
