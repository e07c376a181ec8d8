"""The ruler gate of campaign v2 (issue 33): the gate's arithmetic against hand-computed numbers, disjoint splits,
resumption, and the committed JSON's verdict recomputed from its own rows."""

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from research.campaign import SHAPES
from research.ruler import (
    RowLayout,
    gate_summary,
    primary_accuracy,
    probe_test_accuracy,
    ruler_pool,
    split_rows,
)

from hf_flatbias.synthetic import PCFG

REPO = Path(__file__).resolve().parents[1]
GATE_JSON = REPO / "recipes" / "research" / "results" / "campaign_v2" / "ruler_gate.json"

# test rows: one feature x = 0..9; tasks A and B are "x > 4.5", task C the same except row x = 0 is labelled 1
TEST_X = np.arange(10, dtype=np.float64)[:, None]
TEST_Y = {"A": (TEST_X[:, 0] > 4.5).astype(int), "B": (TEST_X[:, 0] > 4.5).astype(int)}
TEST_Y["C"] = TEST_Y["A"].copy()
TEST_Y["C"][0] = 1


def fit_rows(threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """Fit rows symmetric about ``threshold`` (a half-integer): the probe's boundary lies exactly there, so its test
    accuracy is the share of test rows on the right side of it, known by hand."""
    x = np.repeat(threshold + np.array([-1.5, -0.5, 0.5, 1.5]), 5)[:, None]
    return x, (x[:, 0] > threshold).astype(int)


def split_primary(threshold: float) -> float:
    x, y = fit_rows(threshold)
    per_task = {task: probe_test_accuracy(x, y, TEST_X, TEST_Y[task], regularization=0.3) for task in TEST_Y}
    return primary_accuracy(per_task)


def test_gate_against_hand_computed_splits():
    # the boundary each fit split teaches, per split, for the two checkpoints; A/B lose 0.1 per unit off 4.5
    start_t, last_t = [4.5, 3.5, 5.5, 2.5, 6.5], [4.5, 4.5, 3.5, 4.5, 5.5]
    # by hand: A = B = 1.0, 0.9, 0.9, 0.8, 0.8 (start) and 1.0, 1.0, 0.9, 1.0, 0.9 (last); C = A - 0.1 (row x = 0)
    start_hand = [a - 0.1 / 3 for a in (1.0, 0.9, 0.9, 0.8, 0.8)]
    last_hand = [a - 0.1 / 3 for a in (1.0, 1.0, 0.9, 1.0, 0.9)]
    start = [split_primary(t) for t in start_t]
    last = [split_primary(t) for t in last_t]
    np.testing.assert_allclose(start, start_hand, atol=1e-12)
    np.testing.assert_allclose(last, last_hand, atol=1e-12)

    gate = gate_summary(start, last, threshold=0.002)
    # differences 0, +0.1, 0, +0.2, +0.1: mean 0.08, s.d. sqrt(0.028 / 4), t(0.975, 4) = 2.7764451
    np.testing.assert_allclose(gate["differences"], [0.0, 0.1, 0.0, 0.2, 0.1], atol=1e-12)
    assert gate["mean_difference"] == pytest.approx(0.08)
    assert gate["sd_difference"] == pytest.approx(math.sqrt(0.007))
    half = 2.7764451052 * math.sqrt(0.007) / math.sqrt(5)
    assert gate["ci_low"] == pytest.approx(0.08 - half) and gate["ci_high"] == pytest.approx(0.08 + half)
    assert gate["baseline_mean"] == pytest.approx(np.mean(start_hand))
    assert gate["verdict"] == "FAIL"
    assert gate_summary(start, last, threshold=0.09)["verdict"] == "PASS"
    # equal differences on every split: s.d. 0, a PASS whatever the shift
    assert gate_summary([0.5, 0.6, 0.7], [0.51, 0.61, 0.71])["verdict"] == "PASS"
    with pytest.raises(ValueError, match=">= 2 paired splits"):
        gate_summary([0.5], [0.6])


def test_splits_are_disjoint_and_the_pool_is_fixed():
    layout = RowLayout(n_test=7, n_fit=5, n_splits=4, n_cv=3)
    parts = split_rows(layout)
    assert list(parts) == ["test", "fit0", "fit1", "fit2", "fit3", "cv"]
    assert [len(p) for p in parts.values()] == [7, 5, 5, 5, 5, 3]
    every = np.concatenate(list(parts.values()))
    assert len(np.unique(every)) == len(every) == layout.total  # pairwise disjoint, nothing left out
    assert every.min() == 0 and every.max() == layout.total - 1
    with pytest.raises(ValueError):
        split_rows(RowLayout(n_test=0, n_fit=5, n_splits=2))

    grammar = PCFG.paper_shaped(0, **SHAPES["three_level"])
    pool = ruler_pool(grammar, 120, grammar_seed=0)
    again = ruler_pool(grammar, 120, grammar_seed=0)
    assert len(pool) == 120 and (pool.lengths >= 5).all()
    np.testing.assert_array_equal(pool.word_ids, again.word_ids)
    assert set(pool.labels) == {"A", "B", "C"} and all(len(y) == 120 for y in pool.labels.values())


class Stop(Exception):
    """A run cut off mid-way."""


def test_rerun_skips_finished_splits(recipes, tmp_path, monkeypatch):
    gate = recipes.load("ruler_gate")
    calls = {"probe": 0, "cv": 0, "finetune": 0, "stop_after": None}

    def fake_probe(fit_x, fit_y, test_x, test_y, *, regularization, max_iter):
        calls["probe"] += 1
        if calls["stop_after"] is not None and calls["probe"] > calls["stop_after"]:
            raise Stop
        return float(abs(fit_x[:, :4].mean()) % 1)

    def fake_cv(features, labels, *, grid, folds, max_iter):
        calls["cv"] += 1
        return {"chosen": 0.3, "scores": {}}

    def fake_finetune(model, fit, test, task, **kwargs):
        calls["finetune"] += 1
        return 0.5

    monkeypatch.setattr(gate, "probe_test_accuracy", fake_probe)
    monkeypatch.setattr(gate, "cross_validated_regularization", fake_cv)
    monkeypatch.setattr(gate, "finetune_accuracy", fake_finetune)
    out = tmp_path / "gate.json"
    argv = ["--n-fit", "20", "--n-splits", "3", "--n-test", "15", "--n-cv", "12", "--finetune-splits", "1"]
    argv += ["--out", str(out)]

    calls["stop_after"] = 6  # primary probes of split 0: 2 checkpoints x 3 tasks; cut off in split 1
    with pytest.raises(Stop):
        gate.main(argv)
    first = json.loads(out.read_text())
    assert list(first["splits"]) == ["0"] and calls["cv"] == 1

    calls.update(probe=0, stop_after=None)
    state = gate.main(argv)
    # splits 1-2 primary (2 x 3 x 2) + layers 0-2 of every split (3 x 2 x 3 x 3); split 0 and the CV not redone
    assert calls["probe"] == 12 + 54 and calls["cv"] == 1 and calls["finetune"] == 6
    assert state["splits"]["0"]["start"]["primary"] == first["splits"]["0"]["start"]["primary"]
    assert state["summary"]["splits_finished"] == 3 and state["summary"]["gate"]["verdict"] in ("PASS", "FAIL")

    calls.update(probe=0, finetune=0)
    gate.main(argv)  # everything finished: nothing recomputed
    assert calls == {"probe": 0, "cv": 1, "finetune": 0, "stop_after": None}

    with pytest.raises(SystemExit, match="other settings"):
        gate.main([*argv[:-2], "--n-fit", "21", "--out", str(out)])


@pytest.mark.skipif(not GATE_JSON.exists(), reason="the gate's JSON is not committed yet")
def test_committed_gate_recomputes_from_its_rows():
    state = json.loads(GATE_JSON.read_text())
    settings, summary = state["settings"], state["summary"]
    splits = [state["splits"][str(r)] for r in range(settings["n_splits"]) if str(r) in state["splits"]]
    assert summary["splits_finished"] == len(splits) and settings["threshold"] == 0.002  # as pre-registered
    for split in splits:
        for name in ("start", "last"):
            rows = split[name]["by_layer"]
            primary = rows[max(rows, key=int)]
            assert primary["mean"] == pytest.approx(np.mean([primary[t] for t in ("A", "B", "C")]))
            assert split[name]["primary"] == pytest.approx(primary["mean"])
        assert split["difference"] == pytest.approx(split["last"]["primary"] - split["start"]["primary"])
    if len(splits) < 2:
        return
    again = gate_summary(
        [s["start"]["primary"] for s in splits], [s["last"]["primary"] for s in splits], threshold=settings["threshold"]
    )
    gate = summary["gate"]
    assert gate["sd_difference"] == pytest.approx(again["sd_difference"])
    assert gate["mean_difference"] == pytest.approx(again["mean_difference"])
    assert [gate["ci_low"], gate["ci_high"]] == pytest.approx([again["ci_low"], again["ci_high"]])
    if len(splits) == settings["n_splits"]:
        assert gate["verdict"] == again["verdict"] == ("PASS" if again["sd_difference"] <= 0.002 else "FAIL")
    else:
        assert gate["verdict"].startswith("incomplete")


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["--cv-folds", "1"], "--cv-folds must be a whole number >= 2 (got 1)"),
        (["--finetune-splits", "9"], "--finetune-splits must be from 0 to --n-splits 5 (got 9)"),
        (["--threshold", "nan"], "--threshold must be a finite number > 0 (got nan)"),
        (["--cv-grid", "0.1", "-1"], "--cv-grid must be finite numbers > 0 (got 0.1 -1.0)"),
        (["--shape", "round"], "--shape round: choose one of"),
    ],
)
def test_bad_flags_are_refused_when_parsed(recipes, argv, expected):
    with pytest.raises(ValueError, match=re.escape(expected)):
        recipes.load("ruler_gate").parse_settings(argv)


def test_a_negative_count_is_one_line_before_anything_is_read(recipes, tmp_path):
    """Issue 58, item 8: --n-fit -5 ended in a 9-line traceback; a flag of the wrong form is one line too."""
    for argv, expected in ((["--n-fit", "-5"], "--n-fit must be a whole number >= 1 (got -5)"),
                           (["--n-fit", "4.5"], "argument --n-fit: expected a whole number (got '4.5')"),
                           (["--threshold", "x"], "argument --threshold: expected a number (got 'x')")):  # fmt: skip
        completed = recipes.run("ruler_gate.py", *argv, "--out", str(tmp_path / "gate.json"), tmp_path=tmp_path)
        err = completed.stderr.strip().splitlines()
        assert completed.returncode == 2 and len(err) == 1 and "Traceback" not in completed.stderr, completed.stderr
        assert err[0].startswith("ruler_gate.py: error: ") and expected in err[0], err
        assert not (tmp_path / "gate.json").exists()
