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

Each rank's policy head keeps its rows' ``softmax - onehot`` to the backward in both passes (trl's head scores the
reference model only): 2 processes are 5.6e-17 from 1 at accumulation 1 and 2 (measured).

Under ZeRO-3 (2 processes) the policy's trunk still runs once per micro-batch, and trl's head (which gathers its
partitioned weight) three times: the reference model's, sharded by trl too, and the policy's clean and perturbed
passes. DeepSpeed keeps the optimizer's master weights in float32 and writes them back into the float64 model, so the
trained weights are float32 numbers (checked) while the one process without an engine follows a float64 trajectory (a
one-process ZeRO-3 reference is not reachable here; see the SFT module). The initial weights are float32 numbers, so
the trajectories start equal; each update then rounds every master weight once, by at most half a float32 unit
(machine epsilon) of the tensor's largest weight, and the next update carries an earlier rounding along, grown by
1 + lr * curvature at most. Two updates leave at most 0.5 + 0.5 (1 + lr * curvature) units: held to 2 units per
update (4), measured 0.71 (accumulation 1) and 0.74 (2), 9.8e-8 and 1.06e-7. The same runs with the head's first
gradient left unaveraged across the ranks (each rank perturbing its partition by its own gradient) miss by 1.9e-3 and
2.0e-3, 5e4 units. The fault of each rank perturbing the whole head by its own pairs' gradient is also computed in this
process, as the plain-PyTorch reference with each micro-batch cut into its ranks' rows (`per_rank_perturbation`; a
micro-batch holds its pairs' chosen rows, then their rejected rows, and each rank keeps its pairs' two rows
together): under DDP it is 2.5e-8 and 1.9e-8 from the launched ``sam_perturbation="per_rank"`` run (the reference's
float32 log-softmax), 1.9e-3 and 2.3e-3 from the 2 processes. The ZeRO-3 weights are 5.2e4 and 6.1e4 units from it
(1.9e-3 and 2.3e-3), and the test asserts more than 100 times the tolerance, so it can fail. The first update's
rewards compare the policy with the reference at the same weights and are exactly 0; before `FlatBiasDPOTrainer`
kept the reference log-probabilities it computes out of the Trainer's cast of a batch's floats to DeepSpeed's dtype,
they were rounded to float32 and the rewards were 1.6e-8 to 7e-8 (the weights, 0.80 and 0.74 units apart then, did
not show it).

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
    dpo_trainer,
    fused_head_in_model_dtype,
    trained_parameters,
)
from tests.test_logits_sam import reference_head_sam_sgd  # noqa: E402
from tests.test_trl import dpo_loss_function, fresh_model, updates_of  # noqa: E402

pytestmark = pytest.mark.distributed

STEPS = 2  # 16 pairs: 2 updates of 2 micro-batches of 2 pairs on each of 2 ranks
CASES = logits_sam_cases("dpo", "ddp", STEPS)
ZERO3_CASES = logits_sam_cases("dpo", "zero3", STEPS)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    return launch("accelerate_cpu_2proc.yaml", CASES, tmp_path_factory.mktemp("dpo_logits_ddp"))


@pytest.fixture(scope="module")
def launched_zero3(tmp_path_factory):
    return launch("accelerate_cpu_2proc.yaml", ZERO3_CASES, tmp_path_factory.mktemp("dpo_logits_zero3"))


def one_process_run(tmp_path, case: dict, *, per_rank_fault: bool = False) -> dict[str, dict[str, torch.Tensor]]:
    """The same arguments in this process with both ranks' rows in each micro-batch: the initial and trained
    weights, and the plain-PyTorch two-forward SAM's on the micro-batches its dataloader yields; with
    ``per_rank_fault``, also that reference with a deliberate fault (`per_rank_perturbation`, each rank's pairs
    kept whole)."""
    values = base_arguments(str(tmp_path))
    values.update(case["args"], per_device_train_batch_size=2 * PER_DEVICE)
    with fused_head_in_model_dtype():
        trainer = dpo_trainer(values)
        initial = trained_parameters(fresh_model(trainer))
        loss = dpo_loss_function(fresh_model(trainer).eval(), beta=trainer.args.beta)
        reference = reference_head_sam_sgd(fresh_model(trainer), updates_of(trainer), loss)
        if per_rank_fault:
            # a loss of its own: the first one's reference log-probabilities are keyed by ids of freed batches
            loss = dpo_loss_function(fresh_model(trainer).eval(), beta=trainer.args.beta)
            per_rank = per_rank_perturbation(updates_of(trainer), paired=True)
            fault = reference_head_sam_sgd(fresh_model(trainer), per_rank, loss)
        trainer.train()
    weights = {
        "initial": initial,
        "trained": trained_parameters(trainer.model),
        "reference": trained_parameters(reference),
    }
    if per_rank_fault:
        weights["per_rank_fault"] = trained_parameters(fault)
    return weights


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_two_processes_equal_one_process_on_the_global_batch(launched, case, tmp_path):
    two = [load(launched, case["name"], rank)["params"] for rank in (0, 1)]
    one = one_process_run(tmp_path, case)
    micro_batches = STEPS * case["args"]["gradient_accumulation_steps"]
    # the policy's head with its softmax - onehot kept, in both passes; trl's for the reference model only
    heads = {"head_gradient_forwards": 2 * micro_batches, "trl_kernel_calls": micro_batches}
    for rank in (0, 1):
        result = json.loads((launched / f"{case['name']}.rank{rank}.json").read_text())
        assert result["world_size"] == 2
        assert result["first_layer_forwards"] == micro_batches, "one policy trunk forward per micro-batch"
        assert {key: result[key] for key in heads} == heads, "each rank ran the kept-softmax head"
    differences = {name: max_difference(two[0], one[name]) for name in ("trained", "reference", "initial")}
    assert max_difference(two[0], two[1]) == 0.0
    assert differences["trained"] < 1e-10
    assert differences["reference"] < 1e-6
    assert differences["initial"] > 1e-3, "the steps moved the weights"


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
@pytest.mark.parametrize("case", ZERO3_CASES, ids=[case["name"] for case in ZERO3_CASES])
def test_zero3_two_processes_equal_one_process_up_to_float32_master_weights(launched_zero3, case, tmp_path):
    two = [load(launched_zero3, case["name"], rank)["params"] for rank in (0, 1)]
    one = one_process_run(tmp_path, case, per_rank_fault=True)
    micro_batches = STEPS * case["args"]["gradient_accumulation_steps"]
    for rank in (0, 1):
        result = json.loads((launched_zero3 / f"{case['name']}.rank{rank}.json").read_text())
        assert result["world_size"] == 2
        assert result["first_layer_forwards"] == micro_batches, "one policy trunk forward per micro-batch"
        assert result["trl_kernel_calls"] == 3 * micro_batches, "trl's head: the reference once, the policy twice"
        first_update = next(entry for entry in result["log_history"] if "rewards/margins" in entry)
        rewards = [first_update[f"rewards/{key}"] for key in ("chosen", "rejected", "margins")]
        assert rewards == [0.0, 0.0, 0.0], "the reference log-probabilities are the policy's at the start"
    assert max_difference(two[0], two[1]) == 0.0
    assert_float32_master_rounding_apart(two[0], one["trained"], STEPS)
    # the fault run (each rank perturbing by its own pairs), in this process: 5.2e4 and 6.1e4 units (measured)
    assert float32_units_apart(two[0], one["per_rank_fault"]) > 100 * 2 * STEPS, "the tolerance tells the fault apart"
    assert max_difference(two[0], one["initial"]) > 1e-3, "the steps moved the weights"
