"""The trace of a model sharded by FSDP2 or DeepSpeed ZeRO-3, measured in every launched process.

Started by `tests/distributed/test_sharded_trace.py` through ``torch.distributed.run`` (CPU, gloo):

    python -m torch.distributed.run --nproc_per_node 2 tests/helpers/sharded_trace_script.py ENGINE CASES.json OUT

``ENGINE`` is ``fsdp2`` (``fully_shard`` on each decoder layer, then on the root) or ``zero3`` (``deepspeed.initialize``
at stage 3 with nothing kept whole: persistence threshold 0). The model is the float64 tiny Llama of the FSDP2
training tests. For each case of CASES.json (``name``, ``trace``: keyword arguments of `estimate_hessian_trace`) the
script writes ``OUT/<name>.rank<r>.json``: the estimate, or the message of the ValueError it raised, the most parameter
entries the rank held whole at once during the measurement (read at every module's forward), and those it still held
whole after it (none must be).
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


def sharded_model(engine: str) -> torch.nn.Module:
    model = tiny_causal_lm_float64()
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 1,
        # nothing kept whole, fetched ahead or kept for reuse: ZeRO-3's defaults (a 5e7-entry prefetch bucket, 1e9
        # entries kept when reused soon) would hold this tiny model whole, in training as in a measurement
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 0,
            "stage3_max_reuse_distance": 0,
        },
    }
    engine_, *_ = deepspeed.initialize(model=model, config=config)
    return engine_.module


def whole_parameters(model: torch.nn.Module, engine: str) -> list[int]:
    """Entries of each parameter this rank holds whole right now, from the engine's own state."""
    if engine == "zero3":
        return [p.ds_numel for p in model.parameters() if p.ds_status.name != "NOT_AVAILABLE"]
    from torch.distributed.fsdp import FSDPModule

    whole = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for param in group.fsdp_params:
                    if hasattr(param, "_unsharded_param") and param._unsharded_param.untyped_storage().size() > 0:
                        whole.append(param._unsharded_param.numel())
    return whole


class MostGathered:
    """The most parameter entries held whole at once, read at every module's forward start and end."""

    def __init__(self, model: torch.nn.Module, engine: str) -> None:
        self.model, self.engine, self.value = model, engine, 0

    def _read(self, *unused) -> None:
        self.value = max(self.value, sum(whole_parameters(self.model, self.engine)))

    def __enter__(self) -> MostGathered:
        self._handles = [h for m in self.model.modules() for h in (m.register_forward_pre_hook(self._read),
                                                                   m.register_forward_hook(self._read))]  # fmt: skip
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()


def main(engine: str, cases_file: str, out: str) -> None:
    from hf_flatbias.flatness import estimate_hessian_trace

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = sharded_model(engine)
    for case in json.loads(Path(cases_file).read_text()):
        result: dict = {"world_size": dist.get_world_size()}
        try:
            with MostGathered(model, engine) as gathered:
                estimate = estimate_hessian_trace(model, causal_rows(), across_processes=True, **case["trace"])
            result["most_gathered"] = gathered.value
            result.update(mean=estimate.mean, stderr=estimate.stderr, n_contexts=estimate.n_contexts)
            if estimate.by_group is not None:
                result["by_group"] = {name: value.mean for name, value in estimate.by_group.items()}
        except ValueError as error:
            result["error"] = str(error)
        result["whole_after"] = sum(whole_parameters(model, engine))
        Path(out, f"{case['name']}.rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
