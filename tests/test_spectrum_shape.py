"""The spectrum's shape (issue 55, deliverable 3a): a power law fitted to the top eigenvalues, against numpy's
polyfit and scipy's linregress, recovered from a synthetic operator with a known power-law spectrum through the
package's own Lanczos, and wired through the table (the callback, the trace command, the card and compare)."""

import copy
import math

import numpy as np
import pytest
import scipy.stats
import torch

from hf_flatbias.cli import main
from hf_flatbias.flatness import build_masked_contexts, estimate_top_eigenvalues
from hf_flatbias.flatness.lanczos import thick_restart_lanczos
from hf_flatbias.flatness.spectrum_shape import fit_power_law, spectrum_shape
from hf_flatbias.measures import EXTRA_MEASURES, MEASURE_TABLE, MeasureSettings
from hf_flatbias.modelcard import format_comparison_table, load_flatness_card
from tests.helpers.tiny_models import VOCAB, tiny_mlm
from tests.test_modelcard import full_card


def test_the_fit_equals_numpy_polyfit_and_scipy_linregress():
    rng = np.random.default_rng(0)
    values = np.sort(7.0 * np.arange(1, 21) ** -1.4 * np.exp(0.1 * rng.standard_normal(20)))[::-1]
    fit = fit_power_law(values.tolist())
    ranks = np.log(np.arange(1, 21))
    slope, intercept = np.polyfit(ranks, np.log(values), 1)
    assert fit.alpha == pytest.approx(-slope, rel=1e-12) and fit.log_scale == pytest.approx(intercept, rel=1e-12)
    reference = scipy.stats.linregress(ranks, np.log(values))
    assert fit.alpha_stderr == pytest.approx(reference.stderr, rel=1e-10)
    assert fit.r_squared == pytest.approx(reference.rvalue**2, rel=1e-12)
    assert fit.n_fitted == 20


def test_an_exact_power_law_has_no_error_and_negative_values_are_left_out():
    fit = fit_power_law([3.0 * k**-0.8 for k in range(1, 11)] + [-0.5, 0.0])
    assert fit.alpha == pytest.approx(0.8, rel=1e-12) and fit.alpha_stderr == pytest.approx(0.0, abs=1e-12)
    assert fit.n_fitted == 10 and fit.log_scale == pytest.approx(math.log(3.0))
    shuffled = fit_power_law([3.0 * k**-0.8 for k in (4, 1, 10, 2, 3, 5, 6, 7, 8, 9)])
    assert shuffled.alpha == pytest.approx(0.8, rel=1e-12)  # ranked by value, not by position


@pytest.mark.parametrize(
    ("values", "message"),
    [([1.0, 0.5], "at least 3 positive"), ([1.0, -1.0, -2.0, 0.5], "at least 3"), ([1.0, math.nan, 0.2], "finite")],
)
def test_too_few_or_bad_values_name_the_fix(values, message):
    with pytest.raises(ValueError, match=message):
        fit_power_law(values)


@pytest.mark.parametrize("alpha", [0.7, 1.5])
def test_lanczos_on_an_operator_with_a_known_power_law_spectrum_recovers_alpha(alpha):
    """A rotated diagonal operator with eigenvalues ``5 k^-alpha`` (k = 1..300): the top 16 by the package's own
    thick-restart Lanczos, fitted, give ``alpha`` back."""
    n = 300
    generator = torch.Generator().manual_seed(1)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))
    spectrum = 5.0 * torch.arange(1, n + 1, dtype=torch.float64) ** -alpha
    operator = q @ torch.diag(spectrum) @ q.T
    start = torch.randn(n, generator=generator, dtype=torch.float64)
    pairs = thick_restart_lanczos(lambda v: operator @ v, start, 16, max_vectors=40, max_matvecs=600, tol=1e-8)
    assert np.allclose(sorted(pairs.values, reverse=True), spectrum[:16].numpy(), rtol=1e-6)
    fit = fit_power_law(pairs.values)
    assert fit.alpha == pytest.approx(alpha, rel=1e-5) and fit.alpha_stderr < 1e-5


def test_settings_refuse_a_fit_of_two_points():
    with pytest.raises(ValueError, match="power_law_k must be at least 3"):
        MeasureSettings(power_law_k=2)
    assert "spectrum_shape" in EXTRA_MEASURES


def _contexts(n=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    rows = [{"input_ids": torch.randint(2, VOCAB, (6,), generator=generator).tolist()} for _ in range(n)]
    return build_masked_contexts(rows, mask_token_id=1, seed=seed)


def test_the_measure_on_a_tiny_bert_is_the_fit_of_its_top_eigenvalues():
    model, contexts = tiny_mlm(seed=1), _contexts()
    settings = MeasureSettings(power_law_k=6)
    spec = MEASURE_TABLE["spectrum_shape"]
    result = spec.function()(model, contexts, n_contexts=None, settings=settings, seed=0, batch_size=4)
    assert isinstance(result, type(spectrum_shape(model, contexts, n_contexts=None, settings=settings, batch_size=4)))
    top = estimate_top_eigenvalues(model, contexts, k=6, max_iterations=100, seed=0, batch_size=4)
    assert result.eigenvalues == pytest.approx(top.eigenvalues, rel=1e-8)
    slope, _ = np.polyfit(np.log(np.arange(1, 7)), np.log(top.eigenvalues), 1)
    assert result.alpha == pytest.approx(-slope, rel=1e-6)
    record = spec.record(result)
    assert record["value"] == result.alpha and record["stderr"] == result.alpha_stderr and record["k"] == 6


RECORD = {
    "value": 1.25, "stderr": 0.0625, "r_squared": 0.984375, "log_scale": 2.5, "n_fitted": 16, "matrix": "fisher",
    "k": 16, "eigenvalues": [4.0, 2.0, 1.0], "n_contexts": 64, "n_matvecs": 120, "converged": True, "seconds": 3.5,
    "step": 40,
}  # fmt: skip


def test_card_reads_it_back_and_compare_shows_it(tmp_path, capsys):
    card = full_card(measures={"spectrum_shape": copy.deepcopy(RECORD)})
    card.save(tmp_path)
    loaded = load_flatness_card(tmp_path)
    assert loaded.measures == {"spectrum_shape": RECORD}
    text = (tmp_path / "README.md").read_text()
    assert (
        "| Spectrum power-law exponent α (fisher) ± fit standard error | 1.25 ± 0.062 (the 16 largest positive" in text
    )
    table = format_comparison_table([("a", loaded), ("b", full_card())]).splitlines()
    assert "spectrum α ± fit stderr" in table[0] and "| 1.25 ± 0.062 (fisher, top 16) |" in table[2]
    assert main(["card", str(tmp_path)]) == 0
    assert "R² 0.984" in capsys.readouterr().out


from tests.test_cli_trace import checkpoint  # noqa: E402, F401 - the fixture
from tests.test_trace_callback import tokenizer  # noqa: E402, F401 - the fixture


def test_trace_command_and_callback_take_it_as_the_api_does(checkpoint, tokenizer, tmp_path):  # noqa: F811
    import json

    from transformers import BertForMaskedLM

    from hf_flatbias import HessianTraceCallback
    from tests.helpers.tiny_models import trace_command_contexts, train_word_mlm

    folder, data, text_tokenizer, lines = checkpoint
    output = tmp_path / "out.json"
    arguments = ["trace", str(folder), "--data", str(data), "--n-contexts", "6", "--seed", "1", "--batch-size", "3"]
    arguments += ["--measures", "spectrum_shape", "--power-law-k", "4", "--output", str(output), "--no-progress"]
    assert main(arguments) == 0
    record = json.loads(output.read_text())["measures"]["spectrum_shape"]
    model = BertForMaskedLM.from_pretrained(folder)
    contexts = trace_command_contexts(text_tokenizer, lines, n_contexts=6, seed=1)
    direct = spectrum_shape(
        model, contexts, n_contexts=None, settings=MeasureSettings(power_law_k=4), seed=1, batch_size=3
    )
    assert record["value"] == pytest.approx(direct.alpha, rel=1e-9) and record["k"] == 4

    callback = HessianTraceCallback(
        n_contexts=6, n_draws=1, every_n_steps=3, batch_size=3, max_overhead=None, also_measure=("spectrum_shape",),
        measure_settings={"power_law_k": 4},
    )  # fmt: skip
    trained = train_word_mlm(tmp_path / "measured", tokenizer, [callback])
    logged = [entry for entry in trained.state.log_history if "flatness/spectrum_shape" in entry]
    assert [entry["step"] for entry in logged] == [3, 6] and "flatness/spectrum_shape_stderr" in logged[-1]
    assert callback.flatness_record.measures["spectrum_shape"].k == 4
