"""Top eigenvalues (finite-difference products) and critical sharpness of `tiny_causal_lm_float64` in one process
group, with the model as an engine holds it: ``ddp`` (whole parameters on every rank), ``fsdp2`` (``fully_shard`` on
each decoder layer and the root), ``zero2``/``zero3`` (``deepspeed.initialize``). Started by
`tests/distributed/test_sharded_curvature.py`:

    torchrun --nproc_per_node 2 tests/helpers/sharded_curvature_script.py ENGINE OUT_DIR

Every rank writes ``OUT_DIR/<engine>.rank<r>.json`` with what it measured; the test compares them with one process.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.helpers.distributed_sam_script import causal_rows, tiny_causal_lm_float64  # noqa: E402

#: What every layout measures; the one-process reference takes the same arguments.
# tol below reach: both layouts run all max_iterations products, whose count the test compares
EIGENVALUE_ARGS = {"k": 2, "product": "finite_difference", "batch_size": 2, "tol": 1e-12, "max_iterations": 10}
CRITICAL_BATCH = 4
LEARNING_RATE = 0.05


def measure(model: torch.nn.Module, optimizer: object | None, *, with_optimizer: bool) -> dict:
    from hf_flatbias.flatness.beyond_trace import critical_sharpness
    from hf_flatbias.flatness.spectrum import estimate_top_eigenvalues
    from hf_flatbias.measures import MeasureSettings

    before = [t.detach().clone() for t in local_tensors(model)]
    result = {}
    for matrix in ("hessian", "fisher"):
        top = estimate_top_eigenvalues(model, causal_rows(), matrix=matrix, optimizer=optimizer, **EIGENVALUE_ARGS)
        result[f"top_{matrix}"] = top.to_dict()
    settings = MeasureSettings(critical_batch_size=CRITICAL_BATCH)
    descent = MeasureSettings(critical_batch_size=CRITICAL_BATCH, critical_direction="gradient_descent")
    rows = causal_rows()
    result["critical_gd"] = critical_sharpness(
        model, rows, n_contexts=None, settings=descent, batch_size=CRITICAL_BATCH, optimizer=optimizer
    ).to_dict()
    if with_optimizer:
        result["critical_adamw"] = critical_sharpness(
            model, rows, n_contexts=None, settings=settings, batch_size=CRITICAL_BATCH, optimizer=optimizer
        ).to_dict()
    after = local_tensors(model)
    result["weights_restored"] = len(before) == len(after) and all(
        torch.equal(b, a) for b, a in zip(before, after, strict=True)
    )
    return result


def local_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """What this process holds of each parameter: FSDP2's shard, ZeRO-3's partition, or the whole tensor."""
    return [p.to_local() if hasattr(p, "to_local") else getattr(p, "ds_tensor", p) for p in model.parameters()]


def main(engine: str, out: str) -> None:
    model = tiny_causal_lm_float64()
    if engine in ("ddp", "fsdp2"):
        dist.init_process_group("gloo")
    if engine == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
        result = measure(model, optimizer, with_optimizer=True)
    elif engine == "ddp":
        optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
        result = measure(model, optimizer, with_optimizer=True)
    else:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": int(engine.removeprefix("zero"))},
            "zero_allow_untested_optimizer": True,
        }
        optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
        engine_model, engine_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        result = measure(engine_model.module, engine_optimizer, with_optimizer=False)
    rank = dist.get_rank()
    result["world_size"] = dist.get_world_size()
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"{engine}.rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
