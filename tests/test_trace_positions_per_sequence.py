"""Several positions of one causal-LM sequence in one backward (``positions_per_sequence``), against references
computed here from the full logit Jacobians and against the exact Fisher traces of the same positions."""

import statistics

import pytest
import torch
from torch.func import functional_call, jacrev
from transformers import LlamaConfig, LlamaForCausalLM

from hf_flatbias.constants import IGNORE_INDEX
from hf_flatbias.flatness import (
    TraceContexts,
    build_masked_contexts,
    compute_trace_samples,
    estimate_hessian_trace,
)
from hf_flatbias.flatness.estimators.output_probes import OutputProbes
from hf_flatbias.flatness.estimators.per_sample import forget_self_checks
from hf_flatbias.flatness.exact import per_context_fisher_traces
from hf_flatbias.flatness.ghost import GhostNormRecorder
from tests.helpers.tiny_models import TINY_DECODER, randomize_norms, wide_masked_lm

VOCAB = 14


def _tiny_llama(seed=0, **overrides):
    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY_DECODER, "vocab_size": VOCAB, "initializer_range": 0.4, **overrides})
    return randomize_norms(LlamaForCausalLM(config)).double().eval()


def _rows(n_rows, seed=0, lengths=(6, 10)):
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n_rows):
        length = int(torch.randint(*lengths, (1,), generator=generator))
        rows.append({"input_ids": torch.randint(2, VOCAB, (length,), generator=generator).tolist()})
    return rows


def _labelled(rows, positions, seed):
    return build_masked_contexts(rows, mask_token_id=None, causal=True, seed=seed, positions_per_sequence=positions)


def _jacobian_reference(model, rows, n_draws, seed, kind):
    """Draw k of each row: ``||sum_t J_t^T c_t||^2 / P`` with ``J_t`` the full Jacobian of the logits at the row's
    position t (torch.func, the stock forward) and ``c_t`` the cotangent context t would draw alone."""
    params = {name: p.detach() for name, p in model.named_parameters()}
    values, first_context = [], 0
    for row in rows:
        labelled = [t for t, label in enumerate(row["labels"]) if label != IGNORE_INDEX]
        ids = torch.tensor([row["input_ids"]])
        read_at = [t - 1 for t in labelled]  # labels[t] is predicted from the positions before t

        def logits_at(p, ids=ids, read_at=read_at):
            return functional_call(model, p, (ids,)).logits[0, read_at]

        jacobian = jacrev(logits_at)(params)
        flat = torch.cat([j.reshape(len(read_at), VOCAB, -1) for j in jacobian.values()], dim=2)
        probs = torch.softmax(logits_at(params), dim=-1)
        contexts = list(range(first_context, first_context + len(labelled)))
        probes = OutputProbes(probs, contexts, n_draws, seed, kind)
        draws = []
        for k in range(n_draws):
            gradient = torch.einsum("tv,tvn->n", probes.cotangent(k), flat)
            draws.append(float(gradient.square().sum()) / len(labelled))
        values.append(draws)
        first_context += len(labelled)
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize("kind", ["rademacher", "label"])
def test_each_draw_is_the_squared_norm_of_the_summed_position_gradients(kind):
    forget_self_checks()  # the check against a plain backward runs on the several-position path too
    model, rows = _tiny_llama(seed=1), _labelled(_rows(5, seed=1), 3, seed=1)
    contexts = TraceContexts.from_rows(rows, causal=True)
    samples = compute_trace_samples(
        model, contexts, n_draws=3, seed=4, batch_size=2, output_probe=kind, exact_output_expectation=False,
        positions_per_sequence=3,
    )  # fmt: skip
    assert samples.weights.tolist() == [3.0] * 5
    # Llama's RMSNorm computes in float32 even in a float64 model: agreement to its rounding, not to 1e-12
    torch.testing.assert_close(samples.values, _jacobian_reference(model, rows, 3, 4, kind), rtol=1e-5, atol=1e-9)


def test_with_only_the_untied_head_trained_every_draw_is_the_exact_mean_trace():
    """The head's own term in exact expectation, over the positions of each row, is all there is: no draw noise."""
    model = _tiny_llama(seed=2, tie_word_embeddings=False)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("lm_head"))
    rows = _labelled(_rows(4, seed=2), 4, seed=2)
    samples = compute_trace_samples(
        model, TraceContexts.from_rows(rows, causal=True), n_draws=2, seed=0, positions_per_sequence=4
    )
    per_position = per_context_fisher_traces(model, rows).reshape(4, 4).mean(dim=1)
    torch.testing.assert_close(samples.values, per_position.unsqueeze(1).expand(-1, 2), rtol=1e-6, atol=0)


def test_the_mean_over_seeds_is_the_exact_mean_trace_of_the_same_positions():
    model, rows = _tiny_llama(seed=3), _labelled(_rows(6, seed=3), 4, seed=3)
    exact = float(per_context_fisher_traces(model, rows).mean())
    several = [estimate_hessian_trace(model, rows, n_draws=1, seed=s, positions_per_sequence=4) for s in range(40)]
    one = [estimate_hessian_trace(model, rows, n_draws=1, seed=s) for s in range(40)]
    means = [e.mean for e in several]
    spread = statistics.stdev(means) / len(means) ** 0.5
    assert several[0].n_contexts == 24 and abs(statistics.fmean(means) - exact) < 4 * spread
    # the same positions one at a time carry no cross terms: the draw noise the shared backward adds, recorded
    print(
        f"\nexact {exact:.4f}; over 40 seeds, 4 positions per row: mean {statistics.fmean(means):.4f}, "
        f"std {statistics.stdev(means):.4f}; one position per context: std {statistics.stdev(e.mean for e in one):.4f}"
    )


def test_at_equal_sequences_both_are_unbiased_for_the_mean_over_every_position():
    """Fresh positions per seed: P positions per row and one per row estimate the same population mean (rows alike,
    positions uniform within a row), computed exactly over every position of every row."""
    model, rows = _tiny_llama(seed=7), _rows(6, seed=7)
    every = [{**row, "labels": [IGNORE_INDEX, *row["input_ids"][1:]]} for row in rows]
    per_position = per_context_fisher_traces(model, every).split([len(row["input_ids"]) - 1 for row in rows])
    exact = statistics.fmean(float(traces.mean()) for traces in per_position)
    errors = {}
    for positions in (1, 4):
        means = [
            estimate_hessian_trace(model, _labelled(rows, positions, seed=s), n_draws=1, seed=s,
                                   positions_per_sequence=positions).mean
            for s in range(40)
        ]  # fmt: skip
        assert abs(statistics.fmean(means) - exact) < 4 * statistics.stdev(means) / len(means) ** 0.5
        errors[positions] = statistics.fmean((m - exact) ** 2 for m in means)
    print(f"\nsquared error over 40 seeds, 6 rows: 1 position {errors[1]:.2f}, 4 positions {errors[4]:.2f}")


def test_short_units_weigh_by_their_positions():
    """Rows labelling 3 and 1 positions at positions_per_sequence=2 give units of 2, 1 and 1 contexts."""
    model = _tiny_llama(seed=4)
    rows = [
        {"input_ids": [3, 4, 5, 6, 7], "labels": [IGNORE_INDEX, 4, IGNORE_INDEX, 6, 7]},
        {"input_ids": [5, 6, 7], "labels": [IGNORE_INDEX, IGNORE_INDEX, 7]},
    ]
    samples = compute_trace_samples(
        model, TraceContexts.from_rows(rows, causal=True), n_draws=2, positions_per_sequence=2
    )
    assert samples.weights.tolist() == [2.0, 1.0, 1.0]
    alone = compute_trace_samples(model, TraceContexts.from_rows(rows, causal=True), n_draws=2)
    torch.testing.assert_close(samples.values[1:], alone.values[2:], rtol=1e-12, atol=0)


def test_one_position_per_sequence_is_the_default_estimate():
    model, rows = _tiny_llama(seed=5), _labelled(_rows(4, seed=5), 1, seed=5)
    assert rows == build_masked_contexts(_rows(4, seed=5), mask_token_id=None, causal=True, seed=5)
    default = estimate_hessian_trace(model, rows, n_draws=2, seed=1)
    explicit = estimate_hessian_trace(model, rows, n_draws=2, seed=1, positions_per_sequence=1)
    assert (default.mean, default.stderr) == (explicit.mean, explicit.stderr)


def test_bad_positions_per_sequence_raise_one_line_errors_naming_the_fix():
    model, rows = _tiny_llama(seed=6), _labelled(_rows(3, seed=6), 2, seed=6)
    with pytest.raises(ValueError, match="needs a causal LM"):
        build_masked_contexts(_rows(2), mask_token_id=1, positions_per_sequence=2)
    masked = build_masked_contexts(_rows(2), mask_token_id=1)
    with pytest.raises(ValueError, match="needs a causal LM"):
        estimate_hessian_trace(wide_masked_lm(0, vocab_size=VOCAB), masked, positions_per_sequence=2)
    with pytest.raises(ValueError, match="fewer than positions_per_sequence=9: lower"):
        _labelled(_rows(2, lengths=(6, 7)), 9, seed=0)
    with pytest.raises(ValueError, match="label at most 2 positions each"):
        estimate_hessian_trace(model, rows, positions_per_sequence=3)
    with pytest.raises(ValueError, match="estimator='per_sample' only"):
        estimate_hessian_trace(model, rows, estimator="naive", positions_per_sequence=2)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="positions_per_sequence must be"):
            estimate_hessian_trace(model, rows, positions_per_sequence=bad)
    with pytest.raises(ValueError, match="use positions_per_sequence=1"):
        compute_trace_samples(model, TraceContexts.from_rows(rows, causal=True), positions_per_sequence=2, diagonal={})


def test_the_split_by_group_adds_up_to_the_mean_per_position():
    model, rows = _tiny_llama(seed=8), _labelled(_rows(4, seed=8), 3, seed=8)
    estimate = estimate_hessian_trace(model, rows, n_draws=2, by_group=True, positions_per_sequence=3)
    assert sum(group.mean for group in estimate.by_group.values()) == pytest.approx(estimate.mean, rel=1e-12)


@pytest.mark.parametrize("kind", ["rademacher", "label"])
def test_the_check_against_a_plain_backward_runs_and_fails_a_wrong_ghost_norm(kind, monkeypatch):
    model, rows = _tiny_llama(seed=9), _labelled(_rows(4, seed=9), 3, seed=9)
    original = GhostNormRecorder.squared_norms
    monkeypatch.setattr(GhostNormRecorder, "squared_norms", lambda self, *a, **k: 1.01 * original(self, *a, **k))
    forget_self_checks()
    with pytest.raises(ValueError, match="do not match a plain backward"):
        estimate_hessian_trace(model, rows, n_draws=1, output_probe=kind, positions_per_sequence=3)
    monkeypatch.setattr(GhostNormRecorder, "squared_norms", original)
    estimate_hessian_trace(model, rows, n_draws=1, output_probe=kind, positions_per_sequence=3)
    forget_self_checks()
