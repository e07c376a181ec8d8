"""Top eigenvalues by finite-difference products and critical sharpness, sharded, against one process.

`tests/helpers/sharded_curvature_script.py` runs in 2 CPU processes (torchrun, gloo) with the model as each engine
holds it: DDP (whole parameters, the contexts split), FSDP2 (``fully_shard``: Lanczos vectors in the shard space),
ZeRO-2 and ZeRO-3 (``deepspeed.initialize``); the two sharded layouts also in 4 processes (marked slow), where a
critical-sharpness batch of 4 contexts puts one on each rank and the 7 contexts leave one rank a padded share. The
reference is the same measurement in this process on the whole model: the same start vector (drawn per parameter, so
each layout holds its slice of it), the same contexts and ``h``.
The model is float64 (`tiny_causal_lm_float64`), so the layouts' different reduction orders stay near 1e-14.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.test_distributed import REPO_ROOT, free_port
from tests.helpers.distributed_sam_script import tiny_causal_lm_float64
from tests.helpers.sharded_curvature_script import LEARNING_RATE, measure

pytestmark = pytest.mark.distributed

SCRIPT = REPO_ROOT / "tests" / "helpers" / "sharded_curvature_script.py"
DEEPSPEED = {"zero2", "zero3"}
SHARDED = ("fsdp2", "zero3")
#: (engine, processes): every layout in 2 processes, the sharded ones in 4 too
LAUNCHES = [
    pytest.param(engine, n, marks=[pytest.mark.deepspeed] * (engine in DEEPSPEED) + [pytest.mark.slow] * (n > 2))
    for engine, n in [*((e, 2) for e in ("ddp", "fsdp2", "zero2", "zero3")), *((e, 4) for e in SHARDED)]
]
RELATIVE = 1e-5  # the bound; measured: 5e-15 (eigenvalues), 0 (critical sharpness)


def launch(engine: str, n_processes: int, out_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update(PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(n_processes),
        "--master_port",
        str(free_port()),
        str(SCRIPT),
        engine,
        str(out_dir),
    ]
    # 4 processes share 2 cores here: a launch may take twice as long
    timeout = 300 * n_processes
    completed = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    if completed.returncode != 0:
        pytest.fail(f"{engine} launch failed ({completed.returncode}):\n{completed.stderr[-4000:]}")
    return {rank: json.loads((out_dir / f"{engine}.rank{rank}.json").read_text()) for rank in range(n_processes)}


@pytest.fixture(scope="module")
def one_process() -> dict:
    model = tiny_causal_lm_float64()
    return measure(model, torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE), with_optimizer=True)


def relative_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(("engine", "n_processes"), LAUNCHES)
def test_processes_measure_what_one_does(engine, n_processes, one_process, tmp_path):
    runs = launch(engine, n_processes, tmp_path)
    for rank in range(n_processes):
        run = runs[rank]
        assert run["world_size"] == n_processes
        assert run["weights_restored"], f"rank {rank}: the weights were not restored bit for bit"
        for matrix in ("hessian", "fisher"):
            key = f"top_{matrix}"
            assert run[key]["product"] == "finite_difference"
            assert run[key]["n_matvecs"] == one_process[key]["n_matvecs"]
            assert relative_difference(one_process[key]["eigenvalues"], run[key]["eigenvalues"]) < RELATIVE
        directions = ["critical_gd", "critical_adamw"] if "critical_adamw" in run else ["critical_gd"]
        for key in directions:
            assert run[key]["n_converged"] == run[key]["n_batches"] == 2
            assert run[key]["n_forward_passes"] == one_process[key]["n_forward_passes"]
            assert relative_difference(one_process[key]["per_batch"], run[key]["per_batch"]) < RELATIVE
    # every process holds the same numbers: they took the same branches
    for run in runs.values():
        assert run["top_hessian"]["eigenvalues"] == runs[0]["top_hessian"]["eigenvalues"]
        assert run["critical_gd"]["per_batch"] == runs[0]["critical_gd"]["per_batch"]
    # DeepSpeed's optimizer cannot propose its update; the torch AdamW under DDP and FSDP2 does
    assert ("critical_adamw" in runs[0]) == (engine in ("ddp", "fsdp2"))
