"""recipes/sam_variants_comparison.py and recipes/research/sam_variants.py: a smoke run of the whole pipeline,
its resumability, its KL and its verdicts."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import scipy.stats
import torch
from research.sam_variants import sequence_kl_per_token, summarize


@pytest.fixture(scope="module")
def recipe(recipes):
    return recipes.load("sam_variants_comparison")


def test_smoke_run_writes_every_run_and_resumes(recipe, tmp_path):
    output = tmp_path / "results.json"
    payload = recipe.main(["--smoke", "--output", str(output)])
    runs = payload["runs"]
    assert len(runs) == len(recipe.METHODS) * len(recipe.MODELS)
    assert json.loads(output.read_text())["rule"] == recipe.RULE
    for run in runs:
        assert run["held_out_kl"] > 0 and math.isfinite(run["fisher_trace"]) and run["fisher_trace"] > 0
        _, multiplier, passes = recipe.METHODS[run["method"]]
        assert run["nominal_passes"] == round(4 * multiplier) * passes
    assert set(payload["summary"]) == {"bert", "llama"}
    again = recipe.main(["--smoke", "--output", str(output)])  # nothing left to run
    assert again["runs"] == runs
    with pytest.raises(ValueError, match="holds runs of other settings"):
        recipe.main(["--smoke", "--learning-rate", "1e-3", "--output", str(output)])


def test_verdicts_follow_the_stated_rule():
    def runs(method, kls):
        return [
            {
                "model": "bert",
                "method": method,
                "seed": s,
                "held_out_kl": kl,
                "fisher_trace": 1.0,
                "train_seconds": 1.0,
                "train_cpu_seconds": 1.0,
            }
            for s, kl in enumerate(kls)
        ]

    adamw = [0.50, 0.52, 0.49, 0.51, 0.50]
    all_runs = (
        runs("adamw", adamw)
        + runs("sam", [k + 0.001 * (-1) ** i for i, k in enumerate(adamw)])  # within noise of adamw
        + runs("functional_sam", [k - 0.05 for k in adamw])  # clearly lower, same seeds
        + runs("adamw_2x", [k - 0.10 for k in adamw])  # clearly lower than functional_sam
    )
    differences = summarize(all_runs)["bert"]["kl_differences"]
    assert differences["functional_sam - adamw"]["verdict"] == "paper's way"
    assert differences["functional_sam - adamw"]["mean"] == pytest.approx(-0.05)
    assert differences["functional_sam - adamw_2x"]["verdict"] == "against"
    assert differences["sam - adamw"]["verdict"] == "inconclusive"
    sam_minus = [0.001 * (-1) ** i for i in range(5)]
    half = scipy.stats.t.ppf(0.975, df=4) * np.std(sam_minus, ddof=1) / math.sqrt(5)
    assert differences["sam - adamw"]["high"] == pytest.approx(np.mean(sam_minus) + half)


def test_sequence_kl_of_a_uniform_model():
    """Zero logits: q(s) = V^-(n+1), so the KL per token is mean(log p(s) + (n+1) log V) / mean(n+1)."""
    vocab = 7

    class Uniform(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None):
            return SimpleNamespace(logits=torch.zeros(*input_ids.shape, vocab))

    rows = [{"input_ids": [2, 5, 6, 3]}, {"input_ids": [2, 5, 3]}]
    log_p = np.array([-2.0, -1.5])
    expected = np.mean(log_p + np.array([3, 2]) * math.log(vocab)) / 2.5
    assert sequence_kl_per_token(Uniform(), rows, log_p) == pytest.approx(expected)
