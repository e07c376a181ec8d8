"""Campaign v3 (issue 55): the gate's ladder, the contrasts at equal KL, the dose-response regression and the
tournament's statistics against independent computations; the reads loop resumed and shared; and (once committed)
every verdict recomputed from the committed JSON."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import rankdata, t

pytest.importorskip("transformers")

from research import campaign_v3 as c3  # noqa: E402
from research import rules_v3  # noqa: E402
from research import verdicts_v3 as v3  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "recipes" / "research" / "results" / "campaign_v3"


def _read(value: float, cv: float | None = None) -> dict:
    cv = value if cv is None else cv
    return {"seed": 0, "tasks": {task: {"test": value, "cv": cv} for task in "ABC"}, "cpu_seconds": 1.0}


def _gate_reads(first: list[list[float]], last: list[list[float]]) -> dict:
    """Reads of the gate's pair: ``first[r][j]`` the read of split r, seed index j."""
    a, b = rules_v3.GATE_PAIR
    return {
        key: {f"{r}/{j}": _read(value) for r, row in enumerate(rows) for j, value in enumerate(row)}
        for key, rows in ((a, first), (b, last))
    }


def test_gate_passes_at_the_first_rung_whose_spread_is_small_enough():
    first = [[0.80, 0.80]] * 5
    tight = [[0.805, 0.806], [0.806, 0.806], [0.804, 0.805], [0.805, 0.805], [0.806, 0.804]]
    gate = c3.gate_state(_gate_reads(first, tight), 5)
    assert gate["decided"] and gate["passed"] and gate["rung"] == 0 and gate["seeds"] == 2
    d = np.mean(tight, 1) - 0.80
    assert gate["rungs"][0]["sd"] == pytest.approx(np.std(d, ddof=1), abs=1e-15)


def test_gate_climbs_the_ladder_and_asks_for_more_seeds():
    first = [[0.80, 0.80]] * 5
    loose = [[0.81, 0.81], [0.80, 0.80], [0.79, 0.79], [0.81, 0.81], [0.80, 0.80]]
    gate = c3.gate_state(_gate_reads(first, loose), 5)
    assert not gate["decided"] and gate["rung"] == 1 and gate["seeds"] == 4
    assert gate["rungs"][0]["sd"] > rules_v3.GATE_MAX_SD and not gate["rungs"][0]["passed"]
    # seeds 3-4 pull every split to the same difference: rung 1 passes
    first4 = [[0.80] * 4] * 5
    balanced = [row + [1.61 - row[0]] * 2 for row in loose]  # mean of four = 0.805 on every split
    gate = c3.gate_state(_gate_reads(first4, balanced), 5)
    assert gate["decided"] and gate["passed"] and gate["rung"] == 1


def test_gate_failing_every_rung_reads_at_the_last_and_says_so():
    first = [[0.80] * 4] * 5
    loose = [[0.81] * 4, [0.80] * 4, [0.79] * 4, [0.81] * 4, [0.80] * 4]
    gate = c3.gate_state(_gate_reads(first, loose), 5)
    assert gate["decided"] and not gate["passed"] and (gate["seeds"], gate["rows"]) == rules_v3.GATE_LADDER[-1]
    assert len(gate["rungs"]) == len(rules_v3.GATE_LADDER)


def test_split_read_pools_tasks_seeds_and_row_sets():
    reads = {"k": {"0/0": _read(0.5, 0.7), "0/1": _read(0.6, 0.8)}}
    assert c3.split_read(reads, "k", 0, 1, "test") == pytest.approx(0.5)
    assert c3.split_read(reads, "k", 0, 2, "test") == pytest.approx(0.55)
    assert c3.split_read(reads, "k", 0, 2, "test+cv") == pytest.approx(0.65)
    assert c3.split_read(reads, "k", 0, 3, "test") is None
    assert c3.finetune_seed(0, 0) != 0 and c3.finetune_seed(1, 0) != 1  # no v2 seed (seed r) is reused


def test_within_seed_fit_equals_a_regression_with_seed_dummies():
    rng = np.random.default_rng(0)
    seeds = np.repeat(np.arange(5), 6)
    x = rng.normal(size=(30, 2))
    y = 0.3 * seeds - 0.02 * x[:, 0] + 0.5 * x[:, 1] + rng.normal(scale=0.01, size=30)
    dummies = (seeds[:, None] == np.arange(5)[None]).astype(float)
    reference = np.linalg.lstsq(np.column_stack([dummies, x]), y, rcond=None)[0][-2:]
    np.testing.assert_allclose(v3.within_seed_fit(y, x, seeds), reference, atol=1e-12)


def test_dose_response_recovers_a_planted_slope_and_its_interval_matches_the_formula():
    rng = np.random.default_rng(1)
    points = []
    for seed in range(5):
        for _ in range(6):
            trace, kl = 130 + 10 * rng.normal(), 0.008 + 0.001 * rng.normal()
            base = 0.84 + 0.01 * seed - 0.001 * trace - 2.0 * kl
            points.append((seed, (base + rng.normal(scale=0.002, size=5)).tolist(), trace, kl))
    row = v3.dose_response(points)
    assert row["trace"]["coefficient"] == pytest.approx(-0.001, abs=2e-4)
    assert row["verdict"] == "PASS" and row["reading"] == "predicted direction"
    # the interval from its definition, computed here by dummy regressions
    seeds = np.array([p[0] for p in points])
    reads = np.array([p[1] for p in points])
    x = np.array([[p[2], p[3]] for p in points])
    dummies = (seeds[:, None] == np.arange(5)[None]).astype(float)

    def slope(y, rows):
        return np.linalg.lstsq(np.column_stack([dummies[rows][:, dummies[rows].any(0)], x[rows]]), y, rcond=None)[0][-2]

    everything = np.ones(30, bool)
    per_split = [slope(reads[:, r], everything) for r in range(5)]
    jack = np.array([slope(reads.mean(1)[seeds != s], seeds != s) for s in range(5)])
    variance = np.var(per_split, ddof=1) / 5 + 4 / 5 * ((jack - jack.mean()) ** 2).sum()
    half = t.ppf(0.975, 4) * np.sqrt(variance)
    assert row["trace"]["ci"] == pytest.approx([np.mean(per_split) - half, np.mean(per_split) + half], abs=1e-12)


def _checkpoint(key, family, seed, label, kl, trace=100.0):
    return c3.Checkpoint(key, family, seed, label, "x", Path("."), kl, kl + 0.001, trace)


def test_paired_contrast_adjusts_for_kl_and_needs_both_intervals_on_the_predicted_side():
    pairs, reads = {}, {}
    for s in range(5):
        a = _checkpoint(f"a{s}", "c1", s, "last", 0.009)
        b = _checkpoint(f"b{s}", "c1", s, "first", 0.008)
        pairs[s] = (a, b)
        reads[a.key] = [0.804 + 0.0005 * s + 0.0002 * r for r in range(5)]
        reads[b.key] = [0.800] * 5
    # a loss effect of -10 accuracy per nat: 0.001 nats worse explains -0.01; at equal KL the gain is larger
    row = v3.paired_contrast(pairs, reads, b_kl=-10.0)
    d = np.array([reads[f"a{s}"] for s in range(5)]) - 0.8
    assert row["unadjusted"]["difference"]["mean"] == pytest.approx(d.mean())
    assert row["adjusted"]["difference"]["mean"] == pytest.approx(d.mean() + 0.01)
    assert row["verdict"] == "PASS" and row["kl_difference_mean"] == pytest.approx(0.001)
    # a loss effect of +10 per nat explains the whole gain: adjusted, it vanishes and the contrast fails
    row = v3.paired_contrast(pairs, reads, b_kl=+10.0)
    assert row["unadjusted"]["verdict"] == "PASS" and row["adjusted"]["verdict"] == "FAIL"
    assert row["verdict"] == "FAIL"
    missing = {k: v for k, v in reads.items() if k != "a4"}
    assert v3.paired_contrast(pairs, missing, -10.0)["verdict"].startswith("undecided (budget: 4 of 5")


def test_partial_rank_correlation_equals_the_textbook_partial_correlation_of_ranks():
    rng = np.random.default_rng(2)
    y, m, kl = rng.normal(size=12), rng.normal(size=12), rng.normal(size=12)
    m = m + 0.8 * y
    ry, rm, rk = rankdata(y), rankdata(m), rankdata(kl)
    r = np.corrcoef([ry, rm, rk])
    textbook = (r[0, 1] - r[0, 2] * r[1, 2]) / np.sqrt((1 - r[0, 2] ** 2) * (1 - r[1, 2] ** 2))
    assert v3.partial_rank_correlation([(y, m, kl)]) == pytest.approx(textbook, abs=1e-12)


def test_permutation_p_is_small_for_a_strong_within_group_relation_and_not_for_noise():
    rng = np.random.default_rng(3)
    groups = []
    for _ in range(5):
        y, kl = rng.normal(size=6), rng.normal(size=6)
        groups.append((y, -y + 0.05 * rng.normal(size=6), kl))
    assert v3.partial_rank_correlation(groups) < -0.9
    assert v3.within_group_permutation_p(groups, n=999) == pytest.approx(1 / 1000)
    noise = [(rng.normal(size=6), rng.normal(size=6), rng.normal(size=6)) for _ in range(5)]
    assert v3.within_group_permutation_p(noise, n=999) > 0.05
    low, high = v3.seed_bootstrap(dict(enumerate([[g] for g in groups])), v3.partial_rank_correlation, n=500)
    assert low <= v3.partial_rank_correlation(groups) <= high and high < 0


def test_holm_against_hand_computed_adjustments():
    adjusted = v3.holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.5})
    # sorted 0.01, 0.03, 0.04, 0.5 -> 4*0.01, max(.04, 3*.03), max(.09, 2*.04), max(.09, 1*.5)
    assert adjusted == pytest.approx({"a": 0.04, "c": 0.09, "b": 0.09, "d": 0.5})


def test_selection_gain_picks_the_flattest_inside_the_window():
    # seed 0: lowest KL reads 0.80; a checkpoint 0.005 nats above is flatter and reads 0.81; one 0.02 above is
    # flattest of all but outside the window
    rows = [([0.80] * 5, 150.0, 0.008), ([0.81] * 5, 120.0, 0.013), ([0.90] * 5, 90.0, 0.028)]
    found = v3.selection_gain({0: rows, 1: rows}, direction=+1)
    assert found["per_seed"] == pytest.approx({"0": 0.01, "1": 0.01})
    assert found["shortfall"]["0"] == pytest.approx(0.09)


def test_the_58_checkpoints_are_committed_and_staged_as_the_rules_say():
    table = c3.checkpoint_table()
    assert len(table) == 58 and all(c.path.joinpath("model.safetensors").exists() for c in table.values())
    stages = [c.stage for c in table.values()]
    assert stages == sorted(stages, key=[name for name, _ in rules_v3.STAGES].index)
    assert [k for k, c in table.items() if c.stage == "gate"] == list(rules_v3.GATE_PAIR)


def test_reads_loop_reads_the_gate_first_resumes_and_stops_at_the_budget(tmp_path):
    """A smoke-sized run on two committed checkpoints and one more: the gate's pair first, then the next stage; a
    second run reads nothing new; a budget already spent stops before any read."""
    from research.campaign_v2 import Sizes, load_material
    from research.ruler_reads import RULER_SMOKE, ReadStore, ruler_rows

    sizes = dataclasses.replace(RULER_SMOKE, n_cv=40, n_test=40, n_fit=40)
    language = load_material(tmp_path / "material", dataclasses.replace(Sizes(), n_train=2000, n_pool=2000)).language
    table = c3.checkpoint_table()
    chosen = {k: c for k, c in table.items() if c.stage == "gate" or k == "c1/seed1/step-8000"}

    def run(budget=3600.0):
        return c3.ReadsRun(
            checkpoints=chosen,
            rows=ruler_rows(language.grammar, language.grammar_seed, sizes, tmp_path / "cache"),
            sizes=sizes,
            finetune=c3.FinetuneStore(tmp_path / "ft.json", sizes),
            probe=ReadStore(tmp_path / "probe.json", sizes),
            v2_probe=ReadStore(tmp_path / "v2.json", sizes),
            budget_seconds=budget,
        )

    assert not c3.run_reads(run(budget=0.0))["decided"] and not (tmp_path / "ft.json").exists()
    gate = c3.run_reads(run(), poll_seconds=0.01)
    reads = json.loads((tmp_path / "ft.json").read_text())["reads"]
    assert gate["decided"] and set(reads) == set(chosen)
    assert all(len(entry) == sizes.n_splits * gate["seeds"] for entry in reads.values())
    assert {read["seed"] for read in reads["c1/seed0/step-8000"].values()} == {
        c3.finetune_seed(r, j) for r in range(sizes.n_splits) for j in range(gate["seeds"])
    }
    before = (tmp_path / "ft.json").read_text()
    c3.run_reads(run(), poll_seconds=0.01)
    assert (tmp_path / "ft.json").read_text() == before


@pytest.mark.skipif(not (RESULTS / "contrasts.json").exists(), reason="contrasts.json is not committed yet")
def test_committed_contrasts_recompute_from_the_committed_reads():
    committed = json.loads((RESULTS / "contrasts.json").read_text())
    raw = json.loads((RESULTS / "finetune_reads.json").read_text())["reads"]
    stores = [
        json.loads(path.read_text())["reads"]
        for path in (RESULTS.parent / "campaign_v2" / "claims" / "reads.json", RESULTS / "probe_reads.json")
        if path.exists()
    ]
    recomputed = json.loads(json.dumps(v3.contrasts(c3.checkpoint_table(), raw, stores, 5), default=float))
    for key in ("gate", "finetune", "probe", "read"):
        assert recomputed.get(key) == committed.get(key), key


@pytest.mark.skipif(not (RESULTS / "contrasts.json").exists(), reason="contrasts.json is not committed yet")
def test_the_docs_tables_equal_the_committed_json():
    from research.campaign_v3_report import contrasts_table, gate_table, progress_table

    committed = json.loads((RESULTS / "contrasts.json").read_text())
    raw = json.loads((RESULTS / "finetune_reads.json").read_text())["reads"]
    page = (REPO / "docs" / "reproduction" / "campaign_v3.md").read_text()
    for name, body in (
        ("gate", gate_table(committed["gate"])),
        ("progress", progress_table(c3.checkpoint_table(), raw, committed["gate"])),
        ("contrasts", contrasts_table(committed)),
    ):
        block = page.split(f"<!-- v3 {name}: begin -->\n", 1)[1].split(f"\n<!-- v3 {name}: end -->", 1)[0]
        assert block == body, name


def test_tournament_ranks_a_planted_measure_above_noise_and_holds_kl_fixed():
    """Fake C1 and C3 groups: transfer falls with a planted sharpness measure beyond what KL explains; a second
    measure is noise, a third only tracks KL. Only the planted one survives Holm, in the paper's direction."""
    rng = np.random.default_rng(4)
    checkpoints, reads, values = {}, {}, {}
    for seed in range(5):
        for family, labels in (("c1", ["start"] + [f"step-{s}" for s in rules_v3.C1_STEPS]), ("c3", rules_v3.C3_ARMS)):
            for label in labels:
                key = f"{family}/{seed}/{label}"
                kl = 0.008 + 0.001 * rng.normal()
                sharp = rng.normal()
                checkpoints[key] = _checkpoint(key, family, seed, label, kl)
                reads[key] = (0.8 - 0.01 * sharp - 1.0 * kl + 0.001 * rng.normal(size=5)).tolist()
                values[key] = {
                    "fisher_trace": 100 + 10 * sharp,
                    "sam_sharpness": rng.normal(),
                    "weight_noise": kl,
                }
    found = v3.tournament(checkpoints, {"finetune": reads}, values, bootstraps=200, permutations=199)
    planted = found["measures"]["fisher_trace"]["finetune"]
    assert planted["partial_rank_correlation"] < -0.8 and planted["survives"] and planted["paper_direction"]
    assert planted["ci"][1] < 0 and planted["selection"]["gain"]["mean"] > 0
    assert not found["measures"]["sam_sharpness"]["finetune"]["survives"]
    kl_only = found["measures"]["weight_noise"]["finetune"]  # KL's own ranks are partialled out: nothing is left
    assert np.isnan(kl_only["partial_rank_correlation"]) and np.isnan(kl_only["p"]) and not kl_only["survives"]
    assert found["measures"]["hessian_trace"]["finetune"]["status"] == "not measured or not read"


def test_sentence_types_of_masked_contexts_are_those_of_the_whole_sentences():
    from research.measures_v3 import tournament_values, with_sentence_types

    from hf_flatbias.synthetic import PCFG
    from hf_flatbias.synthetic.data import masked_contexts, sentences_to_dataset

    grammar = PCFG.paper_shaped(0, n_levels=3, symbols_per_level=5, n_words=50, binary_rules_per_symbol=10)
    sample = grammar.sample(40, seed=3)
    contexts = masked_contexts(sentences_to_dataset(sample.word_ids, sample.lengths), seed=1)
    typed = with_sentence_types(contexts, grammar)
    expected = grammar.task_labels(sample.word_ids, sample.lengths)["task_a"]
    assert [row["sentence_type"] for row in typed] == expected.tolist()
    assert all(row["input_ids"] == list(c["input_ids"]) for row, c in zip(typed, contexts, strict=True))
    measured = {
        "fisher_trace": {"value": 3.0, "median_of_means": 2.5},
        "spectrum": {"value": 7.0, "density_tail": 0.7, "power_law_alpha": 0.4},
    }
    assert tournament_values(measured) == {
        "fisher_trace": 3.0,
        "fisher_trace_median_of_means": 2.5,
        "top_eigenvalue": 7.0,
        "spectral_density_tail": 0.7,
        "spectrum_power_law": 0.4,
    }
