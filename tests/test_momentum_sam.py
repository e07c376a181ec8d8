"""Momentum-SAM (``flatness_method="momentum_sam"``) against its recurrence written here in plain PyTorch, in float64:
the gradient of each update taken at ``w - rho * d / ||d||``, ``d`` the optimizer's coming update from the state it
holds before that gradient (AdamW: ``m_hat / (sqrt(v_hat) + eps)``; SGD: the momentum buffer), no perturbation
before the optimizer has state, and AdamW / SGD-with-momentum written out, not taken from torch.optim."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

from hf_flatbias import FlatBiasConfig, FlatBiasTrainer
from hf_flatbias.sharpness.coming_update import (
    coming_update_direction,
    momentum_sam_offsets,
    why_coming_update_unreadable,
)
from tests.helpers.tiny_models import classification_rows, flatbias_config, stack, tiny_classifier

LR = {"adamw": 0.01, "sgd": 0.1}
BETAS, EPS = (0.9, 0.999), 1e-8


def reference_momentum_sam(
    model, updates, loss_of, *, optimizer, lr, rho, weight_decay=0.0, decayed=(), momentum=0.9, trajectory=None
):
    """Momentum-SAM from its definition. ``updates``: each update's micro-batches; ``loss_of(model, batch, update)``
    the micro-batch's share of the update's loss. ``decayed``: the names of the parameters AdamW decays.
    ``trajectory`` (a list) receives the weights after every update."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    decays = [name in set(decayed) for name, _ in named]
    state = [None] * len(params)  # AdamW: (t, m, v); SGD: the momentum buffer
    for update in updates:
        directions = []
        for s in state:
            if s is None:
                directions.append(None)
            elif optimizer == "adamw":
                t, m, v = s
                directions.append((m / (1 - BETAS[0] ** t)) / ((v / (1 - BETAS[1] ** t)).sqrt() + EPS))
            else:
                directions.append(s)
        offsets = [None] * len(params)
        present = [d for d in directions if d is not None]
        if present:
            norm = math.sqrt(sum(float((d * d).sum()) for d in present))
            offsets = [None if d is None else -rho * d / norm for d in directions]
        total = [None] * len(params)
        for batch in update:
            saved = [p.detach().clone() for p in params]
            with torch.no_grad():
                for p, e in zip(params, offsets, strict=True):
                    if e is not None:
                        p.add_(e)
            grads = torch.autograd.grad(loss_of(model, batch, update), params, allow_unused=True)
            with torch.no_grad():
                for p, w in zip(params, saved, strict=True):
                    p.copy_(w)
            total = [g if t is None else t if g is None else t + g for t, g in zip(total, grads, strict=True)]
        with torch.no_grad():
            for i, (p, g) in enumerate(zip(params, total, strict=True)):
                if g is None:  # torch's optimizers skip a parameter without gradient
                    continue
                if optimizer == "adamw":
                    t, m, v = state[i] or (0, torch.zeros_like(p), torch.zeros_like(p))
                    t += 1
                    if decays[i]:
                        p.mul_(1 - lr * weight_decay)
                    m = BETAS[0] * m + (1 - BETAS[0]) * g
                    v = BETAS[1] * v + (1 - BETAS[1]) * g * g
                    p.sub_(lr * (m / (1 - BETAS[0] ** t)) / ((v / (1 - BETAS[1] ** t)).sqrt() + EPS))
                    state[i] = (t, m, v)
                else:
                    state[i] = g.clone() if state[i] is None else momentum * state[i] + g
                    p.sub_(lr * state[i])
        if trajectory is not None:
            trajectory.append({name: p.detach().clone() for name, p in named})
    return model


def updates_of_rows(rows, *, steps, batch_size, accumulation):
    starts = [[(s * accumulation + i) * batch_size for i in range(accumulation)] for s in range(steps)]
    return [[stack(rows[start : start + batch_size]) for start in update] for update in starts]


def classifier_loss(model, batch, update):
    return model(**batch).loss / len(update)


def max_param_diff(a, b) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def momentum_config(tmp_path, optimizer="adamw", **overrides) -> FlatBiasConfig:
    values = {"flatness_method": "momentum_sam", "sam_rho": 0.05, "max_steps": 5, "learning_rate": LR[optimizer]}
    if optimizer == "adamw":
        values.update(optim="adamw_torch", weight_decay=0.01)
    else:
        values.update(optim="sgd", optim_args="momentum=0.9")
    return flatbias_config(tmp_path, **{**values, **overrides})


def run_and_reference(tmp_path, optimizer, accumulation, *, rows=None, **overrides):
    rows = rows if rows is not None else classification_rows(n=40)
    batch_size = 4 // accumulation
    sizes = {"per_device_train_batch_size": batch_size, "gradient_accumulation_steps": accumulation}
    args = momentum_config(tmp_path, optimizer, **sizes, **overrides)
    model = tiny_classifier().double()
    trainer = FlatBiasTrainer(model=model, args=args, train_dataset=rows)
    reference = reference_momentum_sam(
        copy.deepcopy(model),
        updates_of_rows(rows, steps=args.max_steps, batch_size=batch_size, accumulation=accumulation),
        classifier_loss,
        optimizer=optimizer,
        lr=args.learning_rate,
        rho=args.sam_rho,
        weight_decay=args.weight_decay,
        decayed=trainer.get_decay_parameter_names(model),
    )
    trainer.train()
    return trainer, reference


@pytest.mark.parametrize("optimizer,accumulation", [("adamw", 1), ("adamw", 2), ("sgd", 1), ("sgd", 2)])
def test_momentum_sam_matches_its_recurrence_in_float64(tmp_path, optimizer, accumulation):
    trainer, reference = run_and_reference(tmp_path, optimizer, accumulation)
    assert max_param_diff(trainer.model, reference) < 1e-12
    # the perturbation changed the steps: the same recurrence with rho -> 0 is a plain run
    plain = reference_momentum_sam(
        tiny_classifier().double(),
        updates_of_rows(classification_rows(n=40), steps=5, batch_size=4 // accumulation, accumulation=accumulation),
        classifier_loss,
        optimizer=optimizer,
        lr=LR[optimizer],
        rho=0.0,
        weight_decay=trainer.args.weight_decay,
        decayed=trainer.get_decay_parameter_names(trainer.model),
    )
    assert max_param_diff(plain, reference) > 1e-6


def test_the_first_update_is_plain_and_the_rho_is_logged(tmp_path):
    momentum, _ = run_and_reference(tmp_path / "m", "adamw", 1, max_steps=1)
    plain = FlatBiasTrainer(
        model=tiny_classifier().double(),
        args=momentum_config(tmp_path / "p", flatness_method="none", sam_rho=0.05, max_steps=1),
        train_dataset=classification_rows(n=40),
    )
    plain.train()
    assert max_param_diff(momentum.model, plain.model) == 0.0
    trainer, _ = run_and_reference(tmp_path / "r", "adamw", 1, max_steps=2)
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert "sam/rho" not in logged[0] and logged[1]["sam/rho"] == 0.05


class WeightsAtEvaluation(TrainerCallback):
    def __init__(self):
        self.seen = []

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        self.seen.append((state.global_step, {name: p.detach().clone() for name, p in model.named_parameters()}))


def test_evaluation_checkpoints_and_save_model_see_the_unperturbed_weights(tmp_path):
    rows, eval_rows = classification_rows(n=40), classification_rows(n=8, seed=9)
    args = momentum_config(
        tmp_path, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=2, per_device_eval_batch_size=8
    )
    model = tiny_classifier().double()
    seen = WeightsAtEvaluation()
    trainer = FlatBiasTrainer(model=model, args=args, train_dataset=rows, eval_dataset=eval_rows, callbacks=[seen])
    trajectory = []
    reference = reference_momentum_sam(
        copy.deepcopy(model),
        updates_of_rows(rows, steps=5, batch_size=4, accumulation=1),
        classifier_loss,
        optimizer="adamw",
        lr=args.learning_rate,
        rho=args.sam_rho,
        weight_decay=args.weight_decay,
        decayed=trainer.get_decay_parameter_names(model),
        trajectory=trajectory,
    )
    trainer.train()
    assert [step for step, _ in seen.seen] == [1, 2, 3, 4, 5]
    for step, weights in seen.seen:
        assert max(float((weights[n] - trajectory[step - 1][n]).abs().max()) for n in weights) < 1e-12, step
    evaluated = {e["step"]: e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e}
    with torch.no_grad():
        expected = float(reference(**stack(eval_rows)).loss)
    assert abs(evaluated[5] - expected) < 1e-12
    for step in (2, 4):
        saved = load_file(str(tmp_path / f"checkpoint-{step}" / "model.safetensors"))
        assert max(float((saved[n] - trajectory[step - 1][n]).abs().max()) for n in saved) < 1e-12, step
    trainer.save_model(str(tmp_path / "final"))
    final = load_file(str(tmp_path / "final" / "model.safetensors"))
    assert max(float((final[n] - trajectory[-1][n]).abs().max()) for n in final) < 1e-12
    assert "Momentum-SAM" in (tmp_path / "final" / "README.md").read_text()


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_resumed_run_takes_the_steps_of_an_uninterrupted_one(tmp_path, optimizer):
    rows = classification_rows(n=40)
    whole = FlatBiasTrainer(
        model=tiny_classifier().double(),
        args=momentum_config(tmp_path / "whole", optimizer, save_strategy="steps", save_steps=2),
        train_dataset=rows,
    )
    whole.train()
    resumed = FlatBiasTrainer(
        model=tiny_classifier(seed=5).double(),  # other weights: the checkpoint must bring them back
        args=momentum_config(tmp_path / "resumed", optimizer),
        train_dataset=rows,
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"))
    assert max_param_diff(whole.model, resumed.model) < 1e-12
    assert resumed.state.global_step == 5


def test_the_direction_is_adams_coming_update():
    """After three AdamW steps on a quadratic: d = m_hat / (sqrt(v_hat) + eps) from the state; no state: None."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
    optimizer = torch.optim.AdamW([weight], lr=0.1, weight_decay=0.0, betas=BETAS, eps=EPS)
    for _ in range(3):
        optimizer.zero_grad()
        (weight**2).sum().backward()
        optimizer.step()
    state = optimizer.state[weight]
    t = float(state["step"])
    expected = (state["exp_avg"] / (1 - BETAS[0] ** t)) / ((state["exp_avg_sq"] / (1 - BETAS[1] ** t)).sqrt() + EPS)
    (direction,) = coming_update_direction(optimizer, [weight])
    torch.testing.assert_close(direction, expected, rtol=1e-14, atol=0)
    assert coming_update_direction(torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))]), [weight]) == [None]


@pytest.mark.parametrize(
    "optimizer,match",
    [
        (lambda p: torch.optim.RMSprop(p), "not RMSprop; use optim='adamw_torch'"),
        (lambda p: torch.optim.SGD(p, lr=0.1), "momentum=0 keeps none; set optim_args='momentum=0.9'"),
        (lambda p: torch.optim.AdamW(p, amsgrad=True), "amsgrad=False"),
    ],
)
def test_an_optimizer_whose_state_it_cannot_read_is_refused_before_any_step(tmp_path, optimizer, match):
    model = tiny_classifier()
    before = copy.deepcopy(model)
    reason = why_coming_update_unreadable(optimizer(model.parameters()))
    assert reason is not None and "\n" not in reason and match in reason
    with pytest.raises(ValueError, match=match):
        FlatBiasTrainer(
            model=model,
            args=momentum_config(tmp_path),
            train_dataset=classification_rows(),
            optimizers=(optimizer(model.parameters()), None),
        )
    assert max_param_diff(model, before) == 0.0


def test_an_optim_it_cannot_read_is_refused_with_the_config(tmp_path):
    refused = r"^flatness_method='momentum_sam' reads the coming update .* optim='adafactor'"
    with pytest.raises(ValueError, match=refused):
        momentum_config(tmp_path, optim="adafactor")
    # SGD without momentum: refused when the optimizer is built, before the first forward
    model = tiny_classifier()
    before = copy.deepcopy(model)
    trainer = FlatBiasTrainer(
        model=model, args=momentum_config(tmp_path, "sgd", optim_args=None), train_dataset=classification_rows()
    )
    with pytest.raises(ValueError, match="set optim_args='momentum=0.9'"):
        trainer.train()
    assert max_param_diff(model, before) == 0.0


def test_unsupported_engines_and_options_are_refused_by_the_table(tmp_path):
    from hf_flatbias.sharpness.support import check_deepspeed_supports_method, check_fsdp_supports

    args = momentum_config(tmp_path)
    with pytest.raises(ValueError, match="^flatness_method='momentum_sam' is not supported with DeepSpeed"):
        check_deepspeed_supports_method({"zero_optimization": {"stage": 1}}, args)
    with pytest.raises(ValueError, match="^flatness_method='momentum_sam' is not supported under FSDP2"):
        check_fsdp_supports("momentum_sam", "global", fsdp_version=2)
    with pytest.raises(ValueError, match="sam_preconditioner='adam' applies to flatness_method in"):
        momentum_config(tmp_path, sam_preconditioner="adam")


# ---------------------------------------------------------------- trl's SFT and DPO trainers, peft adapters


def trl_overrides(**overrides) -> dict:
    """SGD with momentum, four updates (three of them perturbed), two micro-batches of two rows each."""
    values = dict(
        flatness_method="momentum_sam",
        sam_rho=0.05,
        optim_args="momentum=0.9",
        max_steps=4,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
    )
    return {**values, **overrides}


def trainable_diff(trained, expected) -> float:
    a = [p for p in trained.parameters() if p.requires_grad]
    b = [p for p in expected.parameters() if p.requires_grad]
    assert len(a) == len(b)
    return max(float((p - q).detach().abs().max()) for p, q in zip(a, b, strict=True))


@pytest.mark.parametrize("adapters", [False, True])
def test_sft_momentum_sam_matches_its_recurrence(tmp_path, adapters):
    pytest.importorskip("trl")
    from tests.helpers.tiny_models import tiny_llama, word_tokenizer
    from tests.test_trl import N_WORDS, sft_loss, sft_trainer, updates_of, with_lora

    tokenizer = word_tokenizer(N_WORDS)

    def model():
        built = tiny_llama(len(tokenizer))
        return with_lora(built) if adapters else built

    trainer = sft_trainer(tmp_path, tokenizer, "completion_only", model=model(), **trl_overrides())
    reference = reference_momentum_sam(model(), updates_of(trainer), sft_loss, optimizer="sgd", lr=0.1, rho=0.05)
    plain = reference_momentum_sam(model(), updates_of(trainer), sft_loss, optimizer="sgd", lr=0.1, rho=0.0)
    trainer.train()
    assert trainable_diff(trainer.model, reference) < 1e-6
    assert trainable_diff(plain, reference) > 1e-5  # the perturbation changed the steps


def test_dpo_momentum_sam_matches_its_recurrence(tmp_path):
    pytest.importorskip("trl")
    from hf_flatbias import FlatBiasDPOTrainer
    from tests.helpers.tiny_models import tiny_llama, word_tokenizer
    from tests.test_trl import N_WORDS, dpo_config, dpo_loss_function, preference_rows, updates_of

    tokenizer = word_tokenizer(N_WORDS)
    trainer = FlatBiasDPOTrainer(
        model=tiny_llama(len(tokenizer)),
        ref_model=tiny_llama(len(tokenizer)),
        args=dpo_config(tmp_path, precompute_ref_log_probs=False, **trl_overrides()),
        train_dataset=preference_rows(n=16),
        processing_class=tokenizer,
    )
    loss = dpo_loss_function(tiny_llama(len(tokenizer)).eval(), beta=0.5)
    reference = reference_momentum_sam(
        tiny_llama(len(tokenizer)), updates_of(trainer), loss, optimizer="sgd", lr=0.1, rho=0.05
    )
    trainer.train()
    assert trainable_diff(trainer.model, reference) < 1e-6


def test_the_forward_sees_weights_rho_away_along_the_coming_update(tmp_path):
    rows = classification_rows(n=40)
    model = tiny_classifier().double()
    args = momentum_config(tmp_path, max_steps=3)
    trainer = FlatBiasTrainer(model=model, args=args, train_dataset=rows)
    trajectory = []
    reference_momentum_sam(
        copy.deepcopy(model),
        updates_of_rows(rows, steps=3, batch_size=4, accumulation=1),
        classifier_loss,
        optimizer="adamw",
        lr=args.learning_rate,
        rho=args.sam_rho,
        weight_decay=args.weight_decay,
        decayed=trainer.get_decay_parameter_names(model),
        trajectory=trajectory,
    )
    at_forward = []
    model.register_forward_pre_hook(
        lambda module, inputs: at_forward.append({n: p.detach().clone() for n, p in module.named_parameters()})
    )
    trainer.train()
    assert len(at_forward) == 3
    for step in (1, 2):  # the forwards of updates 2 and 3, from the weights after updates 1 and 2
        master, perturbed = trajectory[step - 1], at_forward[step]
        distance = math.sqrt(sum(float(((perturbed[n] - master[n]) ** 2).sum()) for n in master))
        assert abs(distance - args.sam_rho) < 1e-12, (step, distance)
    assert all(torch.equal(at_forward[0][n], p) for n, p in tiny_classifier().double().named_parameters())


def test_no_direction_means_no_perturbation():
    assert momentum_sam_offsets([None, None], 0.05) is None  # no state yet
    assert momentum_sam_offsets([torch.zeros(3), None], 0.05) is None
    assert momentum_sam_offsets([torch.tensor([1.0, float("nan")])], 0.05) is None
    (offset, missing) = momentum_sam_offsets([torch.tensor([3.0, 4.0], dtype=torch.float64), None], 0.5)
    assert missing is None
    torch.testing.assert_close(offset, torch.tensor([-0.3, -0.4], dtype=torch.float64), rtol=1e-15, atol=0)
