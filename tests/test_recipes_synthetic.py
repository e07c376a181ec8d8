"""The synthetic-language recipes in --smoke mode: output schema and the entropy floor's place among the losses."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RECORD_KEYS = {"step", "loss", "loss_gap_to_entropy", "hessian_trace", "hessian_trace_stderr", "probe_accuracy"}


@pytest.fixture
def recipes(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "recipes"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def check_records(records, entropy):
    for record in records:
        assert RECORD_KEYS <= set(record)
        # no trained model beats the exact conditionals on the same contexts
        assert record["loss"] > entropy
        assert record["loss_gap_to_entropy"] == pytest.approx(record["loss"] - entropy)
        assert record["hessian_trace"] > 0 and record["hessian_trace_stderr"] >= 0
        assert 0 <= record["probe_accuracy"] <= 1


@pytest.mark.slow  # about 70 s on the shared machine: exact conditional features of every probe sentence
def test_lookup_table_recipe_smoke(recipes, tmp_path):
    from pcfg_lookup_table import main

    payload = main(["--smoke", "--output-dir", str(tmp_path)])
    table = payload["lookup_table"]
    assert table["loss"] == pytest.approx(payload["entropy_bound"], abs=1e-4)
    check_records(payload["transformer"], payload["entropy_bound"])
    assert json.loads((tmp_path / "results.json").read_text())["recipe"] == "lookup_table"


def test_continue_training_recipe_smoke(recipes, tmp_path):
    from pcfg_continue_training import main

    payload = main(["--smoke", "--output-dir", str(tmp_path)])
    assert [r["step"] for r in payload["records"]] == [0, 10, 20]
    check_records(payload["records"], payload["entropy_bound"])
    assert set(payload["correlations_all_checkpoints"]) == {
        "spearman_trace_vs_accuracy",
        "spearman_loss_vs_accuracy",
        "n_checkpoints",
    }
    assert (tmp_path / "plot.png").stat().st_size > 0


@pytest.mark.slow
def test_optimizers_recipe_smoke(recipes, tmp_path):
    from pcfg_optimizers import main

    payload = main(["--smoke", "--output-dir", str(tmp_path)])
    assert set(payload["runs"]) == {"adamw_dropout_wd", "adamw_plain", "adamw_plain_sam"}
    for records in payload["runs"].values():
        check_records(records, payload["entropy_bound"])


@pytest.mark.slow
@pytest.mark.parametrize("script", ["hmm_continue_training.py", "hmm_lookup_table.py", "hmm_optimizers.py"])
def test_hmm_recipes_run_as_scripts(script, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, str(REPO / "recipes" / script), "--smoke", "--output-dir", str(tmp_path)],
        check=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    payload = json.loads((tmp_path / "results.json").read_text())
    assert payload["language"] == "hmm"
