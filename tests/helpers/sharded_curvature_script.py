"""Top eigenvalues (finite-difference products) and critical sharpness of `tiny_causal_lm_float64` in one process
group, with the model as an engine holds it: ``ddp`` (whole parameters on every rank), ``fsdp2`` (``fully_shard`` on
each decoder layer and the root), ``zero1``/``zero2``/``zero3`` (``deepspeed.initialize`` around torch's AdamW).
Started by `tests/distributed/test_sharded_curvature.py`:

    torchrun --nproc_per_node 2 tests/helpers/sharded_curvature_script.py ENGINE OUT_DIR

Every rank writes ``OUT_DIR/<engine>.rank<r>.json`` with what it measured; the test compares them with one process.
Under DeepSpeed it also writes ``OUT_DIR/<engine>.rank<r>.pt`` (`zero_update_check`): the ZeRO optimizer's proposed
update after two clipped AdamW steps, whether everything was restored bit for bit, and the weights after the next
real step, for the test to hold against plain PyTorch.
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
#: `zero_update_check`'s AdamW: weight decay and a clipping norm below the gradients' norms (about 0.5-1.3), so that
#: both the decay and DeepSpeed's clipping are part of the update checked.
ZERO_ADAMW = {"lr": 0.01, "weight_decay": 0.1}
ZERO_CLIP = 0.2
ZERO_TRAIN_BATCHES = ((0, 4), (2, 6))  # rows of causal_rows(); the proposed update is for rows 3-7, then stepped
ZERO_PROPOSED_BATCH = (3, 7)


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


def rows_batch(bounds: tuple[int, int]) -> dict[str, torch.Tensor]:
    rows = causal_rows()[bounds[0] : bounds[1]]
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


def zero_state(zero) -> list[torch.Tensor]:
    """Everything a proposed update could disturb: the fp32 masters and their .grad, every tensor of the torch
    optimizer's state, its groups' hyper-parameters, and the model's weights as this rank holds them."""
    inner = zero.optimizer
    masters = list(getattr(zero, "single_partition_of_fp32_groups", None) or zero.fp32_partitioned_groups_flat)
    held = [m.detach().clone() for m in masters] + [torch.tensor(m.grad is None) for m in masters]
    for master in masters:
        for _key, value in sorted(inner.state.get(master, {}).items()):
            held.append(torch.as_tensor(value).detach().clone())
    for group in inner.param_groups:
        held += [torch.tensor(float(v)) for k, v in sorted(group.items()) if isinstance(v, (int, float))]
        held.append(torch.tensor(len(group["params"])))
    return held


def zero_update_check(stage: int) -> dict:
    """DeepSpeed's ZeRO optimizer around torch's AdamW on float32 `tiny_causal_lm`, clipping at `ZERO_CLIP`: two
    training steps (every rank on the same rows, so the averaged gradient is theirs), then the proposed update for the
    gradient of `ZERO_PROPOSED_BATCH`, then the real step on that batch."""
    import deepspeed

    from hf_flatbias.flatness.parameter_space import parameter_space
    from hf_flatbias.flatness.zero_update import zero_proposed_update
    from tests.helpers.distributed_sam_script import tiny_causal_lm

    model = tiny_causal_lm()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": ZERO_CLIP,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
    }
    optimizer = torch.optim.AdamW(model.parameters(), **ZERO_ADAMW)
    engine, zero, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    for bounds in ZERO_TRAIN_BATCHES:
        engine.backward(engine(**rows_batch(bounds)).loss)
        engine.step()
    space = parameter_space(engine.module, zero)
    batch = rows_batch(ZERO_PROPOSED_BATCH)
    world_size = dist.get_world_size()
    grads = space.gradient([engine.module(**batch).loss / world_size])  # summed over ranks: this batch's gradient
    space.release_gathered()
    before = zero_state(zero) + [t.detach().clone() for t in space.tensors]
    proposed = zero_proposed_update(zero, space, grads)
    after = zero_state(zero) + [t.detach().clone() for t in space.tensors]
    restored = len(before) == len(after) and all(torch.equal(b, a) for b, a in zip(before, after, strict=True))
    held = [t.detach().clone() for t in space.tensors]
    engine.backward(engine(**batch).loss)
    engine.step()
    space.release_gathered()
    stepped = [t.detach().clone() - h for t, h in zip(space.tensors, held, strict=True)]
    return {
        "updates": [u.clone() for u in proposed.updates],
        "real_step": stepped,
        "learning_rate": proposed.learning_rate,
        "restored": restored,
        "names": [name for name, p in engine.module.named_parameters() if p.requires_grad],
    }


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
        stage = int(engine.removeprefix("zero"))
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,
        }
        optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
        engine_model, engine_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        result = measure(engine_model.module, engine_optimizer, with_optimizer=True)
    rank = dist.get_rank()
    result["world_size"] = dist.get_world_size()
    Path(out).mkdir(parents=True, exist_ok=True)
    if engine.startswith("zero"):
        torch.save(zero_update_check(stage), Path(out) / f"{engine}.rank{rank}.pt")
    (Path(out) / f"{engine}.rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
