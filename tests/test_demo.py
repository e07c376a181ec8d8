"""The README's main job, `hf-flatbias demo`, end to end at a small size."""

import json
import math

import pytest
import yaml

from hf_flatbias.cli import main


def test_demo_trains_with_sam_logs_the_trace_and_writes_the_card(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--output-dir", str(out), "--steps", "12", "--n-train", "400", "--trace-contexts", "32"]) == 0
    printed = capsys.readouterr().out
    summary = json.loads(printed[printed.rindex("\n{") + 1:])

    metadata = yaml.safe_load((out / "README.md").read_text().split("---")[1])
    flatness = metadata["flatness"]
    assert flatness["method"] == "sam" and flatness["sam_rho"] == pytest.approx(0.05)
    assert math.isfinite(flatness["hessian_trace"]) and flatness["hessian_trace"] > 0
    assert flatness["hessian_trace_stderr"] > 0
    assert summary["hessian_trace"] == pytest.approx(flatness["hessian_trace"])
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()


def test_demo_rejects_a_non_positive_step_count(tmp_path):
    with pytest.raises(SystemExit, match="--steps"):
        main(["demo", "--output-dir", str(tmp_path), "--steps", "0"])
