"""per_sample's opt-in ``output_probe="rademacher"``: unbiased for the exact Fisher trace of a tiny model, context by
context, with and without the output layer's exact expectation; the default labels are unchanged."""

import math

import pytest
import torch

from hf_flatbias.flatness import TraceContexts, build_masked_contexts, compute_trace_samples, estimate_hessian_trace
from hf_flatbias.flatness.exact import per_context_fisher_traces
from hf_flatbias.flatness.lm import evaluation_mode
from tests.helpers.tiny_models import wide_masked_lm

VOCAB, MASK = 14, 1
DRAWS = 400


def _rows(n, seed=0):
    generator = torch.Generator().manual_seed(seed)
    rows = [
        {"input_ids": torch.randint(2, VOCAB, (int(torch.randint(4, 9, (1,), generator=generator)),),
                                    generator=generator).tolist()}
        for _ in range(n)
    ]  # fmt: skip
    return build_masked_contexts(rows, mask_token_id=MASK, seed=seed)


@pytest.mark.parametrize("exact_output_expectation", [False, True])
def test_rademacher_output_probe_is_unbiased_for_the_exact_fisher_trace(exact_output_expectation):
    model, rows = wide_masked_lm(0, vocab_size=VOCAB), _rows(6)
    exact = per_context_fisher_traces(model, rows)
    contexts = TraceContexts.from_rows(rows, causal=False)
    with evaluation_mode(model):
        samples = compute_trace_samples(
            model,
            contexts,
            n_draws=DRAWS,
            batch_size=6,
            output_probe="rademacher",
            exact_output_expectation=exact_output_expectation,
        )
    values = samples.values
    stderr = values.std(dim=1) / math.sqrt(DRAWS)
    z = (values.mean(dim=1) - exact) / stderr
    # measured |z| <= 1.7 over these 6 contexts; a biased probe (e.g. sqrt(p) z without the centring term, of
    # covariance diag(p)) would be off by more than the 5 standard errors allowed
    assert (z.abs() < 5).all(), z
    total_stderr = float(stderr.square().sum().sqrt())
    assert abs(float(values.mean(dim=1).sum() - exact.sum())) < 5 * total_stderr
    assert total_stderr < 0.02 * float(exact.sum())  # the check has the power to see a bias of 10%


def test_the_default_is_the_sampled_label_and_other_values_are_refused():
    model, rows = wide_masked_lm(0, vocab_size=VOCAB), _rows(4)
    default = estimate_hessian_trace(model, rows, n_draws=2, seed=3)
    label = estimate_hessian_trace(model, rows, n_draws=2, seed=3, output_probe="label")
    probed = estimate_hessian_trace(model, rows, n_draws=2, seed=3, output_probe="rademacher")
    assert (default.mean, default.stderr) == (label.mean, label.stderr)
    assert probed.mean != label.mean
    with pytest.raises(ValueError, match="output_probe='gaussian' is not supported"):
        estimate_hessian_trace(model, rows, output_probe="gaussian")
    with pytest.raises(ValueError, match="applies to estimator='per_sample' only"):
        estimate_hessian_trace(model, rows, output_probe="rademacher", estimator="naive")
