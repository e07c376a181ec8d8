"""Campaign v2's claims phase (issue 33): the two-way interval and the verdicts against hand-computed numbers, the
pilot refusal, the ruler's read-outs resumed split by split, a smoke run of C1 with fake starts and pilots, and (once
committed) the claim files' verdicts recomputed and the docs' rows equal to them."""

from __future__ import annotations

import ast
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")

from research import claims_v2 as cl  # noqa: E402
from research import claims_v2_report as report  # noqa: E402
from research import ruler_reads as rr  # noqa: E402
from research import rules_v2  # noqa: E402
from research import verdicts_v2 as v  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "recipes" / "research" / "results" / "campaign_v2"
T975 = {1: 12.706204736, 4: 2.776445105}  # Student t quantiles, from tables


def test_two_way_interval_against_hand_computed_numbers():
    # D[s, r] for 4 seeds x 2 splits; seed means 0.02 0.02 0.01 0.04 (mean 0.0225), split means 0.015, 0.030
    d = [[0.01, 0.03], [0.02, 0.02], [0.00, 0.02], [0.03, 0.05]]
    var_seeds = (0.0025**2 + 0.0025**2 + 0.0125**2 + 0.0175**2) / 3  # 1.58333e-4
    var_splits = (0.0075**2 + 0.0075**2) / 1  # 1.125e-4
    half = T975[1] * math.sqrt(var_seeds / 4 + var_splits / 2)  # df = min(4, 2) - 1 = 1
    row = v.two_way_interval(d)
    assert row["mean"] == pytest.approx(0.0225)
    assert row["ci"] == pytest.approx([0.0225 - half, 0.0225 + half])
    assert row["df"] == 1 and row["split_means"] == pytest.approx([0.015, 0.030])
    seed_half = 3.182446305 * math.sqrt(var_seeds / 4)  # t(0.975, 3)
    assert row["seed_level_ci"] == pytest.approx([0.0225 - seed_half, 0.0225 + seed_half])
    # a split effect shared by every seed widens the two-way interval, not the seed-level one
    shifted = np.asarray(d) + np.array([0.0, 0.02])
    again = v.two_way_interval(shifted)
    assert again["seed_level_ci"][1] - again["seed_level_ci"][0] == pytest.approx(2 * seed_half)
    assert again["ci"][1] - again["ci"][0] > row["ci"][1] - row["ci"][0]
    # one split: the seed-level interval alone
    single = v.two_way_interval([[0.1], [0.2], [0.3], [0.4], [0.5]])
    assert single["ci"] == pytest.approx(single["seed_level_ci"])
    with pytest.raises(ValueError, match="seeds >= 2"):
        v.two_way_interval([[0.1, 0.2]])


def _read(values_per_split):
    values = list(values_per_split)
    return {"mean": values, "tasks": {t: values for t in "ABC"}}


def _record(key, kl, trace, read=None, step=None, ci=None):
    record = {"key": key, "kl": kl, "ci_high": kl + 0.001 if ci is None else ci, "fisher_trace": trace, "reads": {}}
    if step is not None:
        record["step"] = step
    if read is not None:
        record["reads"]["probe"] = _read(read)
    return record


def _c1_seed(seed, gain, kl=0.006, traces=(100, 98, 96, 94, 92), read_steps=(1, 5)):
    """Five saturated branches (trace falling: Spearman -1); the first reads 0.70 on both splits, the last 0.70 +
    gain[r]; the start 0.69."""
    branches = []
    for k, trace in enumerate(traces, start=1):
        read = None
        if k == read_steps[0]:
            read = [0.70, 0.70]
        elif k == read_steps[1]:
            read = [0.70 + g for g in gain]
        branches.append(_record(f"c1/seed{seed}/step-{k}", kl, trace, read, step=k))
    return {"start": _record(f"start/h64/seed{seed}", 0.005, 110, [0.69, 0.69]), "branches": branches}


def test_c1_verdict_against_hand_computed_numbers():
    gains = {"0": (0.01, 0.03), "1": (0.02, 0.02), "2": (0.00, 0.02), "3": (0.03, 0.05), "4": (0.02, 0.04)}
    seeds = {s: _c1_seed(s, g) for s, g in gains.items()}
    row = v.c1_verdict(seeds, planned=5)
    # D: the hand-made table above plus seed 4 (0.02, 0.04); seed means 0.02 0.02 0.01 0.04 0.03, split means
    # 0.016 0.032: mean 0.024, var_s = 1.3e-4, var_r = 1.28e-4, df = min(5, 2) - 1 = 1
    half = T975[1] * math.sqrt(1.3e-4 / 5 + 1.28e-4 / 2)
    assert row["difference"]["mean"] == pytest.approx(0.024)
    assert row["difference"]["ci"] == pytest.approx([0.024 - half, 0.024 + half])
    assert row["seeds_with_negative_step_trace_spearman"] == 5
    # the interval includes 0 (half = 0.12): FAIL, reading "includes 0"
    assert (row["verdict"], row["reading"]) == ("FAIL", "includes 0")
    assert row["reads_pending"] == []
    # gains that agree across splits and seeds: 0.020 +- 0.0016, half = 12.71 * 0.00158 / sqrt(5) = 0.009: PASS
    flat = {s: _c1_seed(s, (g, g)) for s, g in zip(gains, [0.020, 0.021, 0.019, 0.022, 0.018], strict=True)}
    passed = v.c1_verdict(flat, planned=5)
    assert passed["verdict"] == "PASS" and passed["reading"] == "predicted direction"
    half = T975[1] * math.sqrt(np.var([0.020, 0.021, 0.019, 0.022, 0.018], ddof=1) / 5)
    assert passed["difference"]["ci"] == pytest.approx([0.02 - half, 0.02 + half])
    assert passed["trace_fall_start_to_last"]["mean"] == pytest.approx(1 - 92 / 110)
    assert passed["last_minus_start"]["difference"]["mean"] == pytest.approx(0.01 + 0.02)
    # trace rising in two seeds: only 3 negative Spearmans, FAIL though the read-out rises
    rising = {**flat, "0": _c1_seed("0", (0.02, 0.02), traces=(90, 92, 94, 96, 98))}
    rising["1"] = _c1_seed("1", (0.02, 0.02), traces=(90, 92, 94, 96, 98))
    assert v.c1_verdict(rising, planned=5)["verdict"] == "FAIL"
    # two seeds out of the tier: 3 compared, undecided; the matched tier compares them all
    hot = {**flat, "0": _c1_seed("0", (0.02, 0.02), kl=0.012), "1": _c1_seed("1", (0.02, 0.02), kl=0.012)}
    assert v.c1_verdict(hot, planned=5)["verdict"] == v.NOT_SATURATED
    assert v.c1_verdict(hot, planned=5, tier="matched")["verdict"] == "PASS"
    # runs missing, then read-outs missing
    assert v.c1_verdict({s: flat[s] for s in "0123"}, planned=5)["verdict"].startswith("undecided (runs in progress")
    unread = {**flat, "2": _c1_seed("2", (0.0, 0.0), read_steps=(0, 0))}
    pending = v.c1_verdict(unread, planned=5)
    assert pending["verdict"] == v.READS_PENDING
    assert pending["reads_pending"] == ["c1/seed2/step-1", "c1/seed2/step-5"]


def test_c6_picks_by_the_selector_and_counts_equal_picks_as_zero():
    # steps 1..5 at KL 0.006 except step 3 (0.0059, lowest KL) and step 4 (trace 80, the flattest within 0.01 nats)
    def seed(chosen_gain):
        record = _c1_seed("x", (0.0, 0.0), read_steps=(0, 0))
        record["branches"][2].update(kl=0.0059, reads={"probe": _read([0.70] * 5)})  # five splits: df 4
        record["branches"][3].update(fisher_trace=80, reads={"probe": _read([0.70 + chosen_gain] * 5)})
        return record

    seeds = {str(s): seed(g) for s, g in enumerate([0.01, 0.02, 0.01, 0.02, 0.015])}
    row = v.c6_verdict(seeds, planned=5)
    assert row["picks"]["0"] == {"chosen_step": 4, "lowest_kl_step": 3}
    assert row["difference"]["mean"] == pytest.approx(0.015)
    half = T975[4] * math.sqrt(np.var([0.01, 0.02, 0.01, 0.02, 0.015], ddof=1) / 5)  # no split effect
    assert row["difference"]["ci"] == pytest.approx([0.015 - half, 0.015 + half])
    assert row["verdict"] == "PASS"


def test_c4_beats_the_strongest_row_per_task():
    baselines = {
        "lexical": {"key": "baseline/lexical", "reads": {"probe": {"mean": [0.6] * 2, "tasks": {
            "A": [0.50, 0.50], "B": [0.60, 0.60], "C": [0.70, 0.70]}}}},
        "lookup": {"key": "baseline/lookup", "reads": {"probe": {"mean": [0.55] * 2, "tasks": {
            "A": [0.45, 0.45], "B": [0.65, 0.65], "C": [0.55, 0.55]}}}},
        "unmasked_lookup": {"key": "baseline/unmasked_lookup", "reads": {"probe": {"mean": [0.62] * 2, "tasks": {
            "A": [0.48, 0.48], "B": [0.62, 0.62], "C": [0.76, 0.76]}}}},
    }  # fmt: skip
    # every start: A 0.60 (+0.10 over lexical), B 0.66 + e (+0.01 over lookup), C 0.74 (-0.02 under unmasked)
    starts = {}
    for s, e in zip("01234", [0.0, 0.002, -0.002, 0.001, -0.001], strict=True):
        read = {"mean": [0.66] * 2, "tasks": {"A": [0.60, 0.60], "B": [0.66 + e] * 2, "C": [0.74, 0.74]}}
        starts[s] = {"key": f"start/h64/seed{s}", "kl": 0.006, "ci_high": 0.007, "fisher_trace": 1.0,
                     "reads": {"probe": read}}  # fmt: skip
    row = v.c4_verdict(starts, baselines, planned=5)
    assert row["strongest"] == {"A": "lexical", "B": "lookup", "C": "unmasked_lookup", "mean": "unmasked_lookup"}
    assert row["per_task"]["A"]["difference"]["mean"] == pytest.approx(0.10)
    assert row["per_task"]["C"]["reading"] == "opposite direction"
    assert row["tasks_won"] == 2 and row["verdict"] == "PASS"  # A and B (B: +0.01, s.d. 0.0016)
    assert row["each_baseline"]["lookup"]["A"]["mean"] == pytest.approx(0.15)
    # against v1's lookup row alone C would pass too; against the strongest it does not
    assert row["each_baseline"]["lookup"]["C"]["mean"] == pytest.approx(0.19)
    unread = {**baselines, "lookup": {"key": "baseline/lookup", "reads": {}}}
    assert v.c4_verdict(starts, unread, planned=5)["reads_pending"] == ["baseline/lookup"]


def test_c5_c2_c3_on_hand_made_rows():
    def branch(key, kl, trace, gain, **extra):
        return {**_record(key, kl, trace, [0.70 + gain] * 5), **extra}  # five splits: df 4

    losses = [-0.01, -0.02, -0.015, -0.01, -0.02]
    adversarial = {str(s): branch(f"c5/seed{s}", 0.008, 120, g) for s, g in enumerate(losses)}
    plain = {str(s): branch(f"c1/seed{s}/step-5", 0.007, 100, 0.0) for s in range(5)}
    c5 = v.c5_verdict(adversarial, plain, planned=5)
    assert c5["verdict"] == "PASS" and c5["difference"]["mean"] == pytest.approx(-0.015)
    assert c5["fisher_trace_difference"]["mean"] == pytest.approx(20)
    # 0.004 nats apart in three seeds: not matched, undecided
    far = {**adversarial, **{s: branch(f"c5/seed{s}", 0.0111, 120, -0.01, ci=0.012) for s in "012"}}
    assert v.c5_verdict(far, plain, planned=5)["verdict"] == v.NOT_SATURATED

    sizes = {
        "48": {str(s): branch(f"c2/h48/seed{s}", 0.008, 90, 0.0, fisher_trace_enlarged=60) for s in range(5)},
        "64": {str(s): branch(f"c1/seed{s}/step-5", 0.008, 95, 0.01, fisher_trace_enlarged=70) for s in range(5)},
        "128": {str(s): branch(f"c2/h128/seed{s}", 0.008, 80, g, fisher_trace_enlarged=80 - s) for s, g in
                enumerate([0.02, 0.03, 0.02, 0.03, 0.025])},
    }  # fmt: skip
    c2 = v.c2_verdict(sizes, planned=5)
    # larger (H128) reads better (+0.025) but is sharper in H128's space (+18): FAIL
    assert (c2["larger"], c2["smaller"]) == ("128", "48")
    assert c2["accuracy_difference"]["verdict"] == "PASS" and c2["verdict"] == "FAIL"
    assert c2["enlarged_fisher_trace_difference"]["mean"] == pytest.approx(18)

    arms = ("adamw_plain", "adamw_plain_sam")
    c3_seeds = {
        str(s): {"adamw_plain": branch(f"p{s}", 0.007, 130, 0.0), "adamw_plain_sam": branch(f"q{s}", 0.008, 95, g)}
        for s, g in enumerate([0.01, 0.02, 0.01, 0.015, 0.02])
    }
    c3 = v.c3_verdict(c3_seeds, arms, planned=5)
    assert (c3["sharpest"], c3["flattest"], c3["lowest_read_out"]) == ("adamw_plain", "adamw_plain_sam", "adamw_plain")
    assert c3["verdict"] == "PASS" and c3["flattest_minus_sharpest"]["difference"]["mean"] == pytest.approx(0.015)


def _write_units(path: Path, units: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"units": units}))


def _pilots(dose=10, dropout=0.05, weight=None):
    rates = {f"c2_rate/h{w}": {"status": "done", "choice": {"status": "chosen", "chosen": 1e-4}} for w in (64, 128, 48)}
    return {
        "c1_dose": {"status": "done", "choice": {"status": "met", "chosen": dose,
                                                  "rungs": [{"steps": dose, "trace_fall": 0.21}]}},
        **rates,
        "c3_dropout": {"status": "done", "choice": {"status": "chosen", "chosen": dropout}},
        "c5_weight": {"status": "done", "choice": {"status": "none saturated", "chosen": weight}},
    }  # fmt: skip


def test_a_claim_whose_pilot_is_missing_is_refused_by_name(tmp_path):
    pilots = tmp_path / "pilots.json"
    units = _pilots()
    del units["c3_dropout"]
    units["c2_rate/h48"] = {"status": "running", "rows": [{"value": 4e-4, "kl": 0.0115}]}  # a ladder mid-run: no choice
    _write_units(pilots, units)
    decisions = cl.pilot_decisions(pilots, ["C1", "C4", "C6", "C5"])
    assert decisions["dose"] == 10 and decisions["dose_status"] == "met" and decisions["adversary_weight"] is None
    with pytest.raises(SystemExit, match="claim C3 needs the pilot 'c3_dropout'.*--phase pilots"):
        cl.pilot_decisions(pilots, ["C1", "C3"])
    with pytest.raises(SystemExit, match="claim C2 needs the pilot 'c2_rate/h48'"):
        cl.pilot_decisions(pilots, ["C2"])
    assert cl.parse_claims("c4, C1") == ["C1", "C4"]
    with pytest.raises(SystemExit, match="--claims takes"):
        cl.parse_claims("C7")
    assert list(cl.c3_arms(None)) == ["adamw_plain", "adamw_plain_sam"]
    assert cl.c3_arms(0.05)["adamw_sam"] == (0.05, rules_v2.CONTINUE_WEIGHT_DECAY, True)


def test_the_recipe_refuses_before_any_compute(tmp_path, monkeypatch):
    import pcfg_campaign_v2 as recipe

    _write_units(tmp_path / "pilots.json", {})
    monkeypatch.setattr(recipe, "load_material", lambda *a, **k: pytest.fail("material loaded before the check"))
    with pytest.raises(SystemExit, match="claim C1 needs the pilot 'c1_dose'"):
        recipe.main(["--phase", "claims", "--claims", "C1", "--results-dir", str(tmp_path), "--smoke"])


def test_reads_resume_split_by_split_and_refuse_another_ruler(tmp_path, monkeypatch):
    from research.campaign import SHAPES

    from hf_flatbias.synthetic import PCFG

    grammar = PCFG.paper_shaped(0, **SHAPES["three_level"])
    sizes = rr.RULER_SMOKE
    rows = rr.ruler_rows(grammar, 0, sizes, tmp_path)
    assert (tmp_path / "ruler_pool_g0_160.npz").exists()
    again = rr.ruler_rows(grammar, 0, sizes, tmp_path)
    np.testing.assert_array_equal(again.sentences.word_ids, rows.sentences.word_ids)
    calls = []

    def fake_probe(fit_x, fit_y, test_x, test_y, **kwargs):
        calls.append(fit_x.shape)
        return 0.5

    monkeypatch.setattr(rr, "probe_test_accuracy", fake_probe)
    store = rr.ReadStore(tmp_path / "reads.json", sizes)
    entry = store.entry("baseline/lexical", "baseline lexical")
    entry["readouts"]["probe"] = {"0": {"A": 0.4, "B": 0.5, "C": 0.6, "mean": 0.5}}  # split 0 read before a stop
    rr.read_record(store, "baseline/lexical", rows, sizes, ["probe"], baseline="lexical")
    width = grammar.max_length * grammar.n_words
    assert calls == [(sizes.n_fit, width)] * 3  # split 1 only, three tasks
    compact = rr.compact_read(rr.ReadStore(tmp_path / "reads.json", sizes).reads["baseline/lexical"], "probe", sizes)
    assert compact == {"mean": [0.5, 0.5], "tasks": {"A": [0.4, 0.5], "B": [0.5, 0.5], "C": [0.6, 0.5]}}
    with pytest.raises(SystemExit, match="another ruler"):
        rr.ReadStore(tmp_path / "reads.json", rr.RulerSizes())
    # the unmasked lookup: the word's one-hot scaled by its exact conditional, beside lookup and lexical
    part = rows.part("fit0")
    features = rr.baseline_features(grammar, part, "unmasked_lookup")
    lookup, lexical = features[:, :width], features[:, width : 2 * width]
    np.testing.assert_allclose(features[:, 2 * width :], lookup * lexical)
    exact = grammar.masked_conditionals(part.word_ids[:1], part.lengths[:1])[0, 0]
    word = part.word_ids[0, 0]
    assert features[0, 2 * width + word] == pytest.approx(exact[word], rel=1e-6)


def test_smoke_run_of_c1_with_fake_starts_and_pilots(tmp_path, monkeypatch):
    import pcfg_campaign_v2 as recipe
    from research.campaign import SHAPES

    from hf_flatbias.synthetic import PCFG, build_model, make_tokenizer

    grammar = PCFG.paper_shaped(0, **SHAPES["three_level"])
    results, work = tmp_path / "results", tmp_path / "work"
    start_dir = work / "starts" / "h64" / "seed0" / "start"  # where the starts phase wrote it; committed beside
    committed = results / "starts" / "h64" / "seed0" / "start"
    build_model(len(make_tokenizer(grammar.words())), hidden=64, layers=1, seed=0).save_pretrained(committed)
    measured = {"kl": 0.006, "saturation": {"ci_high": 0.007}, "fisher_trace": 50.0}
    start = {"status": "done", "measured": measured, "margin_met": True, "checkpoint": str(start_dir)}
    _write_units(results / "starts.json", {"h64/seed0": start})
    _write_units(results / "pilots.json", _pilots(dose=5))
    # a random model is far from saturated: widen the tier so the rule compares (and the ruler reads) its branches
    monkeypatch.setattr(rules_v2, "SATURATED_KL", 1e9)
    monkeypatch.setattr(rules_v2, "SATURATED_KL_UPPER", 1e9)
    argv = ["--phase", "claims", "--claims", "C1", "--only-seeds", "0", "--smoke"]
    argv += ["--work-dir", str(work), "--results-dir", str(results)]
    payloads = recipe.main(argv)
    c1 = payloads["C1"]
    branches = c1["records"]["seeds"]["0"]["branches"]
    assert [b["step"] for b in branches] == [1, 2, 3, 4, 5]  # C1_BRANCHES over the dose of 5
    assert c1["verdict"]["verdict"] == "undecided (runs in progress: 1 of 5 seeds)"
    reads = json.loads((results / "claims" / "reads.json").read_text())["reads"]
    assert set(reads) == {"start/h64/seed0", "c1/seed0/step-1", "c1/seed0/step-5"}  # the first, last and start
    assert set(reads["c1/seed0/step-5"]["readouts"]) == {"probe", "layer0", "finetune"}
    assert len(reads["c1/seed0/step-5"]["readouts"]["probe"]) == rr.RULER_SMOKE.n_splits
    # the file's verdicts recompute from its records
    on_disk = json.loads((results / "claims" / "C1.json").read_text())
    assert report.claim_verdicts("C1", on_disk["records"], on_disk["pilots"], on_disk["layers"]) == {
        k: on_disk[k] for k in ("verdict", "sensitivity_matched", "secondary")
    }
    # a rerun trains and reads nothing
    train, probe_test_accuracy = cl.train_with_branches, rr.probe_test_accuracy
    monkeypatch.setattr(cl, "train_with_branches", lambda *a, **k: pytest.fail("a finished unit was retrained"))
    monkeypatch.setattr(rr, "probe_test_accuracy", lambda *a, **k: pytest.fail("a finished split was read again"))
    assert recipe.main(argv)["C1"]["verdict"] == c1["verdict"]
    assert "| C1 continued training |" in report.claims_markdown(results / "claims")
    with pytest.raises(SystemExit, match="--carry-out: no work folder"):
        recipe.main(["--carry-out", "--work-dir", str(tmp_path / "elsewhere"), "--results-dir", str(results)])
    assert not (results / "carry").exists()  # nothing written for a wrong folder
    # the next session's checkout has no work folder: what --carry-out kept comes back, nothing is trained again
    recipe.main(["--carry-out", "--work-dir", str(work), "--results-dir", str(results)])
    assert (results / "carry" / "claims" / "c1" / "seed0" / "branches" / "step-5" / "model.safetensors").exists()
    assert not list((results / "carry").rglob("checkpoint-*"))  # a finished trunk is not carried
    shutil.rmtree(work)
    assert recipe.main(argv)["C1"]["verdict"] == c1["verdict"]
    # without it the unit's weights are lost: set aside with its reads, trained and read again, to the same numbers
    shutil.rmtree(work)
    shutil.rmtree(results / "carry")
    monkeypatch.setattr(cl, "train_with_branches", train)
    monkeypatch.setattr(rr, "probe_test_accuracy", probe_test_accuracy)
    again = recipe.main(argv)["C1"]
    lost = json.loads((results / "claims" / "lost.json").read_text())
    assert (
        lost["units"]["c1/seed0"]["branches"] == cl.read_units(results / "claims" / "runs.json")["c1/seed0"]["branches"]
    )
    assert set(lost["reads"]) == {"c1/seed0/step-1", "c1/seed0/step-5"}  # the start's weights are committed
    assert again["verdict"] == c1["verdict"]


def test_claims_modules_read_the_rules_not_literals():
    numbers = set()
    for name in rules_v2.__all__:
        value = getattr(rules_v2, name)
        for item in value if isinstance(value, tuple) else (value,):
            if isinstance(item, int | float) and not isinstance(item, bool):
                numbers.add(float(item))
    numbers -= {0.0, 1.0, 2.0, 3.0}  # indices and everyday arithmetic
    for module in (cl, report, rr, v):
        tree = ast.parse(Path(module.__file__).read_text())
        smoke = {
            id(n)
            for node in tree.body
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "RULER_SMOKE" for t in node.targets)
            for n in ast.walk(node)
        }
        literals = {
            float(node.value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, int | float)
            and not isinstance(node.value, bool) and id(node) not in smoke
        }  # fmt: skip
        assert not literals & numbers, f"{module.__name__} copies rule values: {literals & numbers}"
    assert rr.RulerSizes().regularization == rules_v2.RULER_C


def test_ruler_c_is_the_gates_cross_validated_choice():
    gate = RESULTS / "ruler_gate.json"
    if not gate.exists():
        pytest.skip("ruler_gate.json is not committed")
    state = json.loads(gate.read_text())
    assert state["cv"]["chosen"] == rules_v2.RULER_C
    settings = state["settings"]
    assert (settings["n_fit"], settings["n_splits"], settings["n_test"], settings["n_cv"]) == (
        rules_v2.RULER_N_FIT, rules_v2.RULER_SPLITS, rules_v2.RULER_N_TEST, rules_v2.RULER_N_CV,
    )  # fmt: skip
    assert state["summary"]["gate"]["verdict"] == "PASS"


def test_committed_claim_files_recompute_and_the_docs_rows_equal_them():
    claims_dir = RESULTS / "claims"
    files = sorted(claims_dir.glob("C*.json")) if claims_dir.exists() else []
    if not files:
        pytest.skip("no claim file is committed yet")
    for path in files:
        payload = json.loads(path.read_text())
        again = report.claim_verdicts(path.stem, payload["records"], payload["pilots"], payload["layers"])
        assert json.loads(json.dumps(again)) == {k: payload[k] for k in again}, path.name
    docs = (REPO / "docs" / "reproduction" / "campaign_v2.md").read_text()
    begin, end = "<!-- campaign_v2 claims: begin -->", "<!-- campaign_v2 claims: end -->"
    assert docs[docs.index(begin) + len(begin) : docs.index(end)].strip() == report.claims_markdown(claims_dir)


def test_committed_claims_figure_plots_the_fields_of_their_json(tmp_path):
    """The v2 figure from the committed claim files: every plotted point is the field it stands for, recomputed here
    from the JSON (the primary read-out as the mean over splits, the tier from the rules' thresholds)."""
    from research.plots import plot_claims_v2

    claims_dir = RESULTS / "claims"
    if not (claims_dir / "C1.json").exists():
        pytest.skip("no claim file is committed yet")
    data = plot_claims_v2(claims_dir, tmp_path / "claims.png")
    assert (tmp_path / "claims.png").stat().st_size > 50_000  # drawn panels, not an empty canvas
    load = {c: json.loads((claims_dir / f"{c}.json").read_text())["records"] for c in ("C1", "C3", "C4", "C2")}
    picks = json.loads((claims_dir / "C6.json").read_text())["verdict"]["picks"]

    def read(r, task=None):
        probe = r.get("reads", {}).get("probe")
        return None if probe is None else float(np.mean(probe["mean"] if task is None else probe["tasks"][task]))

    def saturated(r):
        return (
            not r.get("excluded") and r["kl"] <= rules_v2.SATURATED_KL and r["ci_high"] <= rules_v2.SATURATED_KL_UPPER
        )

    c1 = load["C1"]["seeds"]
    steps = {s: {0: row["start"], **{b["step"]: b for b in row["branches"]}} for s, row in c1.items()}
    expected = {
        "C1": [(s, step, r["fisher_trace"], read(r), saturated(r))
               for s, by_step in steps.items() for step, r in by_step.items() if read(r) is not None],
        "C6": [(s, rule, pick[key], read(steps[s][pick[key]]), saturated(steps[s][pick[key]]))
               for s, pick in picks.items()
               for rule, key in (("flatness", "chosen_step"), ("lowest_kl", "lowest_kl_step"))],
        "C3": [(s, arm, r["fisher_trace"], read(r), saturated(r))
               for s, arms in load["C3"]["seeds"].items() for arm, r in arms.items() if read(r) is not None],
        "C4": [(name, task, read(r, None if task == "mean" else task), None)
               for name, r in load["C4"]["baselines"].items() for task in ("A", "B", "C", "mean")]
              + [(f"start seed {s}", task, read(r, None if task == "mean" else task), saturated(r))
                 for s, r in load["C4"]["starts"].items() for task in ("A", "B", "C", "mean")],
        "C2": [(int(w), s, r["kl"], r["fisher_trace"], saturated(r))
               for w, by_seed in load["C2"]["sizes"].items() for s, r in by_seed.items()],
    }  # fmt: skip

    def rounded(rows):  # the figure averages with sum / len, this test with numpy
        return sorted((tuple(round(x, 12) if isinstance(x, float) else x for x in row) for row in rows), key=repr)

    assert set(data) == set(expected)
    for claim, rows in expected.items():
        assert rounded(data[claim]) == rounded(rows), claim


def test_enlarged_trace_keeps_the_branch_depth_whatever_the_run_sizes(tmp_path, monkeypatch):
    # the smoke sizes train 1-layer models but C2 reads H64 starts of more layers: enlarging must not cut layers
    from types import SimpleNamespace

    from hf_flatbias.synthetic import build_model

    vocabulary = 40
    build_model(vocabulary, hidden=64, layers=2, seed=0).save_pretrained(tmp_path / "branch")
    seen = {}

    def fake_trace(model, contexts, **kwargs):
        seen.update(hidden=model.config.hidden_size, layers=model.config.num_hidden_layers, seed=kwargs["seed"])
        return SimpleNamespace(mean=1.0, stderr=0.1)

    monkeypatch.setattr(cl, "estimate_hessian_trace", fake_trace)
    language = SimpleNamespace(tokenizer=range(vocabulary), trace_contexts=range(4))
    run = SimpleNamespace(
        material=SimpleNamespace(language=language),
        sizes=SimpleNamespace(layers=1, n_trace=4, trace_draws=1, widths=rules_v2.WIDTHS, device="cpu"),
    )
    out = cl.enlarged_trace(run, {"checkpoint": str(tmp_path / "branch"), "step": 3})
    assert seen == {"hidden": max(rules_v2.WIDTHS), "layers": 2, "seed": 3}
    assert out == {"fisher_trace_enlarged": 1.0, "fisher_trace_enlarged_stderr": 0.1}


def test_each_claim_is_read_before_the_next_trains_and_a_held_record_is_waited_for(tmp_path, monkeypatch):
    """The order of `run_claims`: a claim's units, the primary reads then ready, the next claim's units, ...; the
    secondary reads last; a record another process holds makes the process poll and go round again."""
    from types import SimpleNamespace

    events, held = [], iter([True, False])  # the first secondary stage finds a record held elsewhere

    def unit(key):
        def work(save):
            events.append(key)
            return {}

        return work

    def read_stage(run, claims, store, rows, stage):
        events.append(stage)
        return next(held) if stage == "secondary" else False

    units = [(k, unit(k)) for k in ("c1/seed0", "c1/seed1", "c2/h48/seed0", "c3/adamw/seed0")]
    monkeypatch.setattr(cl, "training_units", lambda run, claims, seeds: units)
    monkeypatch.setattr(cl, "read_stage", read_stage)
    monkeypatch.setattr(cl, "write_claims", lambda run, claims, store: {})
    monkeypatch.setattr(cl, "ruler_rows", lambda *a: None)
    claims_dir = tmp_path / "claims"
    run = SimpleNamespace(
        claims_dir=claims_dir,
        runs_path=claims_dir / "runs.json",
        reads_path=claims_dir / "reads.json",
        lost_path=claims_dir / "lost.json",
        ruler=rr.RULER_SMOKE,
        material=SimpleNamespace(language=SimpleNamespace(grammar=None, grammar_seed=0)),
        work_dir=tmp_path,
    )
    cl.run_claims(run, ["C1", "C2", "C3"], [0], poll_seconds=0)
    first_round = ["c1/seed0", "c1/seed1", "primary", "c2/h48/seed0", "primary", "c3/adamw/seed0", "primary"]
    assert events == [*first_round, "secondary", "primary", "primary", "primary", "secondary"]
