"""Campaign v2's starts and pilots (issue 33): the pre-registered rules as the code reads them, resumption, the
choice rules on hand-made rows, and the committed JSON's decisions recomputed (skipped while absent)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from research import campaign_v2 as cv2  # noqa: E402
from research import rules_v2  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "recipes" / "research" / "results" / "campaign_v2"


#: the claims phase's constants: read by the claims' modules (tests/test_claims_v2.py checks those), not these phases
CLAIM_CONSTANTS = {
    "RULER_C", "RULER_N_FIT", "RULER_SPLITS", "RULER_N_TEST", "RULER_N_CV", "RULER_MAX_ITER", "SECONDARY_SPLITS",
    "FINETUNE_EPOCHS", "FINETUNE_LR", "FINETUNE_BATCH", "FINETUNE_SEED", "CLAIMS", "C1_BRANCHES",
    "MIN_COMPARED_BRANCHES", "SEEDS_REQUIRED", "MATCHED_KL_CEILING", "MATCHED_KL_TOLERANCE", "CONFIDENCE",
    "C3_SAM_RHO", "C4_TASKS_REQUIRED", "C4_BASELINES",
}  # fmt: skip


def _rule_numbers() -> set[float]:
    numbers: set[float] = set()
    for name in rules_v2.__all__:
        value = getattr(rules_v2, name)
        if name in ("LOST_SESSION", "SEEDS", "PILOT_SEED") or name in CLAIM_CONSTANTS:
            continue
        for item in value if isinstance(value, tuple) else (value,):
            numbers.add(float(item))
    # 0-3 and 1.0 are everyday numbers (indices, 1 - fall); they say nothing about a rule being copied
    return {n for n in numbers if n not in (0.0, 1.0, 2.0, 3.0)}


def test_rules_are_constants_the_code_reads_not_literals():
    source = Path(cv2.__file__).read_text()
    tree = ast.parse(source)
    smoke = next(
        node
        for node in tree.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SMOKE" for t in node.targets)
    )
    skipped = {id(n) for n in ast.walk(smoke)}
    literals = {
        float(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
        and id(node) not in skipped
    }
    assert not literals & _rule_numbers(), f"rule values copied as literals: {literals & _rule_numbers()}"
    # the full-size schedule is the rules' own
    sizes = cv2.Sizes()
    assert sizes.extension_steps == rules_v2.EXTENSION_STEPS and sizes.first_decay == rules_v2.FIRST_DECAY
    assert sizes.dose_ladder == rules_v2.DOSE_LADDER and sizes.anneal_steps == rules_v2.ANNEAL_STEPS


def test_rule_functions_read_the_rules_module_at_call_time(monkeypatch):
    assert cv2.meets_margin(0.0069, 0.0099) and not cv2.meets_margin(0.0071, 0.009)
    assert not cv2.meets_margin(0.006, 0.0101)
    monkeypatch.setattr(rules_v2, "MARGIN_KL", 0.008)
    assert cv2.meets_margin(0.0071, 0.009)
    assert cv2.stays_saturated(0.0099, 0.0149) and not cv2.stays_saturated(0.0099, 0.0151)
    monkeypatch.setattr(rules_v2, "DOSE_LADDER", (5000,))
    monkeypatch.setattr(rules_v2, "DOSE_MIN_TRACE_FALL", 0.05)
    row = {"steps": 5000, "kl": 0.008, "ci_high": 0.009, "fisher_trace": 94.0}
    assert cv2.choose_dose(100.0, [row]) == {
        "status": "met",
        "chosen": 5000,
        "rungs": [{"steps": 5000, "trace_fall": pytest.approx(0.06), "saturated": True, "kl": 0.008}],
    }


def _dose_row(steps, trace, kl, ci_high=None):
    return {"steps": steps, "kl": kl, "ci_high": kl + 0.001 if ci_high is None else ci_high, "fisher_trace": trace}


def test_dose_choice_on_hand_made_rows():
    # start trace 100: falls 5%, 18%, 21% (not saturated: KL 0.0105), 25% (saturated) -> 40k, the shortest that
    # both falls >= 20% and stays saturated
    rows = [_dose_row(5000, 95, 0.008), _dose_row(10000, 82, 0.009), _dose_row(20000, 79, 0.0105)]
    assert cv2.choose_dose(100.0, rows)["status"] == "pending"
    chosen = cv2.choose_dose(100.0, [*rows, _dose_row(40000, 75, 0.0095)])
    assert (chosen["status"], chosen["chosen"]) == ("met", 40000)
    # 15k is off the ladder: ignored even though it qualifies
    assert cv2.choose_dose(100.0, [*rows, _dose_row(15000, 70, 0.008)])["status"] == "pending"
    # two qualifying rungs: the shorter
    both = [_dose_row(5000, 95, 0.008), _dose_row(10000, 79, 0.009), _dose_row(20000, 70, 0.009)]
    assert cv2.choose_dose(100.0, both)["chosen"] == 10000
    # none falls 20%: the longest saturated rung, under-dosed (the upper end 0.016 unsaturates 40k)
    weak = [_dose_row(5000, 98, 0.008), _dose_row(10000, 96, 0.009), _dose_row(20000, 95, 0.0099)]
    under = cv2.choose_dose(100.0, [*weak, _dose_row(40000, 94.6, 0.0098, ci_high=0.016)])
    assert (under["status"], under["chosen"]) == ("under-dosed", 20000)
    assert under["rungs"][2]["trace_fall"] == pytest.approx(0.05)
    # no rung saturated: the shortest, flagged
    hot = [_dose_row(s, 70, 0.012) for s in rules_v2.DOSE_LADDER]
    assert cv2.choose_dose(100.0, hot) == {**cv2.choose_dose(100.0, hot), "status": "no rung saturated", "chosen": 5000}


def _ladder_row(value, kl, ci_high=None):
    return {"value": value, "kl": kl, "ci_high": kl + 0.001 if ci_high is None else ci_high}


def test_largest_saturated_choice_on_hand_made_rows():
    rates = rules_v2.RATE_LADDER  # 4e-4, 2e-4, 1e-4, 5e-5
    assert cv2.choose_largest_saturated(rates, [], fallback_smallest=True) == {
        "status": "pending",
        "chosen": None,
        "next": 4e-4,
    }
    tried = [_ladder_row(4e-4, 0.0152)]
    assert cv2.choose_largest_saturated(rates, tried, fallback_smallest=True)["next"] == 2e-4
    tried.append(_ladder_row(2e-4, 0.0095, ci_high=0.0120))
    assert cv2.choose_largest_saturated(rates, tried, fallback_smallest=True) == {
        "status": "chosen",
        "chosen": 2e-4,
        "next": None,
    }
    # a mean inside the tier with an upper end outside it does not count
    dropouts = rules_v2.DROPOUT_LADDER  # 0.1, 0.05, 0.025
    rows = [_ladder_row(0.1, 0.0098, ci_high=0.0155), _ladder_row(0.05, 0.0097)]
    assert cv2.choose_largest_saturated(dropouts, rows, fallback_smallest=False)["chosen"] == 0.05
    hot = [_ladder_row(v, 0.013) for v in dropouts]
    assert cv2.choose_largest_saturated(dropouts, hot, fallback_smallest=False)["chosen"] is None
    hot_rates = [_ladder_row(v, 0.013) for v in rates]
    choice = cv2.choose_largest_saturated(rates, hot_rates, fallback_smallest=True)
    assert (choice["status"], choice["chosen"]) == ("none saturated", 5e-5)


def test_a_stopped_ladder_keeps_its_finished_rungs(tmp_path):
    path = tmp_path / "pilots.json"
    ran = []

    def pilot(value, stop_at=None):
        ran.append(value)
        if value == stop_at:
            raise RuntimeError("session over")
        kl = 0.0115 if value == 4e-4 else 0.0085  # 4e-4 leaves the saturated tier, 2e-4 keeps it
        return {"step": 10, "kl": kl, "saturation": {"ci_high": kl + 0.001}}

    def saved():
        return cv2.read_units(path).get("rate", {}).get("rows", [])

    def unit(stop_at=None):
        ladder = cv2.ladder_unit(
            rules_v2.RATE_LADDER, lambda v: pilot(v, stop_at), fallback_smallest=True, describe={}, saved_rows=saved
        )
        return [("rate", ladder)]

    with pytest.raises(RuntimeError):
        cv2.run_phase(path, unit(stop_at=2e-4), "pilots")
    assert [r["value"] for r in saved()] == [4e-4]
    ran.clear()
    units = cv2.run_phase(path, unit(), "pilots")
    assert ran == [2e-4]  # 4e-4's rung is read back, not trained again
    assert units["rate"]["choice"]["chosen"] == 2e-4 and [r["value"] for r in units["rate"]["rows"]] == [4e-4, 2e-4]


def test_run_phase_skips_finished_units_and_reruns_unfinished(tmp_path):
    path = tmp_path / "phase.json"
    calls = []

    def unit(name, fail=False):
        def work(save):
            calls.append(name)
            save({"partial": name})
            if fail:
                raise RuntimeError("stopped")
            return {"value": name}

        return work

    with pytest.raises(RuntimeError):
        cv2.run_phase(path, [("a", unit("a")), ("b", unit("b", fail=True))], "test")
    on_disk = cv2.read_units(path)
    assert on_disk["a"]["status"] == "done" and on_disk["b"] == {"partial": "b", "status": "running"}
    assert json.loads(path.read_text())["constants"]["MARGIN_KL"] == rules_v2.MARGIN_KL
    calls.clear()
    units = cv2.run_phase(path, [("a", unit("a")), ("b", unit("b")), ("c", unit("c"))], "test")
    assert calls == ["b", "c"]  # a was done; b's running row is not
    assert {k: v["status"] for k, v in units.items()} == {"a": "done", "b": "done", "c": "done"}
    calls.clear()
    cv2.run_phase(path, [("a", unit("a")), ("b", unit("b")), ("c", unit("c"))], "test")
    assert calls == []


def test_extend_start_stops_at_the_margin_and_resumes_finished_decays(tmp_path, monkeypatch):
    if not (cv2.v1_start_dir(rules_v2.V1_WIDTH, 0) / "start.json").exists():
        pytest.skip("v1's committed start is not in this checkout")
    kls = iter([0.0085, 0.0068])  # first extension misses the margin, the second meets it
    decays = []

    def fake_decay(model, material, directory, **kwargs):
        decays.append((directory.name, kwargs["steps"], kwargs["peak"], kwargs["seed"]))
        kl = next(kls)
        return {"stop_kl": {"kl": kl, "ci_high": kl + 0.001}, "seconds": 1.0, "cpu_seconds": 1.0}

    monkeypatch.setattr(cv2, "_decay", fake_decay)
    saved = []
    model, row = cv2.extend_start(None, rules_v2.V1_WIDTH, 0, tmp_path, cv2.Sizes(), saved.append)
    steps, peak = rules_v2.EXTENSION_STEPS, rules_v2.EXTENSION_PEAK
    assert decays == [("decay1", steps, peak, 1000), ("decay2", steps, peak, 2000)]
    assert row["margin_met"] and row["chosen_decay"] == 2 and len(saved) == 2
    assert row["v1_stop_kl"] > rules_v2.MARGIN_KL  # v1's start missed the margin, so it was extended
    decays.clear()
    _, again = cv2.extend_start(None, rules_v2.V1_WIDTH, 0, tmp_path, cv2.Sizes(), saved.append)
    assert decays == [] and again["chosen_decay"] == 2 and again["decays"] == row["decays"]


def test_extend_start_keeps_the_best_decay_when_all_miss(tmp_path, monkeypatch):
    if not (cv2.v1_start_dir(rules_v2.V1_WIDTH, 1) / "start.json").exists():
        pytest.skip("v1's committed start is not in this checkout")
    kls = iter([0.0090, 0.0080, 0.0083, 0.0050])  # the fourth is never asked for: at most MAX_EXTENSIONS decays

    def fake_decay(model, material, directory, **kwargs):
        kl = next(kls)
        return {"stop_kl": {"kl": kl, "ci_high": kl + 0.001}, "seconds": 1.0, "cpu_seconds": 1.0}

    monkeypatch.setattr(cv2, "_decay", fake_decay)
    _, row = cv2.extend_start(None, rules_v2.V1_WIDTH, 1, tmp_path, cv2.Sizes(), lambda row: None)
    assert len(row["decays"]) == rules_v2.MAX_EXTENSIONS
    assert not row["margin_met"] and row["chosen_decay"] == 2


def _committed(name: str) -> dict:
    path = RESULTS / name
    if not path.exists():
        pytest.skip(f"{name} is not committed yet")
    return json.loads(path.read_text())


def test_starts_decisions_recompute_from_the_committed_json():
    units = _committed("starts.json")["units"]
    assert units, "starts.json has no unit"
    for key, row in units.items():
        for decay in row["decays"]:
            assert decay["margin_met"] == cv2.meets_margin(decay["stop_kl"], decay["stop_ci_high"]), key
        if row["status"] != "done":
            continue
        if row["source"] == "v1 reused":
            assert cv2.meets_margin(row["v1_stop_kl"], row["v1_stop_ci_high"]), key
            continue
        met = [d for d in row["decays"] if d["margin_met"]]
        assert row["margin_met"] == bool(met), key
        best = met[0] if met else min(row["decays"], key=lambda d: d["stop_kl"])
        assert row["chosen_decay"] == best["decay"], key
        assert len([d for d in row["decays"] if d["decay"] > 0]) <= rules_v2.MAX_EXTENSIONS, key
        measured = row["measured"]
        assert measured["kl_margin_met"] == cv2.meets_margin(measured["kl"], measured["saturation"]["ci_high"])
        assert "probe_accuracy" not in measured  # these phases read no probe


def test_pilot_choices_recompute_from_the_committed_json():
    units = _committed("pilots.json")["units"]
    for key, row in units.items():
        if row["status"] != "done":
            continue
        if key == "c1_dose":
            assert row["choice"] == json.loads(json.dumps(cv2.choose_dose(row["start_trace"], row["rows"])))
        else:
            ladder = row["ladder"]
            again = cv2.choose_largest_saturated(ladder, row["rows"], fallback_smallest=key.startswith("c2_rate"))
            assert row["choice"] == again, key


def test_docs_tables_equal_the_committed_json():
    docs = Path(__file__).resolve().parents[1] / "docs" / "reproduction" / "campaign_v2.md"
    starts = RESULTS / "starts.json"
    if not (docs.exists() and starts.exists()):
        pytest.skip("starts.json or the docs page is not committed yet")
    text = docs.read_text()
    begin, end = "<!-- campaign_v2 tables: begin -->", "<!-- campaign_v2 tables: end -->"
    table = text[text.index(begin) + len(begin) : text.index(end)].strip()
    expected = [cv2.starts_markdown(cv2.read_units(starts))]
    if (RESULTS / "pilots.json").exists():
        expected.append(cv2.pilots_markdown(cv2.read_units(RESULTS / "pilots.json")))
    assert table == "\n\n".join(expected)
