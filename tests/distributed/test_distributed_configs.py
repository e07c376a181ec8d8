"""The accelerate and DeepSpeed configs in recipes/configs load and describe what their names say."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import DistributedType

from hf_flatbias.sharpness.support import check_deepspeed_supports_sam

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIGS = REPO_ROOT / "recipes" / "configs"

ACCELERATE_CONFIGS = {
    "accelerate_1proc.yaml": (DistributedType.NO, 1),
    "accelerate_cpu_1proc.yaml": (DistributedType.NO, 1),
    "accelerate_cpu_2proc.yaml": (DistributedType.MULTI_GPU, 2),
    "accelerate_multi_gpu.yaml": (DistributedType.MULTI_GPU, 2),
    "accelerate_deepspeed_zero1.yaml": (DistributedType.DEEPSPEED, 2),
    "accelerate_deepspeed_zero2.yaml": (DistributedType.DEEPSPEED, 2),
    "accelerate_deepspeed_zero3.yaml": (DistributedType.DEEPSPEED, 2),
    "accelerate_fsdp2_cpu_2proc.yaml": (DistributedType.FSDP, 2),
}


def test_every_distributed_config_is_known():
    present = {p.name for p in CONFIGS.glob("accelerate_*.yaml")} | {p.name for p in CONFIGS.glob("deepspeed_*.json")}
    expected = set(ACCELERATE_CONFIGS) | {f"deepspeed_zero{stage}.json" for stage in range(4)}
    assert present == expected


@pytest.mark.parametrize("name", sorted(ACCELERATE_CONFIGS))
def test_accelerate_config_loads(name):
    config = load_config_from_file(str(CONFIGS / name))
    distributed_type, processes = ACCELERATE_CONFIGS[name]
    assert config.distributed_type == distributed_type
    assert config.num_processes == processes
    if distributed_type == DistributedType.DEEPSPEED:
        stage = int(name.removesuffix(".yaml")[-1])
        deepspeed_file = REPO_ROOT / config.deepspeed_config["deepspeed_config_file"]
        assert json.loads(deepspeed_file.read_text())["zero_optimization"]["stage"] == stage
        # accelerate refuses a deepspeed_config_file next to settings it would ignore
        assert config.mixed_precision in (None, "no") and "zero_stage" not in config.deepspeed_config
        assert config.deepspeed_config["zero3_init_flag"] == (stage == 3)
    if distributed_type == DistributedType.FSDP:
        # FSDP2 is what the flatness steps support; FSDP1 is refused at trainer start
        assert config.fsdp_config["fsdp_version"] == 2 and config.mixed_precision == "no" and not config.use_cpu


@pytest.mark.parametrize("stage", range(4))
def test_deepspeed_json_runs_sam(stage):
    config = json.loads((CONFIGS / f"deepspeed_zero{stage}.json").read_text())
    assert config["zero_optimization"]["stage"] == stage
    # the Trainer's torch optimizers (sgd, adamw_torch) need this under ZeRO; batch sizes come from the arguments
    assert config["zero_allow_untested_optimizer"] is True
    assert config["train_micro_batch_size_per_gpu"] == "auto" and config["gradient_accumulation_steps"] == "auto"
    check_deepspeed_supports_sam(config, "global")
