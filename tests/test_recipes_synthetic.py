"""The synthetic-language recipes in --smoke mode: output schema and the entropy floor's place among the losses."""

import json
from pathlib import Path

import numpy as np
import pytest

from hf_flatbias.constants import IGNORE_INDEX
from hf_flatbias.experiments import (
    add_common_arguments,
    at_common_loss,
    build_model,
    context_batch,
    default_output_dir,
    flatness_selection,
    markdown_table,
    parse_recipe_arguments,
    partial_spearman,
    summarize,
)
from hf_flatbias.synthetic import PCFG, build_pcfg_dataset, masked_contexts

RECORD_KEYS = {"step", "loss", "loss_gap_to_entropy", "hessian_trace", "hessian_trace_stderr", "probe_accuracy"}


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
    payload = recipes.load("pcfg_lookup_table").main(["--smoke", "--output-dir", str(tmp_path)])
    table = payload["lookup_table"]
    assert table["loss"] == pytest.approx(payload["entropy_bound"], abs=1e-4)
    check_records(payload["transformer"], payload["entropy_bound"])
    assert json.loads((tmp_path / "results.json").read_text())["recipe"] == "lookup_table"


def test_continue_training_recipe_smoke(recipes, tmp_path):
    payload = recipes.load("pcfg_continue_training").main(["--smoke", "--output-dir", str(tmp_path)])
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
    summary = summarize(tmp_path / "results.json").splitlines()
    assert summary[0].startswith("### continue_training (pcfg)")
    assert sum(line.startswith("| adamw |") for line in summary) == len(payload["records"])


def test_contexts_are_padded_as_they_are_with_one_label_each():
    contexts = masked_contexts(build_pcfg_dataset(PCFG.from_seed(0), 1, 12, seed=0)["validation"], seed=1)
    batch = context_batch(contexts)
    lengths = [len(row) for row in contexts["input_ids"]]
    assert len(set(lengths)) > 1  # the padding is exercised
    assert batch["input_ids"].shape == (len(contexts), max(lengths))
    for i, (row, labels) in enumerate(zip(contexts["input_ids"], contexts["labels"], strict=True)):
        assert batch["input_ids"][i, : len(row)].tolist() == row and batch["labels"][i, : len(row)].tolist() == labels
        assert batch["attention_mask"][i].tolist() == [1] * len(row) + [0] * (max(lengths) - len(row))
        assert (batch["labels"][i, len(row) :] == IGNORE_INDEX).all()
        assert int((batch["labels"][i] != IGNORE_INDEX).sum()) == 1


def test_partial_spearman_matches_the_correlation_of_rank_residuals():
    from scipy.stats import rankdata

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


def test_runs_are_compared_at_the_lowest_loss_all_of_them_reached():
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
    payload = recipes.load("pcfg_optimizers").main(["--smoke", "--output-dir", str(tmp_path)])
    assert set(payload["runs"]) == {"adamw_dropout_wd", "adamw_plain", "adamw_plain_sam"}
    for records in payload["runs"].values():
        check_records(records, payload["entropy_bound"])


@pytest.mark.slow
@pytest.mark.parametrize("script", ["hmm_continue_training.py", "hmm_lookup_table.py", "hmm_optimizers.py"])
def test_hmm_recipes_run_as_scripts(script, recipes, tmp_path):
    completed = recipes.run(script, "--smoke", "--output-dir", str(tmp_path), tmp_path=tmp_path)
    assert completed.returncode == 0, completed.stderr[-4000:]
    payload = json.loads((tmp_path / "results.json").read_text())
    assert payload["language"] == "hmm"


def test_build_model_heads_default_and_override():
    assert build_model(20, hidden=64, layers=1).config.num_attention_heads == 2  # hidden // 32, as before
    assert build_model(20, hidden=64, layers=1, heads=4).config.num_attention_heads == 4
    with pytest.raises(ValueError, match="heads"):
        build_model(20, hidden=64, layers=1, heads=3)


def test_markdown_table_formats_cells():
    table = markdown_table([{"a": 1, "b": 0.123456}, {"a": "x", "b": float("nan")}], ["a", "b", "c"])
    assert table.splitlines() == ["| a | b | c |", "|---|---|---|", "| 1 | 0.1235 |  |", "| x | nan |  |"]


def test_selection_is_skipped_without_traces_and_never_sees_the_probe():
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


def test_smoke_runs_write_beside_the_real_results_not_over_them(tmp_path):
    import argparse

    def parsed(*argv):
        parser = argparse.ArgumentParser()
        add_common_arguments(parser, steps=100, eval_every=10)
        return parse_recipe_arguments(parser, list(argv), "pcfg")

    assert default_output_dir(parsed(), "pcfg_optimizers") == Path("outputs/pcfg_optimizers")
    assert default_output_dir(parsed("--smoke"), "pcfg_optimizers") == Path("outputs/pcfg_optimizers-smoke")
    assert default_output_dir(parsed("--smoke", "--output-dir", str(tmp_path)), "pcfg_optimizers") == tmp_path
