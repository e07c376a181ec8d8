"""The measures beyond the trace in training and on cards: the callback logs them without changing training, the card
records each with its settings and step and reads them back, and compare shows them."""

import json
import math

import pytest
from transformers import BertForMaskedLM

from hf_flatbias.callbacks import HessianTraceCallback
from hf_flatbias.cli import main
from hf_flatbias.constants import (
    SAM_SHARPNESS_METRIC,
    SAM_SHARPNESS_STDERR_METRIC,
    TOP_EIGENVALUE_METRIC,
    TRACE_METRIC,
)
from hf_flatbias.flatness.spectrum import estimate_sam_sharpness, estimate_top_eigenvalues
from hf_flatbias.modelcard import flatness_card_from_trainer, format_comparison_table, load_flatness_card
from tests.helpers.tiny_models import assert_training_unchanged, trace_command_contexts, train_word_mlm
from tests.test_cli_trace import checkpoint  # noqa: F401 - the fixture
from tests.test_modelcard import front_matter, full_card
from tests.test_trace_callback import tokenizer  # noqa: F401 - the fixture

MEASURES = {
    "top_eigenvalue": {"value": 31.5, "residual": 0.002, "matrix": "hessian", "k": 2, "eigenvalues": [31.5, 12.25],
                       "n_contexts": 64, "n_matvecs": 30, "seconds": 1.5, "step": 40},
    "sam_sharpness": {"value": 0.125, "stderr": 0.0625, "rho": 0.05, "adaptive": False, "batch_size": 8,
                      "n_contexts": 64, "seconds": 0.5, "step": 38},
}  # fmt: skip


def test_card_records_every_measure_and_reads_it_back(tmp_path):
    card = full_card(measures={name: dict(record) for name, record in MEASURES.items()})
    path = card.save(tmp_path)
    flatness = front_matter(path)["flatness"]
    assert flatness["top_eigenvalue"] == MEASURES["top_eigenvalue"]
    assert flatness["sam_sharpness"] == MEASURES["sam_sharpness"]
    assert flatness["hessian_trace"] == 123.25  # the trace's keys stay as they were
    loaded = load_flatness_card(tmp_path)
    assert loaded.measures == MEASURES
    assert loaded == card
    text = path.read_text()
    assert "| Largest hessian eigenvalue | 31.5 (residual 0.002), step 40 |" in text
    assert "0.125 ± 0.062 (rho = 0.05, batches of 8), step 38" in text


def test_a_card_without_the_measures_reads_back_without_them(tmp_path):
    full_card().save(tmp_path)
    assert load_flatness_card(tmp_path).measures == {}


@pytest.mark.parametrize("record", [{"value": math.nan}, {"value": 1.0, "step": -1}, {"value": 1.0, "stderr": -1}])
def test_bad_measures_are_refused_and_nothing_is_written(tmp_path, record):
    with pytest.raises(ValueError, match="sam_sharpness"):
        full_card(measures={"sam_sharpness": record}).save(tmp_path)
    assert not (tmp_path / "README.md").exists()


def test_non_finite_measure_read_from_a_card_is_unknown(tmp_path):
    path = full_card(measures={"top_eigenvalue": dict(MEASURES["top_eigenvalue"])}).save(tmp_path)
    path.write_text(path.read_text().replace("value: 31.5", "value: .nan"))
    with pytest.warns(UserWarning, match="flatness.top_eigenvalue.value"):
        assert load_flatness_card(tmp_path).measures == {}


def test_compare_shows_every_recorded_measure():
    with_measures = full_card(measures={name: dict(record) for name, record in MEASURES.items()})
    table = format_comparison_table([("a", with_measures), ("b", full_card())]).splitlines()
    assert "top eigenvalue" in table[0] and "SAM sharpness ± stderr" in table[0]
    assert "| 31.5 (hessian) | 0.125 ± 0.062 (ρ=0.05) |" in table[2]
    assert "| - | - |" in table[3]
    assert "top eigenvalue" not in format_comparison_table([("b", full_card())])


def test_callback_logs_the_measures_without_changing_training(tmp_path, tokenizer):  # noqa: F811
    plain = train_word_mlm(tmp_path / "plain", tokenizer, [])
    callback = HessianTraceCallback(
        n_contexts=6, n_draws=2, every_n_steps=3, also_measure=("top_eigenvalue", "sam_sharpness"), sam_rho=0.1
    )
    measured = train_word_mlm(tmp_path / "measured", tokenizer, [callback])
    logged = [entry for entry in measured.state.log_history if TOP_EIGENVALUE_METRIC in entry]
    assert [entry["step"] for entry in logged] == [3, 6]
    assert all(SAM_SHARPNESS_METRIC in entry and SAM_SHARPNESS_STDERR_METRIC in entry for entry in logged)
    assert len([entry for entry in measured.state.log_history if TRACE_METRIC in entry]) == 2

    # the last values are those of the estimators on the final weights and the callback's contexts
    eigenvalues = estimate_top_eigenvalues(measured.model, callback._contexts, seed=callback.config.seed)
    sharpness = estimate_sam_sharpness(measured.model, callback._contexts, 0.1, batch_size=4)
    assert logged[-1][TOP_EIGENVALUE_METRIC] == pytest.approx(eigenvalues.top, rel=1e-5)
    assert logged[-1][SAM_SHARPNESS_METRIC] == pytest.approx(sharpness.mean, rel=1e-5)
    record = callback.flatness_record
    assert record.top_eigenvalues_step == record.sam_sharpness_step == record.trace_step == 6
    assert record.top_eigenvalues.matrix == "fisher" and record.sam_sharpness.batch_size == 4

    card = flatness_card_from_trainer(measured)
    assert card.measures["top_eigenvalue"]["step"] == 6 and card.measures["top_eigenvalue"]["matrix"] == "fisher"
    assert card.measures["sam_sharpness"]["rho"] == 0.1 and card.measures["sam_sharpness"]["n_contexts"] == 6
    card.save(tmp_path / "card")
    assert load_flatness_card(tmp_path / "card").measures == card.measures
    assert_training_unchanged(plain, measured)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"also_measure": ("trace_norm",)}, "trace_norm"),
        ({"also_measure": ("top_eigenvalue",), "eigenvalue_matrix": "ggn"}, "eigenvalue_matrix"),
        ({"also_measure": ("sam_sharpness",), "sam_rho": 0.0}, "sam_rho"),
    ],
)
def test_bad_measure_arguments_fail_when_the_callback_is_made(arguments, message):
    with pytest.raises(ValueError, match=message):
        HessianTraceCallback(**arguments)


def test_trace_command_takes_every_measure(checkpoint, tmp_path, capsys):  # noqa: F811
    folder, data, text_tokenizer, lines = checkpoint
    output = tmp_path / "measures.json"
    arguments = ["trace", str(folder), "--data", str(data), "--n-contexts", "6", "--seed", "2", "--output", str(output)]
    measures = ["--measures", "trace,top_eigenvalue,sam_sharpness", "--top-k", "2", "--eigenvalue-matrix", "hessian"]
    assert main([*arguments, *measures, "--sam-rho", "0.1", "--sam-batch-size", "4", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "Fisher trace Tr(F) of" in printed  # the default estimator's quantity, not "Hessian trace"
    assert "Largest hessian eigenvalue: " in printed and "SAM sharpness" in printed
    written = json.loads(output.read_text())

    model = BertForMaskedLM.from_pretrained(folder)
    contexts = trace_command_contexts(text_tokenizer, lines, n_contexts=6, seed=2)
    eigenvalues = estimate_top_eigenvalues(model, contexts, k=2, matrix="hessian", seed=2)
    sharpness = estimate_sam_sharpness(model, contexts, 0.1, batch_size=4)
    assert written["top_eigenvalues"]["eigenvalues"] == pytest.approx(eigenvalues.eigenvalues, rel=1e-5)
    assert written["sam_sharpness"]["per_batch"] == pytest.approx(sharpness.per_batch, rel=1e-5)
    assert written["estimate"]["n_contexts"] == 6

    assert main([*arguments, "--measures", "sam_sharpness", "--no-progress"]) == 0
    only = json.loads(output.read_text())
    assert "estimate" not in only and "top_eigenvalues" not in only and only["sam_sharpness"]["rho"] == 0.05
    with pytest.raises(SystemExit):
        main([*arguments, "--measures", "trace,flatness"])
    assert "choose a comma-separated list" in capsys.readouterr().err
