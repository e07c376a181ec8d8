"""The paper-shaped protocol's pipeline: fixed-width probes, paired comparisons, the C1 verdict, branches resumed."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from research import (
    RunSpec,
    c1_verdict,
    mcnemar,
    onehot_position_word,
    setup_paper_language,
    train_with_branches,
    without_predictions,
)
from research.paper_probes import encoder_features, lexical_features, selected_probe
from research.verdicts import compared_branches, t_interval
from scipy.stats import binomtest, t

from hf_flatbias.probe import extract_features
from hf_flatbias.synthetic import build_model

FIXTURE = Path(__file__).parent / "data" / "c1_verdict_fixture.json"


@pytest.fixture(scope="module")
def language():
    return setup_paper_language(0, n_train=50, n_kl=8, n_trace=8, n_probe=40, with_conditionals=False)


def test_material_depends_on_the_grammar_seed_only_and_probe_sentences_are_long(language):
    again = setup_paper_language(0, n_train=50, n_kl=8, n_trace=8, n_probe=40, with_conditionals=False)
    for split, sentences in language.probes.items():
        np.testing.assert_array_equal(sentences.word_ids, again.probes[split].word_ids)
        assert sentences.lengths.min() >= 5
        assert set(sentences.labels) == {"A", "B", "C"}
    other = setup_paper_language(1, n_train=50, n_kl=8, n_trace=8, n_probe=40, with_conditionals=False)
    assert not np.array_equal(language.probes["test"].lengths, other.probes["test"].lengths)


def test_fit_and_test_features_have_one_width_whatever_the_lengths(language):
    model = build_model(len(language.tokenizer), hidden=32, layers=1)
    features = encoder_features(model, language)
    longest = {split: int(s.lengths.max()) for split, s in language.probes.items()}
    assert len(set(longest.values())) > 1 or max(longest.values()) < language.width  # widths differ from the rows'
    assert {f.shape[1] for f in features.values()} == {(language.width + 2) * 32}
    lexical = lexical_features(language)
    assert {f.shape[1] for f in lexical.values()} == {language.width * language.grammar.n_words}
    # the fixed width only pads: the columns a row fills are those of the row's own unpadded features
    short = language.probes["test"]
    row = [2, *(short.word_ids[0, : short.lengths[0]] + 5).tolist(), 3]
    alone = extract_features(model, [row], pooling="concat")
    np.testing.assert_allclose(features["test"][0, : alone.shape[1]], alone[0], atol=1e-5)
    assert not features["test"][0, alone.shape[1] :].any()
    with pytest.raises(ValueError, match="width"):
        extract_features(model, [row], pooling="concat", width=len(row) - 1)


def test_onehot_position_word_marks_each_word_at_its_position():
    out = onehot_position_word(np.array([[2, 0, -1], [1, -1, -1]]), np.array([2, 1]), 3, 3).reshape(2, 3, 3)
    expected = np.zeros((2, 3, 3))
    expected[0, 0, 2] = expected[0, 1, 0] = expected[1, 0, 1] = 1
    np.testing.assert_array_equal(out, expected)


def test_selected_probe_chooses_on_validation_and_refuses_unequal_widths():
    rng = np.random.default_rng(0)
    x = {s: rng.normal(size=(200, 5)) for s in ("fit", "validation", "test")}
    y = {s: (x[s][:, 0] > 0).astype(int) for s in x}
    result = selected_probe(x, y, grid=(1e-4, 1.0))
    assert result["accuracy"] > 0.9 and result["regularization"] == 1.0  # C=1e-4 shrinks the weights to nothing
    assert len(result["correct"]) == 200 and result["accuracy"] == result["correct"].count("1") / 200
    x["test"] = x["test"][:, :4]
    with pytest.raises(ValueError, match="fixed width"):
        selected_probe(x, y)


def test_mcnemar_counts_discordant_rows_and_matches_the_exact_binomial_test():
    a = [1] * 30 + [0] * 10 + [1] * 3 + [0] * 7
    b = [1] * 30 + [1] * 10 + [0] * 3 + [0] * 7
    result = mcnemar(a, b)
    assert (result["only_a"], result["only_b"]) == (3, 10)
    assert result["difference"] == pytest.approx(7 / 50)
    assert result["p_value"] == pytest.approx(binomtest(3, 13, 0.5).pvalue)
    assert mcnemar("".join(map(str, a)), "".join(map(str, b))) == result
    assert mcnemar(a, a)["p_value"] == 1.0
    with pytest.raises(ValueError, match="same test rows"):
        mcnemar(a, b[:-1])


def test_t_interval_matches_scipy():
    values = [0.01, 0.03, -0.005, 0.02, 0.015]
    mean, low, high = t_interval(values)
    expected = t.interval(0.95, 4, loc=np.mean(values), scale=np.std(values, ddof=1) / np.sqrt(5))
    assert mean == pytest.approx(np.mean(values)) and (low, high) == pytest.approx(expected)


def test_c1_verdict_recomputed_from_the_json_fixture():
    fixture = json.loads(FIXTURE.read_text())
    verdict = c1_verdict(fixture["seeds"])
    assert verdict["verdict"] == fixture["expected_verdict"] == "PASS"
    assert verdict["regime"] == "saturated" and verdict["seeds_with_negative_step_trace_spearman"] == 4
    assert verdict["accuracy_gain_ci"][0] > 0
    json.dumps(verdict, allow_nan=False)  # standard JSON


def branch(step, kl, trace, accuracy, ci_high=None):
    return {
        "step": step,
        "kl": kl,
        "saturation": {"ci_high": kl + 0.002 if ci_high is None else ci_high},
        "fisher_trace": trace,
        "probe_accuracy": accuracy,
    }


def test_c1_verdict_fails_undecides_and_falls_back_to_matched_as_stated():
    fixture = json.loads(FIXTURE.read_text())["seeds"]
    # one more seed with a rising trace: only 3 of 5 negative, so the rule fails (never "nearly passes")
    rising = dict(fixture)
    rising["3"] = [dict(r, fisher_trace=100.0 + r["step"]) for r in fixture["3"]]
    assert c1_verdict(rising)["verdict"] == "FAIL"
    # accuracy flat within noise: the t interval straddles 0, the rule fails
    flat = {
        s: [dict(r, probe_accuracy=0.5 + 0.001 * ((int(s) + i) % 3 - 1)) for i, r in enumerate(rs)]
        for s, rs in fixture.items()
    }
    assert c1_verdict(flat)["verdict"] == "FAIL"
    # nothing below 0.02 nats: undecided
    far = {s: [dict(r, kl=0.05) for r in rs] for s, rs in fixture.items()}
    assert c1_verdict(far)["verdict"] == "undecided (not saturated)"
    # a saturated upper bound above 0.015 does not count as saturated; KLs within 0.003 below 0.02 are matched
    records = [branch(s, 0.012 + 0.001 * i, 50 - i, 0.5 + 0.01 * i, ci_high=0.02) for i, s in enumerate((1, 2, 3, 4))]
    regime, compared = compared_branches(records)
    assert regime == "matched, not saturated" and [r["step"] for r in compared] == [1, 2, 3, 4]
    records.append(branch(5, 0.019, 40, 0.6))  # 0.007 above the lowest: outside the matched set
    assert [r["step"] for r in compared_branches(records)[1]] == [1, 2, 3, 4]
    assert c1_verdict({str(s): records for s in range(5)})["regime"] == "matched, not saturated"


def _killable_trunk(monkeypatch, output_dir: Path, **options):
    """``run(killed_at=None)``: a 20-step trunk with a branch every 10 steps and a checkpoint every 6 into
    ``output_dir``, its process killed right after step ``killed_at`` (as a session's end kills it, before that
    step's save); returns the records, or None when killed."""
    import research.branches

    shape = {"n_levels": 3, "symbols_per_level": 3, "n_words": 12, "binary_rules_per_symbol": 4}
    language = setup_paper_language(0, n_train=200, n_kl=8, n_trace=8, n_probe=40, shape=shape)
    measure = dict(trace_contexts=8, trace_draws=1, hutchinson_draws=1, probes=False)
    spec = RunSpec(label="s", steps=20, eval_every=10, batch_size=8, warmup_steps=0, hidden=16, layers=1)
    on_step_end = research.branches.BranchEvaluator.on_step_end

    def run(killed_at=None):
        def step_end(self, args, state, control, **kwargs):
            on_step_end(self, args, state, control, **kwargs)
            if state.global_step == killed_at:
                raise KeyboardInterrupt
            return control

        monkeypatch.setattr(research.branches.BranchEvaluator, "on_step_end", step_end)
        kwargs = dict(branch_every=10, anneal_steps=5, measure_kwargs=measure, checkpoint_every=6, **options)
        try:
            return train_with_branches(language, spec, output_dir, **kwargs)
        except KeyboardInterrupt:
            return None

    return run


def test_a_trunk_stopped_between_branches_resumes_from_its_latest_checkpoint(tmp_path, monkeypatch, capsys):
    """Checkpoints every ``checkpoint_every`` steps and at every branch: a long trunk killed between branches loses
    at most ``checkpoint_every`` steps, never its measured branches (a 40,000-step pilot outlasts a session)."""
    run = _killable_trunk(monkeypatch, tmp_path)

    def checkpoints():
        return sorted(path.name for path in (tmp_path / "trunk").glob("checkpoint-*"))

    run(killed_at=11)  # the last save was the branch's at 10 (the cadence alone would have left checkpoint-6)
    assert checkpoints() == ["checkpoint-10"]
    first = json.loads((tmp_path / "branches.json").read_text())["records"]
    assert [r["step"] for r in first] == [10]
    run(killed_at=13)  # resumed at 10, then saved by the cadence at 12, with no branch there
    assert "resuming from" in capsys.readouterr().out and checkpoints() == ["checkpoint-12"]
    partial = tmp_path / "trunk" / "checkpoint-14"  # killed while saving: the Trainer writes its state file last
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    records = run()
    assert "checkpoint-12 with 1 measured branches" in capsys.readouterr().out
    assert [r["step"] for r in records] == [10, 20] and records[0] == first[0]


def test_a_trunk_carried_out_of_a_lost_work_folder_resumes_in_the_next_one(tmp_path, monkeypatch, capsys):
    """`research.carry`: the next session's checkout has no work folder; what ``carry_out`` kept of a killed trunk
    (its records, kept branches and newest checkpoint) lets it go on from that checkpoint, nothing measured again."""
    from research.carry import carry_in, carry_out

    work, results = tmp_path / "work", tmp_path / "results"
    folder = work / "claims" / "c1" / "seed0"
    run = _killable_trunk(monkeypatch, folder, keep_branches=True)
    run(killed_at=13)  # checkpoint-12 by the cadence, branch 10 measured and kept
    first = json.loads((folder / "branches.json").read_text())["records"]
    carry_out(work, results / "carry")
    carried = results / "carry" / "claims" / "c1" / "seed0"
    assert sorted(p.name for p in (carried / "trunk").iterdir()) == ["checkpoint-12"]
    assert (carried / "branches" / "step-10" / "model.safetensors").exists()
    shutil.rmtree(work)
    carry_in(results, work)
    records = run()
    assert "checkpoint-12 with 1 measured branches" in capsys.readouterr().out
    assert [r["step"] for r in records] == [10, 20] and records[0] == first[0]
    carry_out(work, results / "carry")  # finished: its checkpoint leaves the carried folder, its branches stay
    assert not (carried / "trunk" / "checkpoint-12").exists() and not list(carried.rglob("checkpoint-*"))
    assert (carried / "branches" / "step-20" / "model.safetensors").exists()


def test_build_model_heads_default_and_override():
    assert build_model(20, hidden=64, layers=1).config.num_attention_heads == 2  # hidden // 32, as before
    assert build_model(20, hidden=64, layers=1, heads=4).config.num_attention_heads == 4
    with pytest.raises(ValueError, match="heads"):
        build_model(20, hidden=64, layers=1, heads=3)


def test_a_stopped_trunk_resumes_from_its_last_branch_whose_record_splits_the_fisher_trace(tmp_path, capsys):
    """What the retired from-scratch C1 recipe's smoke test checked of this protocol, on `train_with_branches`."""
    shape = {"n_levels": 3, "symbols_per_level": 3, "n_words": 12, "binary_rules_per_symbol": 4}
    language = setup_paper_language(0, n_train=200, n_kl=8, n_trace=8, n_probe=40, shape=shape)
    measure = dict(trace_contexts=8, trace_draws=1, hutchinson_draws=1)

    def run(steps):
        spec = RunSpec(label="s", steps=steps, eval_every=10, batch_size=8, warmup_steps=0, hidden=16, layers=1)
        return train_with_branches(language, spec, tmp_path, branch_every=10, anneal_steps=5, measure_kwargs=measure)

    run(10)  # stopped after its first branch, as an interrupted run would be
    first = json.loads((tmp_path / "branches.json").read_text())["records"]
    capsys.readouterr()
    records = run(20)
    assert "resuming from" in capsys.readouterr().out
    assert [r["step"] for r in records] == [10, 20] and records[0] == first[0]
    record = records[-1]
    assert {"kl", "saturation", "fisher_trace", "hutchinson_trace_data_loss", "probe_accuracy"} <= set(record)
    # the output layer's own term and the rest add up to the total, as do all the parameter groups
    assert record["fisher_trace_output_layer"] + record["fisher_trace_rest"] == pytest.approx(record["fisher_trace"])
    groups = record["fisher_trace_by_group"]
    assert sum(part["mean"] for part in groups.values()) == pytest.approx(record["fisher_trace"], rel=1e-9)
    assert record["fisher_trace_output_layer"] == groups["output_layer"]["mean"] > 0
    # the per-row predictions the McNemar tests pair are in the record; the compact JSON drops only them
    assert len(record["probe"]["A"]["correct"]) == 40
    compact = without_predictions(record)
    assert "correct" not in compact["probe"]["A"]
    assert compact["probe"]["A"]["accuracy"] == record["probe"]["A"]["accuracy"]
