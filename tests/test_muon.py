"""SAM and the gradient-norm penalty with ``torch.optim.Muon`` as the base optimizer (AdamW for the parameters that
are not matrices, held together by `MuonWithAdamW`), against a plain-PyTorch loop: the same model and rows, the SAM
or penalty step written by hand, then ``torch.optim.Muon`` and ``torch.optim.AdamW`` stepped directly.

In float64. Muon's update is scale-free (the momentum orthogonalised by Newton-Schulz, in bfloat16): a matrix whose
gradient is small by cancellation (this tiny BERT's attention query/key at initialisation) turns float32 rounding of
that gradient into an O(1) change of its update. In float32 the loop and the trainer, whose only difference is the
order in which e's norm is summed, ended 3.1e-3 apart (query weight; 1e-7 for the AdamW parameters); in float64 they
agree below 1e-7, and are held to 1e-6."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from hf_flatbias import FlatBiasTrainer, MuonWithAdamW
from tests.helpers.tiny_models import classification_rows, flatbias_config, stack, tiny_classifier

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="this torch has no torch.optim.Muon")

STEPS = 3
ROWS_PER_UPDATE = 4
MUON = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95}
ADAMW = {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def reference_optimizers(params, muon=MUON, adamw=ADAMW):
    """What the torch docs prescribe: Muon on the 2-D parameters, AdamW on the others."""
    matrices = [p for p in params if p.ndim == 2]
    others = [p for p in params if p.ndim != 2]
    return [torch.optim.Muon(matrices, **muon), torch.optim.AdamW(others, **adamw)]


def reference_run(model, rows, *, accumulation, scope, method, rho=0.05, penalty_lambda=0.02, fd_step=0.05, **opt):
    """``method="sam"``: textbook SAM (the first gradient of each micro-batch, or of the whole update for
    ``scope="batch"``); ``"grad_norm_penalty"``: the gradient of L + lambda ||grad L|| by the finite difference
    ``(1 - lambda/h) g(w) + lambda/h g(w + h g/||g||)`` per micro-batch. Each micro-batch's loss is its mean divided
    by ``accumulation``; gradients summed into ``.grad``; then Muon and AdamW step."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizers = reference_optimizers(params, **opt)
    micro = ROWS_PER_UPDATE // accumulation

    def grad_of(batch):
        grads = torch.autograd.grad(model(**batch).loss / accumulation, params, allow_unused=True)
        return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]

    def at_shifted(batch, direction, radius):
        norm = math.sqrt(sum(float((d * d).sum()) for d in direction))
        saved = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, d in zip(params, direction, strict=True):
                p.add_(d, alpha=radius / norm)
        grads = grad_of(batch)
        with torch.no_grad():
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)
        return grads

    for step in range(STEPS):
        start = step * ROWS_PER_UPDATE
        batches = [stack(rows[start + i * micro : start + (i + 1) * micro]) for i in range(accumulation)]
        update = [torch.zeros_like(p) for p in params]
        if scope == "batch":
            first = [sum(gs) for gs in zip(*(grad_of(b) for b in batches), strict=True)]
        for batch in batches:
            if method == "sam":
                direction = first if scope == "batch" else grad_of(batch)
                grads = at_shifted(batch, direction, rho)
            else:
                clean = grad_of(batch)
                shifted = at_shifted(batch, clean, fd_step)
                ratio = penalty_lambda / fd_step
                grads = [(1 - ratio) * c + ratio * s for c, s in zip(clean, shifted, strict=True)]
            update = [u + g for u, g in zip(update, grads, strict=True)]
        for p, u in zip(params, update, strict=True):
            p.grad = u
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return model


def max_param_diff(a, b) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def muon_with_adamw(model):
    """`MuonWithAdamW` with the reference's settings."""
    return MuonWithAdamW(
        model.parameters(),
        **MUON,
        adamw_lr=ADAMW["lr"],
        adamw_betas=ADAMW["betas"],
        adamw_eps=ADAMW["eps"],
        adamw_weight_decay=ADAMW["weight_decay"],
    )


CASES = {
    "sam_micro_acc2": ({"flatness_method": "sam", "sam_rho": 0.05}, "sam", "micro_batch"),
    "sam_batch_acc2": ({"flatness_method": "sam", "sam_rho": 0.05, "sam_scope": "batch"}, "sam", "batch"),
    "grad_norm_penalty_acc2": (
        {"flatness_method": "grad_norm_penalty", "penalty_lambda": 0.02, "penalty_fd_step": 0.05},
        "grad_norm_penalty",
        "micro_batch",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_flatness_steps_with_muon_match_a_plain_pytorch_loop(tmp_path, case):
    overrides, method, scope = CASES[case]
    rows = classification_rows()
    model = tiny_classifier().double()
    reference = reference_run(copy.deepcopy(model), rows, accumulation=2, scope=scope, method=method)
    args = flatbias_config(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, **overrides)
    trainer = FlatBiasTrainer(model=model, args=args, train_dataset=rows, optimizers=(muon_with_adamw(model), None))
    trainer.train()
    assert max_param_diff(trainer.model, reference) < 1e-6
    model = tiny_classifier().double()
    plain = reference_run(model, rows, accumulation=2, scope="micro_batch", method="sam", rho=1e-12)
    assert max_param_diff(trainer.model, plain) > 1e-4  # the flatness step moved the run


def test_muon_through_the_trainers_optimizer_class_hook(tmp_path):
    """``optimizer_cls_and_kwargs``: the Trainer builds MuonWithAdamW from its decay/no-decay groups, whose
    ``weight_decay`` (the arguments', 0 here) applies in both inner optimizers."""
    rows = classification_rows()
    model = tiny_classifier().double()
    no_decay = {"muon": {**MUON, "weight_decay": 0.0}, "adamw": {**ADAMW, "weight_decay": 0.0}}
    reference = reference_run(copy.deepcopy(model), rows, accumulation=2, scope="batch", method="sam", **no_decay)
    args = flatbias_config(
        tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, flatness_method="sam", sam_scope="batch"
    )
    kwargs = {**MUON, "adamw_lr": ADAMW["lr"], "adamw_betas": ADAMW["betas"], "adamw_eps": ADAMW["eps"]}
    trainer = FlatBiasTrainer(
        model=model, args=args, train_dataset=rows, optimizer_cls_and_kwargs=(MuonWithAdamW, kwargs)
    )
    trainer.train()
    assert isinstance(trainer.optimizer.optimizer, MuonWithAdamW)
    assert max_param_diff(trainer.model, reference) < 1e-6


@pytest.mark.parametrize("hook", ["optimizers", "optimizer_cls_and_kwargs"])
def test_adam_preconditioner_with_muon_is_refused_at_construction(tmp_path, hook):
    model = tiny_classifier().double()
    args = flatbias_config(tmp_path, flatness_method="sam", sam_preconditioner="adam", optim="adamw_torch")
    given = (
        {"optimizers": (muon_with_adamw(model), None)}
        if hook == "optimizers"
        else {"optimizer_cls_and_kwargs": (MuonWithAdamW, dict(MUON))}
    )
    with pytest.raises(ValueError, match="sam_preconditioner='adam' is not defined for MuonWithAdamW") as refused:
        FlatBiasTrainer(model=model, args=args, train_dataset=classification_rows(), **given)
    assert "\n" not in str(refused.value) and "sam_preconditioner='none'" in str(refused.value)


def test_adam_preconditioner_accepts_a_given_adamw(tmp_path):
    model = tiny_classifier().double()
    args = flatbias_config(tmp_path, flatness_method="sam", sam_preconditioner="adam", optim="adamw_torch")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    FlatBiasTrainer(model=model, args=args, train_dataset=classification_rows(), optimizers=(optimizer, None))
    with pytest.raises(ValueError, match="given a SGD"):
        FlatBiasTrainer(
            model=tiny_classifier().double(),
            args=args,
            train_dataset=classification_rows(),
            optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None),
        )


def test_muon_with_adamw_state_round_trips_and_schedules_both(tmp_path):
    model = tiny_classifier().double()
    optimizer = muon_with_adamw(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    model(**stack(classification_rows(4))).loss.backward()
    optimizer.step()
    scheduler.step()
    assert [g["lr"] for g in optimizer.muon.param_groups] == [MUON["lr"] / 2]
    assert [g["lr"] for g in optimizer.adamw.param_groups] == [ADAMW["lr"] / 2]
    restored = muon_with_adamw(copy.deepcopy(model))
    restored.load_state_dict(optimizer.state_dict())
    buffers = [s["momentum_buffer"] for s in restored.muon.state.values()]
    assert buffers and all(
        torch.equal(a, b["momentum_buffer"]) for a, b in zip(buffers, optimizer.muon.state.values(), strict=True)
    )


def test_adamw_for_sends_chosen_matrices_to_adamw():
    model = tiny_classifier()
    embedding = model.get_input_embeddings().weight
    optimizer = MuonWithAdamW(model.parameters(), adamw_for=lambda p: p is embedding)
    in_muon = {id(p) for group in optimizer.muon.param_groups for p in group["params"]}
    in_adamw = {id(p) for group in optimizer.adamw.param_groups for p in group["params"]}
    assert id(embedding) in in_adamw and id(embedding) not in in_muon
    assert all(p.ndim == 2 for group in optimizer.muon.param_groups for p in group["params"])
    assert in_muon | in_adamw == {id(p) for p in model.parameters()} and not in_muon & in_adamw


def test_resumed_sam_run_with_muon_is_bit_identical(tmp_path):
    """The Trainer saves and reloads MuonWithAdamW's state (Muon's momentum, AdamW's moments) with the checkpoint."""
    rows = classification_rows(20)
    common = dict(flatness_method="sam", sam_rho=0.05, max_steps=5)

    def run(output_dir, resume=None, **extra):
        model = tiny_classifier()
        args = flatbias_config(output_dir, **common, **extra)
        trainer = FlatBiasTrainer(model=model, args=args, train_dataset=rows, optimizers=(muon_with_adamw(model), None))
        trainer.train(resume_from_checkpoint=resume)
        return trainer.model

    straight = run(tmp_path / "straight")
    run(tmp_path / "resumed", save_strategy="steps", save_steps=2)
    resumed = run(tmp_path / "resumed", str(tmp_path / "resumed" / "checkpoint-2"), save_strategy="steps", save_steps=2)
    assert max_param_diff(resumed, straight) == 0.0


@pytest.mark.parametrize(
    "option,value,expected",
    [
        ("ns_steps", 0, r"ns_steps must be a whole number >= 1 \(got 0\)"),
        ("ns_steps", 2.5, r"ns_steps must be a whole number >= 1 \(got 2.5\)"),
        ("momentum", 1.5, r"momentum must be a number in \[0, 1\) \(got 1.5\)"),
        ("momentum", -0.1, r"momentum must be a number in \[0, 1\) \(got -0.1\)"),
        ("lr", "abc", r"lr must be a finite number >= 0 \(got 'abc'\)"),
        ("lr", -1.0, r"lr must be a finite number >= 0 \(got -1.0\)"),
        ("weight_decay", -0.1, r"weight_decay must be a finite number >= 0"),
        ("adamw_lr", "x", r"adamw_lr must be a finite number >= 0 or None"),
        ("adamw_betas", (0.9, 1.0), r"adamw_betas must be two numbers in \[0, 1\)"),
        ("adamw_eps", -1e-8, r"adamw_eps must be a finite number >= 0"),
        ("adamw_weight_decay", float("nan"), r"adamw_weight_decay must be a finite number >= 0"),
    ],
)
def test_muon_with_adamw_refuses_an_option_out_of_range_naming_it(option, value, expected):
    """Issue 58, item 8: ns_steps=0 and momentum=1.5 were accepted, lr='abc' ended in torch's TypeError."""
    with pytest.raises(ValueError, match=f"^MuonWithAdamW: {expected}"):
        MuonWithAdamW(tiny_classifier().parameters(), **{option: value})
