"""The cotangents at the logits of ``per_sample`` and ``naive`` (``output_probe``): each draw's value against the
quadratic form of a plain-autograd logit Jacobian, the expectation against the exact Fisher trace in closed form and
by sampling, and the one-draw variance against its closed form."""

import math

import pytest
import torch

from hf_flatbias.flatness import TraceContexts, build_masked_contexts, compute_trace_samples, estimate_hessian_trace
from hf_flatbias.flatness.estimators.output_probes import OutputProbes
from hf_flatbias.flatness.exact import per_context_fisher_traces
from hf_flatbias.flatness.lm import evaluation_mode, measured_parameters
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


def _logit_gram(model, contexts, index):
    """``K = J J^T`` (V x V) for the Jacobian ``J`` of the logits at the context's predicted position, by one plain
    backward per logit, and the probabilities there (float64)."""
    params = measured_parameters(model)
    with torch.enable_grad():
        logits = model(**contexts.model_inputs([index], model)).logits[0, contexts.positions[index]]
        rows = []
        for v in range(logits.shape[0]):
            grads = torch.autograd.grad(logits[v], params, retain_graph=True, allow_unused=True)
            flat = [(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads, strict=True)]
            rows.append(torch.cat(flat))
    jacobian = torch.stack(rows).double()
    return jacobian @ jacobian.T, torch.softmax(logits.detach().double(), dim=-1)


@pytest.mark.parametrize("estimator", ["per_sample", "naive"])
@pytest.mark.parametrize("output_probe", ["label", "rademacher"])
def test_each_draw_is_the_quadratic_form_of_its_cotangent(estimator, output_probe):
    model, rows = wide_masked_lm(0, vocab_size=VOCAB).double(), _rows(4)
    contexts = TraceContexts.from_rows(rows, causal=False)
    with evaluation_mode(model):
        samples = compute_trace_samples(
            model, contexts, n_draws=3, seed=5, batch_size=4, estimator=estimator, output_probe=output_probe,
            exact_output_expectation=False,
        )  # fmt: skip
        for index in range(len(contexts)):
            gram, probs = _logit_gram(model, contexts, index)
            probes = OutputProbes(probs.unsqueeze(0), [index], 3, 5, output_probe)
            expected = torch.stack([c @ gram @ c for c in (probes.cotangent(k)[0] for k in range(3))])
            torch.testing.assert_close(samples.values[index], expected, rtol=1e-9, atol=1e-12)


def test_the_expectations_are_the_exact_fisher_trace_in_closed_form():
    """``E[c c^T] = diag(p) - p p^T`` for both cotangents, so ``E[c^T K c] = Tr((diag(p) - p p^T) K)``: the label's as
    ``sum_y p_y f(e_y - p)``, the signs' as ``Tr(L^T K L)`` with ``L = diag(sqrt p) - p sqrt(p)^T`` (``E[z z^T] = I``),
    both equal to the exact per-context Fisher trace."""
    model, rows = wide_masked_lm(0, vocab_size=VOCAB).double(), _rows(4)
    contexts = TraceContexts.from_rows(rows, causal=False)
    exact = per_context_fisher_traces(model, rows)
    with evaluation_mode(model):
        for index in range(len(contexts)):
            gram, p = _logit_gram(model, contexts, index)
            covariance = torch.diag(p) - torch.outer(p, p)
            factor = torch.diag(p.sqrt()) - torch.outer(p, p.sqrt())
            torch.testing.assert_close(factor @ factor.T, covariance, rtol=0, atol=1e-14)
            centred = torch.eye(VOCAB, dtype=torch.float64) - p
            by_label = (p * torch.einsum("yv,vw,yw->y", centred, gram, centred)).sum()
            by_signs = torch.trace(factor.T @ gram @ factor)
            torch.testing.assert_close(by_label, exact[index], rtol=1e-9, atol=0)
            torch.testing.assert_close(by_signs, exact[index], rtol=1e-9, atol=0)


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
    # a biased probe (e.g. sqrt(p) z without the centring term, of covariance diag(p)) would be off by more than the
    # 5 standard errors allowed
    assert (z.abs() < 5).all(), z
    total_stderr = float(stderr.square().sum().sqrt())
    assert abs(float(values.mean(dim=1).sum() - exact.sum())) < 5 * total_stderr
    assert total_stderr < 0.02 * float(exact.sum())  # the check has the power to see a bias of 10%


def test_the_one_draw_variance_is_its_closed_form():
    """Labels: ``sum_y p_y f_y^2 - Tr^2``; signs: Hutchinson's ``2 (||M||_F^2 - sum_i M_ii^2)`` for
    ``M = L^T K L``. The measured variance of 400 draws per context within 30% of it (its own sampling error is
    about 10-15% here), context by context."""
    model, rows = wide_masked_lm(0, vocab_size=VOCAB).double(), _rows(3)
    contexts = TraceContexts.from_rows(rows, causal=False)
    with evaluation_mode(model):
        measured = {
            kind: compute_trace_samples(
                model, contexts, n_draws=DRAWS, seed=11, batch_size=3, output_probe=kind,
                exact_output_expectation=False,
            ).values.var(dim=1)
            for kind in ("label", "rademacher")
        }  # fmt: skip
        for index in range(len(contexts)):
            gram, p = _logit_gram(model, contexts, index)
            centred = torch.eye(VOCAB, dtype=torch.float64) - p
            norms = torch.einsum("yv,vw,yw->y", centred, gram, centred)
            by_label = (p * norms.square()).sum() - (p * norms).sum().square()
            factor = torch.diag(p.sqrt()) - torch.outer(p, p.sqrt())
            m = factor.T @ gram @ factor
            by_signs = 2 * (m.square().sum() - m.diagonal().square().sum())
            assert abs(float(measured["label"][index] / by_label) - 1) < 0.3, (measured["label"][index], by_label)
            assert abs(float(measured["rademacher"][index] / by_signs) - 1) < 0.3, (
                measured["rademacher"][index],
                by_signs,
            )


def test_the_default_is_the_random_signs_and_other_values_are_refused():
    model, rows = wide_masked_lm(0, vocab_size=VOCAB), _rows(4)
    default = estimate_hessian_trace(model, rows, n_draws=2, seed=3)
    label = estimate_hessian_trace(model, rows, n_draws=2, seed=3, output_probe="label")
    probed = estimate_hessian_trace(model, rows, n_draws=2, seed=3, output_probe="rademacher")
    assert (default.mean, default.stderr) == (probed.mean, probed.stderr)
    assert probed.mean != label.mean
    with pytest.raises(ValueError, match="output_probe='gaussian' is not supported"):
        estimate_hessian_trace(model, rows, output_probe="gaussian")
    with pytest.raises(ValueError, match="applies to estimator='per_sample' or 'naive' only"):
        estimate_hessian_trace(model, rows, output_probe="label", estimator="summed")
