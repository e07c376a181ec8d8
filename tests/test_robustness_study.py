"""The robustness study (issue 37): the pre-registered verdicts against hand-computed intervals, resumption, the late
SAM window's settings, one smoke unit end to end, and the docs' tables against the committed JSON (skipped while
the study is pending)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from research import robustness as study  # noqa: E402
from research import robustness_rules as rules  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
T_975_4 = 2.7764451051977987  # Student t, 97.5% quantile, 4 degrees of freedom (from a table, not from scipy)


def _row(trace: float, noise: float, quantization: float, forgetting: float) -> dict:
    """A finished unit's row holding only what `primary_values` reads (plus one other sigma and bit width)."""
    return {
        "status": "done",
        "fisher_trace": trace,
        "weight_noise": {
            "points": [{"sigma": rules.PRIMARY_SIGMA / 3, "mean": 99.0}, {"sigma": rules.PRIMARY_SIGMA, "mean": noise}]
        },
        "quantization": {
            "per_channel": {
                "points": [
                    {"bits": 8, "loss_increase": 99.0},
                    {"bits": rules.PRIMARY_BITS, "loss_increase": quantization},
                ]
            }
        },
        "forgetting": {"forgetting": forgetting},
    }


def _units(window_seeds=rules.SEEDS) -> dict:
    # sam - adamw: trace -1..-5 (met), noise -1, 1, -2, 2, 0 (no direction), quantization +1..+5 (opposite),
    # forgetting -0.1..-0.5 (predicted)
    units = {}
    for i, seed in enumerate(rules.SEEDS):
        base = (100.0 + seed, 0.5, 0.25, 0.75)
        units[study.unit_key(seed, "adamw")] = _row(*base)
        units[study.unit_key(seed, "sam")] = _row(
            base[0] - (i + 1), base[1] + (-1, 1, -2, 2, 0)[i], base[2] + (i + 1), base[3] - 0.1 * (i + 1)
        )
        if seed in window_seeds:
            units[study.unit_key(seed, "sam_window")] = _row(*base)
    return units


def _entry(entries, arm, measure):
    return next(e for e in entries if e["arm"] == arm and e["measure"] == measure)


def test_verdicts_against_hand_computed_intervals():
    entries = study.verdicts(_units(window_seeds=(0, 1, 2, 3)))
    half = T_975_4 * (2.5**0.5) / 5**0.5  # s.d. of 1..5 is sqrt(2.5)
    trace = _entry(entries, "sam", "trace")
    assert trace["role"] == "precondition" and trace["verdict"] == "met"
    assert trace["estimate"] == pytest.approx(-3.0) and trace["low"] == pytest.approx(-3.0 - half)
    assert trace["high"] == pytest.approx(-3.0 + half)
    noise = _entry(entries, "sam", "noise")
    assert noise["verdict"] == "FAIL" and noise["direction"] == "none" and noise["estimate"] == pytest.approx(0.0)
    assert noise["high"] == pytest.approx(T_975_4 * (2.5**0.5) / 5**0.5)  # s.d. of (-1, 1, -2, 2, 0) is sqrt(2.5)
    quantization = _entry(entries, "sam", "quantization")
    assert quantization["verdict"] == "FAIL" and quantization["direction"] == "opposite"
    assert quantization["low"] == pytest.approx(3.0 - half)
    forgetting = _entry(entries, "sam", "forgetting")
    assert forgetting["verdict"] == "PASS" and forgetting["direction"] == "predicted"
    assert forgetting["differences"] == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5])
    assert forgetting["high"] == pytest.approx(-0.3 + 0.1 * half)
    # the window has four seeds of five: pending, its interval shown over those four
    window = [e for e in entries if e["arm"] == "sam_window"]
    assert {e["verdict"] for e in window} == {"pending"} and all(e["n"] == 4 for e in window)
    assert _entry(entries, "sam_window", "trace")["estimate"] == pytest.approx(0.0)


def test_verdict_reads_the_primary_sigma_and_bits_not_the_others():
    units = _units()
    for row in units.values():  # the other sigma and bit width disagree wildly: the verdict must not move
        row["weight_noise"]["points"][0]["mean"] = -1e9
        row["quantization"]["per_channel"]["points"][0]["loss_increase"] = -1e9
    assert [e["verdict"] for e in study.verdicts(units)] == [e["verdict"] for e in study.verdicts(_units())]


def test_run_study_skips_finished_units_and_reruns_the_stopped_one(tmp_path):
    path = tmp_path / "study.json"
    calls = []

    def work(fail_at=None):
        def unit(seed, arm):
            calls.append((seed, arm))
            if (seed, arm) == fail_at:
                raise RuntimeError("stopped")
            return _row(1.0, 0.1, 0.1, 0.1)

        return unit

    with pytest.raises(RuntimeError):
        study.run_study(path, work(fail_at=(1, "sam")), seeds=(0, 1), arms=("adamw", "sam"))
    on_disk = json.loads(path.read_text())
    assert set(on_disk["units"]) == {"seed0/adamw", "seed0/sam", "seed1/adamw"}
    assert on_disk["constants"]["STEPS"] == rules.STEPS and on_disk["rules"].endswith("robustness_rules.py")
    calls.clear()
    units = study.run_study(path, work(), seeds=(0, 1), arms=("adamw", "sam"))
    assert calls == [(1, "sam")]
    assert all(row["status"] == "done" and row["cpu_seconds"] >= 0 for row in units.values())


def test_window_arm_takes_sam_on_the_last_quarter_only(tmp_path):
    from hf_flatbias.config import FlatBiasConfig

    sizes = study.StudySizes()
    window = study.arm_settings("sam_window", 3, sizes, tmp_path)
    assert window["sam_start_step"] == rules.STEPS - rules.STEPS // 4 and window["flatness_method"] == "sam"
    adamw, sam = (study.arm_settings(arm, 3, sizes, tmp_path) for arm in ("adamw", "sam"))
    assert adamw["flatness_method"] == "none" and "sam_start_step" not in sam
    # every other setting is shared: same schedule, seed (data order and masks), rate
    assert {k: v for k, v in adamw.items() if k != "flatness_method"} == {
        k: v for k, v in sam.items() if k != "flatness_method"
    }
    assert adamw["lr_scheduler_type"] == "linear" and adamw["seed"] == 3
    FlatBiasConfig(**window)  # the trainer's config accepts the window
    with pytest.raises(ValueError, match="unknown arm"):
        study.arm_settings("sgd", 0, sizes, tmp_path)


def test_recipe_refuses_to_write_a_smoke_or_a_changed_schedule_into_the_study_json():
    import robustness_study

    with pytest.raises(SystemExit):
        robustness_study.parse_arguments(["--smoke"])
    with pytest.raises(SystemExit):
        robustness_study.parse_arguments(["--steps", "10"])


def test_one_smoke_unit_end_to_end(tmp_path):
    import robustness_study

    out = tmp_path / "smoke.json"
    units = robustness_study.main(
        ["--smoke", "--seeds", "0", "--arms", "sam_window", "--out", str(out), "--work-dir", str(tmp_path / "w")]
    )
    row = units["seed0/sam_window"]
    assert row["status"] == "done" and row["training"]["sam_start_step"] == study.window_start(study.SMOKE.steps)
    assert [p["sigma"] for p in row["weight_noise"]["points"]] == list(rules.NOISE_SIGMAS)
    assert row["weight_noise"]["n_draws"] == study.SMOKE.noise_draws and row["weight_noise"]["antithetic"]
    assert row["quantization"]["per_group"]["group_size"] == rules.QUANT_GROUP_SIZE
    assert [p["bits"] for p in row["quantization"]["per_channel"]["points"]] == list(rules.QUANT_BITS)
    assert row["forgetting"]["steps"] == study.SMOKE.finetune_steps and row["forgetting"]["accuracy_on"] == "eval_rows"
    assert set(study.primary_values(row)) == {"trace", *rules.HYPOTHESES}
    assert (tmp_path / "w" / "seed0" / "sam_window" / "model" / "config.json").exists()
    assert "seed0/sam_window" in study.study_markdown(units)


def test_docs_tables_equal_the_committed_json():
    docs = ROOT / "docs" / "reproduction" / "robustness.md"
    path = study.RESULTS / "study.json"
    if not (docs.exists() and path.exists()):
        pytest.skip("the study is pending: study.json is not committed yet")
    text = docs.read_text()
    begin, end = "<!-- robustness tables: begin -->", "<!-- robustness tables: end -->"
    assert text[text.index(begin) + len(begin) : text.index(end)].strip() == study.study_markdown(
        study.read_units(path)
    )


def test_markdown_and_figure_from_rows(tmp_path):
    pytest.importorskip("matplotlib")
    units = _units()
    entries = study.plot_study(units, tmp_path / "study.png")
    assert (tmp_path / "study.png").stat().st_size > 0 and len(entries) == 2 * (1 + len(rules.HYPOTHESES))
    table = study.study_markdown({})  # nothing run yet: every verdict pending, no arm row
    assert table.count("| pending |") == 2 * (1 + len(rules.HYPOTHESES))
