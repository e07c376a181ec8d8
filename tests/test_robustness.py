"""Robustness measures of the pre-training loss: weight-noise sensitivity against the exact Hessian, round-to-nearest
quantization against a hand-written quantizer, and forgetting after fine-tuning. The reference computations here are
written independently of the package (plain forwards, Python rounding)."""

import copy
import json
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_flatbias.flatness import (
    ForgettingResult,
    QuantizationSensitivity,
    WeightNoiseSensitivity,
    estimate_quantization_sensitivity,
    estimate_weight_noise_sensitivity,
    measure_forgetting,
    quantized_weight_matrices,
    round_to_nearest,
    weight_noise,
)
from hf_flatbias.flatness.contexts import build_masked_contexts
from hf_flatbias.flatness.exact import exact_hessian_trace
from tests.helpers.tiny_models import TINY_DECODER, VOCAB, classification_rows, tiny_mlm, wide_masked_lm

NOISE_VOCAB = 12


def _mlm_contexts(n, vocab, seed=0, length=6):
    generator = torch.Generator().manual_seed(seed)
    rows = [{"input_ids": torch.randint(2, vocab, (length,), generator=generator).tolist()} for _ in range(n)]
    return build_masked_contexts(rows, mask_token_id=1, seed=seed)


def _reference_loss(model, rows):
    """Mean data-label cross-entropy from the stock forward (logits at every position), rows of equal length."""
    batch = {k: torch.tensor([r[k] for r in rows]) for k in ("input_ids", "attention_mask")}
    labels = torch.tensor([r["labels"] for r in rows])
    logits = model(**batch).logits.double()
    picked = labels != -100
    return torch.nn.functional.cross_entropy(logits[picked], labels[picked])  # with its graph: the HVP needs it


def _noise_model():
    return wide_masked_lm(vocab_size=NOISE_VOCAB).double()


def _snapshot(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _assert_same_weights(model, snapshot):
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), snapshot[name]), name


# ---------------------------------------------------------------------------------------------------------------------
# weight noise


def test_weight_noise_mean_is_half_sigma_squared_times_the_exact_hessian_trace():
    # 956 float64 parameters, eager attention (exact_hessian_trace needs a double backward). At sigma = 1e-3 the
    # antithetic pairs' expectation is sigma^2/2 Tr(H) up to O(sigma^4); the error left is the draw noise, about 6%
    # with 400 pairs (measured: mean / prediction 0.93 +- 0.057 for this seed).
    model = _noise_model()
    rows = _mlm_contexts(48, NOISE_VOCAB)
    sigma = 1e-3
    trace = exact_hessian_trace(model, rows)
    result = estimate_weight_noise_sensitivity(model, rows, [sigma], scale="absolute", n_draws=400, seed=0)
    predicted = sigma**2 / 2 * trace
    point = result.points[0]
    assert trace > 0
    assert point.stderr < 0.08 * predicted  # the check below is tight enough to catch a factor 2 or a lost sign
    assert abs(point.mean - predicted) < 3 * point.stderr
    assert result.n_parameters == sum(p.numel() for p in model.parameters())
    assert result.base_loss == pytest.approx(float(_reference_loss(model, rows).detach()), rel=1e-12)


def _quadratic_form_and_slope(model, rows, directions):
    """``d^T H d`` and ``g . d`` of the reference loss for a direction given per parameter name."""
    params = dict(model.named_parameters())
    names = list(directions)
    with torch.enable_grad():
        loss = _reference_loss(model, rows)
        grads = torch.autograd.grad(loss, [params[n] for n in names], create_graph=True)
        slope = sum((g * directions[n]).sum() for g, n in zip(grads, names, strict=True))
        hvp = torch.autograd.grad(slope, [params[n] for n in names])
    curvature = sum(float((h * directions[n]).sum()) for h, n in zip(hvp, names, strict=True))
    return curvature, float(slope.detach())


@pytest.mark.parametrize("scale", ["absolute", "rms"])
def test_each_draw_is_the_quadratic_form_of_its_noise(scale):
    # Per draw, no statistics: the antithetic value is sigma^2/2 d^T H d + O(sigma^4), d the draw's noise
    # (times each tensor's RMS for scale="rms"); the single-sided value keeps the first-order term sigma g.d.
    model = _noise_model()
    rows = _mlm_contexts(16, NOISE_VOCAB)
    sigma = 1e-3
    n_draws = 4
    paired = estimate_weight_noise_sensitivity(model, rows, [sigma, 2 * sigma], scale=scale, n_draws=n_draws, seed=5)
    single = estimate_weight_noise_sensitivity(
        model, rows, [sigma], scale=scale, n_draws=n_draws, seed=5, antithetic=False
    )
    for draw in range(n_draws):
        noise = weight_noise(model, seed=5, draw=draw)
        directions = {}
        for name, p in model.named_parameters():
            rms = p.detach().square().mean().sqrt() if scale == "rms" else 1.0
            directions[name] = noise[name].double() * rms
        curvature, slope = _quadratic_form_and_slope(model, rows, directions)
        expected = sigma**2 / 2 * curvature
        assert paired.points[0].per_draw[draw] == pytest.approx(expected, rel=2e-3, abs=1e-12)
        assert paired.points[1].per_draw[draw] == pytest.approx(4 * expected, rel=5e-3, abs=1e-12)
        assert single.points[0].per_draw[draw] == pytest.approx(sigma * slope + expected, rel=1e-3, abs=1e-12)
        assert abs(sigma * slope) > 10 * abs(expected)  # why the pairs: one draw is dominated by the slope


def test_weight_noise_restores_weights_grads_modes_and_random_streams():
    model = _noise_model()
    rows = _mlm_contexts(8, NOISE_VOCAB)
    model.train()
    model.bert.encoder.eval()
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    modes = [m.training for m in model.modules()]
    snapshot = _snapshot(model)
    rng = torch.random.get_rng_state()
    estimate_weight_noise_sensitivity(model, rows, [1e-2, 1e-1], n_draws=3)
    _assert_same_weights(model, snapshot)
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in model.parameters())
    assert [m.training for m in model.modules()] == modes
    assert torch.equal(torch.random.get_rng_state(), rng)


def test_weight_noise_common_random_numbers_across_checkpoints():
    # Two checkpoints of the same architecture (different weights, even a different dtype) get the same noise; it
    # depends on (seed, draw, name) only, not on which other parameters are asked for.
    first, second = wide_masked_lm(0, vocab_size=NOISE_VOCAB), wide_masked_lm(1, vocab_size=NOISE_VOCAB).double()
    a, b = weight_noise(first, seed=3, draw=2), weight_noise(second, seed=3, draw=2)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[name], b[name]) for name in a)
    name = "bert.encoder.layer.0.attention.self.query.weight"
    assert torch.equal(weight_noise(first, seed=3, draw=2, names=[name])[name], a[name])
    assert not torch.equal(weight_noise(first, seed=3, draw=1)[name], a[name])
    assert not torch.equal(weight_noise(first, seed=4, draw=2)[name], a[name])
    key = "bert.encoder.layer.0.attention.self.key.weight"  # same shape, another name: other noise
    assert not torch.equal(a[key], a[name])
    # the estimate uses that noise: the same draws on both checkpoints
    rows = _mlm_contexts(8, NOISE_VOCAB)
    one = estimate_weight_noise_sensitivity(second, rows, [1e-2], n_draws=3, seed=3)
    two = estimate_weight_noise_sensitivity(second, rows, [1e-2], n_draws=3, seed=3)
    assert one.points[0].per_draw == two.points[0].per_draw


def test_weight_noise_result_is_plain_and_records_its_settings():
    model = _noise_model()
    result = estimate_weight_noise_sensitivity(model, _mlm_contexts(6, NOISE_VOCAB), [1e-2, 1e-1], n_draws=2, seed=7)
    assert isinstance(result, WeightNoiseSensitivity)
    values = json.loads(json.dumps(result.to_dict()))
    assert values["scale"] == "rms" and values["antithetic"] is True and values["seed"] == 7
    assert values["n_draws"] == 2 and values["n_contexts"] == 6
    assert [p["sigma"] for p in values["points"]] == [1e-2, 1e-1]
    assert "per_draw" not in values["points"][0]
    assert len(result.to_dict(per_draw=True)["points"][0]["per_draw"]) == 2
    assert result.sigmas == [1e-2, 1e-1] and all(math.isfinite(m) for m in result.means)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(sigmas=[]), "sigmas"),
        (dict(sigmas=[1e-2, -1.0]), "sigmas"),
        (dict(scale="l2"), "scale"),
        (dict(n_draws=0), "n_draws"),
        (dict(batch_size=0), "batch_size"),
    ],
)
def test_weight_noise_refuses_bad_settings(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment) as error:
        estimate_weight_noise_sensitivity(_noise_model(), _mlm_contexts(4, NOISE_VOCAB), **kwargs)
    assert "\n" not in str(error.value)


# ---------------------------------------------------------------------------------------------------------------------
# quantization


def _hand_quantized(matrix, bits, group_size):
    """Round-to-nearest with Python floats, one row and group at a time (``round``: ties to even)."""
    rows, columns = matrix.shape
    size = columns if group_size is None else group_size
    top = 2 ** (bits - 1) - 1
    out = torch.zeros(rows, columns, dtype=torch.float64)
    for r in range(rows):
        for g in range(0, columns, size):
            values = [float(v) for v in matrix[r, g : g + size]]
            largest = max(abs(v) for v in values)
            if largest == 0:
                continue
            step = largest / top
            for j, v in enumerate(values):
                out[r, g + j] = max(-top, min(top, round(v / step))) * step
    return out


EXPECTED_MATRICES = {
    "bert.embeddings.word_embeddings.weight",  # also the tied decoder: quantized once
    "bert.embeddings.position_embeddings.weight",
    "bert.embeddings.token_type_embeddings.weight",
    "bert.encoder.layer.0.attention.self.query.weight",
    "bert.encoder.layer.0.attention.self.key.weight",
    "bert.encoder.layer.0.attention.self.value.weight",
    "bert.encoder.layer.0.attention.output.dense.weight",
    "bert.encoder.layer.0.intermediate.dense.weight",
    "bert.encoder.layer.0.output.dense.weight",
    "cls.predictions.transform.dense.weight",
}


def test_quantized_matrices_are_the_linear_and_embedding_weights():
    model = tiny_mlm()
    assert set(quantized_weight_matrices(model)) == EXPECTED_MATRICES
    without = set(quantized_weight_matrices(model, include_embeddings=False))
    assert without == {n for n in EXPECTED_MATRICES if "embeddings" not in n}


@pytest.mark.parametrize("group_size", [None, 8])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantization_matches_a_hand_written_quantizer(bits, group_size):
    model = tiny_mlm().double().eval()
    rows = _mlm_contexts(24, VOCAB)
    snapshot = _snapshot(model)
    result = estimate_quantization_sensitivity(model, rows, bits, group_size=group_size)
    _assert_same_weights(model, snapshot)

    reference = copy.deepcopy(model)
    matrices = quantized_weight_matrices(reference)
    with torch.no_grad():
        for name, weight in matrices.items():
            expected = _hand_quantized(weight.detach(), bits, group_size)
            assert torch.equal(round_to_nearest(weight.detach(), bits, group_size), expected), name
            weight.copy_(expected)
        for name, p in reference.named_parameters():
            if name not in matrices and "word_embeddings" not in name:
                assert torch.equal(p, snapshot[name]), name  # biases, norms: untouched
        tied = matrices["bert.embeddings.word_embeddings.weight"]
        assert torch.equal(reference.cls.predictions.decoder.weight, tied)
        base, quantized = _reference_loss(model, rows), _reference_loss(reference, rows)
    point = result.points[0]
    assert result.base_loss == pytest.approx(float(base), rel=1e-12)
    assert point.quantized_loss == pytest.approx(float(quantized), rel=1e-12)
    assert point.loss_increase == pytest.approx(float(quantized - base), rel=1e-9, abs=1e-13)
    assert point.loss_increase != 0
    assert result.granularity == ("per_channel" if group_size is None else "per_group")
    assert result.n_tensors == len(EXPECTED_MATRICES)


def test_four_bits_cost_more_than_eight():
    model = tiny_mlm().double().eval()
    result = estimate_quantization_sensitivity(model, _mlm_contexts(32, VOCAB), (8, 4), group_size=8)
    eight, four = result.points
    assert (eight.bits, four.bits) == (8, 4)
    assert four.relative_weight_error > 8 * eight.relative_weight_error
    assert abs(four.loss_increase) > abs(eight.loss_increase)
    assert isinstance(result, QuantizationSensitivity)
    values = json.loads(json.dumps(result.to_dict()))
    assert values["group_size"] == 8 and values["include_embeddings"] is True


def test_quantization_keeps_embeddings_when_asked():
    model = tiny_mlm().double().eval()
    rows = _mlm_contexts(8, VOCAB)
    result = estimate_quantization_sensitivity(model, rows, 4, include_embeddings=False)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for weight in quantized_weight_matrices(reference, include_embeddings=False).values():
            weight.copy_(_hand_quantized(weight.detach(), 4, None))
        expected = float(_reference_loss(reference, rows) - _reference_loss(model, rows))
    assert result.points[0].loss_increase == pytest.approx(expected, rel=1e-9)
    assert result.n_tensors == len(EXPECTED_MATRICES) - 3


def test_quantization_of_gpt2_conv1d_is_per_output_column():
    # GPT-2's Conv1D stores (in, out): a channel is a column, its groups run down the inputs.
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    model = GPT2LMHeadModel(config).double().eval()
    generator = torch.Generator().manual_seed(0)
    texts = [{"input_ids": torch.randint(0, VOCAB, (6,), generator=generator).tolist()} for _ in range(12)]
    rows = build_masked_contexts(texts, mask_token_id=None, causal=True)
    result = estimate_quantization_sensitivity(model, rows, 4, group_size=8)
    reference = copy.deepcopy(model)
    matrices = quantized_weight_matrices(reference)
    assert set(matrices) == {
        "transformer.wte.weight",
        "transformer.wpe.weight",
        "transformer.h.0.attn.c_attn.weight",
        "transformer.h.0.attn.c_proj.weight",
        "transformer.h.0.mlp.c_fc.weight",
        "transformer.h.0.mlp.c_proj.weight",
    }
    with torch.no_grad():
        for name, weight in matrices.items():
            transposed = "wte" not in name and "wpe" not in name
            w = weight.detach()
            weight.copy_(_hand_quantized(w.t(), 4, 8).t() if transposed else _hand_quantized(w, 4, 8))
        batch = {"input_ids": torch.tensor([r["input_ids"] for r in rows])}
        labels = torch.tensor([r["labels"] for r in rows])

        def loss(m):
            logits = m(**batch).logits[:, :-1].double()
            picked = labels[:, 1:] != -100
            return float(torch.nn.functional.cross_entropy(logits[picked], labels[:, 1:][picked]))

        expected = loss(reference) - loss(model)
    assert result.points[0].loss_increase == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(bits=1), "from 2 to 8"),
        (dict(bits=9), "from 2 to 8"),
        (dict(bits=True), "from 2 to 8"),
        (dict(bits=(8, 16)), "from 2 to 8"),
        (dict(bits=()), "bits is empty"),
        (dict(bits=4, group_size=0), "positive integer"),
        (dict(bits=4, group_size=5), "does not divide the 16 input entries of bert.embeddings"),
        (dict(bits=4, group_size=12), "use a divisor"),
    ],
)
def test_quantization_refuses_bad_settings(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment) as error:
        estimate_quantization_sensitivity(tiny_mlm(), _mlm_contexts(4, VOCAB), **kwargs)
    assert "\n" not in str(error.value)


def test_round_to_nearest_refuses_a_group_size_that_does_not_divide():
    with pytest.raises(ValueError, match="does not divide the matrix's 6 input entries"):
        round_to_nearest(torch.ones(2, 6), 4, 4)


# ---------------------------------------------------------------------------------------------------------------------
# forgetting


def _task_rows(n=24, seed=1):
    return [
        {"input_ids": r["input_ids"], "attention_mask": r["attention_mask"], "label": r["labels"]}
        for r in classification_rows(n, seed)
    ]


def _pretrained_mlm(rows, seed=0, steps=100):
    """The tiny masked LM trained to (near) zero loss on ``rows``: a minimum for fine-tuning to move away from."""
    model = tiny_mlm(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = {k: torch.tensor([r[k] for r in rows]) for k in ("input_ids", "attention_mask", "labels")}
    for _ in range(steps):
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.zero_grad(set_to_none=True)
    return model.eval()


def _without_time(result):
    values = result.to_dict()
    values.pop("seconds")
    for key in ("trace_before", "trace_after"):
        if values[key] is not None:
            values[key].pop("seconds")
    return values


def test_forgetting_is_deterministic_and_leaves_the_model_untouched():
    model = tiny_mlm(0)
    model.train()
    rows = _mlm_contexts(16, VOCAB)
    snapshot = _snapshot(model)
    modes = [m.training for m in model.modules()]
    rng = torch.random.get_rng_state()
    settings = dict(steps=4, learning_rate=1e-2, batch_size=8, seed=3)
    first = measure_forgetting(model, rows, _task_rows(), **settings)
    second = measure_forgetting(model, rows, _task_rows(), **settings)
    assert isinstance(first, ForgettingResult)
    assert _without_time(first) == _without_time(second)
    assert first.forgetting != 0 and len(first.train_losses) == 4
    other = measure_forgetting(model, rows, _task_rows(), **{**settings, "seed": 4})
    assert other.forgetting != first.forgetting
    _assert_same_weights(model, snapshot)
    assert all(p.grad is None for p in model.parameters())
    assert [m.training for m in model.modules()] == modes
    assert torch.equal(torch.random.get_rng_state(), rng)
    values = json.loads(json.dumps(first.to_dict()))
    assert values["steps"] == 4 and values["optimizer"] == "adamw" and values["num_labels"] == 3


def test_zero_steps_forget_nothing_exactly():
    model = tiny_mlm(0)
    rows = _mlm_contexts(16, VOCAB)
    result = measure_forgetting(model, rows, _task_rows(), steps=0, learning_rate=1.0, trace={"n_draws": 1})
    assert result.forgetting == 0.0 and result.stderr == 0.0
    assert result.lm_loss_after == result.lm_loss_before
    assert result.trace_after.mean == result.trace_before.mean and result.trace_change == 0.0
    assert result.accuracy_after == result.accuracy_before and result.train_losses == []


def test_a_larger_learning_rate_forgets_more():
    # Measured on five pre-trained seeds (pre-training loss 0.009-0.013): 10 AdamW steps forget 0.009-0.063 nats at
    # lr 1e-3, 7.9-10.7 at lr 1e-1, 7.4-13.3 standard errors apart.
    rows = _mlm_contexts(32, VOCAB)
    model = _pretrained_mlm(rows)
    small = measure_forgetting(model, rows, _task_rows(), steps=10, learning_rate=1e-3, seed=0)
    large = measure_forgetting(model, rows, _task_rows(), steps=10, learning_rate=1e-1, seed=0)
    assert small.lm_loss_before == large.lm_loss_before < 0.1
    assert large.forgetting > 10 * small.forgetting > 0
    assert large.forgetting - small.forgetting > 5 * math.hypot(large.stderr, small.stderr)


def test_forgetting_of_a_causal_lm():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_DECODER)).eval()
    generator = torch.Generator().manual_seed(0)
    texts = [{"input_ids": torch.randint(2, 16, (7,), generator=generator).tolist()} for _ in range(8)]
    rows = build_masked_contexts(texts, mask_token_id=None, causal=True)
    task = [{"input_ids": t["input_ids"], "label": i % 2} for i, t in enumerate(texts)]
    assert measure_forgetting(model, rows, task, steps=0).forgetting == 0.0
    result = measure_forgetting(model, rows, task, steps=2, learning_rate=1e-2, batch_size=4)
    assert result.forgetting != 0 and result.num_labels == 2


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(steps=-1), "steps"),
        (dict(optimizer="adam"), "optimizer"),
        (dict(num_labels=2), "Labels must lie in 0..1"),
        (dict(batch_size=0), "batch_size"),
    ],
)
def test_forgetting_refuses_bad_settings(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment) as error:
        measure_forgetting(tiny_mlm(), _mlm_contexts(4, VOCAB), _task_rows(6), **kwargs)
    assert "\n" not in str(error.value)


def test_forgetting_refuses_rows_without_labels():
    with pytest.raises(ValueError, match="no single class 'label'"):
        measure_forgetting(tiny_mlm(), _mlm_contexts(4, VOCAB), [{"input_ids": [2, 3, 4]}])
