"""The robust summary of trace estimates (issue 55, deliverable 3d): median of means and the top-1% share, against
numpy on fixed samples, on a heavy-tailed sample, and on every `TraceEstimate` that `summarize_trace_samples` makes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hf_flatbias.flatness.results import TraceSamples, summarize_trace_samples
from hf_flatbias.flatness.robust_summary import median_of_means, top_share


def _numpy_median_of_means(values: np.ndarray, n_groups: int) -> float:
    return float(np.median([chunk.mean() for chunk in np.array_split(values, n_groups)]))


@pytest.mark.parametrize("n_groups", [10, 7, 1, 500])
def test_median_of_means_equals_numpy(n_groups):
    values = np.random.default_rng(3).gamma(2.0, 5.0, size=203)
    got, used = median_of_means(torch.tensor(values), n_groups=n_groups)
    assert used == min(n_groups, 203)
    assert got == pytest.approx(_numpy_median_of_means(values, used), rel=1e-12)


def test_weighted_groups_are_weighted_means():
    values = np.array([1.0, 2.0, 10.0, 4.0, 3.0, 8.0])
    weights = np.array([1.0, 3.0, 1.0, 2.0, 2.0, 4.0])
    got, used = median_of_means(torch.tensor(values), torch.tensor(weights), n_groups=3)
    groups = [
        np.average(v, weights=w) for v, w in zip(np.array_split(values, 3), np.array_split(weights, 3), strict=True)
    ]
    assert used == 3 and got == pytest.approx(float(np.median(groups)))


def test_heavy_tail_pulls_the_mean_not_the_median_of_means():
    # 2,000 per-context traces near 130 and two contexts with enormous gradients, as in campaign v2's C1 branches
    rng = np.random.default_rng(0)
    clean = rng.gamma(20.0, 130.0 / 20.0, size=2000)
    heavy = clean.copy()
    heavy[[137, 1411]] = 50_000.0
    mean_clean, mean_heavy = clean.mean(), heavy.mean()
    mom_clean, _ = median_of_means(torch.tensor(clean))
    mom_heavy, _ = median_of_means(torch.tensor(heavy))
    assert mean_heavy - mean_clean > 40  # the two contexts move the mean by about 50
    assert abs(mom_heavy - mom_clean) < 3.0  # two groups change; the median moves by about a rank, not by 50
    assert abs(mom_clean - mean_clean) < 2.0
    share_clean, units = top_share(torch.tensor(clean))
    share_heavy, _ = top_share(torch.tensor(heavy))
    assert units == 20
    top = np.sort(heavy)[::-1][:20].sum() / heavy.sum()
    assert share_heavy == pytest.approx(top, rel=1e-12)
    assert share_clean < 0.02 < 0.25 < share_heavy  # 100,000 of about 360,000


def test_skewed_sample_median_of_means_sits_below_the_mean():
    # lognormal per-context values: every group mean is right-skewed too, so their median is below the mean
    values = np.random.default_rng(1).lognormal(0.0, 1.5, size=1000)
    got, _ = median_of_means(torch.tensor(values))
    assert got < values.mean()
    assert got == pytest.approx(_numpy_median_of_means(values, 10), rel=1e-12)


def test_top_share_of_alike_units_is_their_count_share():
    share, units = top_share(torch.full((700,), 2.5))
    assert units == 7 and share == pytest.approx(7 / 700)
    signed, _ = top_share(torch.tensor([-4.0, 1.0, 1.0, 2.0]), fraction=0.25)
    assert signed == pytest.approx(0.5)
    assert math.isnan(top_share(torch.zeros(5))[0])


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: median_of_means(torch.ones(4), n_groups=0), "n_groups"),
        (lambda: median_of_means(torch.ones(4), torch.ones(3)), "differ in length"),
        (lambda: median_of_means(torch.ones(0)), "at least one"),
        (lambda: top_share(torch.ones(4), fraction=0.0), "fraction"),
        (lambda: top_share(torch.ones(2), torch.tensor([1.0, 0.0])), "weights"),
    ],
)
def test_bad_arguments_name_the_fix(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_every_trace_estimate_carries_the_summary():
    values = torch.tensor(np.random.default_rng(2).gamma(2.0, 3.0, size=(40, 2)))
    estimate = summarize_trace_samples(TraceSamples(values, torch.ones(40), n_draws=2, estimator="per_sample"))
    unit_means = values.double().mean(dim=1).numpy()
    assert estimate.median_of_means == pytest.approx(_numpy_median_of_means(unit_means, 10), rel=1e-12)
    assert estimate.median_of_means_groups == 10
    assert estimate.top_share_units == 1
    assert estimate.top_share == pytest.approx(unit_means.max() / unit_means.sum(), rel=1e-12)
    assert "median_of_means" in estimate.to_dict()
    single = summarize_trace_samples(TraceSamples(values[:2], torch.ones(2), n_draws=2, estimator="per_sample"))
    assert single.median_of_means is None and single.top_share is None


def test_card_records_reads_back_and_shows_the_summary(tmp_path):
    from hf_flatbias.flatness.results import FlatnessRecord, TraceEstimate
    from hf_flatbias.modelcard import FlatnessCard, load_flatness_card
    from hf_flatbias.modelcard.from_trainer import _trace_from_records

    estimate = TraceEstimate(
        mean=179.7,
        stderr=44.0,
        n_contexts=2000,
        n_draws=1,
        estimator="per_sample",
        seconds=1.0,
        median_of_means=131.2,
        median_of_means_groups=10,
        top_share=0.29,
        top_share_units=20,
    )
    fields = _trace_from_records([FlatnessRecord(trace=estimate, trace_step=40000)])
    assert fields["hessian_trace_median_of_means"] == 131.2 and fields["top_share_contexts"] == 20
    card = FlatnessCard(model_name="m", **fields)
    card.save(tmp_path)
    text = (tmp_path / "README.md").read_text()
    assert "median of means of 10 groups of contexts | 131.2 |" in text
    assert "top 1% of contexts (20) | 29.0% |" in text
    read = load_flatness_card(tmp_path)
    assert (read.hessian_trace_median_of_means, read.median_of_means_groups) == (131.2, 10)
    assert (read.hessian_trace_top_share, read.top_share_contexts) == (0.29, 20)
    old = FlatnessCard(model_name="m", hessian_trace=1.0)  # a card written before the summary: nothing shown
    assert "median of means" not in old.render()


def test_card_and_compare_commands_show_the_summary(tmp_path, capsys):
    from hf_flatbias.cli import main as cli_main
    from hf_flatbias.modelcard import FlatnessCard

    for name, mom in (("a", 131.2), ("b", None)):
        FlatnessCard(
            model_name=name,
            hessian_trace=179.7,
            hessian_trace_stderr=44.0,
            hessian_trace_median_of_means=mom,
            median_of_means_groups=10 if mom else None,
            hessian_trace_top_share=0.29 if mom else None,
            top_share_contexts=20 if mom else None,
        ).save(tmp_path / name)
    assert cli_main(["card", str(tmp_path / "a")]) == 0
    shown = capsys.readouterr().out
    assert "| trace, median of means | 131.2 (10 groups) |" in shown
    assert "| trace's top 1% of contexts carry | 29.0% (20 contexts) |" in shown
    assert cli_main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    table = capsys.readouterr().out
    assert "179.7 ± 44 (MoM 131.2)" in table and "| 179.7 ± 44 |" in table


def test_trace_command_line_names_groups_and_share():
    from hf_flatbias.commands.trace import robust_summary_line

    line = robust_summary_line(
        {"median_of_means": 131.2, "median_of_means_groups": 10, "top_share": 0.29, "top_share_units": 20}
    )
    assert line == "Median of means (10 groups): 131.2; the top 20 contexts carry 29.0% of it"


def test_compare_sorts_by_the_median_of_means(tmp_path, capsys):
    from hf_flatbias.cli import main as cli_main
    from hf_flatbias.modelcard import FlatnessCard

    for name, mean, mom in (("heavy", 179.7, 131.2), ("plain", 150.0, 140.0), ("old", 100.0, None)):
        FlatnessCard(model_name=name, hessian_trace=mean, hessian_trace_median_of_means=mom).save(tmp_path / name)
    folders = [str(tmp_path / name) for name in ("heavy", "plain", "old")]
    assert cli_main(["compare", *folders, "--sort", "trace_median_of_means"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if str(tmp_path) in line]
    assert [row.split("|")[1].strip().rsplit("/", 1)[-1] for row in rows] == ["heavy", "plain", "old"]
    assert cli_main(["compare", *folders, "--sort", "trace"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if str(tmp_path) in line]
    assert [row.split("|")[1].strip().rsplit("/", 1)[-1] for row in rows] == ["old", "plain", "heavy"]
