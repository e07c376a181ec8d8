"""FlatBiasTrainer's SAM/ASAM steps against a plain-PyTorch SAM written here, independently of the package."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from torch.utils.data import IterableDataset
from transformers import Trainer, TrainingArguments

from hf_flatbias import FlatBiasConfig, FlatBiasTrainer
from tests.helpers.tiny_models import (
    SEQ_LEN,
    VOCAB,
    classification_rows,
    flatbias_config,
    randomly_masked_rows,
    stack,
    tiny_classifier,
    tiny_mlm,
)


def config(tmp_path, **overrides) -> FlatBiasConfig:
    return flatbias_config(tmp_path, **{"flatness_method": "sam", "sam_rho": 0.05, **overrides})


def train(model, args, rows=None):
    trainer = FlatBiasTrainer(model=model, args=args, train_dataset=rows if rows is not None else classification_rows())
    trainer.train()
    return trainer


def reference_sam_sgd(
    model, rows, *, steps, batch_size, accumulation, lr, rho, scope, adaptive=False, eta=0.01, max_grad_norm=0.0
):
    """Textbook SAM with SGD on sequential batches; the loss of each micro-batch is divided by `accumulation`."""
    params = [p for p in model.parameters() if p.requires_grad]

    def loss_of(batch):
        return model(**batch).loss / accumulation

    def perturbation(grads):
        scales = [p.detach().abs() + eta if adaptive else torch.ones_like(p) for p in params]
        norm = math.sqrt(sum(float(((s * g) ** 2).sum()) for s, g in zip(scales, grads, strict=False)))
        return [rho * s * s * g / norm for s, g in zip(scales, grads, strict=False)]

    micro = batch_size
    for step in range(steps):
        start = step * micro * accumulation
        micro_batches = [stack(rows[start + i * micro : start + (i + 1) * micro]) for i in range(accumulation)]
        total = [torch.zeros_like(p) for p in params]
        if scope == "batch":
            first = [torch.zeros_like(p) for p in params]
            for batch in micro_batches:
                grads = torch.autograd.grad(loss_of(batch), params, allow_unused=True)
                first = [f + (torch.zeros_like(f) if g is None else g) for f, g in zip(first, grads, strict=False)]
            eps = perturbation(first)
        for batch in micro_batches:
            if scope == "micro_batch":
                grads = torch.autograd.grad(loss_of(batch), params, allow_unused=True)
                grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=False)]
                eps = perturbation(grads)
            saved = [p.detach().clone() for p in params]
            with torch.no_grad():
                for p, e in zip(params, eps, strict=False):
                    p.add_(e)
            grads = torch.autograd.grad(loss_of(batch), params, allow_unused=True)
            total = [t + (torch.zeros_like(t) if g is None else g) for t, g in zip(total, grads, strict=False)]
            with torch.no_grad():
                for p, s in zip(params, saved, strict=False):
                    p.copy_(s)
        if max_grad_norm > 0:
            norm = math.sqrt(sum(float((g * g).sum()) for g in total))
            total = [g * min(1.0, max_grad_norm / (norm + 1e-6)) for g in total]
        with torch.no_grad():
            for p, g in zip(params, total, strict=False):
                p.sub_(lr * g)
    return model


def max_param_diff(a, b) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=False))


@pytest.mark.parametrize(
    "method,scope,accumulation,rho",
    [
        ("sam", "micro_batch", 1, 0.05),
        ("sam", "micro_batch", 2, 0.05),
        ("sam", "batch", 2, 0.05),
        ("asam", "micro_batch", 2, 0.5),
        ("asam", "batch", 2, 0.5),
    ],
)
def test_trainer_matches_reference_sam(tmp_path, method, scope, accumulation, rho):
    rows = classification_rows()
    batch_size = 4 // accumulation
    model = tiny_classifier()
    reference = reference_sam_sgd(
        copy.deepcopy(model),
        rows,
        steps=3,
        batch_size=batch_size,
        accumulation=accumulation,
        lr=0.1,
        rho=rho,
        scope=scope,
        adaptive=method == "asam",
    )
    args = config(
        tmp_path,
        flatness_method=method,
        sam_scope=scope,
        sam_rho=rho,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
    )
    trained = train(model, args, rows).model
    assert max_param_diff(trained, reference) < 1e-5


def test_sam_differs_from_plain_step(tmp_path):
    sam = train(tiny_classifier(), config(tmp_path / "sam")).model
    plain = train(tiny_classifier(), config(tmp_path / "plain", flatness_method="none")).model
    assert max_param_diff(sam, plain) > 1e-4


def test_batch_scope_with_accumulation_equals_one_large_batch(tmp_path):
    accumulated = train(
        tiny_classifier(),
        config(tmp_path / "a", sam_scope="batch", per_device_train_batch_size=2, gradient_accumulation_steps=2),
    ).model
    single = train(tiny_classifier(), config(tmp_path / "b", sam_scope="batch", per_device_train_batch_size=4)).model
    assert max_param_diff(accumulated, single) < 1e-5
    # m-sharpness is a different step: the check above can tell the scopes apart.
    micro = train(
        tiny_classifier(),
        config(tmp_path / "c", sam_scope="micro_batch", per_device_train_batch_size=2, gradient_accumulation_steps=2),
    ).model
    assert max_param_diff(micro, single) > 1e-6


class RowStream(IterableDataset):
    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


def test_batch_scope_streams_an_iterable_dataset(tmp_path):
    """The update's micro-batches are prefetched by the Trainer loop, so a stream needs no replay."""
    rows = classification_rows()
    streamed = train(
        tiny_classifier(),
        config(tmp_path / "s", sam_scope="batch", per_device_train_batch_size=2, gradient_accumulation_steps=2),
        RowStream(rows),
    ).model
    reference = reference_sam_sgd(
        tiny_classifier(), rows, steps=3, batch_size=2, accumulation=2, lr=0.1, rho=0.05, scope="batch"
    )
    assert max_param_diff(streamed, reference) < 1e-5


def test_bert_mlm_accumulation_keeps_the_gradient_scale(tmp_path):
    """BERT accepts **kwargs but ignores num_items_in_batch: accumulation must still divide the loss."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (8, SEQ_LEN), generator=g)
    rows = [{"input_ids": ids[i], "labels": ids[i].clone()} for i in range(8)]  # every position labelled: equal counts
    base = tiny_mlm()
    runs = {}
    for k in (1, 2):
        args = config(
            tmp_path / str(k),
            flatness_method="none",
            per_device_train_batch_size=4 // k,
            gradient_accumulation_steps=k,
            max_steps=1,
        )
        trainer = FlatBiasTrainer(model=copy.deepcopy(base), args=args, train_dataset=rows)
        trainer.train()
        runs[k] = trainer.model
    assert max_param_diff(runs[1], runs[2]) < 1e-6


def test_logs_sam_norms(tmp_path):
    trainer = train(tiny_classifier(), config(tmp_path))
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logged and all(entry["sam/perturbation_norm"] == pytest.approx(0.05, rel=1e-4) for entry in logged)
    assert all(entry["sam/first_grad_norm"] > 0 for entry in logged)


def test_non_finite_first_gradient_skips_the_perturbation(tmp_path, monkeypatch):
    from hf_flatbias.sharpness import engines

    real = engines.gradients_of
    calls = {"n": 0}

    def poisoned(loss, params):
        calls["n"] += 1
        grads = real(loss, params)
        if calls["n"] == 1:
            grads[0].fill_(float("nan"))
        return grads

    monkeypatch.setattr(engines, "gradients_of", poisoned)
    trainer = train(tiny_classifier(), config(tmp_path, max_steps=2))
    assert trainer._flatness_log.skipped_perturbations == 1
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_bf16_autocast_step_runs_and_restores(tmp_path):
    rows = classification_rows()
    model = tiny_classifier()
    before = copy.deepcopy(model)
    trainer = train(model, config(tmp_path, bf16=True, learning_rate=0.0), rows)
    # lr 0: after perturb/restore the weights must be exactly where they started.
    assert max_param_diff(trainer.model, before) == 0.0


def test_plain_training_arguments_are_accepted(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to="none", use_cpu=True)
    trainer = FlatBiasTrainer(model=tiny_classifier(), args=args, train_dataset=classification_rows())
    assert isinstance(trainer.args, FlatBiasConfig) and trainer.args.flatness_method == "none"
    assert trainer.args.max_steps == 1


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"flatness_method": "sharp"}, "flatness_method"),
        ({"sam_rho": 0.0}, "sam_rho"),
        ({"sam_rho": float("nan")}, "sam_rho"),
        ({"sam_scope": "epoch"}, "sam_scope"),
        ({"sam_perturbation": "local"}, "sam_perturbation"),
    ],
)
def test_bad_config_is_rejected_early(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        config(tmp_path, **overrides)


def test_numbers_written_as_text_in_yaml_are_read_as_numbers(tmp_path):
    # YAML 1.1 reads `sam_rho: 5e-2` as the string "5e-2"
    args = config(tmp_path, sam_rho="5e-2", sam_every_k="2", penalty_lambda=" 0.1 ")
    assert (args.sam_rho, args.sam_every_k, args.penalty_lambda) == (0.05, 2, 0.1)
    assert isinstance(args.sam_every_k, int)


@pytest.mark.parametrize(("field", "text"), [("sam_rho", "large"), ("sam_every_k", "2.5"), ("asam_eta", "")])
def test_text_that_is_not_a_number_is_refused_by_name(tmp_path, field, text):
    with pytest.raises(ValueError, match=f"^{field} must be a number, got the string {text!r}"):
        config(tmp_path, **{field: text})


def test_pinned_memory_is_off_without_an_accelerator(tmp_path):
    args = config(tmp_path, dataloader_pin_memory=True)
    assert args.dataloader_pin_memory is (torch.accelerator.is_available() and not args.use_cpu)


def test_model_without_trainable_parameters_is_rejected(tmp_path):
    model = tiny_classifier()
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        FlatBiasTrainer(model=model, args=config(tmp_path), train_dataset=classification_rows())


def test_clipping_applies_to_the_second_gradient(tmp_path):
    rows = classification_rows()
    reference = reference_sam_sgd(
        tiny_classifier(),
        rows,
        steps=3,
        batch_size=4,
        accumulation=1,
        lr=0.1,
        rho=0.05,
        scope="micro_batch",
        max_grad_norm=0.05,
    )
    trained = train(tiny_classifier(), config(tmp_path, max_grad_norm=0.05), rows).model
    assert max_param_diff(trained, reference) < 1e-5


class ScaledLossTrainer(FlatBiasTrainer):
    """accelerate gives fp16 a GradScaler on GPUs only. A CPU GradScaler in fp32, unscaled before clipping as
    accelerate's fp16 branch does, drives the same loss-scaling path with exact arithmetic (powers of two)."""

    def __init__(self, *args, init_scale: float, **kwargs):
        super().__init__(*args, **kwargs)
        accelerator = self.accelerator
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)

        def unscale_gradients(optimizer=None):
            for wrapped in accelerator._optimizers:
                accelerator.scaler.unscale_(wrapped.optimizer)

        accelerator.unscale_gradients = unscale_gradients


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.05])
def test_grad_scaler_is_unscaled_once(tmp_path, max_grad_norm):
    rows = classification_rows()
    reference = reference_sam_sgd(
        tiny_classifier(),
        rows,
        steps=3,
        batch_size=4,
        accumulation=1,
        lr=0.1,
        rho=0.05,
        scope="micro_batch",
        max_grad_norm=max_grad_norm,
    )
    trainer = ScaledLossTrainer(
        model=tiny_classifier(),
        args=config(tmp_path, max_grad_norm=max_grad_norm),
        train_dataset=rows,
        init_scale=2.0**12,
    )
    trainer.train()
    assert trainer._flatness_log.skipped_perturbations == 0
    assert max_param_diff(trainer.model, reference) < 1e-5


def test_lora_perturbs_and_trains_adapters_only(tmp_path):
    peft = pytest.importorskip("peft")
    rows = classification_rows()
    lora = peft.LoraConfig(task_type="SEQ_CLS", r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["query", "value"])
    model = peft.get_peft_model(tiny_classifier(), lora)
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    reference = reference_sam_sgd(
        copy.deepcopy(model), rows, steps=3, batch_size=4, accumulation=1, lr=0.1, rho=0.05, scope="micro_batch"
    )
    trained = train(model, config(tmp_path), rows).model
    assert max_param_diff(trained, reference) < 1e-5
    for name, param in trained.named_parameters():
        if name in frozen_before:
            assert torch.equal(param, frozen_before[name]), name


def test_gradient_checkpointing_gives_the_same_step(tmp_path):
    rows = classification_rows()
    reference = reference_sam_sgd(
        tiny_classifier(), rows, steps=3, batch_size=4, accumulation=1, lr=0.1, rho=0.05, scope="micro_batch"
    )
    trained = train(tiny_classifier(), config(tmp_path, gradient_checkpointing=True), rows).model
    assert max_param_diff(trained, reference) < 1e-5


def test_resume_from_checkpoint_continues_identically(tmp_path):
    """Dropout and shuffling on: the SAM first pass draws from the RNG, and the resumed run must replay it."""

    def dropout_model():
        model = tiny_classifier()
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.1
        return model

    rows = classification_rows(24)
    common = dict(max_steps=4, train_sampling_strategy="random", optim="adamw_torch", learning_rate=1e-2)
    straight = train(dropout_model(), config(tmp_path / "straight", **common), rows).model
    first = config(tmp_path / "resumed", save_strategy="steps", save_steps=2, **common)
    FlatBiasTrainer(model=dropout_model(), args=first, train_dataset=rows).train()
    resumed = FlatBiasTrainer(model=dropout_model(), args=first, train_dataset=rows)
    resumed.train(resume_from_checkpoint=str(tmp_path / "resumed" / "checkpoint-2"))
    assert max_param_diff(resumed.model, straight) < 1e-6


@pytest.mark.parametrize(
    "method,overrides",
    [
        ("none", {}),
        ("sam", {"sam_every_k": 3}),
        ("asam", {}),
        ("functional_sam", {"sam_scope": "batch", "gradient_accumulation_steps": 2, "per_device_train_batch_size": 2}),
        (
            "functional_sam",
            {
                "sam_preconditioner": "adam",
                "sam_start_step": 1,
                "sam_rho_schedule": "linear_warmup",
                "sam_rho_warmup_steps": 3,
                "sam_parameters": "cls.*",
            },
        ),
        ("sam", {"sam_ascent_fraction": 0.5, "sam_preconditioner": "adam", "sam_end_step": 4}),
        ("looksam", {"sam_every_k": 3}),
        ("fisher_penalty", {}),
        ("grad_norm_penalty", {}),
    ],
)
def test_resumed_run_is_bit_identical_for_every_method(tmp_path, method, overrides):
    """Resumed at step 2 (not a multiple of k=3): LookSAM reuses the direction update 0 stored, the Fisher penalty
    continues its label draws; both come from the checkpoint."""
    rows = randomly_masked_rows(24)
    common = dict(flatness_method=method, max_steps=5, optim="adamw_torch", learning_rate=1e-2, **overrides)
    straight = train(tiny_mlm(), config(tmp_path / "straight", **common), rows).model
    first = config(tmp_path / "resumed", save_strategy="steps", save_steps=2, **common)
    FlatBiasTrainer(model=tiny_mlm(), args=first, train_dataset=rows).train()
    resumed = FlatBiasTrainer(model=tiny_mlm(), args=first, train_dataset=rows)
    resumed.train(resume_from_checkpoint=str(tmp_path / "resumed" / "checkpoint-2"))
    assert max_param_diff(resumed.model, straight) == 0.0


# ---------------------------------------------------------------- what a run reports (issue 13)


@pytest.mark.parametrize("method", ["none", "sam"])
def test_accumulation_of_unequal_micro_batches_equals_one_large_batch(tmp_path, method):
    """BERT ignores num_items_in_batch; its loss is still weighted by tokens over the whole update."""
    rows = randomly_masked_rows()
    counts = [int((r["labels"] != -100).sum()) for r in rows]
    assert sum(counts[:4]) != sum(counts[4:8]), "the check needs micro-batches with different label counts"
    runs = {}
    for k in (1, 2):
        args = config(
            tmp_path / str(k),
            flatness_method=method,
            sam_scope="batch",
            per_device_train_batch_size=8 // k,
            gradient_accumulation_steps=k,
            max_steps=2,
        )
        runs[k] = train(tiny_mlm(), args, rows)
    assert max_param_diff(runs[1].model, runs[2].model) < 1e-6
    # the same loss is logged, and it is the clean one: L(w) of the first update's 8 rows
    first = [e["loss"] for e in runs[1].state.log_history if "loss" in e][0]
    accumulated = [e["loss"] for e in runs[2].state.log_history if "loss" in e][0]
    assert accumulated == pytest.approx(first, rel=1e-5)
    assert first == pytest.approx(float(tiny_mlm()(**stack(rows[:8])).loss), rel=1e-5)


def test_none_is_bit_identical_to_trainer_where_transformers_weights_by_tokens(tmp_path):
    """One micro-batch per update: the model's own mean is the token-weighted loss, nothing is recomputed."""
    rows = randomly_masked_rows()
    ours_args = config(tmp_path / "f", flatness_method="none", max_steps=2)
    plain_fields = {f.name for f in dataclasses.fields(TrainingArguments) if f.init}
    plain_args = TrainingArguments(**{name: getattr(ours_args, name) for name in plain_fields})
    plain = Trainer(model=tiny_mlm(), args=plain_args, train_dataset=rows)
    plain.train()
    ours = train(tiny_mlm(), ours_args, rows)
    for (name, a), b in zip(plain.model.state_dict().items(), ours.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_sam_logs_the_clean_loss_and_the_perturbed_loss(tmp_path):
    rows = classification_rows()
    trainer = train(tiny_classifier(), config(tmp_path, max_steps=1), rows)
    logged = next(e for e in trainer.state.log_history if "loss" in e)
    model, batch = tiny_classifier(), stack(rows[:4])
    clean = model(**batch).loss
    grads = torch.autograd.grad(clean, list(model.parameters()))
    norm = math.sqrt(sum(float((g**2).sum()) for g in grads))
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads, strict=True):
            p.add_(g * (0.05 / norm))
    perturbed = float(model(**batch).loss)
    assert logged["loss"] == pytest.approx(float(clean), rel=1e-5)
    assert logged["sam/perturbed_loss"] == pytest.approx(perturbed, rel=1e-5)
    assert logged["sam/perturbed_loss"] > logged["loss"]
    assert logged["sam/first_grad_norm"] == pytest.approx(norm, rel=1e-5)


@pytest.mark.parametrize("scope", ["batch", "micro_batch"])
def test_first_grad_norm_does_not_depend_on_accumulation(tmp_path, scope):
    """The same 4 rows as one batch, or as 4 micro-batches of 1 (micro-batch scope: each one's own gradient)."""
    rows = classification_rows()
    logged = {}
    for k in (1, 4):
        args = config(
            tmp_path / str(k),
            sam_scope=scope,
            per_device_train_batch_size=4 // k,
            gradient_accumulation_steps=k,
            max_steps=1,
        )
        logged[k] = next(e for e in train(tiny_classifier(), args, rows).state.log_history if "loss" in e)
    model = tiny_classifier()
    if scope == "batch":
        expected = logged[1]["sam/first_grad_norm"]
    else:  # the mean over micro-batches of the norm of each one's mean-loss gradient
        norms = []
        for row in rows[:4]:
            grads = torch.autograd.grad(model(**stack([row])).loss, list(model.parameters()))
            norms.append(math.sqrt(sum(float((g**2).sum()) for g in grads)))
        expected = sum(norms) / len(norms)
    assert logged[4]["sam/first_grad_norm"] == pytest.approx(expected, rel=1e-5)


def test_total_flos_counts_the_second_pass(tmp_path):
    rows = classification_rows()
    flos = {}
    for method, k in (("none", 1), ("sam", 1), ("sam", 2), ("looksam", 2), ("grad_norm_penalty", 1)):
        args = config(tmp_path / f"{method}{k}", flatness_method=method, sam_every_k=k, max_steps=3)
        flos[method, k] = train(tiny_classifier(), args, rows).state.total_flos
    plain = flos["none", 1]
    assert plain > 0
    assert flos["sam", 1] == pytest.approx(2 * plain)
    assert flos["grad_norm_penalty", 1] == pytest.approx(2 * plain)
    # SAM on updates 0 and 2 of 3
    assert flos["sam", 2] == pytest.approx(5 / 3 * plain)
    assert flos["looksam", 2] == pytest.approx(5 / 3 * plain)
