"""Top eigenvalues by finite-difference products and critical sharpness, sharded, against one process.

`tests/helpers/sharded_curvature_script.py` runs in 2 CPU processes (torchrun, gloo) with the model as each engine
holds it: DDP (whole parameters, the contexts split), FSDP2 (``fully_shard``: Lanczos vectors in the shard space),
ZeRO-1, ZeRO-2 and ZeRO-3 (``deepspeed.initialize`` around torch's AdamW); the two sharded layouts also in 4
processes (marked slow), where a critical-sharpness batch of 4 contexts puts one on each rank and the 7 contexts leave
one rank a padded share. The reference is the same measurement in this process on the whole model: the same start
vector (drawn per parameter, so each layout holds its slice of it), the same contexts and ``h``, and critical
sharpness along torch's AdamW's update. The model is float64 (`tiny_causal_lm_float64`), so the layouts' different
reduction orders stay near 1e-14; DeepSpeed's AdamW steps float32 masters, whose update differs from float64's by
~1e-7, below the line search's decisions.

Under DeepSpeed the ZeRO optimizer's proposed update is also held against plain PyTorch's AdamW with torch's clipping
through the same steps (`test_deepspeeds_proposed_update_is_plain_pytorchs_clipped_adamw_step`).
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
from tests.helpers.distributed_sam_script import tiny_causal_lm, tiny_causal_lm_float64
from tests.helpers.sharded_curvature_script import (
    LEARNING_RATE,
    ZERO_ADAMW,
    ZERO_CLIP,
    ZERO_PROPOSED_BATCH,
    ZERO_TRAIN_BATCHES,
    measure,
    rows_batch,
)

pytestmark = pytest.mark.distributed

SCRIPT = REPO_ROOT / "tests" / "helpers" / "sharded_curvature_script.py"
ZERO_ENGINES = [
    pytest.param("zero1", marks=[pytest.mark.deepspeed, pytest.mark.slow]),  # ZeRO-2's optimizer class: ~2 min more
    pytest.param("zero2", marks=pytest.mark.deepspeed),
    pytest.param("zero3", marks=pytest.mark.deepspeed),
]
DEEPSPEED = {"zero1", "zero2", "zero3"}
SHARDED = ("fsdp2", "zero3")
#: (engine, processes): every layout in 2 processes, the sharded ones in 4 too (slow: 4 processes share 2 cores)
LAUNCHES = [
    *(pytest.param(e.values[0], 2, marks=e.marks, id=f"{e.values[0]}-2") for e in ZERO_ENGINES),
    *(pytest.param(e, 2, id=f"{e}-2") for e in ("ddp", "fsdp2")),
    *(
        pytest.param(e, 4, marks=[pytest.mark.deepspeed] * (e in DEEPSPEED) + [pytest.mark.slow], id=f"{e}-4")
        for e in SHARDED
    ),
]
RELATIVE = 1e-5  # the bound; measured: 5e-15 (eigenvalues), 0 (critical sharpness)
# Held in float64 only: in float32 one process's finite-difference eigenvalue moves by 1e-4 (this tiny Llama) to 1.7e-2
# (100M Llama) with its batch size alone, the floor under any sharded layout (benchmarks/finite_difference_op_order.py)
# float32 weights' rounding on a move of ~1e-2: measured 6e-8 (ZeRO-3, 2 processes); not clipping the last step moves
# the update by more than 1e-4
UPDATE_ATOL = 1e-6


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
def launched(tmp_path_factory):
    """Each launch once per module: ``launched(engine, n_processes)`` -> (its output folder, rank -> JSON)."""
    done: dict[tuple[str, int], tuple[Path, dict]] = {}

    def run(engine: str, n_processes: int = 2) -> tuple[Path, dict]:
        if (engine, n_processes) not in done:
            out_dir = tmp_path_factory.mktemp(f"{engine}-{n_processes}")
            done[engine, n_processes] = (out_dir, launch(engine, n_processes, out_dir))
        return done[engine, n_processes]

    return run


@pytest.fixture(scope="module")
def one_process() -> dict:
    model = tiny_causal_lm_float64()
    return measure(model, torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE), with_optimizer=True)


def relative_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(("engine", "n_processes"), LAUNCHES)
def test_processes_measure_what_one_does(engine, n_processes, one_process, launched):
    _, runs = launched(engine, n_processes)
    for rank in range(n_processes):
        run = runs[rank]
        assert run["world_size"] == n_processes
        assert run["weights_restored"], f"rank {rank}: the weights were not restored bit for bit"
        for matrix in ("hessian", "fisher"):
            key = f"top_{matrix}"
            assert run[key]["product"] == "finite_difference"
            assert run[key]["n_matvecs"] == one_process[key]["n_matvecs"]
            assert relative_difference(one_process[key]["eigenvalues"], run[key]["eigenvalues"]) < RELATIVE
        assert run["critical_adamw"]["direction"] == "AdamW"
        for key in ("critical_gd", "critical_adamw"):
            assert run[key]["n_converged"] == run[key]["n_batches"] == 2
            assert run[key]["n_forward_passes"] == one_process[key]["n_forward_passes"]
            assert relative_difference(one_process[key]["per_batch"], run[key]["per_batch"]) < RELATIVE
    # every process holds the same numbers: they took the same branches
    for run in runs.values():
        assert run["top_hessian"]["eigenvalues"] == runs[0]["top_hessian"]["eigenvalues"]
        assert run["critical_gd"]["per_batch"] == runs[0]["critical_gd"]["per_batch"]
        assert run["critical_adamw"]["per_batch"] == runs[0]["critical_adamw"]["per_batch"]
    # the optimizer's update is not the negative gradient: the two directions are told apart
    assert (
        relative_difference(one_process["critical_gd"]["per_batch"], one_process["critical_adamw"]["per_batch"]) > 0.1
    )


def plain_adamw_moves(*, clip_last: bool = True) -> dict[str, torch.Tensor]:
    """Plain PyTorch: AdamW with torch's ``clip_grad_norm_`` through `zero_update_check`'s two steps; the move of the
    next step on `ZERO_PROPOSED_BATCH` (clipped, or not with ``clip_last=False``)."""
    model = tiny_causal_lm()
    optimizer = torch.optim.AdamW(model.parameters(), **ZERO_ADAMW)
    for bounds, clip in [(b, True) for b in ZERO_TRAIN_BATCHES] + [(ZERO_PROPOSED_BATCH, clip_last)]:
        optimizer.zero_grad()
        model(**rows_batch(bounds)).loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), ZERO_CLIP)
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        optimizer.step()
    return {name: p.detach() - before[name] for name, p in model.named_parameters()}


def whole_tensors(engine: str, runs: list[dict], key: str, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """ZeRO-1/2: every rank's whole tensors, which must agree bit for bit; ZeRO-3: the ranks' partitions joined and
    the padding cut off."""
    joined = {}
    for index, name in enumerate(runs[0]["names"]):
        pieces = [run[key][index] for run in runs]
        if engine == "zero3":
            joined[name] = torch.cat([piece.reshape(-1) for piece in pieces])[: shapes[name].numel()]
            joined[name] = joined[name].view(shapes[name])
        else:
            assert all(torch.equal(pieces[0], piece) for piece in pieces), name
            joined[name] = pieces[0]
    return joined


@pytest.mark.parametrize("engine", ZERO_ENGINES)
def test_deepspeeds_proposed_update_is_plain_pytorchs_clipped_adamw_step(engine, launched):
    """After two clipped AdamW steps (moments, step counts and weight decay in play), the update the ZeRO optimizer
    proposes for a further batch's gradient is plain PyTorch's next step; proposing it left the masters, their
    ``.grad``, the optimizer's state and groups and the weights bit for bit as they were; and the real step that
    followed moved the weights by the proposed update."""
    out_dir, _ = launched(engine)
    runs = [torch.load(out_dir / f"{engine}.rank{rank}.pt") for rank in (0, 1)]
    assert all(run["restored"] for run in runs), "proposing the update disturbed the optimizer or the weights"
    assert all(run["learning_rate"] == ZERO_ADAMW["lr"] for run in runs)
    reference = plain_adamw_moves()
    shapes = {name: move.shape for name, move in reference.items()}
    assert sorted(runs[0]["names"]) == sorted(reference)
    proposed = whole_tensors(engine, runs, "updates", shapes)
    stepped = whole_tensors(engine, runs, "real_step", shapes)
    for name, move in reference.items():
        torch.testing.assert_close(proposed[name], move, rtol=0, atol=UPDATE_ATOL)
        torch.testing.assert_close(stepped[name], proposed[name], rtol=0, atol=UPDATE_ATOL)
    unclipped = plain_adamw_moves(clip_last=False)
    assert max(float((unclipped[n] - reference[n]).abs().max()) for n in reference) > 100 * UPDATE_ATOL
