"""recipes/sft_sam.py: the smoke run, launched as users launch it (accelerate launch, one CPU process)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

pytest.importorskip("trl")


def test_smoke_run_under_accelerate_launch(recipes, tmp_path):
    output_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(recipes.directory / "configs" / "accelerate_cpu_1proc.yaml"),
        str(recipes.directory / "sft_sam.py"),
        "--config", str(recipes.directory / "configs" / "sft_sam.yaml"),
        "--smoke", "--output_dir", str(output_dir),
    ]  # fmt: skip
    result = subprocess.run(
        command, env=recipes.environment(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((output_dir / "sft_summary.json").read_text())
    assert summary["flatness_method"] == "sam" and summary["steps"] == 4 and summary["trace_contexts"] == 8
    assert math.isfinite(summary["eval_loss"]) and summary["hessian_trace"] > 0
    card = (output_dir / "README.md").read_text()
    assert all(f"- {tag}\n" in card for tag in ("trl", "sft", "hf_flatbias", "sam"))  # trl's tags and ours
    assert (output_dir / "tokenizer_config.json").is_file()
