"""Output-layer SAM with one trunk forward under DDP and DeepSpeed ZeRO-3 (2 CPU processes over gloo): equal to one
process on the same global batch, and the second pass replayed the trunk there too (its floating-point operations
count the head only).

One launch of `tests/helpers/distributed_sam_script.py` per engine runs its cases; the one-process runs are trained
here, without an engine.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tests.distributed.test_distributed import PER_DEVICE, launch, load, max_difference
from tests.helpers.distributed_sam_script import TRAINING_TASKS, base_arguments

pytestmark = pytest.mark.distributed

HEAD_SAM = {"sam_parameters": "output_layer"}
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
CASES = [
    {
        "name": f"{engine}-llama-head_sam_acc{k}",
        "engine": engine,
        "task": "causal_lm_float64",
        "args": {**HEAD_SAM, **acc},
    }
    for engine in ("ddp", "zero3")
    for k, acc in ((1, {}), (2, {"gradient_accumulation_steps": 2}))
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    launched: dict[str, Path] = {}

    def of(engine: str) -> Path:
        if engine not in launched:
            cases = [case for case in CASES if case["engine"] == engine]
            launched[engine] = launch("accelerate_cpu_2proc.yaml", cases, tmp_path_factory.mktemp(f"logits_{engine}"))
        return launched[engine]

    return of


def marks_for(case: dict) -> list:
    if case["engine"] == "ddp":
        return []
    return [pytest.mark.deepspeed, pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")]


def one_process_run(tmp_path: Path, case: dict) -> tuple[dict[str, torch.Tensor], float, int]:
    """The same arguments in this process with both ranks' rows in each micro-batch: the weights, the total
    floating-point operations and the forwards of the trunk's first layer."""
    from hf_flatbias import FlatBiasConfig, FlatBiasTrainer

    values = base_arguments(str(tmp_path))
    values.update(case["args"], per_device_train_batch_size=2 * PER_DEVICE, use_cpu=True)
    model, rows = TRAINING_TASKS[case["task"]]
    trainer = FlatBiasTrainer(model=model(), args=FlatBiasConfig(**values), train_dataset=rows())
    calls = []
    trainer.model.model.layers[0].register_forward_pre_hook(lambda module, args: calls.append(1))
    trainer.train()
    params = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    return params, trainer.state.total_flos, len(calls)


def total_flos(runs: Path, name: str) -> float:
    history = json.loads((runs / f"{name}.rank0.json").read_text())["log_history"]
    return next(entry["total_flos"] for entry in history if "total_flos" in entry)


@pytest.mark.parametrize("case", [pytest.param(c, marks=marks_for(c), id=c["name"]) for c in CASES])
def test_two_processes_equal_one_process_with_the_trunk_replayed(runs, case, tmp_path):
    launched = runs(case["engine"])
    two = [load(launched, case["name"], rank)["params"] for rank in (0, 1)]
    one, flos, calls = one_process_run(tmp_path, case)
    steps, k = 3, case["args"].get("gradient_accumulation_steps", 1)
    assert calls == steps * k, "one trunk forward per micro-batch in the one-process run"
    assert max_difference(two[0], two[1]) == 0.0
    # ZeRO-3 keeps this float64 model float32-accurate: 1.0e-7 from the one process without an engine (measured at
    # accumulation 1); in one process under ZeRO-3 the replayed step equalled the two-forward step bit for bit
    assert max_difference(two[0], one) < (1e-12 if case["engine"] == "ddp" else 1e-6)
    info = json.loads((launched / f"{case['name']}.rank0.json").read_text())
    assert info["first_layer_forwards"] == steps * k, "one trunk forward per micro-batch on each rank"
    assert info["zero_stage"] == (3 if case["engine"] == "zero3" else None)
    if case["engine"] == "ddp":  # (ZeRO-3's partitioned parameters count as empty in the Trainer's flos)
        # the two ranks' flos summed: a whole second forward/backward would have doubled the plain step's count
        assert total_flos(launched, case["name"]) == pytest.approx(flos)
