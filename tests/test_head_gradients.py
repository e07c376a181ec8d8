"""`label_log_probs`: the label log-probabilities of a linear head with the gradients formed in the forward, against
autograd through the materialised logits (float64 and float32), in chunks with an uneven last one, ignored labels
dropped as trl's SFT loss drops them, token-sum losses over ``num_items_in_batch``, per-token weights (the recomputed
path, and ``softmax - onehot`` kept to the backward for all rows or the first chunks), and the number of head-sized
products each pass costs."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from hf_flatbias.sharpness.head_gradients import label_log_probs

ROWS, WIDTH, VOCAB = 37, 6, 11


def inputs(dtype, *, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, WIDTH, generator=g, dtype=dtype).requires_grad_()
    weight = torch.randn(VOCAB, WIDTH, generator=g, dtype=dtype).requires_grad_()
    head_bias = torch.randn(VOCAB, generator=g, dtype=dtype).requires_grad_() if bias else None
    labels = torch.randint(0, VOCAB, (ROWS,), generator=g)
    labels[::4] = -100  # ignored positions, as a completion-only or padded batch has
    return hidden, weight, head_bias, labels


def sft_loss(log_probs_of, hidden, weight, bias, labels, num_items, token_weights=None):
    """trl's SFT loss: minus the trained tokens' log-probabilities summed over ``num_items``."""
    mask = labels != -100
    log_probs = log_probs_of(hidden[mask], weight, bias, labels[mask])
    if token_weights is not None:
        log_probs = log_probs * token_weights[mask]
    return -log_probs.sum() / num_items


def materialised(hidden, weight, bias, labels):
    logits = hidden @ weight.T + (0 if bias is None else bias)
    return torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-10), (torch.float32, 1e-6)])
@pytest.mark.parametrize("chunk_rows", [1000, 4])  # one chunk; 4-row chunks, the last of 28 trained rows uneven
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("per_token", [False, True])  # DFT-like weights: the head's gradient recomputed in backward
# rows whose softmax - onehot is kept to the backward: none, the first 3 chunks of 4 rows (or none of one chunk), all
@pytest.mark.parametrize("kept_rows", [0, 12, ROWS])
def test_loss_and_gradients_equal_autograd_through_the_logits(dtype, tolerance, chunk_rows, bias, per_token, kept_rows):
    hidden, weight, head_bias, labels = inputs(dtype, bias=bias)
    params = [t for t in (hidden, weight, head_bias) if t is not None]
    token_weights = torch.rand(ROWS, generator=torch.Generator().manual_seed(1), dtype=dtype) if per_token else None
    num_items = 41  # the update's trained tokens, more than this micro-batch's

    def chunked(h, w, b, y):
        kept = kept_rows * VOCAB * torch.promote_types(dtype, torch.float32).itemsize
        return label_log_probs(h, w, b, y, chunk_elements=chunk_rows * VOCAB, kept_bytes=kept).log_probs

    loss = sft_loss(chunked, hidden, weight, head_bias, labels, num_items, token_weights)
    grads = torch.autograd.grad(loss, params)
    expected = sft_loss(materialised, hidden, weight, head_bias, labels, num_items, token_weights)
    expected_grads = torch.autograd.grad(expected, params)
    assert float((loss - expected).detach().abs()) < tolerance
    for grad, reference in zip(grads, expected_grads, strict=True):
        assert float((grad - reference).abs().max()) < tolerance
    assert float(expected_grads[0][labels == -100].abs().max()) == 0.0
    assert float(grads[0][labels == -100].abs().max()) == 0.0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_metrics_are_the_softmax_entropy_and_the_first_argmax(dtype):
    hidden, weight, head_bias, labels = inputs(dtype)
    labels = labels.clamp(min=0)
    with torch.no_grad():
        logits = hidden @ weight.T + head_bias
        logits[0] = 0.0
        logits[0, 3] = logits[0, 7] = 1.0  # a tie: the first maximum (3) is the top-1 prediction
        labels[0], labels[1] = 7, int(logits[1].argmax())
        # hidden states and a head that give these logits exactly: identity rows
        hidden_eye, weight_eye = logits.clone(), torch.eye(VOCAB, dtype=dtype)
    out = label_log_probs(hidden_eye, weight_eye, None, labels, metrics=True, chunk_elements=5 * VOCAB)
    log_p = torch.log_softmax(logits, -1)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    assert float((out.entropy - (-(log_p.exp() * log_p).sum(-1))).abs().max()) < tolerance
    assert torch.equal(out.is_top1, logits.argmax(-1) == labels)
    assert not out.is_top1[0] and out.is_top1[1]
    assert float((out.mean_logits - logits.mean(-1)).abs().max()) < tolerance
    # with a bias (row 0's logits were overwritten above)
    with_bias = label_log_probs(hidden, weight, head_bias, labels, metrics=True).mean_logits
    assert float((with_bias[1:] - logits[1:].mean(-1)).abs().max()) < tolerance
    assert label_log_probs(hidden, weight, head_bias, labels).entropy is None


def test_differentiating_the_entropy_is_refused():
    hidden, weight, head_bias, labels = inputs(torch.float64)
    out = label_log_probs(hidden, weight, head_bias, labels.clamp(min=0), metrics=True)
    with pytest.raises(RuntimeError, match="entropy it returns is a metric"):
        out.entropy.sum().backward()


def head_products(hidden, weight, labels, *, row_weights=None, kept_bytes=0) -> float:
    """Multiply-adds of a forward and backward of the (weighted) summed log-probabilities, in units of one
    ``hidden @ W^T``."""
    with FlopCounterMode(display=False) as counter:
        log_probs = label_log_probs(hidden, weight, None, labels, kept_bytes=kept_bytes).log_probs
        loss = log_probs.sum() if row_weights is None else (log_probs * row_weights).sum()
        torch.autograd.grad(loss, [t for t in (hidden, weight) if t.requires_grad])
    return counter.get_total_flops() / (2 * hidden.shape[0] * weight.shape[0] * weight.shape[1])


def test_a_pass_costs_two_head_products_without_the_hidden_gradient_and_three_with_it():
    hidden, weight, _, labels = inputs(torch.float32, bias=False)
    labels = labels.clamp(min=0)
    assert head_products(hidden.detach(), weight, labels) == 2  # logits, weight gradient; the backward only scales
    assert head_products(hidden, weight, labels) == 3  # and the hidden states' gradient


def test_per_row_weights_cost_two_and_three_products_with_the_rows_kept_and_one_more_without():
    """DPO-like weights, different per row and known only after the forward: with ``softmax - onehot`` kept the
    backward forms each gradient once; without, the head's gradient recomputes the logits."""
    hidden, weight, _, labels = inputs(torch.float32, bias=False)
    labels = labels.clamp(min=0)
    row_weights = torch.linspace(-1.0, 1.0, ROWS)
    everything = ROWS * VOCAB * 4  # bytes of float32
    assert head_products(hidden.detach(), weight, labels, row_weights=row_weights, kept_bytes=everything) == 2
    assert head_products(hidden, weight, labels, row_weights=row_weights, kept_bytes=everything) == 3
    # without: logits, the head's gradient formed in the forward, then recomputed (logits and product) in backward
    assert head_products(hidden.detach(), weight, labels, row_weights=row_weights) == 4
    # a budget below one chunk keeps no row: the logits recomputed in the backward, as trl's head does
    assert head_products(hidden.detach(), weight, labels, row_weights=row_weights, kept_bytes=4) == 3
    assert head_products(hidden, weight, labels, row_weights=row_weights, kept_bytes=4) == 4


def test_without_gradient_nothing_is_formed_and_no_rows_is_a_differentiable_zero():
    hidden, weight, head_bias, labels = inputs(torch.float32)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        label_log_probs(hidden, weight, head_bias, labels.clamp(min=0), metrics=True)
    assert counter.get_total_flops() == 2 * ROWS * VOCAB * WIDTH
    empty = label_log_probs(hidden[:0], weight, head_bias, labels[:0]).log_probs
    grads = torch.autograd.grad(-empty.sum(), (hidden, weight, head_bias))
    assert all(float(g.abs().max()) == 0.0 for g in grads)
    with pytest.raises(ValueError, match="takes rows"):
        label_log_probs(hidden.unsqueeze(0), weight, head_bias, labels.unsqueeze(0))
