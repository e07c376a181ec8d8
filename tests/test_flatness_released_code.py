"""The released code's trace (Gaussian Hutchinson on the data-label loss) against the exact Hessian of a tiny BERT."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import BertConfig, BertForMaskedLM
from transformers.models.bert.modeling_bert import BertPooler

from hf_flatbias.flatness.contexts import context_generator
from hf_flatbias.flatness.released_code import released_code_parameters, released_code_trace


def _tiny_bert() -> BertForMaskedLM:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=11,
        hidden_size=4,
        num_hidden_layers=1,
        num_attention_heads=1,
        intermediate_size=6,
        max_position_embeddings=8,
        type_vocab_size=1,
        hidden_dropout_prob=0.1,  # eval mode must switch it off
    )
    model = BertForMaskedLM(config)
    # The released code's model (BertForPreTraining) has a pooler; BertForMaskedLM leaves it out, so add one.
    model.bert.pooler = BertPooler(config)
    return model


def _batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(5, 11, (3, 6), generator=generator)
    labels = torch.full_like(input_ids, -100)
    labels[0, 1], labels[1, 3], labels[2, 2], labels[2, 4] = 7, 5, 9, 6  # several masks per sequence
    input_ids[labels != -100] = 4
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}


def _exact_hessian(model: BertForMaskedLM, batch: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    """The full Hessian (torch.autograd.functional.hessian) of the batch's loss over ``names``, flattened in order."""
    model.eval()
    fixed = dict(model.named_parameters())
    shapes = [fixed[name].shape for name in names]
    flat = torch.cat([fixed[name].detach().reshape(-1) for name in names]).double()

    def loss(vector: torch.Tensor) -> torch.Tensor:
        pieces = torch.split(vector, [s.numel() for s in shapes])
        params = {n: p.detach().double() for n, p in fixed.items()}
        params.update({name: piece.reshape(shape) for name, piece, shape in zip(names, pieces, shapes, strict=True)})
        return functional_call(model.double(), params, args=(), kwargs=batch).loss

    with sdpa_kernel(SDPBackend.MATH):  # the fused kernels have no second derivative
        hessian = torch.autograd.functional.hessian(loss, flat)
    model.float()
    return hessian


def test_pooler_and_output_bias_are_excluded():
    model = _tiny_bert()
    names = [name for name, _ in released_code_parameters(model)]
    assert not any("pooler" in name for name in names)
    assert all(param is not model.get_output_embeddings().bias for _, param in released_code_parameters(model))
    every = {name for name, _ in model.named_parameters()}
    assert set(every) - set(names) == {"bert.pooler.dense.weight", "bert.pooler.dense.bias", "cls.predictions.bias"}


def test_gaussian_hutchinson_matches_the_exact_hessian_trace():
    model = _tiny_bert()
    batch = _batch()
    names = [name for name, _ in released_code_parameters(model)]
    hessian = _exact_hessian(model, batch, names)
    exact = float(hessian.diagonal().sum())
    everything = float(_exact_hessian(model, batch, [name for name, _ in model.named_parameters()]).diagonal().sum())
    assert abs(everything - exact) > 0.5  # the exclusion changes the number: the test can tell them apart

    # One probe on one batch is v^T H v for the probe drawn from (seed, batch 0), to rounding.
    model.train()
    generator = context_generator(3, 0)
    probe = torch.cat(
        [torch.randn(p.shape, generator=generator).reshape(-1) for _, p in released_code_parameters(model)]
    )
    single = released_code_trace(model, [batch], probes_per_batch=1, seed=3)
    assert single.mean == pytest.approx(float(probe.double() @ hessian @ probe.double()), rel=1e-4)

    estimate = released_code_trace(model, [batch] * 20, probes_per_batch=40, seed=3)
    assert estimate.n_contexts == 20 and estimate.n_draws == 40
    assert abs(estimate.mean - exact) < 4 * estimate.stderr
    assert estimate.stderr < 0.1 * abs(exact) + 0.05  # precise enough for the comparison to mean something
    assert model.training  # the mode is restored
    again = released_code_trace(model, [batch] * 3, probes_per_batch=2, seed=3)
    assert again.mean == pytest.approx(released_code_trace(model, [batch] * 3, probes_per_batch=2, seed=3).mean)


def test_a_batch_without_masked_tokens_is_refused():
    batch = _batch()
    batch["labels"] = torch.full_like(batch["labels"], -100)
    with pytest.raises(ValueError, match="no masked"):
        released_code_trace(_tiny_bert(), [batch])
