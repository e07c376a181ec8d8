"""Functional-SAM, the Adam-preconditioned perturbation, sub-batch ascent, the SAM window / rho schedule and the
perturbed-parameter selection, each against a plain-PyTorch step written here, independently of the package."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_flatbias import FlatBiasTrainer
from hf_flatbias.modelcard import flatness_card_from_trainer
from hf_flatbias.sharpness.sam_options import adam_preconditioner
from tests.helpers.tiny_models import (
    SEQ_LEN,
    TINY_DECODER,
    classification_rows,
    flatbias_config,
    randomly_masked_rows,
    stack,
    tiny_classifier,
    tiny_mlm,
)

RHO = 0.05


def config(tmp_path, **overrides):
    return flatbias_config(tmp_path, **{"flatness_method": "sam", "sam_rho": RHO, **overrides})


def train(model, args, rows):
    trainer = FlatBiasTrainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    return trainer


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**TINY_DECODER))


def causal_rows(n: int = 16, seed: int = 5) -> list[dict[str, torch.Tensor]]:
    """Random tokens; a random tail of each row is unlabelled, so micro-batches hold unequal label counts."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, TINY_DECODER["vocab_size"], (n, SEQ_LEN), generator=g)
    keep = torch.randint(2, SEQ_LEN + 1, (n,), generator=g)
    labels = torch.where(torch.arange(SEQ_LEN)[None, :] < keep[:, None], ids, torch.full_like(ids, -100))
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(n)]


def max_param_diff(a, b) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


# ---------------------------------------------------------------- plain-PyTorch references


def summed_cross_entropy(logits, labels, *, causal):
    if causal:
        logits, labels = logits[:, :-1], labels[:, 1:]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )


def label_count(batch, *, causal):
    labels = batch["labels"][:, 1:] if causal else batch["labels"]
    return int((labels != -100).sum())


def reference_sam_lm(
    model,
    rows,
    *,
    steps,
    batch_size,
    accumulation,
    lr,
    rho,
    scope,
    causal,
    functional,
    ascent_fraction=1.0,
    optimizer=None,
    precondition=False,
    rho_at=None,
    perturbed=None,
):
    """SAM / Functional-SAM on an LM whose loss is the update's summed cross-entropy over its labelled tokens.

    ``functional``: the update is d/dw <F(w + e), dL/dF(w)> instead of dL/dw(w + e). ``optimizer`` (default SGD at
    ``lr``) steps; ``precondition`` divides g by Adam's denominator after taking g (from ``optimizer``'s state):
    ``True`` or ``"adam"`` with g folded into the moment, ``"adam_stored_moment"`` the moment as stored,
    ``"adam_preconditioned_ball"`` as ``"adam"`` with the radius in P's norm.
    ``rho_at(step)`` gives the radius (``None``: a plain step); ``perturbed`` the parameters that move.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    moving = params if perturbed is None else perturbed(model)
    optimizer = optimizer or torch.optim.SGD(params, lr=lr)
    for step in range(steps):
        start = step * batch_size * accumulation
        micro = [stack(rows[start + i * batch_size : start + (i + 1) * batch_size]) for i in range(accumulation)]
        n_items = sum(label_count(b, causal=causal) for b in micro)

        def loss_and_logits(batch, n_items=n_items):
            logits = model(input_ids=batch["input_ids"]).logits
            return summed_cross_entropy(logits, batch["labels"], causal=causal) / n_items, logits

        def first_rows(batch):
            keep = max(1, math.ceil(ascent_fraction * batch["input_ids"].shape[0]))
            return {k: v[:keep] for k, v in batch.items()}

        def direction(batches):
            total = [torch.zeros_like(p) for p in moving]
            cotangents = []
            for batch in batches:
                loss, logits = loss_and_logits(first_rows(batch))
                grads = torch.autograd.grad(loss, [*moving, logits], allow_unused=True)
                cotangents.append(grads[-1].detach())
                total = [t + (torch.zeros_like(t) if g is None else g) for t, g in zip(total, grads[:-1], strict=True)]
            return total, cotangents

        def perturbation(grads, radius, micro=micro):
            if not precondition:
                norm = math.sqrt(sum(float((g * g).sum()) for g in grads))
                return [radius * g / norm for g in grads]
            # the denominator of a whole update's gradient: the micro-batches' share scaled up
            share = accumulation / (len(micro) if scope == "batch" else 1)
            stored = precondition == "adam_stored_moment"
            denominators = [
                adam_denominator(optimizer, p, g * share, stored=stored) for p, g in zip(moving, grads, strict=True)
            ]
            directions = [g / d for g, d in zip(grads, denominators, strict=True)]
            if precondition == "adam_preconditioned_ball":  # ||e||_P = radius: normalise by sqrt(g^T P^-1 g)
                norm = math.sqrt(sum(float((g * g / d).sum()) for g, d in zip(grads, denominators, strict=True)))
            else:
                norm = math.sqrt(sum(float((x * x).sum()) for x in directions))
            return [radius * x / norm for x in directions]

        radius = rho_at(step) if rho_at is not None else rho
        optimizer.zero_grad()
        if radius is not None and scope == "batch":
            eps = perturbation(direction(micro)[0], radius)
            _, cotangents = direction(micro)
        for i, batch in enumerate(micro):
            if radius is None:
                loss_and_logits(batch)[0].backward()
                continue
            if scope == "micro_batch":
                grads, (cotangent,) = direction([batch])
                eps = perturbation(grads, radius)
            else:
                cotangent = cotangents[i]
            saved = [p.detach().clone() for p in moving]
            with torch.no_grad():
                for p, e in zip(moving, eps, strict=True):
                    p.add_(e)
            loss, logits = loss_and_logits(batch)
            (logits * cotangent).sum().backward() if functional else loss.backward()
            with torch.no_grad():
                for p, s in zip(moving, saved, strict=True):
                    p.copy_(s)
        optimizer.step()
    return model


def adam_denominator(optimizer, param, grad, stored=False):
    """What torch's Adam would divide by after taking ``grad``: its second moment with ``grad`` folded in; with
    ``stored``, what it divided by at its last step (``eps`` everywhere before its first)."""
    group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
    beta2, eps = group["betas"][1], group["eps"]
    state = optimizer.state.get(param, {})
    previous = state.get("exp_avg_sq", torch.zeros_like(param))
    step = float(state.get("step", 0.0))
    if stored:
        return torch.sqrt(previous) / math.sqrt(1 - beta2**step) + eps if step else torch.full_like(param, eps)
    second = beta2 * previous + (1 - beta2) * grad * grad
    return torch.sqrt(second) / math.sqrt(1 - beta2 ** (step + 1)) + eps


def lm_setup(kind):
    if kind == "bert":
        return tiny_mlm, randomly_masked_rows(), False
    return tiny_llama, causal_rows(), True


# ---------------------------------------------------------------- Functional-SAM


@pytest.mark.parametrize("kind", ["bert", "llama"])
@pytest.mark.parametrize("scope,accumulation", [("micro_batch", 1), ("micro_batch", 2), ("batch", 2)])
def test_functional_sam_matches_reference(tmp_path, kind, scope, accumulation):
    build, rows, causal = lm_setup(kind)
    batch_size = 4 // accumulation
    common = dict(steps=3, batch_size=batch_size, accumulation=accumulation, lr=0.1, rho=RHO, scope=scope)
    reference = reference_sam_lm(build(), rows, causal=causal, functional=True, **common)
    args = config(
        tmp_path,
        flatness_method="functional_sam",
        sam_scope=scope,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
    )
    trainer = train(build(), args, rows)
    assert max_param_diff(trainer.model, reference) < 1e-5
    # the check can tell Functional-SAM from SAM on this model
    sam = reference_sam_lm(build(), rows, causal=causal, functional=False, **common)
    assert max_param_diff(trainer.model, sam) > 1e-5
    # the logged loss is the clean one, L(w) of the update's rows, and the loss at w + e is beside it
    logged = next(e for e in trainer.state.log_history if "loss" in e)
    first = stack(rows[:4])
    clean = summed_cross_entropy(build()(input_ids=first["input_ids"]).logits, first["labels"], causal=causal)
    assert logged["loss"] == pytest.approx(float(clean) / label_count(first, causal=causal), rel=1e-5)
    assert logged["sam/perturbed_loss"] > logged["loss"]


def test_functional_sam_restores_the_weights_bit_for_bit(tmp_path):
    before = tiny_mlm()
    args = config(tmp_path, flatness_method="functional_sam", learning_rate=0.0)
    trainer = train(copy.deepcopy(before), args, randomly_masked_rows())
    assert max_param_diff(trainer.model, before) == 0.0  # lr 0: only the perturbation and its restore happened


# ---------------------------------------------------------------- Adam-preconditioned perturbation


def test_adam_preconditioner_is_the_denominator_of_adams_next_step():
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(5))
    optimizer = torch.optim.AdamW([param], lr=1e-2, betas=(0.9, 0.98), eps=1e-6)
    g0 = torch.randn(5)
    assert torch.allclose(adam_preconditioner(optimizer, [param], [g0])[0], g0.abs() + 1e-6)  # no state yet
    for gradient in (g0, torch.randn(5) * 3):
        param.grad = gradient
        optimizer.step()
    g = torch.randn(5)
    expected = adam_preconditioner(optimizer, [param], [g])[0]
    param.grad = g
    optimizer.step()
    state = optimizer.state[param]
    denominator = state["exp_avg_sq"].sqrt() / math.sqrt(1 - 0.98 ** float(state["step"])) + 1e-6
    assert torch.allclose(expected, denominator, rtol=1e-6, atol=0)


PRECONDITIONER_FORMS = ["adam", "adam_stored_moment", "adam_preconditioned_ball"]


def test_stored_moment_preconditioner_is_the_denominator_of_adams_last_step():
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(5))
    optimizer = torch.optim.AdamW([param], lr=1e-2, betas=(0.9, 0.98), eps=1e-6)
    g = torch.randn(5)
    assert torch.equal(adam_preconditioner(optimizer, [param], [g], with_gradient=False)[0], torch.full((5,), 1e-6))
    for gradient in (g, torch.randn(5) * 3):
        param.grad = gradient
        optimizer.step()
    state = optimizer.state[param]
    denominator = state["exp_avg_sq"].sqrt() / math.sqrt(1 - 0.98 ** float(state["step"])) + 1e-6
    stored = adam_preconditioner(optimizer, [param], [torch.randn(5)], with_gradient=False)[0]
    assert torch.allclose(stored, denominator, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "method,form",
    [("sam", form) for form in PRECONDITIONER_FORMS] + [("functional_sam", "adam")],
)
def test_preconditioned_perturbation_matches_reference(tmp_path, method, form):
    rows = causal_rows()
    model = tiny_llama()
    reference_model = copy.deepcopy(model)
    adam = torch.optim.AdamW(reference_model.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    common = dict(steps=3, batch_size=2, accumulation=2, lr=1e-2, rho=RHO, scope="micro_batch", causal=True)
    reference = reference_sam_lm(
        reference_model, rows, functional=method == "functional_sam", optimizer=adam, precondition=form, **common
    )
    args = config(
        tmp_path,
        flatness_method=method,
        sam_preconditioner=form,
        optim="adamw_torch",
        learning_rate=1e-2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
    )
    trainer = train(model, args, rows)
    assert max_param_diff(trainer.model, reference) < 1e-5
    plain_model = copy.deepcopy(tiny_llama())
    plain_adam = torch.optim.AdamW(plain_model.parameters(), lr=1e-2, weight_decay=0.0)
    plain = reference_sam_lm(
        plain_model, rows, functional=method == "functional_sam", optimizer=plain_adam, precondition=False, **common
    )
    assert max_param_diff(trainer.model, plain) > 1e-5, "the preconditioner changes the step"
    for other in PRECONDITIONER_FORMS:
        if other != form and method == "sam":  # the tolerance tells the forms apart
            other_model = copy.deepcopy(tiny_llama())
            other_adam = torch.optim.AdamW(other_model.parameters(), lr=1e-2, weight_decay=0.0)
            moved = reference_sam_lm(
                other_model, rows, functional=False, optimizer=other_adam, precondition=other, **common
            )
            assert max_param_diff(trainer.model, moved) > 1e-5, other


# ---------------------------------------------------------------- sub-batch ascent


@pytest.mark.parametrize("scope,accumulation", [("micro_batch", 1), ("micro_batch", 2), ("batch", 2)])
def test_ascent_fraction_takes_the_first_gradient_from_the_first_rows(tmp_path, scope, accumulation):
    rows = randomly_masked_rows()
    batch_size = 8 // accumulation
    common = dict(steps=2, batch_size=batch_size, accumulation=accumulation, lr=0.1, rho=RHO, scope=scope, causal=False)
    reference = reference_sam_lm(tiny_mlm(), rows, functional=False, ascent_fraction=0.5, **common)
    args = config(
        tmp_path,
        sam_ascent_fraction=0.5,
        sam_scope=scope,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
        max_steps=2,
    )
    trainer = train(tiny_mlm(), args, rows)
    assert max_param_diff(trainer.model, reference) < 1e-5
    whole = reference_sam_lm(tiny_mlm(), rows, functional=False, **common)
    assert max_param_diff(trainer.model, whole) > 1e-5


def test_ascent_fraction_logs_the_ascent_rows_loss_per_token(tmp_path):
    rows = causal_rows()
    trainer = train(tiny_llama(), config(tmp_path, sam_ascent_fraction=0.5, max_steps=1), rows)
    logged = next(e for e in trainer.state.log_history if "loss" in e)
    first = stack(rows[:2])  # ceil(0.5 * 4) rows
    logits = tiny_llama()(input_ids=first["input_ids"]).logits
    mean = float(summed_cross_entropy(logits, first["labels"], causal=True)) / label_count(first, causal=True)
    assert logged["loss"] == pytest.approx(mean, rel=1e-5)


# ---------------------------------------------------------------- window and rho schedule


def test_window_and_linear_warmup(tmp_path):
    rows = randomly_masked_rows()
    radii = {1: RHO / 2, 2: RHO}  # update 0 before the window, update 3 after it

    reference = reference_sam_lm(
        tiny_mlm(),
        rows,
        steps=4,
        batch_size=4,
        accumulation=1,
        lr=0.1,
        rho=RHO,
        scope="micro_batch",
        causal=False,
        functional=False,
        rho_at=radii.get,
    )
    args = config(
        tmp_path,
        max_steps=4,
        sam_start_step=1,
        sam_end_step=3,
        sam_rho_schedule="linear_warmup",
        sam_rho_warmup_steps=2,
    )
    trainer = train(tiny_mlm(), args, rows)
    assert max_param_diff(trainer.model, reference) < 1e-5
    logged = [e.get("sam/rho") for e in trainer.state.log_history if "loss" in e]
    assert logged == [None, pytest.approx(RHO / 2), pytest.approx(RHO), None]
    constant = reference_sam_lm(
        tiny_mlm(),
        rows,
        steps=4,
        batch_size=4,
        accumulation=1,
        lr=0.1,
        rho=RHO,
        scope="micro_batch",
        causal=False,
        functional=False,
    )
    assert max_param_diff(trainer.model, constant) > 1e-5


# ---------------------------------------------------------------- which parameters move


def test_output_layer_only_perturbs_the_head_and_normalises_over_it(tmp_path):
    rows = causal_rows()
    reference = reference_sam_lm(
        tiny_llama(),
        rows,
        steps=3,
        batch_size=4,
        accumulation=1,
        lr=0.1,
        rho=RHO,
        scope="micro_batch",
        causal=True,
        functional=False,
        perturbed=lambda model: [model.lm_head.weight],
    )
    trainer = train(tiny_llama(), config(tmp_path, sam_parameters="output_layer"), rows)
    assert max_param_diff(trainer.model, reference) < 1e-5
    logged = next(e for e in trainer.state.log_history if "loss" in e)
    assert logged["sam/perturbation_norm"] == pytest.approx(RHO, rel=1e-5)


def test_name_patterns_select_parameters(tmp_path):
    rows = classification_rows()
    model = tiny_classifier()
    reference_model = copy.deepcopy(model)
    params = [p for p in reference_model.parameters()]
    head = [p for n, p in reference_model.named_parameters() if n.startswith("classifier.")]
    optimizer = torch.optim.SGD(params, lr=0.1)
    for step in range(3):
        batch = stack(rows[4 * step : 4 * step + 4])
        grads = torch.autograd.grad(reference_model(**batch).loss, head)
        norm = math.sqrt(sum(float((g * g).sum()) for g in grads))
        with torch.no_grad():
            for p, g in zip(head, grads, strict=True):
                p.add_(RHO * g / norm)
        optimizer.zero_grad()
        reference_model(**batch).loss.backward()
        with torch.no_grad():
            for p, g in zip(head, grads, strict=True):
                p.sub_(RHO * g / norm)
        optimizer.step()
    trainer = train(model, config(tmp_path, sam_parameters="classifier.*"), rows)
    assert max_param_diff(trainer.model, reference_model) < 1e-5


def test_a_selection_matching_nothing_fails_before_training(tmp_path):
    with pytest.raises(ValueError, match="sam_parameters='decoder.\\*' selects no trainable parameter"):
        FlatBiasTrainer(
            model=tiny_classifier(),
            args=config(tmp_path, sam_parameters="decoder.*"),
            train_dataset=classification_rows(),
        )


# ---------------------------------------------------------------- validation, card, resume


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"sam_preconditioner": "shampoo"}, "^sam_preconditioner='shampoo' is not supported"),
        ({"sam_preconditioner": "adam", "optim": "sgd"}, "^sam_preconditioner='adam' reads Adam's second moment"),
        ({"flatness_method": "asam", "sam_preconditioner": "adam", "optim": "adamw_torch"}, "^sam_preconditioner="),
        ({"sam_ascent_fraction": 0.0}, "^sam_ascent_fraction must be in"),
        ({"sam_ascent_fraction": 1.5}, "^sam_ascent_fraction must be in"),
        ({"flatness_method": "functional_sam", "sam_ascent_fraction": 0.5}, "^sam_ascent_fraction=0.5 applies to"),
        ({"sam_start_step": -1}, "^sam_start_step must be an integer >= 0"),
        ({"sam_start_step": 5, "sam_end_step": 5}, "^sam_end_step=5 must be > sam_start_step=5"),
        ({"sam_rho_schedule": "cosine"}, "^sam_rho_schedule='cosine' is not supported"),
        ({"sam_rho_schedule": "linear_warmup"}, "'linear_warmup' needs sam_rho_warmup_steps >= 1"),
        ({"sam_rho_warmup_steps": 3}, "'constant' needs 0"),
        ({"sam_parameters": " "}, "^sam_parameters must be"),
        ({"flatness_method": "looksam", "sam_start_step": 2}, "^sam_start_step=2 applies to"),
        ({"flatness_method": "none", "sam_parameters": "output_layer"}, "^sam_parameters='output_layer' applies to"),
    ],
)
def test_bad_options_are_rejected_in_the_config(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        config(tmp_path, **overrides)


@pytest.mark.parametrize("form", ["adam", "adam_stored_moment", "adam_preconditioned_ball"])
def test_refusals_name_the_adam_form_chosen(tmp_path, form):
    from hf_flatbias.sharpness.support import check_deepspeed_supports_method

    args = config(tmp_path, sam_preconditioner=form, optim="adamw_torch")
    model = tiny_llama()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=f"^sam_preconditioner='{form}' reads Adam's second moment.*given a SGD"):
        FlatBiasTrainer(model=model, args=args, train_dataset=causal_rows(), optimizers=(sgd, None))
    with pytest.raises(ValueError, match=f"^sam_preconditioner='{form}' is not supported with DeepSpeed"):
        check_deepspeed_supports_method({"zero_optimization": {"stage": 2}}, args)
    param = next(model.parameters())
    sgd.state[param]["momentum_buffer"] = torch.zeros_like(param)  # a state without Adam's second moment
    with pytest.raises(ValueError, match=f"^sam_preconditioner='{form}' needs Adam's second moment"):
        adam_preconditioner(sgd, [param], [torch.ones_like(param)], chosen=form)
    with pytest.raises(ValueError, match=f"^sam_preconditioner='{form}': a perturbed parameter is not in"):
        adam_preconditioner(sgd, [torch.zeros(2)], [torch.ones(2)], chosen=form)


def test_yaml_text_numbers_are_read(tmp_path):
    args = config(tmp_path, sam_ascent_fraction="0.25", sam_start_step="2", sam_end_step="-1")
    assert (args.sam_ascent_fraction, args.sam_start_step, args.sam_end_step) == (0.25, 2, -1)


def test_card_records_the_sam_step_options_of_the_method(tmp_path):
    args = config(
        tmp_path,
        flatness_method="functional_sam",
        sam_preconditioner="adam",
        optim="adamw_torch",
        sam_parameters="output_layer",
        sam_start_step=1,
        sam_rho_schedule="linear_warmup",
        sam_rho_warmup_steps=2,
        max_steps=2,
    )
    trainer = train(tiny_llama(), args, causal_rows())
    card = flatness_card_from_trainer(trainer)
    assert card.method == "functional_sam" and card.sam_rho == RHO
    training = card.training_hyperparameters
    assert {k: training[k] for k in ("sam_preconditioner", "sam_parameters", "sam_rho_schedule")} == {
        "sam_preconditioner": "adam",
        "sam_parameters": "output_layer",
        "sam_rho_schedule": "linear_warmup",
    }
    assert (training["sam_start_step"], training["sam_end_step"], training["sam_rho_warmup_steps"]) == (1, -1, 2)
    assert "sam_ascent_fraction" not in training, "Functional-SAM does not read it"
    plain = flatness_card_from_trainer(
        train(tiny_llama(), config(tmp_path / "p", flatness_method="none"), causal_rows())
    )
    assert "sam_preconditioner" not in plain.training_hyperparameters


def test_engines_that_cannot_run_an_option_refuse_it_before_compute(tmp_path):
    from hf_flatbias.sharpness.support import check_deepspeed_supports_method, check_fsdp_supports_sam_options

    preconditioned = config(tmp_path, sam_preconditioner="adam", optim="adamw_torch")
    with pytest.raises(ValueError, match="^sam_preconditioner='adam' is not supported with DeepSpeed"):
        check_deepspeed_supports_method({"zero_optimization": {"stage": 2}}, preconditioned)
    check_deepspeed_supports_method(
        {"zero_optimization": {"stage": 3}}, config(tmp_path, flatness_method="functional_sam")
    )
    with pytest.raises(ValueError, match="^flatness_method='functional_sam' is not supported under FSDP2"):
        check_fsdp_supports_sam_options(config(tmp_path, flatness_method="functional_sam"))
    with pytest.raises(ValueError, match="^sam_preconditioner not supported under FSDP2"):
        check_fsdp_supports_sam_options(preconditioned)
    check_fsdp_supports_sam_options(config(tmp_path))  # plain SAM runs under FSDP2
