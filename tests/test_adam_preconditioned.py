"""``matrix="adam_preconditioned"`` (`hf_flatbias.flatness.adam_preconditioner`) against a dense reference built here:
the Hessian of the mean data-label loss by plain double backward on the stock forward, one context at a time, scaled
by ``P^-1/2`` computed from the optimizer's state with torch's own denominator, and diagonalised by ``eigvalsh``; then
the refusals, each before any pass."""

import math

import pytest
import torch

from hf_flatbias.callbacks import HessianTraceCallback
from hf_flatbias.cli import main
from hf_flatbias.constants import ADAM_PRECONDITIONED, IGNORE_INDEX, TOP_EIGENVALUE_METRIC
from hf_flatbias.flatness.contexts import TraceContexts
from hf_flatbias.flatness.lm import logits_at_positions
from hf_flatbias.flatness.spectrum import estimate_spectral_density, estimate_top_eigenvalues
from hf_flatbias.modelcard import flatness_card_from_trainer, load_flatness_card
from tests.helpers.tiny_models import train_word_mlm
from tests.test_cli_trace import checkpoint  # noqa: F401 - the fixture
from tests.test_flatness_estimators import _contexts, _tiny_gpt2
from tests.test_trace_callback import tokenizer  # noqa: F401 - the fixture

N_CONTEXTS = 6


def _model_and_rows():
    """A tiny float64 GPT-2 (n_embd 4, 296 trainable parameters) with the position embeddings and the attention's
    key bias frozen: the optimizer then holds no state for them, which frozen parameters must not need, and the
    directions whose gradient is 0 or rounding (positions past the longest context; the key bias, which the softmax
    cannot see), where ``P = eps`` would put ``P^-1/2 = 1e4``, stay out of the matrix."""
    model = _tiny_gpt2(n_embd=4).double()
    model.transformer.wpe.requires_grad_(False)
    model.transformer.h[0].attn.c_attn.bias.requires_grad_(False)
    return model, _contexts(N_CONTEXTS, causal=True)


def _train(model, rows, optimizer, steps):
    contexts = TraceContexts.from_rows(rows, causal=True)
    indices = list(range(len(contexts)))
    batch = contexts.model_inputs(indices, model)
    positions, targets = torch.tensor(contexts.positions), torch.tensor(contexts.targets)
    for _ in range(steps):
        optimizer.zero_grad()
        logits = logits_at_positions(model, batch, positions)[:, 0]
        torch.nn.functional.cross_entropy(logits, targets).backward()
        optimizer.step()
    optimizer.zero_grad()


def _trained(optimizer_class=torch.optim.AdamW, steps=3, **options):
    model, rows = _model_and_rows()
    optimizer = optimizer_class(model.parameters(), lr=1e-2, **options)
    _train(model, rows, optimizer, steps)
    return model, rows, optimizer


def _dense_hessian(model, rows):
    """The Hessian of the mean over rows of -log p(label) over the trainable parameters, one plain double backward
    per row of the matrix, each context through the stock forward alone (no batch, no padding)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    contexts = []
    for row in rows:
        (t,) = [i for i, label in enumerate(row["labels"]) if label != IGNORE_INDEX]
        contexts.append((torch.tensor([row["input_ids"][:t]]), row["labels"][t]))
    loss = torch.stack([-torch.log_softmax(model(ids).logits[0, -1], -1)[target] for ids, target in contexts]).mean()
    gradient = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, trainable, create_graph=True)])
    rows_of_hessian = [
        torch.cat([h.reshape(-1) for h in torch.autograd.grad(gradient[i], trainable, retain_graph=True)])
        for i in range(len(gradient))
    ]
    hessian = torch.stack(rows_of_hessian).detach()
    return (hessian + hessian.T) / 2


def _inverse_sqrt_p(model, optimizer):
    """torch's Adam denominator, sqrt(exp_avg_sq) / sqrt(1 - beta2^t) + eps, to the power -1/2."""
    pieces = []
    for p in (p for p in model.parameters() if p.requires_grad):
        state, (_, beta2), eps = optimizer.state[p], optimizer.defaults["betas"], optimizer.defaults["eps"]
        denominator = state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2 ** float(state["step"])) + eps
        pieces.append(denominator.rsqrt().reshape(-1))
    return torch.cat(pieces)


@pytest.fixture(scope="module")
def reference():
    model, rows, optimizer = _trained()
    scale = _inverse_sqrt_p(model, optimizer)
    exact = torch.linalg.eigvalsh(scale[:, None] * _dense_hessian(model, rows) * scale[None, :]).flip(0)
    return model, rows, optimizer, exact


def test_top_eigenvalues_equal_the_dense_preconditioned_hessians_to_1e8(reference):
    model, rows, optimizer, exact = reference
    result = estimate_top_eigenvalues(
        model, rows, k=3, matrix="adam_preconditioned", optimizer=optimizer, tol=1e-11, max_iterations=400
    )
    assert result.matrix == "adam_preconditioned" and result.converged
    assert result.eigenvalues == pytest.approx(exact[:3].tolist(), rel=1e-8)


def test_the_preconditioner_changes_the_spectrum(reference):
    # P^-1/2 H P^-1/2 is not H scaled: a wrapper that skipped the scaling, or applied it once, would fail here
    model, rows, optimizer, exact = reference
    hessian = estimate_top_eigenvalues(model, rows, k=1, matrix="hessian", tol=1e-10, max_iterations=400)
    assert abs(hessian.top / exact[0].item() - 1) > 0.5


def test_accelerates_wrapper_is_looked_through(reference):
    model, rows, optimizer, exact = reference

    class Wrapper:  # what accelerate's AcceleratedOptimizer exposes of the torch optimizer
        def __init__(self, inner):
            self.optimizer = inner

    result = estimate_top_eigenvalues(
        model, rows, k=1, matrix="adam_preconditioned", optimizer=Wrapper(optimizer), tol=1e-11, max_iterations=400
    )
    assert result.top == pytest.approx(exact[0].item(), rel=1e-8)


def test_spectral_density_spans_the_dense_spectrum(reference):
    model, rows, optimizer, exact = reference
    density = estimate_spectral_density(
        model, rows, matrix="adam_preconditioned", optimizer=optimizer, n_steps=40, n_runs=2
    )
    assert density.matrix == "adam_preconditioned"
    top, bottom = exact[0].item(), exact[-1].item()
    spread = top - bottom
    for nodes, weights in zip(density.nodes, density.weights, strict=True):
        assert max(nodes) == pytest.approx(top, rel=1e-6)  # the extreme Ritz values converge first
        assert min(nodes) >= bottom - 1e-6 * spread
        assert sum(weights) == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize(
    ("make_optimizer", "message"),
    [
        (lambda model: None, "optimizer= a torch Adam or AdamW"),
        (lambda model: torch.optim.SGD(model.parameters(), lr=0.1), "SGD does not keep"),
        (lambda model: torch.optim.AdamW(model.parameters(), amsgrad=True), "amsgrad=False"),
        (lambda model: torch.optim.AdamW(model.parameters()), "after the optimizer's first step"),
        (lambda model: torch.optim.AdamW(model.lm_head.parameters()), "not in the optimizer's param groups"),
    ],
)
def test_unreadable_optimizers_are_refused_in_one_line_before_any_pass(make_optimizer, message, monkeypatch):
    model, rows = _model_and_rows()
    optimizer = make_optimizer(model)
    monkeypatch.setattr(model, "forward", lambda *args, **kwargs: pytest.fail("a forward ran before the refusal"))
    with pytest.raises(ValueError, match=message) as error:
        estimate_top_eigenvalues(model, rows, matrix="adam_preconditioned", optimizer=optimizer)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=message):
        estimate_spectral_density(model, rows, matrix="adam_preconditioned", optimizer=optimizer)


def test_finite_difference_products_are_refused_naming_the_fix(reference):
    model, rows, optimizer, _ = reference
    with pytest.raises(ValueError, match="pass product='exact'"):
        estimate_top_eigenvalues(
            model, rows, matrix="adam_preconditioned", optimizer=optimizer, product="finite_difference"
        )


def test_a_parameter_frozen_after_training_needs_no_state_and_one_unfrozen_late_is_refused():
    model, rows, optimizer = _trained(steps=1)
    model.transformer.ln_f.requires_grad_(False)  # frozen now: outside the matrix, its state unused
    estimate_top_eigenvalues(model, rows, matrix="adam_preconditioned", optimizer=optimizer, max_iterations=3)
    model.transformer.wpe.requires_grad_(True)  # trainable now, but the optimizer never stepped it
    with pytest.raises(ValueError, match="transformer.wpe.weight first"):
        estimate_top_eigenvalues(model, rows, matrix="adam_preconditioned", optimizer=optimizer)


def test_the_callback_measures_with_the_trainers_adamw(tmp_path, tokenizer):  # noqa: F811
    callback = HessianTraceCallback(
        n_contexts=6,
        n_draws=1,
        every_n_steps=3,
        also_measure=("top_eigenvalue",),
        eigenvalue_matrix=ADAM_PRECONDITIONED,
    )
    trainer = train_word_mlm(tmp_path, tokenizer, [callback])
    logged = [entry for entry in trainer.state.log_history if TOP_EIGENVALUE_METRIC in entry]
    assert [entry["step"] for entry in logged] == [3, 6]
    # the last value is the estimator's on the final weights with the final optimizer state
    expected = estimate_top_eigenvalues(
        trainer.model, callback._contexts, matrix=ADAM_PRECONDITIONED, optimizer=trainer.optimizer, seed=0
    )
    assert logged[-1][TOP_EIGENVALUE_METRIC] == pytest.approx(expected.top, rel=1e-5)
    assert callback.flatness_record.top_eigenvalues.matrix == ADAM_PRECONDITIONED
    card = flatness_card_from_trainer(trainer)
    assert card.measures["top_eigenvalue"]["matrix"] == ADAM_PRECONDITIONED
    card.save(tmp_path / "card")
    assert load_flatness_card(tmp_path / "card").measures == card.measures


def test_the_callback_refuses_an_sgd_trainer_when_training_starts(tmp_path, tokenizer):  # noqa: F811
    from transformers import Trainer

    class SGDTrainer(Trainer):
        def create_optimizer(self):
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
            return self.optimizer

    callback = HessianTraceCallback(also_measure=("top_eigenvalue",), eigenvalue_matrix=ADAM_PRECONDITIONED)
    with pytest.raises(ValueError, match="SGD does not keep"):
        train_word_mlm(tmp_path, tokenizer, [callback], trainer_class=SGDTrainer)


def test_the_trace_command_refuses_the_matrix_in_one_line_before_loading(checkpoint, tmp_path, capsys):  # noqa: F811
    folder, data, _, _ = checkpoint
    arguments = ["trace", str(folder), "--data", str(data), "--output", str(tmp_path / "t.json")]
    measures = ["--measures", "trace,top_eigenvalue", "--eigenvalue-matrix", ADAM_PRECONDITIONED]
    assert main([*arguments, *measures]) == 2
    error = capsys.readouterr().err
    assert "needs the Adam state of the run" in error and "HessianTraceCallback" in error
    assert not (tmp_path / "t.json").exists()
