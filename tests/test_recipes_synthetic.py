"""The synthetic-language recipes in --smoke mode: output schema and the entropy floor's place among the losses."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
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
    assert {
        "spearman_trace_vs_accuracy",
        "spearman_loss_vs_accuracy",
        "partial_spearman_trace_vs_accuracy_given_loss",
        "spearman_trace_vs_accuracy_mean_pooled",
        "n_checkpoints",
    } <= set(payload["correlations_all_checkpoints"])
    selection = payload["flatness_selection"]
    assert selection["flattest"]["step"] in selection["candidates"]
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_partial_spearman_matches_the_correlation_of_rank_residuals(recipes):
    from scipy.stats import rankdata
    from synthetic_common import partial_spearman

    rng = np.random.default_rng(0)
    loss = rng.normal(size=40)
    trace = loss + rng.normal(size=40)
    accuracy = -loss - 0.5 * trace + rng.normal(size=40)

    def residual(values, control):
        design = np.column_stack([np.ones_like(control), control])
        return values - design @ np.linalg.lstsq(design, values, rcond=None)[0]

    ranks = [rankdata(v) for v in (trace, accuracy, loss)]
    expected = np.corrcoef(residual(ranks[0], ranks[2]), residual(ranks[1], ranks[2]))[0, 1]
    assert partial_spearman(trace, accuracy, loss) == pytest.approx(expected, abs=1e-12)
    assert partial_spearman([1, 2, 3], [3, 2, 1], [1, 2, 3]) is None  # the control explains everything


def test_runs_are_compared_at_the_lowest_loss_all_of_them_reached(recipes):
    from synthetic_common import at_common_loss

    runs = {
        "fast": [{"step": 0, "loss": 4.0}, {"step": 10, "loss": 2.0}, {"step": 20, "loss": 1.5}],
        "slow": [{"step": 0, "loss": 4.0}, {"step": 10, "loss": 3.0}, {"step": 20, "loss": 2.1}],
    }
    common = at_common_loss(runs)
    assert common["target_loss"] == 2.1
    assert common["checkpoints"]["fast"]["step"] == 10 and common["checkpoints"]["slow"]["step"] == 20
    with pytest.raises(ValueError, match="no checkpoint after step 0"):
        at_common_loss({**runs, "unevaluated": [{"step": 0, "loss": 4.0}]})


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


def test_build_model_heads_default_and_override(recipes):
    from synthetic_common import build_model

    assert build_model(20, hidden=64, layers=1).config.num_attention_heads == 2  # hidden // 32, as before
    assert build_model(20, hidden=64, layers=1, heads=4).config.num_attention_heads == 4
    with pytest.raises(ValueError, match="heads"):
        build_model(20, hidden=64, layers=1, heads=3)


def test_markdown_table_formats_cells(recipes):
    from synthetic_common import markdown_table

    table = markdown_table([{"a": 1, "b": 0.123456}, {"a": "x", "b": float("nan")}], ["a", "b", "c"])
    assert table.splitlines() == ["| a | b | c |", "|---|---|---|", "| 1 | 0.1235 |  |", "| x | nan |  |"]


def test_selection_is_skipped_without_traces_and_never_sees_the_probe(recipes):
    from synthetic_common import flatness_selection

    records = [
        {"step": 10, "loss": 2.00, "hessian_trace": 90.0, "hessian_trace_stderr": 1.0, "probe_accuracy": 0.9},
        {"step": 20, "loss": 1.99, "hessian_trace": 80.0, "hessian_trace_stderr": 1.0, "probe_accuracy": 0.1},
        {"step": 30, "loss": 1.98, "hessian_trace": 95.0, "hessian_trace_stderr": 1.0, "probe_accuracy": 0.8},
        {"step": 40, "loss": 2.50, "hessian_trace": 10.0, "hessian_trace_stderr": 1.0, "probe_accuracy": 1.0},
    ]
    selection = flatness_selection(records, tolerance=0.05)
    assert selection["candidates"] == [10, 20, 30]  # step 40 is flattest but 0.52 nats worse
    assert selection["flattest"]["step"] == 20 and selection["lowest_loss"]["step"] == 30
    assert selection["accuracy_gain"] == pytest.approx(0.1 - 0.8)
    assert flatness_selection([{**r, "hessian_trace": None} for r in records], tolerance=0.05) is None
