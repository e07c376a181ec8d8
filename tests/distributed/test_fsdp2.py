"""FlatBiasTrainer's flatness steps and the trace under FSDP2 (``fully_shard``) in 2 CPU processes over gloo.

One launch of `tests/helpers/distributed_sam_script.py` with `recipes/configs/accelerate_fsdp2_cpu_2proc.yaml` runs
every case; each is compared with the one-process run of the same arguments on the same global batch (4 rows per
micro-batch in one process, 2 per rank in two), trained here in-process, and where one exists with the plain-PyTorch
SAM of `test_distributed.reference_sam_sgd`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed.test_distributed import (
    CRITICAL_ARGS,
    CRITICAL_TRACE,
    PER_DEVICE,
    assert_critical_callback_equals_one_process,
    launch,
    load,
    max_difference,
    reference_sam_sgd,
)
from tests.helpers.distributed_sam_script import TRAINING_TASKS, base_arguments, with_lora

pytestmark = pytest.mark.distributed

# Adapters on every dense layer (the pooler's too), the rest frozen (the head included), A and B random: with peft's
# B = 0 or on the attention projections, this tiny BERT's adapter gradients are ~1e-7, below any useful tolerance.
LORA = {"r": 2, "lora_alpha": 4, "lora_dropout": 0.0, "target_modules": ["dense"], "init_lora_weights": False}
ACC2 = {"gradient_accumulation_steps": 2}
ASAM = {"flatness_method": "asam", "sam_rho": 0.5}
# grad_norm_penalty with penalty_lambda = penalty_fd_step = h is the SAM step with rho = h (an exact reference)
GRAD_NORM_PENALTY = {"flatness_method": "grad_norm_penalty", "penalty_lambda": 0.05, "penalty_fd_step": 0.05}
FISHER_PENALTY = {"flatness_method": "fisher_penalty", "penalty_lambda": 0.1, "penalty_fd_step": 0.01}

#: Cases trained in both layouts; the SAM/ASAM ones without LoRA also have the plain-PyTorch reference.
MATCHED_CASES = [
    {"name": "fsdp2-none_acc2", "args": {"flatness_method": "none", **ACC2}},
    {"name": "fsdp2-sam_micro_acc1", "args": {}},
    {"name": "fsdp2-sam_micro_acc2", "args": ACC2},
    {"name": "fsdp2-sam_batch_acc2", "args": {"sam_scope": "batch", **ACC2}},
    {"name": "fsdp2-asam_micro_acc2", "args": {**ASAM, **ACC2}},
    {"name": "fsdp2-asam_batch_acc2", "args": {**ASAM, "sam_scope": "batch", **ACC2}},
    {"name": "fsdp2-sam_every2_acc2", "args": {"sam_every_k": 2, **ACC2}},
    {"name": "fsdp2-grad_norm_penalty_acc2", "args": {**GRAD_NORM_PENALTY, **ACC2}},
    {"name": "fsdp2-lora-sam_micro_acc2", "args": ACC2, "lora": LORA},
    {"name": "fsdp2-lora-sam_batch_acc2", "args": {"sam_scope": "batch", **ACC2}, "lora": LORA},
    {"name": "fsdp2-lora-grad_norm_penalty_acc2", "args": {**GRAD_NORM_PENALTY, **ACC2}, "lora": LORA},
]
# A Llama-family decoder with its own token-normalised loss (num_items_in_batch summed over ranks), in float64: its wide
# initialisation makes SAM amplify float32 rounding, so in float32 the three reduction orders (FSDP2's reduce-scatter,
# DDP's all-reduce, one process's sum) land 2-3e-6 apart on a CPU; in float64 they agree to 1e-16, so all three are
# held to 1e-12.
LLAMA_ARGS = {"sam_scope": "batch", **ACC2}
LLAMA_CASES = [
    {"name": "fsdp2-llama-sam_batch_acc2", "engine": "launcher", "task": "causal_lm_float64", "args": LLAMA_ARGS},
    {"name": "ddp-llama-sam_batch_acc2", "engine": "ddp", "task": "causal_lm_float64", "args": LLAMA_ARGS},
]
REFERENCE_ARGS = {"fsdp2-grad_norm_penalty_acc2": {"sam_rho": 0.05, **ACC2}}  # the SAM step it equals
# fisher_penalty draws labels from a generator seeded per rank, so one process draws others: it is compared with the
# DDP run of the same launch (2 processes, the same draws).
FISHER_CASES = [
    {"name": "fsdp2-fisher_penalty_acc2", "engine": "launcher", "args": {**FISHER_PENALTY, **ACC2}},
    {"name": "ddp-fisher_penalty_acc2", "engine": "ddp", "args": {**FISHER_PENALTY, **ACC2}},
]
RESUME_CASE = {
    "name": "fsdp2-resume-sam_batch_acc2",
    "engine": "launcher",
    "args": {"sam_scope": "batch", **ACC2},
    "resume_from_step": 2,
}
# sam_perturbation="per_rank": rank r perturbs along its own first gradient, so there is no one-process run to match;
# each is compared with the plain-PyTorch per-rank SAM and, where named, with the DDP run of the same launch.
PER_RANK = {"sam_perturbation": "per_rank"}
PER_RANK_CASES = [
    {"name": "fsdp2-sam_per_rank_micro_acc2", "engine": "launcher", "args": {**PER_RANK, **ACC2}},
    {"name": "fsdp2-sam_per_rank_batch_acc2", "engine": "launcher", "args": {**PER_RANK, "sam_scope": "batch", **ACC2}},
    {"name": "fsdp2-asam_per_rank_micro_acc2", "engine": "launcher", "args": {**PER_RANK, **ASAM, **ACC2}},
    {"name": "ddp-sam_per_rank_batch_acc2", "engine": "ddp", "args": {**PER_RANK, "sam_scope": "batch", **ACC2}},
]
REJECTED_CASES = {
    "fsdp2-per_rank-penalty-rejected": ({**PER_RANK, **GRAD_NORM_PENALTY}, "per_rank"),
    "fsdp2-looksam-rejected": ({"flatness_method": "looksam", "sam_every_k": 2}, "looksam"),
}
# The trace is over the trainable parameters: with LoRA, the adapters'.
LLAMA_LORA = {
    "r": 2,
    "lora_alpha": 4,
    "lora_dropout": 0.0,
    "target_modules": ["q_proj", "v_proj", "down_proj"],
    "init_lora_weights": False,
}
TRACE_CASES = [
    {"name": "trace-fsdp2-per_sample", "kind": "trace", "trace": {"n_draws": 2, "batch_size": 2}},
    {"name": "trace-fsdp2-naive", "kind": "trace", "trace": {"n_draws": 2, "estimator": "naive"}},
    {
        "name": "trace-fsdp2-lora-per_sample",
        "kind": "trace",
        "trace": {"n_draws": 2, "batch_size": 2},
        "lora": LLAMA_LORA,
    },
]
TRACE_CALLBACK_CASE = {
    "name": "tracecb-fsdp2",
    "kind": "trace_callback",
    # no time budget: every context is measured, as the one-process estimate is
    "trace": {"n_contexts": 7, "n_draws": 2, "batch_size": 2, "max_overhead": None},
}
# The callback's critical sharpness along torch's AdamW, sharded (`test_distributed.CRITICAL_TRACE`)
CRITICAL_CALLBACK_CASE = {
    "name": "criticalcb-fsdp2",
    "kind": "trace_callback",
    "task": "causal_lm_float64",
    "args": CRITICAL_ARGS,
    "trace": CRITICAL_TRACE,
}

CASES = (
    [{"engine": "launcher", **case} for case in MATCHED_CASES]
    + FISHER_CASES
    + LLAMA_CASES
    + PER_RANK_CASES
    + [RESUME_CASE]
    + [{"name": name, "engine": "launcher", "args": args} for name, (args, _) in REJECTED_CASES.items()]
    + [{"engine": "launcher", "task": "causal_lm", **case} for case in [*TRACE_CASES, TRACE_CALLBACK_CASE]]
    + [{"engine": "launcher", **CRITICAL_CALLBACK_CASE}]
)


@pytest.fixture(scope="module")
def fsdp2_runs(tmp_path_factory) -> Path:
    return launch("accelerate_fsdp2_cpu_2proc.yaml", CASES, tmp_path_factory.mktemp("fsdp2"))


def info(runs: Path, name: str, rank: int = 0) -> dict:
    return json.loads((runs / f"{name}.rank{rank}.json").read_text())


def one_process_run(tmp_path: Path, case: dict) -> dict[str, torch.Tensor]:
    """The same arguments in this process: one process with the global batch of both ranks per micro-batch."""
    from hf_flatbias import FlatBiasConfig, FlatBiasTrainer

    values = base_arguments(str(tmp_path))
    values.update(case["args"], per_device_train_batch_size=2 * PER_DEVICE, use_cpu=True)
    model, rows = TRAINING_TASKS[case.get("task", "classification")]
    trainer = FlatBiasTrainer(
        model=with_lora(model(), case.get("lora")), args=FlatBiasConfig(**values), train_dataset=rows()
    )
    trainer.train()
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("case", MATCHED_CASES, ids=lambda c: c["name"])
def test_two_fsdp2_processes_equal_one_process(fsdp2_runs, case, tmp_path):
    first = info(fsdp2_runs, case["name"])
    assert first["world_size"] == 2
    two = load(fsdp2_runs, case["name"])["params"]
    assert max_difference(two, one_process_run(tmp_path, case)) < 1e-6
    if "lora" not in case and "sam_every_k" not in case["args"]:
        reference = reference_sam_sgd(world_size=2, **REFERENCE_ARGS.get(case["name"], case["args"]))
        assert max_difference(two, reference) < 1e-6


def test_llama_under_fsdp2_equals_ddp_and_one_process(fsdp2_runs, tmp_path):
    fsdp2, ddp = (load(fsdp2_runs, case["name"])["params"] for case in LLAMA_CASES)
    assert max_difference(fsdp2, ddp) < 1e-12
    one = one_process_run(tmp_path, LLAMA_CASES[0])
    assert max_difference(fsdp2, one) < 1e-12
    plain = one_process_run(tmp_path / "plain", {**LLAMA_CASES[0], "args": {**LLAMA_ARGS, "flatness_method": "none"}})
    assert max_difference(one, plain) > 1e-2


@pytest.mark.parametrize("case", PER_RANK_CASES, ids=lambda c: c["name"])
def test_per_rank_sam_under_fsdp2_equals_the_per_rank_reference(fsdp2_runs, case):
    """Each rank's perturbation from its own whole first gradient, the second gradients averaged: the plain-PyTorch
    per-rank SAM, which differs from the global one by 7e-4 to 1.5e-3 on these runs."""
    two = load(fsdp2_runs, case["name"])["params"]
    assert info(fsdp2_runs, case["name"])["world_size"] == 2
    assert max_difference(two, reference_sam_sgd(world_size=2, **case["args"])) < 1e-6
    global_args = {key: value for key, value in case["args"].items() if key != "sam_perturbation"}
    assert max_difference(two, reference_sam_sgd(world_size=2, **global_args)) > 1e-4


def test_per_rank_sam_under_fsdp2_equals_ddp(fsdp2_runs):
    fsdp2 = load(fsdp2_runs, "fsdp2-sam_per_rank_batch_acc2")["params"]
    assert max_difference(fsdp2, load(fsdp2_runs, "ddp-sam_per_rank_batch_acc2")["params"]) < 1e-6
    # Each FSDP2 rank held whole-parameter copies (per-rank SAM needs a whole perturbation per rank)
    for rank in (0, 1):
        held = info(fsdp2_runs, "fsdp2-sam_per_rank_batch_acc2", rank)
        assert held["perturbation_layouts"] == ["PerRankFullyShardedParameters"]
        assert held["perturbation_bytes"] == held["trainable_bytes"]


@pytest.mark.parametrize(
    "case", [*MATCHED_CASES, *FISHER_CASES, *LLAMA_CASES, *PER_RANK_CASES, RESUME_CASE], ids=lambda c: c["name"]
)
def test_ranks_end_bit_identical(fsdp2_runs, case):
    rank0, rank1 = load(fsdp2_runs, case["name"], 0), load(fsdp2_runs, case["name"], 1)
    for key in rank0:
        assert all(torch.equal(rank0[key][n], rank1[key][n]) for n in rank0[key]), key


def test_the_tolerance_tells_the_methods_apart(tmp_path):
    """1e-6 is meaningful: SAM against a plain step, micro- against batch scope, with and without LoRA."""
    sam = one_process_run(tmp_path / "sam", MATCHED_CASES[2])
    for other in (MATCHED_CASES[0], MATCHED_CASES[3]):
        assert max_difference(sam, one_process_run(tmp_path / other["name"], other)) > 1e-4
    lora_sam = one_process_run(tmp_path / "lora_sam", MATCHED_CASES[8])
    lora_plain = one_process_run(tmp_path / "lora_plain", {"args": {"flatness_method": "none", **ACC2}, "lora": LORA})
    assert max_difference(lora_sam, lora_plain) > 1e-4


def test_lora_under_fsdp2_trains_the_adapters_only(fsdp2_runs):
    trained = load(fsdp2_runs, "fsdp2-lora-sam_micro_acc2")["params"]
    initial = dict(with_lora(TRAINING_TASKS["classification"][0](), LORA).named_parameters())
    for name, param in initial.items():
        moved = float((trained[name] - param.detach()).abs().max())
        assert moved > 0.0 if param.requires_grad else moved == 0.0, name


def test_fisher_penalty_under_fsdp2_equals_ddp(fsdp2_runs):
    fsdp2 = load(fsdp2_runs, "fsdp2-fisher_penalty_acc2")["params"]
    ddp = load(fsdp2_runs, "ddp-fisher_penalty_acc2")["params"]
    assert info(fsdp2_runs, "ddp-fisher_penalty_acc2")["world_size"] == 2
    assert max_difference(fsdp2, ddp) < 1e-6
    plain = reference_sam_sgd(world_size=2, flatness_method="none", **ACC2)
    assert max_difference(fsdp2, plain) > 1e-4  # the penalty did something


def test_resume_continues_bit_identical(fsdp2_runs):
    saved = load(fsdp2_runs, RESUME_CASE["name"])
    assert max_difference(saved["resumed_params"], saved["params"]) == 0.0
    assert max_difference(saved["params"], reference_sam_sgd(world_size=2, **RESUME_CASE["args"])) < 1e-6


def test_the_perturbation_holds_one_shard_per_rank(fsdp2_runs):
    """The step's extra parameter copy (the saved ``w``) is this rank's shard: the ranks' copies tile the model once;
    under DDP each rank holds a whole copy."""
    held = [info(fsdp2_runs, "fsdp2-sam_micro_acc2", rank)["perturbation_bytes"] for rank in (0, 1)]
    total = info(fsdp2_runs, "fsdp2-sam_micro_acc2")["trainable_bytes"]
    assert sum(held) == total and max(held) < 0.6 * total
    assert info(fsdp2_runs, "ddp-fisher_penalty_acc2")["perturbation_bytes"] == total


@pytest.mark.parametrize("name,match", [(name, match) for name, (_, match) in REJECTED_CASES.items()])
def test_what_fsdp2_cannot_do_is_refused_at_start(fsdp2_runs, name, match):
    for rank in (0, 1):
        error = fsdp2_runs / f"{name}.rank{rank}.error"
        assert error.exists(), f"{name} trained instead of raising"
        assert match in error.read_text() and "FSDP2" in error.read_text()


@pytest.mark.parametrize("case", TRACE_CASES, ids=lambda c: c["name"])
def test_trace_across_fsdp2_processes_equals_one_process(fsdp2_runs, case):
    from hf_flatbias.flatness import TraceContexts, compute_trace_samples, estimate_hessian_trace
    from tests.helpers.distributed_sam_script import causal_rows, tiny_causal_lm

    estimates = [info(fsdp2_runs, case["name"], rank)["estimate"] for rank in (0, 1)]
    for estimate in estimates:
        estimate.pop("seconds")
    assert estimates[0] == estimates[1] and info(fsdp2_runs, case["name"])["world_size"] == 2
    model = with_lora(tiny_causal_lm(), case.get("lora"))
    one_process = estimate_hessian_trace(model, causal_rows(), **case["trace"])
    assert estimates[0]["n_contexts"] == one_process.n_contexts == len(causal_rows())
    assert estimates[0]["mean"] == pytest.approx(one_process.mean, rel=1e-6)
    assert estimates[0]["stderr"] == pytest.approx(one_process.stderr, rel=1e-5)
    gathered = load(fsdp2_runs, case["name"])["per_context_values"]
    reference = compute_trace_samples(
        model.eval(), TraceContexts.from_rows(causal_rows(), causal=True), **case["trace"]
    )
    torch.testing.assert_close(gathered, reference.values, rtol=1e-6, atol=0)


def test_the_lora_trace_is_the_adapters_trace(fsdp2_runs):
    """The tolerance of the trace tests tells the adapters' trace from the whole model's."""
    whole = info(fsdp2_runs, "trace-fsdp2-per_sample")["estimate"]["mean"]
    adapters = info(fsdp2_runs, "trace-fsdp2-lora-per_sample")["estimate"]["mean"]
    assert abs(adapters - whole) > 1e-3 * whole


def test_trace_callback_under_fsdp2_logs_the_one_process_estimate(fsdp2_runs):
    from hf_flatbias.flatness import estimate_hessian_trace
    from tests.helpers.distributed_sam_script import tiny_causal_lm

    name = TRACE_CALLBACK_CASE["name"]
    infos = [info(fsdp2_runs, name, rank) for rank in (0, 1)]
    assert infos[0]["world_size"] == 2 and infos[0]["logged_trace"] == infos[1]["logged_trace"]
    trace = TRACE_CALLBACK_CASE["trace"]
    one_process = estimate_hessian_trace(
        tiny_causal_lm(), infos[0]["contexts"], n_draws=trace["n_draws"], batch_size=trace["batch_size"]
    )
    assert infos[0]["logged_trace"] == [pytest.approx(one_process.mean, rel=1e-6)]


def test_critical_sharpness_callback_under_fsdp2_equals_one_process(fsdp2_runs, tmp_path):
    """FlatBiasTrainer with the callback measuring critical sharpness (and the trace) under FSDP2: each batch's line
    search along AdamW's next update moves the shards, and logs what the same trainer in one process logs."""
    assert_critical_callback_equals_one_process(fsdp2_runs, CRITICAL_CALLBACK_CASE, tmp_path)
