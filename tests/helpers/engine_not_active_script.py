"""Builds FlatBiasTrainers inside an FSDP or DeepSpeed launch that accelerate, on a machine without a GPU, does not
start as such, and records what each construction said.

Started by `tests/distributed/test_engine_not_active.py` through ``accelerate launch`` (2 CPU processes):

    accelerate launch --config_file recipes/configs/accelerate_fsdp2_cpu_2proc.yaml \
        tests/helpers/engine_not_active_script.py OUT_DIR

Cases, in this order (each after forgetting accelerate's state): ``as_launched`` (the launch as it comes: accelerate
counts 1 process of 2), ``use_cpu`` (``use_cpu=True``: DDP over gloo instead of FSDP; FSDP launches only),
``no_backend`` (the launcher's FSDP/DeepSpeed settings dropped, nothing requested: still 1 process of 2), ``ddp`` (the
same with ``use_cpu=True``: DDP over gloo on purpose, accepted), ``worked_around`` (the harness's
`work_around_accelerate_cpu_world_size`: the requested engine really runs, accepted). Each rank writes
``OUT_DIR/rank<r>.json``: per case the error message (``None`` when the trainer was built), the distributed type and
the number of processes accelerate counted.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.helpers.distributed_sam_script import (  # noqa: E402
    base_arguments,
    classification_rows,
    reset_accelerate,
    work_around_accelerate_cpu_world_size,
)
from tests.helpers.tiny_models import tiny_classifier  # noqa: E402


def build(out_dir: Path, case: str, **overrides) -> dict:
    from hf_flatbias import FlatBiasConfig, FlatBiasTrainer

    args = FlatBiasConfig(**{**base_arguments(str(out_dir / case)), "max_steps": 2, **overrides})
    try:
        trainer = FlatBiasTrainer(model=tiny_classifier(), args=args, train_dataset=classification_rows(8))
    except ValueError as error:
        return {"error": str(error)}
    state = trainer.accelerator
    return {"error": None, "distributed_type": state.distributed_type.name, "num_processes": state.num_processes}


def main(out: str) -> None:
    out_dir = Path(out)
    launch_environment = dict(os.environ)
    fsdp = launch_environment.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    results = {}
    reset_accelerate(launch_environment)
    results["as_launched"] = build(out_dir, "as_launched")
    if fsdp:
        reset_accelerate(launch_environment)
        results["use_cpu"] = build(out_dir, "use_cpu", use_cpu=True)
    reset_accelerate(launch_environment, keep_fsdp=False)
    for key in [k for k in os.environ if k.startswith("ACCELERATE_USE_")]:
        del os.environ[key]
    results["no_backend"] = build(out_dir, "no_backend")
    reset_accelerate(launch_environment, keep_fsdp=False)
    for key in [k for k in os.environ if k.startswith("ACCELERATE_USE_")]:
        del os.environ[key]
    results["ddp"] = build(out_dir, "ddp", use_cpu=True)
    work_around_accelerate_cpu_world_size()
    reset_accelerate(launch_environment)
    results["worked_around"] = build(out_dir, "worked_around")
    (out_dir / f"rank{os.environ['RANK']}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
