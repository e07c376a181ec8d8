"""Trace estimators against exact references computed here, on models small enough to enumerate the vocabulary."""

import dataclasses
import math

import pytest
import torch
from torch.func import functional_call, jacrev
from transformers import BertConfig, BertForMaskedLM, BertLMHeadModel, BertModel, GPT2Config, GPT2LMHeadModel

import hf_flatbias.flatness.api
from hf_flatbias.constants import IGNORE_INDEX
from hf_flatbias.flatness import (
    ESTIMATORS,
    TraceContexts,
    TraceSamples,
    build_masked_contexts,
    compute_trace_samples,
    estimate_hessian_trace,
    summarize_trace_samples,
)
from hf_flatbias.flatness.estimators import (
    ESTIMATOR_REGISTRY,
    TraceSettings,
    per_context_estimators,
    probed_estimators,
)
from hf_flatbias.flatness.exact import exact_fisher_trace, exact_hessian_trace, per_context_fisher_traces
from hf_flatbias.flatness.lm import is_causal_lm
from hf_flatbias.tensors import trainable_parameters
from tests.helpers.tiny_models import wide_masked_lm

VOCAB, MASK = 14, 1


def _tiny_bert(seed=0, **overrides):
    return wide_masked_lm(seed, **{"vocab_size": VOCAB, **overrides})


def _tiny_gpt2(seed=0, **overrides):
    torch.manual_seed(seed)
    config = dict(
        vocab_size=VOCAB,
        n_embd=8,
        n_layer=1,
        n_head=2,
        n_positions=16,
        bos_token_id=2,
        eos_token_id=2,
        initializer_range=0.4,
        attn_implementation="eager",
    )
    config.update(overrides)
    return GPT2LMHeadModel(GPT2Config(**config)).eval()


def _rows(n_rows, seed=0):
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n_rows):
        length = int(torch.randint(4, 9, (1,), generator=generator))
        rows.append({"input_ids": torch.randint(2, VOCAB, (length,), generator=generator).tolist()})
    return rows


def _contexts(n, causal=False, seed=0):
    return build_masked_contexts(_rows(n, seed), mask_token_id=None if causal else MASK, causal=causal, seed=seed)


def _reference_fisher(model, rows):
    """sum_y p_y ||J^T (e_y - p)||^2 = tr(Cov J J^T) with the full logit Jacobian from torch.func, per context."""
    params = {name: p.detach() for name, p in model.named_parameters()}
    traces = []
    for row in rows:
        (position,) = [t for t, label in enumerate(row["labels"]) if label != IGNORE_INDEX]
        ids = torch.tensor([row["input_ids"]])
        if is_causal_lm(model):
            ids, position = ids[:, :position], position - 1

        def logits_at(p, ids=ids, position=position):
            return functional_call(model, p, (ids,)).logits[0, position]

        jacobian = jacrev(logits_at)(params)
        flat = torch.cat([j.reshape(VOCAB, -1) for j in jacobian.values()], dim=1).double()
        probs = torch.softmax(logits_at(params).double(), dim=-1)
        covariance = torch.diag(probs) - torch.outer(probs, probs)
        traces.append(float(torch.trace(covariance @ flat @ flat.T)))
    return torch.tensor(traces, dtype=torch.float64)


@pytest.fixture(scope="module")
def bert_case():
    model, rows = _tiny_bert(), _contexts(24)
    return model, rows, exact_fisher_trace(model, rows)


def test_exact_fisher_matches_a_jacobian_reference():
    model, rows = _tiny_bert(seed=1), _contexts(4, seed=1)
    torch.testing.assert_close(
        per_context_fisher_traces(model, rows), _reference_fisher(model, rows), rtol=1e-4, atol=0
    )


def test_exact_fisher_matches_a_jacobian_reference_for_causal_lm():
    model, rows = _tiny_gpt2(seed=1), _contexts(4, causal=True, seed=1)
    torch.testing.assert_close(
        per_context_fisher_traces(model, rows), _reference_fisher(model, rows), rtol=1e-4, atol=0
    )


def test_hessian_with_model_labels_averages_to_the_fisher_trace():
    """sum_y p_y Tr H_y = Tr F for each context: checks both exact helpers against each other exactly."""
    model = _tiny_bert(seed=2, hidden_size=4, intermediate_size=4, vocab_size=6, num_attention_heads=1)
    (row,) = build_masked_contexts([{"input_ids": [2, 3, 4, 5]}], mask_token_id=MASK, seed=2)
    (position,) = [t for t, label in enumerate(row["labels"]) if label != IGNORE_INDEX]
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=torch.tensor([row["input_ids"]])).logits[0, position].double(), -1)
    weighted = 0.0
    for label in range(6):
        labels = [IGNORE_INDEX] * 4
        labels[position] = label
        weighted += float(probs[label]) * exact_hessian_trace(model, [{**row, "labels": labels}])
    assert weighted == pytest.approx(exact_fisher_trace(model, [row]), rel=1e-4)


def test_exact_hessian_matches_a_finite_difference_of_the_gradient_on_a_single_weight():
    model = _tiny_bert(seed=3, hidden_size=4, intermediate_size=4, num_attention_heads=1)
    generator = torch.Generator().manual_seed(3)
    same_length = [{"input_ids": torch.randint(2, VOCAB, (6,), generator=generator).tolist()} for _ in range(3)]
    rows = build_masked_contexts(same_length, mask_token_id=MASK, seed=3)
    frozen = [p for name, p in model.named_parameters() if name != "cls.predictions.transform.dense.bias"]
    for p in frozen:
        p.requires_grad_(False)
    bias = model.cls.predictions.transform.dense.bias
    contexts = TraceContexts.from_rows(rows, causal=False)

    def loss_gradient():
        logits = model(input_ids=torch.stack(contexts.input_ids)).logits
        picked = logits[torch.arange(len(rows)), torch.tensor(contexts.positions)]
        loss = torch.nn.functional.cross_entropy(picked.double(), torch.tensor(contexts.targets))
        return torch.autograd.grad(loss, bias)[0].double()

    eps, diagonal = 1e-3, 0.0
    for entry in range(bias.numel()):
        with torch.no_grad():
            bias[entry] += eps
        plus = loss_gradient()[entry]
        with torch.no_grad():
            bias[entry] -= 2 * eps
        minus = loss_gradient()[entry]
        with torch.no_grad():
            bias[entry] += eps
        diagonal += float(plus - minus) / (2 * eps)
    assert exact_hessian_trace(model, rows) == pytest.approx(diagonal, rel=2e-2)


@pytest.mark.parametrize("estimator", ["per_sample", "summed", "naive"])
def test_fisher_estimators_are_within_four_standard_errors_of_the_exact_trace(bert_case, estimator):
    model, rows, exact = bert_case
    # summed and hutchinson sample one value per batch: small batches give enough units for a standard error
    estimate = estimate_hessian_trace(model, rows, n_draws=6, estimator=estimator, batch_size=2, seed=11)
    assert estimate.n_contexts == 24 and estimate.n_draws == 6 and estimate.estimator == estimator
    assert 0 < estimate.stderr < 0.5 * exact
    assert abs(estimate.mean - exact) < 4 * estimate.stderr


def test_per_sample_without_output_expectation_equals_naive_draw_for_draw(bert_case):
    model, rows, _ = bert_case
    contexts = TraceContexts.from_rows(rows, causal=False)
    naive = compute_trace_samples(model, contexts, n_draws=3, estimator="naive", seed=5)
    ghost = compute_trace_samples(
        model, contexts, n_draws=3, estimator="per_sample", seed=5, batch_size=5, exact_output_expectation=False
    )
    torch.testing.assert_close(ghost.values, naive.values, rtol=1e-4, atol=1e-6)


def test_per_sample_equals_naive_for_a_causal_lm_with_conv1d_layers():
    model, rows = _tiny_gpt2(), _contexts(10, causal=True)
    contexts = TraceContexts.from_rows(rows, causal=True)
    naive = compute_trace_samples(model, contexts, n_draws=2, estimator="naive", seed=1)
    ghost = compute_trace_samples(
        model, contexts, n_draws=2, estimator="per_sample", seed=1, batch_size=4, exact_output_expectation=False
    )
    torch.testing.assert_close(ghost.values, naive.values, rtol=1e-4, atol=1e-6)
    estimate = estimate_hessian_trace(model, rows, n_draws=8, seed=2)
    assert abs(estimate.mean - exact_fisher_trace(model, rows)) < 4 * estimate.stderr


def test_output_expectation_removes_the_decoder_draw_noise():
    """With the untied decoder and everything but the head frozen, the expectation makes every draw exact."""
    model = _tiny_bert(seed=4, tie_word_embeddings=False)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("cls.predictions.decoder"))
    rows = _contexts(6, seed=4)
    contexts = TraceContexts.from_rows(rows, causal=False)
    samples = compute_trace_samples(model, contexts, n_draws=4, seed=0)
    expected = _reference_fisher_subset(model, rows).unsqueeze(1).expand(-1, 4)
    torch.testing.assert_close(samples.values, expected, rtol=1e-5, atol=1e-6)
    for p in model.parameters():
        p.requires_grad_(True)


def _reference_fisher_subset(model, rows):
    """Fisher trace over the decoder weight and bias only: (1 - ||p||^2)(||h||^2 + 1), by brute force over y."""
    traces = []
    params = [p for p in model.parameters() if p.requires_grad]
    for row in rows:
        (position,) = [t for t, label in enumerate(row["labels"]) if label != IGNORE_INDEX]
        log_probs = torch.log_softmax(model(input_ids=torch.tensor([row["input_ids"]])).logits[0, position], -1)
        total = 0.0
        for label in range(VOCAB):
            grads = torch.autograd.grad(log_probs[label], params, retain_graph=True)
            total += float(log_probs[label].detach().exp()) * sum(float(g.double().square().sum()) for g in grads)
        traces.append(total)
    return torch.tensor(traces, dtype=torch.float64)


@pytest.mark.parametrize("probe", ["rademacher", "gaussian"])
def test_hutchinson_is_within_four_standard_errors_of_the_exact_hessian(probe):
    model, rows = _tiny_bert(seed=7, hidden_size=4, intermediate_size=8, num_attention_heads=1), _contexts(12, seed=7)
    estimate = estimate_hessian_trace(
        model, rows, n_draws=30, estimator="hutchinson", batch_size=2, seed=3, probe=probe
    )
    exact = exact_hessian_trace(model, rows)
    assert abs(estimate.mean - exact) < 4 * estimate.stderr


def test_gaussian_probes_differ_from_rademacher_ones_and_only_hutchinson_takes_them():
    model, rows = _tiny_bert(seed=7, hidden_size=4, intermediate_size=8, num_attention_heads=1), _contexts(4, seed=7)
    draws = {
        probe: compute_trace_samples(
            model, TraceContexts.from_rows(rows, causal=False), estimator="hutchinson", probe=probe, batch_size=4
        ).values
        for probe in ("rademacher", "gaussian")
    }
    assert not torch.equal(draws["rademacher"], draws["gaussian"])
    with pytest.raises(ValueError, match="applies to estimator='hutchinson' or 'hutchpp' only"):
        estimate_hessian_trace(model, rows, probe="gaussian")
    with pytest.raises(ValueError, match="probe='normal' is not supported"):
        estimate_hessian_trace(model, rows, estimator="hutchinson", probe="normal")


def test_standard_error_covers_the_population_trace_about_95_percent_of_the_time():
    """Contexts drawn at random (with replacement) from a population whose exact per-context traces are known: the
    interval mean +- 2 stderr must contain the population mean about 95% of the time (t with 19 d.o.f.: 94%).
    Every selected context gets its own fresh pair of draws, taken from one long per_sample run to save time."""
    model = _tiny_bert(seed=5, initializer_range=0.1)  # wider ones give heavy tails that n=20 cannot average
    population = _contexts(60, seed=5)
    target = float(per_context_fisher_traces(model, population).mean())
    generator = torch.Generator().manual_seed(0)
    trials, per_trial, draws = 100, 20, 2
    chosen = torch.randint(len(population), (trials, per_trial), generator=generator)
    uses = torch.bincount(chosen.flatten(), minlength=len(population))
    contexts = TraceContexts.from_rows(population, causal=False)
    pool = compute_trace_samples(model, contexts, n_draws=draws * int(uses.max()), seed=1, batch_size=60).values
    next_column = [0] * len(population)
    covered = 0
    for trial in range(trials):
        rows = []
        for index in chosen[trial].tolist():
            rows.append(pool[index, next_column[index] : next_column[index] + draws])
            next_column[index] += draws
        samples = TraceSamples(values=torch.stack(rows), weights=torch.ones(per_trial), n_draws=draws, estimator="x")
        estimate = summarize_trace_samples(samples)
        covered += abs(estimate.mean - target) <= 2 * estimate.stderr
    print(f"coverage {covered / trials:.2f}")
    assert 0.87 <= covered / trials <= 0.99  # +-3 binomial sd around 0.94


def test_draws_depend_only_on_seed_and_context_index(bert_case):
    model, rows, _ = bert_case
    contexts = TraceContexts.from_rows(rows, causal=False)
    whole = compute_trace_samples(model, contexts, n_draws=2, seed=9, batch_size=7)
    halves = [
        compute_trace_samples(model, contexts, indices=part, n_draws=2, seed=9, batch_size=3)
        for part in (range(0, 24, 2), range(1, 24, 2))
    ]
    torch.testing.assert_close(halves[0].values, whole.values[0::2], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(halves[1].values, whole.values[1::2], rtol=1e-5, atol=1e-6)


def test_measurement_leaves_modes_gradients_and_random_streams_alone(bert_case):
    model, rows, _ = bert_case
    model.train()
    model.cls.eval()
    state = torch.random.get_rng_state()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    estimate_hessian_trace(model, rows[:4], n_draws=2)
    assert model.training and not model.cls.training and model.bert.training
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    model.eval()


def test_bad_input_raises_clear_errors(bert_case):
    model, rows, _ = bert_case
    with pytest.raises(ValueError, match="no language-model head"):
        estimate_hessian_trace(BertModel(model.config), rows)
    with pytest.raises(ValueError, match="no labelled position"):
        estimate_hessian_trace(model, [{**rows[0], "labels": [IGNORE_INDEX] * len(rows[0]["labels"])}])
    with pytest.raises(ValueError, match="n_draws must be an integer >= 1"):
        estimate_hessian_trace(model, rows, n_draws=0)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        estimate_hessian_trace(model, [{**rows[0], "input_ids": [VOCAB + 5] + rows[0]["input_ids"][1:]}])
    with pytest.raises(ValueError, match="estimator="):
        estimate_hessian_trace(model, rows, estimator="exact")
    with pytest.raises(ValueError, match="n_contexts=99"):
        estimate_hessian_trace(model, rows, n_contexts=99)
    assert set(ESTIMATORS) == {"per_sample", "summed", "hutchinson", "hutchpp", "naive"}


def test_the_registry_holds_one_estimator_per_name_in_its_own_module():
    assert tuple(ESTIMATOR_REGISTRY) == ESTIMATORS
    for name, estimator in ESTIMATOR_REGISTRY.items():
        assert estimator.name == name
        assert type(estimator).__module__ == f"hf_flatbias.flatness.estimators.{name}"
    assert per_context_estimators() == ("per_sample", "naive")
    assert probed_estimators() == ("hutchinson", "hutchpp")


def test_trace_settings_are_frozen_and_checked_when_made():
    settings = TraceSettings(estimator="hutchpp", probe="gaussian")
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.n_draws = 3
    for bad, message in (
        ({"estimator": "exact"}, "estimator='exact' is not supported"),
        ({"probe": "gaussian"}, "applies to estimator='hutchinson' or 'hutchpp' only"),
        ({"n_draws": 2.0}, "n_draws must be an integer"),
        ({"batch_size": "big"}, "batch_size must be an integer >= 1 or 'auto'"),
    ):
        with pytest.raises(ValueError, match=message):
            TraceSettings(**bad)
    assert all(f.metadata.get("help") for f in dataclasses.fields(TraceSettings))


def test_one_causal_lm_test_for_models_configs_decoders_and_peft_wrappers():
    bert, gpt2 = _tiny_bert(), _tiny_gpt2()
    assert not is_causal_lm(bert) and is_causal_lm(gpt2)
    # a BERT built as a decoder shifts its labels: its config says so, whatever the class
    decoder_config = BertConfig(**{**bert.config.to_dict(), "is_decoder": True})
    assert is_causal_lm(BertLMHeadModel(decoder_config)) and is_causal_lm(BertForMaskedLM(decoder_config))
    # a checkpoint's config, before any class is chosen: its architectures decide
    assert is_causal_lm(GPT2Config(architectures=["GPT2LMHeadModel"]))
    assert not is_causal_lm(BertConfig(architectures=["BertForMaskedLM"]))
    assert not is_causal_lm(GPT2Config())  # no architectures: nothing says causal
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=2, target_modules=["c_attn"])
    assert is_causal_lm(peft.get_peft_model(_tiny_gpt2(), lora))


def test_progress_bar_when_asked_or_when_the_estimate_is_long(bert_case, capsys, monkeypatch):
    model, rows, _ = bert_case
    estimate_hessian_trace(model, rows, n_draws=2, batch_size=8, progress=True)
    bar = capsys.readouterr().err
    assert "Tr(F) (per_sample)" in bar and f"{len(rows)}/{len(rows)}" in bar
    estimate_hessian_trace(model, rows, n_draws=2, progress=False)
    estimate_hessian_trace(model, rows, n_draws=2)  # 48 context-draws: too short for a bar
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(hf_flatbias.flatness.api, "PROGRESS_MIN_CONTEXT_DRAWS", 2 * len(rows))
    estimate_hessian_trace(model, rows, n_draws=2, estimator="naive")
    assert "Tr(F) (naive)" in capsys.readouterr().err


def test_a_frozen_model_is_refused_before_any_pass():
    model, rows = _tiny_bert().requires_grad_(False), _contexts(2)
    with pytest.raises(ValueError, match="no parameter with requires_grad=True"):
        estimate_hessian_trace(model, rows)
    with pytest.raises(ValueError, match="no parameter with requires_grad=True"):
        exact_fisher_trace(model, rows)
    # the training side perturbs nothing instead of failing (the trainer refuses a frozen model itself)
    assert trainable_parameters(model) == []


def test_per_sample_refuses_parameters_it_cannot_see_and_ignores_unused_ones():
    model = _tiny_bert(seed=6)
    temperature = torch.nn.Parameter(torch.full((1,), 2.0))
    model.cls.predictions.temperature = temperature
    rows = _contexts(3)
    # registered but unused: no gradient, nothing missed
    unused = estimate_hessian_trace(model, rows, n_draws=2, exact_output_expectation=False)
    naive = estimate_hessian_trace(model, rows, n_draws=2, estimator="naive")
    assert unused.mean == pytest.approx(naive.mean, rel=1e-4)
    # used outside any supported layer: the gradient would be missed, so per_sample refuses
    decoder = model.cls.predictions.decoder
    decoder.register_forward_hook(lambda module, args, output: output * temperature)
    with pytest.raises(ValueError, match="estimator='naive'.*"):
        estimate_hessian_trace(model, rows, n_draws=1)
    assert math.isfinite(estimate_hessian_trace(model, rows, n_draws=1, estimator="naive").mean)


def test_a_datasets_dataset_gives_the_same_estimate_as_a_list(bert_case):
    from datasets import Dataset

    model, rows, _ = bert_case
    as_list = estimate_hessian_trace(model, rows[:8], n_draws=2, seed=1)
    as_dataset = estimate_hessian_trace(model, Dataset.from_list(rows[:8]), n_draws=2, seed=1)
    assert (as_dataset.mean, as_dataset.stderr) == (as_list.mean, as_list.stderr)


def test_summary_statistics_match_a_hand_computation():
    values = torch.tensor([[1.0, 3.0], [4.0, 8.0], [10.0, 6.0]], dtype=torch.float64)
    samples = TraceSamples(values, torch.ones(3), n_draws=2, estimator="x", forward_seconds=3.0, draw_seconds=1.5)
    summary = summarize_trace_samples(samples, seconds=2.0)
    # unit means 2, 6, 8 -> mean 16/3; sample variance of the means 28/3; within-context variances 2, 8, 8
    assert summary.mean == pytest.approx(16 / 3)
    assert summary.stderr == pytest.approx(math.sqrt(28 / 3 / 3))
    assert summary.draw_variance == pytest.approx(6.0)
    assert summary.context_variance == pytest.approx(28 / 3 - 6.0 / 2)
    # K* = sqrt(draw var / context var * forward per context / draw per context) = sqrt(6 / (19/3) * 1 / 0.25)
    assert summary.suggested_n_draws == round(math.sqrt(6 / (19 / 3) * 1.0 / 0.25))
    assert summary.n_contexts == 3 and summary.seconds == 2.0

    # units of unequal size (summed / hutchinson batches): weighted mean and the ratio-estimator standard error
    weighted = summarize_trace_samples(TraceSamples(torch.tensor([[2.0], [5.0]]), torch.tensor([1.0, 3.0]), 1, "x"))
    assert weighted.mean == pytest.approx((2 + 15) / 4)
    spread = (1 * (2 - 17 / 4) ** 2 + 9 * (5 - 17 / 4) ** 2) * 2 / 1
    assert weighted.stderr == pytest.approx(math.sqrt(spread) / 4)
    assert weighted.n_contexts == 4 and weighted.draw_variance is None
