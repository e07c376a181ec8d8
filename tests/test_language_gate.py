"""Issue 23's language gate: the distillation budget rule, the choice by `GATE_RULE`, the recipe's gate mode and the
committed gate.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from research import ConditionalPool, distil_to_saturation
from research.gate import CANDIDATES, EXTEND_BELOW, gate_choice, gate_markdown

from hf_flatbias.synthetic import PCFG, build_model
from hf_flatbias.synthetic.conditionals import cached_conditionals
from hf_flatbias.synthetic.tokenizer import N_SPECIAL

REPO = Path(__file__).resolve().parents[1]
GATE_JSON = REPO / "recipes" / "research" / "results" / "saturated_start" / "gate.json"


def _pool(grammar: PCFG, n: int, seed: int) -> ConditionalPool:
    sample = grammar.sample(n, seed=seed)
    return ConditionalPool(
        sample.word_ids, sample.lengths, cached_conditionals(grammar, sample.word_ids, sample.lengths)
    )


@pytest.mark.parametrize(("extend_below", "steps"), [(None, 30), (10.0, 30), (1e-6, 20)])
def test_extensions_run_only_when_the_first_decay_ends_at_or_below_extend_below(extend_below, steps):
    shape = {"n_levels": 2, "symbols_per_level": 3, "n_words": 12, "binary_rules_per_symbol": 4}
    grammar = PCFG.paper_shaped(0, n_sentence_types=3, **shape)
    pool, stop = _pool(grammar, 100, 1), _pool(grammar, 20, 2)
    model = build_model(N_SPECIAL + grammar.n_words, hidden=16, layers=1, seed=0)
    result = distil_to_saturation(
        model, pool, stop, steps=20, warmup_steps=2, batch_size=16, extensions=((10, 1e-3),),
        extend_below=extend_below, log=False,
    )  # fmt: skip
    assert result["steps"] == steps  # never saturated: every allowed segment runs to its end
    assert [h["step"] for h in result["history"]] == [20, 30][: 1 + (steps == 30)]
    cpu = [h["cpu_seconds"] for h in result["history"]]
    assert cpu == sorted(cpu) and 0 < cpu[-1] <= result["cpu_seconds"]


def _row(eligible: bool, headroom: float | None) -> dict:
    return {"eligible": eligible, "headroom": headroom}


def test_gate_keeps_the_eligible_candidate_with_the_most_headroom():
    rows = {"a": _row(True, 0.02), "b": _row(True, 0.05), "c": _row(False, 0.20), "hmm": _row(True, None)}
    assert gate_choice(rows) == {"eligible": ["a", "b"], "kept": "b"}  # c is not saturated; the HMM has no tasks
    assert gate_choice({"c": _row(False, 0.2)}) == {"eligible": [], "kept": None}


def test_recipe_gate_reads_the_campaign_language_from_its_folder_and_resumes(recipes, tmp_path, capsys):
    campaign = recipes.load("pcfg_saturated_start")
    folders = ["--smoke", "--work-dir", str(tmp_path / "w"), "--results-dir", str(tmp_path / "r")]
    folders += ["--figures-dir", str(tmp_path / "r")]
    payload = campaign.main([*folders, "--gate", "pcfg_three_level_g0", "hmm_20_states_40_words"])
    assert payload == json.loads((tmp_path / "r" / "gate.json").read_text())
    assert payload["extend_below"] == EXTEND_BELOW and not (tmp_path / "r" / "continued_training.json").exists()
    own, hmm = payload["candidates"]["pcfg_three_level_g0"], payload["candidates"]["hmm_20_states_40_words"]
    # the campaign's own language is its seed-0 start, where the campaign keeps it
    start = json.loads((tmp_path / "w" / "seed0" / "start" / "start.json").read_text())
    assert own["read_from_campaign"] and own["distillation"] == start["distillation"]
    rows = own["probe_rows"]
    assert own["headroom"] == pytest.approx(rows["distilled_start"] - rows["exact_conditionals"])
    assert hmm["probe_rows"] is None and hmm["n_words"] == CANDIDATES["hmm_20_states_40_words"]["n_words"]
    assert payload["choice"] == gate_choice(payload["candidates"])
    capsys.readouterr()
    again = campaign.main([*folders, "--gate", "pcfg_three_level_g0", "hmm_20_states_40_words"])
    assert "distilling" not in capsys.readouterr().out and again == payload


@pytest.mark.skipif(not GATE_JSON.exists(), reason="the gate has not been committed yet")
def test_committed_gate_choice_follows_from_its_rows_by_the_stated_rule():
    gate = json.loads(GATE_JSON.read_text())
    assert gate["choice"] == gate_choice(gate["candidates"])
    docs = (REPO / "docs" / "reproduction" / "synthetic.md").read_text()
    assert all(line in docs for line in gate_markdown(GATE_JSON).splitlines())  # the docs show the committed rows
    for row in gate["candidates"].values():
        first_decay = row["distillation"]["history"]
        assert row["eligible"] == row["distillation"]["saturated"]
        if row["distillation"]["steps"] > 8000:  # extended: only if the first decay ended within the budget
            assert next(h["kl"] for h in first_decay if h["step"] == 8000) <= gate["extend_below"]


def test_a_stopped_distillation_resumes_from_its_checkpoint_to_the_uninterrupted_result(tmp_path, monkeypatch):
    from research import distillation

    shape = {"n_levels": 2, "symbols_per_level": 3, "n_words": 12, "binary_rules_per_symbol": 4}
    grammar = PCFG.paper_shaped(0, n_sentence_types=3, **shape)
    pool, stop = _pool(grammar, 100, 1), _pool(grammar, 20, 2)
    kwargs = dict(steps=30, warmup_steps=2, batch_size=16, check_from=10, check_every=10, extensions=((10, 1e-3),))

    def run(checkpoint):
        model = build_model(N_SPECIAL + grammar.n_words, hidden=16, layers=1, seed=0)
        return model, distil_to_saturation(model, pool, stop, checkpoint=checkpoint, checkpoint_every=7, log=False,
                                           **kwargs)  # fmt: skip

    whole_model, whole = run(None)
    loss, calls = distillation.soft_masked_lm_loss, []

    def killed_at_step_17(*args):
        calls.append(1)
        if len(calls) == 17:
            raise KeyboardInterrupt  # a session's end, between two checkpoints
        return loss(*args)

    monkeypatch.setattr(distillation, "soft_masked_lm_loss", killed_at_step_17)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "state.pt")
    monkeypatch.setattr(distillation, "soft_masked_lm_loss", loss)
    assert torch.load(tmp_path / "state.pt", weights_only=False)["step"] == 14
    resumed_model, resumed = run(tmp_path / "state.pt")
    for name, tensor in whole_model.state_dict().items():
        torch.testing.assert_close(resumed_model.state_dict()[name], tensor, rtol=0, atol=0)
    clocks = ("seconds", "cpu_seconds")
    assert [{k: v for k, v in h.items() if k not in clocks} for h in resumed["history"]] == [
        {k: v for k, v in h.items() if k not in clocks} for h in whole["history"]
    ]
    assert resumed["steps"] == whole["steps"] == 40 and resumed["stop_kl"] == whole["stop_kl"]
