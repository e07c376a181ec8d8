"""benchmarks/gpu_check.py --dry-run: every part of the GPU check runs on a tiny BERT on CPU and lands in the JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # a whole recipe's smoke run (minutes on CI's 2 cores); its parts are tested by the fast tests
def test_gpu_check_dry_run_writes_every_part(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MASTER_PORT="29547")
    completed = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--out", str(out)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] is True
    assert report["sam_step_ratio"]["ratio"] > 1.0  # two passes cost more than one
    assert report["sam_precision"]["bf16"]["ok"], report["sam_precision"]
    assert "skipped" in report["sam_precision"]["fp16"]
    trace = report["trace_throughput"]
    assert trace["auto_batch_size"] >= 1 and trace["trace_contexts_per_second"] > 0
    assert report["sam_zero2"]["ran_under_deepspeed"] and report["sam_zero2"]["ok"], report["sam_zero2"]
    assert "SAM under ZeRO-2 vs without" in completed.stdout
