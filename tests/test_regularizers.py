"""Fisher / gradient-norm penalties, LookSAM and sam_every_k against plain-PyTorch references written here.

Two kinds of reference: the exact algorithm of each step (same sampled labels, same finite difference), which the
trainer must match to float precision, and the mathematical target of the penalties (double backward in float64),
which the finite-difference step must approach as the step length shrinks.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import BertForMaskedLM, BertForSequenceClassification

from hf_flatbias import FlatBiasTrainer
from hf_flatbias.sharpness.penalties import (
    fisher_trace_from_mean_gradient,
    labelled_logits,
    sample_model_labels,
    sampled_label_loss,
)
from hf_flatbias.tensors import squared_norm
from tests.helpers.tiny_models import flatbias_config as config
from tests.helpers.tiny_models import stack, tiny_bert_config, tiny_mlm
from tests.helpers.tiny_models import tiny_classifier as shared_tiny_classifier

VOCAB = 30
SEQ_LEN = 6
N_ROWS = 12


def test_squared_norm_skips_unused_gradients_and_accumulates_in_the_dtype_asked():
    a, b = torch.tensor([3.0, 4.0]), torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16)
    assert squared_norm([a, None, b]).dtype == torch.float32
    assert float(squared_norm([a, None, b])) == 30.0
    wide = squared_norm([a, None, b], dtype=torch.float64)
    assert wide.dtype == torch.float64 and float(wide) == pytest.approx(30.0, rel=1e-15)
    # float32 would round 1 + 1e-9 to 1; float64 keeps it
    tiny = torch.tensor([1.0, 3.16227766e-5], dtype=torch.float64)
    assert float(squared_norm([tiny.float()], dtype=torch.float64)) != float(squared_norm([tiny.float()]))
    assert squared_norm([None]).item() == 0.0


def tiny_classifier(seed: int = 0) -> BertForSequenceClassification:
    return shared_tiny_classifier(seed, layers=1)


def classification_rows(n: int = N_ROWS, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (n, SEQ_LEN), generator=g)
    labels = torch.randint(0, 3, (n,), generator=g)
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(n)]


def mlm_rows(n: int = N_ROWS, seed: int = 2) -> list[dict[str, torch.Tensor]]:
    """Masked-LM rows with one or two masked positions each, so micro-batches hold different label counts."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (n, SEQ_LEN), generator=g)
    rows = []
    for i in range(n):
        labels = torch.full((SEQ_LEN,), -100)
        inputs = ids[i].clone()
        for position in {i % SEQ_LEN, (3 * i + 1) % SEQ_LEN} if i % 3 else {i % SEQ_LEN}:
            labels[position] = ids[i, position]
            inputs[position] = 4
        rows.append({"input_ids": inputs, "labels": labels})
    return rows


def train(model, args, rows):
    trainer = FlatBiasTrainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    return trainer


def max_param_diff(a, b) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def micro_batches_of(rows, step, batch_size, accumulation):
    start = step * batch_size * accumulation
    return [stack(rows[start + i * batch_size : start + (i + 1) * batch_size]) for i in range(accumulation)]


def grad_list(loss, params, retain_graph=False):
    grads = torch.autograd.grad(loss, params, allow_unused=True, retain_graph=retain_graph)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]


def norm_of(vectors) -> float:
    return math.sqrt(sum(float((v.double() ** 2).sum()) for v in vectors))


# ---------------------------------------------------------------- references


def reference_penalty_sgd(model, rows, *, method, steps, batch_size, accumulation, lr, lam, h, autocast=False):
    """Two-pass finite-difference penalty steps with SGD, written from the formulas.

    fisher: grad = g_data(w + h u) + 2 lam N ||g|| / h * (g_y(w + h u) - g_y(w)), u = g_y / ||g_y||, labels y drawn
    from softmax(logits) with a generator seeded 0; grad_norm: grad = (1 - lam/h) g(w) + lam/h g(w + h u).
    Masked-LM data losses with accumulation are token-weighted over the update: a micro-batch's data-loss gradients
    weigh (its labelled tokens / the update's), not 1 / accumulation.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(0)

    def forward(batch):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return model(**batch)

    for step in range(steps):
        total = [torch.zeros_like(p) for p in params]
        update = micro_batches_of(rows, step, batch_size, accumulation)
        update_tokens = sum(int((batch["labels"] != -100).sum()) for batch in update)
        token_weighted = isinstance(model, BertForMaskedLM) and accumulation > 1
        for batch in update:
            mask = batch["labels"] != -100
            # The data loss's weight in the update's gradient, relative to 1 / accumulation.
            share = int(mask.sum()) * accumulation / update_tokens if token_weighted else 1.0
            out = forward(batch)
            if method == "fisher_penalty":
                logits = out.logits[mask].float()
                y = torch.multinomial(torch.softmax(logits.detach(), -1), 1, generator=generator).squeeze(-1)
                g = grad_list(F.cross_entropy(logits, y), params)
            else:
                g = grad_list(out.loss, params)
            g_norm = norm_of(g)
            saved = [p.detach().clone() for p in params]
            with torch.no_grad():
                for p, gi in zip(params, g, strict=True):
                    p.add_(gi * (h / g_norm))
            out = forward(batch)
            if method == "fisher_penalty":
                data_grad = grad_list(out.loss, params, retain_graph=True)
                y_grad = grad_list(F.cross_entropy(out.logits[mask].float(), y), params)
                c = 2 * lam * len(y) * g_norm / h
                step_grad = [share * d + c * (s - gi) for d, s, gi in zip(data_grad, y_grad, g, strict=True)]
            else:
                shifted = grad_list(out.loss, params)
                r = lam / h
                step_grad = [share * ((1 - r) * gi + r * s) for gi, s in zip(g, shifted, strict=True)]
            with torch.no_grad():
                for p, s in zip(params, saved, strict=True):
                    p.copy_(s)
            total = [t + s / accumulation for t, s in zip(total, step_grad, strict=True)]
        with torch.no_grad():
            for p, t in zip(params, total, strict=True):
                p.sub_(lr * t)
    return model


def reference_sam_every_k_sgd(
    model, rows, *, steps, k, batch_size, accumulation, lr, rho, looksam_alpha=None, scope="micro_batch"
):
    """SAM on updates 0, k, 2k, ...; plain SGD between, or LookSAM's reuse when alpha is given.

    scope "micro_batch": each micro-batch perturbed along its own gradient; "batch": along the update's summed one.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    unit_orthogonal = None

    def shifted_gradient(batch, direction):
        saved = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, d in zip(params, direction, strict=True):
                p.add_(d * (rho / norm_of(direction)))
        shifted = grad_list(model(**batch).loss / accumulation, params)
        with torch.no_grad():
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)
        return shifted

    for step in range(steps):
        batches = micro_batches_of(rows, step, batch_size, accumulation)
        plain = [grad_list(model(**batch).loss / accumulation, params) for batch in batches]
        plain_total = [sum(parts) for parts in zip(*plain, strict=True)]
        if step % k:
            total = plain_total
        elif scope == "batch":
            total = [sum(parts) for parts in zip(*(shifted_gradient(b, plain_total) for b in batches), strict=True)]
        else:
            total = [
                sum(parts)
                for parts in zip(*(shifted_gradient(b, g) for b, g in zip(batches, plain, strict=True)), strict=True)
            ]
        if looksam_alpha is not None:
            if step % k == 0:
                along = (
                    sum(float((s * gi).sum()) for s, gi in zip(total, plain_total, strict=True))
                    / norm_of(plain_total) ** 2
                )
                orthogonal = [s - along * gi for s, gi in zip(total, plain_total, strict=True)]
                unit_orthogonal = [v / norm_of(orthogonal) for v in orthogonal]
            else:
                scale = looksam_alpha * norm_of(total)
                total = [t + scale * v for t, v in zip(total, unit_orthogonal, strict=True)]
        with torch.no_grad():
            for p, t in zip(params, total, strict=True):
                p.sub_(lr * t)
    return model


# ---------------------------------------------------------------- the steps match their references


@pytest.mark.parametrize(
    "method,task,accumulation",
    [
        ("fisher_penalty", "classification", 1),
        ("fisher_penalty", "mlm", 2),
        ("grad_norm_penalty", "classification", 2),
        ("grad_norm_penalty", "mlm", 1),
    ],
)
def test_penalty_step_matches_reference(tmp_path, method, task, accumulation):
    rows, make = (classification_rows(), tiny_classifier) if task == "classification" else (mlm_rows(), tiny_mlm)
    batch_size = 4 // accumulation
    lam = 0.02 if method == "fisher_penalty" else 0.05
    reference = reference_penalty_sgd(
        make(), rows, method=method, steps=3, batch_size=batch_size, accumulation=accumulation, lr=0.1, lam=lam, h=0.01
    )
    args = config(
        tmp_path,
        flatness_method=method,
        penalty_lambda=lam,
        penalty_fd_step=0.01,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
    )
    trainer = train(make(), args, rows)
    assert max_param_diff(trainer.model, reference) < 2e-5
    # lam = 0 makes the reference plain SGD: the check above can tell a penalty from no penalty
    plain = reference_penalty_sgd(
        make(),
        rows,
        method="grad_norm_penalty",
        steps=3,
        batch_size=batch_size,
        accumulation=accumulation,
        lr=0.1,
        lam=0.0,
        h=0.01,
    )
    assert max_param_diff(trainer.model, plain) > 1e-3
    metric = "fisher_penalty/trace" if method == "fisher_penalty" else "grad_norm_penalty/grad_norm"
    logged = [e[metric] for e in trainer.state.log_history if "loss" in e]
    assert len(logged) == 3 and all(v > 0 for v in logged)


def test_penalties_under_bf16_autocast_match_reference(tmp_path):
    """Same step under autocast, to bf16 precision: the trainer backpropagates the combined loss once, the reference
    each part separately, and bf16 rounds those differently (then the finite difference divides by h)."""
    rows = classification_rows()
    for method, lam in (("fisher_penalty", 0.02), ("grad_norm_penalty", 0.05)):
        start = tiny_classifier()
        reference = reference_penalty_sgd(
            copy.deepcopy(start),
            rows,
            method=method,
            steps=2,
            batch_size=4,
            accumulation=1,
            lr=0.1,
            lam=lam,
            h=0.05,
            autocast=True,
        )
        args = config(
            tmp_path / method, flatness_method=method, penalty_lambda=lam, penalty_fd_step=0.05, bf16=True, max_steps=2
        )
        trained = train(copy.deepcopy(start), args, rows).model
        update = max_param_diff(reference, start)
        assert max_param_diff(trained, reference) < 0.02 * update, method


@pytest.mark.parametrize("k,accumulation,scope", [(2, 1, "micro_batch"), (3, 2, "micro_batch"), (2, 2, "batch")])
def test_sam_every_k_matches_reference(tmp_path, k, accumulation, scope):
    rows = classification_rows(n=20)
    batch_size = 4 // accumulation
    reference = reference_sam_every_k_sgd(
        tiny_classifier(),
        rows,
        steps=5,
        k=k,
        batch_size=batch_size,
        accumulation=accumulation,
        lr=0.1,
        rho=0.05,
        scope=scope,
    )
    args = config(
        tmp_path,
        flatness_method="sam",
        sam_every_k=k,
        sam_scope=scope,
        max_steps=5,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
    )
    trainer = train(tiny_classifier(), args, rows)
    assert max_param_diff(trainer.model, reference) < 1e-5
    sam_logged = [e["step"] for e in trainer.state.log_history if "sam/perturbation_norm" in e]
    assert sam_logged == [s + 1 for s in range(5) if s % k == 0]


@pytest.mark.parametrize("k,accumulation", [(2, 1), (3, 2)])
def test_looksam_matches_reference(tmp_path, k, accumulation):
    rows = classification_rows(n=24)
    batch_size = 4 // accumulation
    reference = reference_sam_every_k_sgd(
        tiny_classifier(),
        rows,
        steps=6,
        k=k,
        batch_size=batch_size,
        accumulation=accumulation,
        lr=0.1,
        rho=0.05,
        looksam_alpha=0.7,
    )
    args = config(
        tmp_path,
        flatness_method="looksam",
        sam_every_k=k,
        looksam_alpha=0.7,
        max_steps=6,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
    )
    trained = train(tiny_classifier(), args, rows).model
    assert max_param_diff(trained, reference) < 1e-5
    every_k = reference_sam_every_k_sgd(
        tiny_classifier(), rows, steps=6, k=k, batch_size=batch_size, accumulation=accumulation, lr=0.1, rho=0.05
    )
    assert max_param_diff(trained, every_k) > 1e-4  # the reuse step is not a plain step


@pytest.mark.parametrize("method", ["fisher_penalty", "grad_norm_penalty", "looksam"])
def test_bf16_steps_restore_the_weights(tmp_path, method):
    model = tiny_mlm()
    before = copy.deepcopy(model)
    trainer = train(
        model,
        config(
            tmp_path,
            flatness_method=method,
            bf16=True,
            learning_rate=0.0,
            max_steps=3,
            sam_every_k=2 if method == "looksam" else 1,
        ),
        mlm_rows(),
    )
    assert max_param_diff(trainer.model, before) == 0.0
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)


# ---------------------------------------------------------------- the finite difference approaches the true gradient


def float64_classifier():
    """Eager attention: the fused CPU attention kernel has no double backward, which the exact reference needs."""
    torch.manual_seed(0)
    model = BertForSequenceClassification(tiny_bert_config())
    model.set_attn_implementation("eager")
    return model.double()


def one_penalty_step(tmp_path, rows, *, method: str, lam: float, h: float = 1e-6):
    """One trainer step of ``method`` at lr 1 on `float64_classifier`: returns the model it started from and the
    update, which is minus the step's gradient."""
    model = float64_classifier()
    start = copy.deepcopy(model)
    args = config(
        tmp_path, flatness_method=method, penalty_lambda=lam, penalty_fd_step=h, learning_rate=1.0, max_steps=1
    )
    trained = train(model, args, rows).model
    return start, [(p0 - p1).detach() for p0, p1 in zip(start.parameters(), trained.parameters(), strict=True)]


def test_fisher_penalty_step_approaches_the_double_backward_gradient(tmp_path):
    """Compare the step with grad(L + lam N ||g_y||^2), exactly."""
    rows, lam = classification_rows(n=4), 0.05
    start, update = one_penalty_step(tmp_path, rows, method="fisher_penalty", lam=lam)

    params = list(start.parameters())
    batch = stack(rows)
    logits = start(**batch).logits
    y = torch.multinomial(
        torch.softmax(logits.detach().float(), -1), 1, generator=torch.Generator().manual_seed(0)
    ).squeeze(-1)
    g_y = torch.autograd.grad(F.cross_entropy(logits, y), params, create_graph=True)
    penalty = lam * len(y) * sum((g**2).sum() for g in g_y)
    exact = grad_list(start(**batch).loss + penalty, params, retain_graph=True)
    error = norm_of([u - e for u, e in zip(update, exact, strict=True)])
    assert error < 1e-4 * norm_of(exact)
    penalty_only = grad_list(penalty, params)
    assert norm_of(penalty_only) > 0.05 * norm_of(exact)  # the penalty is a visible part of the step


def test_grad_norm_penalty_step_approaches_the_double_backward_gradient(tmp_path):
    """Compare the step with grad(L + lam ||g||), exactly."""
    rows, lam = classification_rows(n=4), 0.3
    start, update = one_penalty_step(tmp_path, rows, method="grad_norm_penalty", lam=lam)

    params = list(start.parameters())
    loss = start(**stack(rows)).loss
    g = torch.autograd.grad(loss, params, create_graph=True)
    exact = grad_list(loss + lam * torch.sqrt(sum((gi**2).sum() for gi in g)), params)
    plain = grad_list(start(**stack(rows)).loss, params)
    assert norm_of([u - e for u, e in zip(update, exact, strict=True)]) < 1e-4 * norm_of(exact)
    assert norm_of([e - p for e, p in zip(exact, plain, strict=True)]) > 0.05 * norm_of(exact)


def test_sampled_label_fisher_trace_is_unbiased():
    """N ||grad mean_i -log p(y_i)||^2 over draws y ~ p averages to the exact per-position Fisher trace."""
    model = tiny_mlm()
    params = list(model.parameters())
    batch = stack(mlm_rows()[:3])
    logits = labelled_logits(model(**batch).logits, batch["labels"])
    n = logits.shape[0]
    probabilities = torch.softmax(logits.detach(), -1)
    exact = 0.0
    for i in range(n):  # brute force over the vocabulary: sum_y p_i(y) ||grad log p_i(y)||^2
        for label in range(VOCAB):
            g = grad_list(-torch.log_softmax(logits[i], -1)[label], params, retain_graph=True)
            exact += float(probabilities[i, label]) * norm_of(g) ** 2
    exact /= n
    generator = torch.Generator().manual_seed(5)
    draws = []
    for _ in range(400):
        y = sample_model_labels(logits, generator)
        g = grad_list(sampled_label_loss(logits, y), params, retain_graph=True)
        draws.append(fisher_trace_from_mean_gradient(norm_of(g) ** 2, n))
    draws = torch.tensor(draws)
    stderr = float(draws.std()) / math.sqrt(len(draws))
    assert abs(float(draws.mean()) - exact) < 4 * stderr
    # and the plain squared norm of the mean gradient would be N times too small
    assert abs(float(draws.mean()) / n - exact) > 4 * stderr


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"flatness_method": "fisher_penalty", "penalty_lambda": 0.0}, "penalty_lambda"),
        ({"flatness_method": "grad_norm_penalty", "penalty_fd_step": float("inf")}, "penalty_fd_step"),
        ({"flatness_method": "sam", "sam_every_k": 0}, "sam_every_k"),
        ({"flatness_method": "sam", "sam_every_k": 1.5}, "sam_every_k"),
        ({"flatness_method": "fisher_penalty", "sam_every_k": 2}, "sam_every_k"),
        ({"flatness_method": "looksam", "looksam_alpha": -1.0}, "looksam_alpha"),
        ({"flatness_method": "looksam", "sam_scope": "batch"}, "sam_scope"),
        ({"flatness_method": "grad_norm_penalty", "sam_scope": "batch"}, "sam_scope"),
    ],
)
def test_bad_config_is_rejected_early(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        config(tmp_path, **overrides)


def test_fisher_penalty_without_labels_names_the_fix(tmp_path):
    rows = [{"input_ids": r["input_ids"]} for r in mlm_rows()]
    trainer = FlatBiasTrainer(
        model=tiny_mlm(), args=config(tmp_path, flatness_method="fisher_penalty"), train_dataset=rows
    )
    with pytest.raises(ValueError, match="labels"):
        trainer.train()
