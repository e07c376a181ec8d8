"""An FSDP or DeepSpeed launch that accelerate does not start as such is refused when the trainer is built.

On a machine without a GPU, accelerate 1.15/1.16 picks no backend for an FSDP or DeepSpeed launch: it counts one
process while torch.distributed's process group holds two, so both ranks believe they are the main one. Before the
check, rank 0 was refused by the output folder's lock ("being written by another training", the wrong cause) and rank
1 died in SAM's first all-reduce. Now every rank refuses at construction with one line naming the cause and the fix,
and the launch ends well within its timeout; the same launch with DDP on purpose (``use_cpu=True``) or with the
harness's workaround builds the trainer on the engine asked for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.test_distributed import CONFIGS, HAS_DEEPSPEED, REPO_ROOT, free_port

pytestmark = pytest.mark.distributed

SCRIPT = REPO_ROOT / "tests" / "helpers" / "engine_not_active_script.py"
#: A launch builds five small trainers (about 45 s on this machine); a hang would stop at the timeout.
TIMEOUT_S = 600
GUIDE = "docs/guides/training.md"


def launch(config: str, out_dir: Path) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    port = free_port()
    env.update(PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", HF_HUB_OFFLINE="1")
    command = [
        *(sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config)),
        *("--main_process_port", str(port), str(SCRIPT), str(out_dir)),
    ]
    completed = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    if completed.returncode != 0:
        pytest.fail(f"launch failed ({completed.returncode}):\n{completed.stderr[-4000:]}")
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def assert_refused(result: dict, *phrases: str) -> None:
    message = result["error"]
    assert message is not None, result
    assert "\n" not in message
    for phrase in (*phrases, GUIDE):
        assert phrase in message, message


def assert_built(result: dict, distributed_type: str) -> None:
    assert result == {"error": None, "distributed_type": distributed_type, "num_processes": 2}


def test_fsdp_launch_that_accelerate_does_not_start_is_refused_on_every_rank(tmp_path):
    for result in launch("accelerate_fsdp2_cpu_2proc.yaml", tmp_path):
        # accelerate's own view, as launched: one process of two, no FSDP
        assert_refused(result["as_launched"], "FSDP was requested", "2 processes", "counts 1", "type NO", "use_cpu")
        assert_refused(result["use_cpu"], "FSDP was requested", "MULTI_CPU")
        assert_refused(result["no_backend"], "2 processes", "counts 1", "use_cpu=True")
        assert "lock" not in result["as_launched"]["error"]
        assert_built(result["ddp"], "MULTI_CPU")
        assert_built(result["worked_around"], "FSDP")


@pytest.mark.deepspeed
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs the deepspeed extra")
def test_deepspeed_launch_that_accelerate_does_not_start_is_refused_on_every_rank(tmp_path):
    for result in launch("accelerate_deepspeed_zero2.yaml", tmp_path):
        assert_refused(result["as_launched"], "DeepSpeed was requested", "2 processes", "counts 1", "DEEPSPEED")
        assert_refused(result["no_backend"], "2 processes", "counts 1")
        assert_built(result["ddp"], "MULTI_CPU")
        assert_built(result["worked_around"], "DEEPSPEED")
