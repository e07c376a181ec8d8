"""Functional-SAM's chunked cotangent and surrogate (`hf_flatbias.sharpness.fused_head`) against the materialised
logits: a tiny embedding + head model in float64, where both are written out in full."""

from __future__ import annotations

import pytest
import torch

from hf_flatbias.sharpness.fused_head import FusedHeadOutputs, fused_head_surrogate

VOCAB, WIDTH, ROWS = 11, 5, 9


def tiny(bias: bool, tied: bool) -> tuple[torch.nn.Embedding, torch.nn.Linear]:
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(VOCAB, WIDTH).double()
    head = torch.nn.Linear(WIDTH, VOCAB, bias=bias).double()
    if tied:
        head.weight = embedding.weight
    return embedding, head


def hidden_of(embedding: torch.nn.Embedding, tokens: torch.Tensor) -> torch.Tensor:
    return torch.tanh(embedding(tokens))


def label_log_probs(hidden, head, labels, temperature=1.0):
    return torch.log_softmax(head(hidden) / temperature, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("bias,tied", [(False, False), (True, False), (False, True)])
def test_chunked_surrogate_has_the_gradient_of_the_materialised_one(bias, tied):
    embedding, head = tiny(bias, tied)
    params = list(dict.fromkeys([*embedding.parameters(), *head.parameters()]))
    tokens, labels = torch.randint(VOCAB, (ROWS,)), torch.randint(VOCAB, (ROWS,))
    mask = torch.rand(ROWS) > 0.3
    weights = torch.rand(ROWS)  # a per-token weighting, as DFT's or DPO's

    def loss_of(log_probs):
        return -(weights * log_probs * mask).sum()

    # at w: the chunked cotangent, and the materialised one for the reference
    hidden = hidden_of(embedding, tokens)
    log_probs = label_log_probs(hidden, head, labels)
    cotangent = FusedHeadOutputs(hidden, labels, mask, log_probs, head).cotangent(loss_of(log_probs))
    logits = head(hidden_of(embedding, tokens))
    (reference_cotangent,) = torch.autograd.grad(loss_of(torch.log_softmax(logits, -1)[range(ROWS), labels]), logits)
    # at w + e
    with torch.no_grad():
        for p in params:
            p.add_(0.1 * torch.randn_like(p))
    hidden = hidden_of(embedding, tokens)
    log_probs = label_log_probs(hidden, head, labels)
    outputs = FusedHeadOutputs(hidden, labels, mask, log_probs, head)
    chunked = torch.autograd.grad(
        fused_head_surrogate(hidden[mask], head, cotangent, chunk_rows=2), params, allow_unused=True
    )
    reference = torch.autograd.grad((head(hidden_of(embedding, tokens)) * reference_cotangent).sum(), params)
    for got, want in zip(chunked, reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert outputs.surrogate(cotangent).requires_grad
    assert max(float(g.abs().max()) for g in reference) > 1e-3  # not a comparison of zeros


def test_a_head_that_transforms_the_logits_is_refused():
    embedding, head = tiny(False, False)
    tokens, labels = torch.randint(VOCAB, (ROWS,)), torch.randint(VOCAB, (ROWS,))
    mask = torch.ones(ROWS, dtype=torch.bool)
    hidden = hidden_of(embedding, tokens)
    log_probs = label_log_probs(hidden, head, labels, temperature=2.0)  # what the head scored is not h W^T
    outputs = FusedHeadOutputs(hidden, labels, mask, log_probs, head)
    cotangent = outputs.cotangent(-log_probs.sum())
    with pytest.raises(ValueError, match="^flatness_method='functional_sam': the fused LM head's log-probabilities"):
        outputs.surrogate(cotangent)
