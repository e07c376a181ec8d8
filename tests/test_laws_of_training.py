"""Laws of training as tests (issue 56): what the curvature estimators must read on a model that is actually trained,
in float64 on tiny models built from configs.

- Edge of Stability (Cohen et al., arXiv 2103.00065): under full-batch gradient descent at step ``eta`` the top Hessian
  eigenvalue rises or falls to ``2 / eta`` and stays there.
- Adaptive Edge of Stability (Cohen et al., arXiv 2207.14484): under full-batch Adam the top eigenvalue of ``P^-1 H``
  rises to ``(2 + 2 beta1) / ((1 - beta1) eta)``, 38/eta at beta1 = 0.9, where training turns unstable.
- Critical sharpness (Kalra et al., arXiv 2601.16979) along the negative gradient is the gradient's Rayleigh quotient
  up to the cubic term, so at most the top eigenvalue.
- The Hessian of the cross-entropy of a linear output layer has a closed form.

The training loss is the measured one, the mean data-label cross-entropy over the contexts (one predicted position
each), computed here in float64: transformers' own ``model(**batch).loss`` casts a float64 model's logits to float32.
Attention is eager (the fused kernels have no double backward).
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_flatbias.flatness.contexts import TraceContexts, build_masked_contexts
from hf_flatbias.flatness.critical_sharpness import estimate_critical_sharpness
from hf_flatbias.flatness.curvature import CurvatureOperator
from hf_flatbias.flatness.lm import logits_at_positions, measured_parameters
from hf_flatbias.flatness.spectrum import estimate_top_eigenvalues
from tests.helpers.tiny_models import TINY_DECODER

N_CONTEXTS = 32


class Problem:
    """A tiny float64 Llama (`TINY_DECODER`, 1,256 parameters) and 32 causal contexts of random tokens: more than
    it fits in a few hundred steps, so the loss stays well above 0 and the curvature keeps meeting the step size."""

    def __init__(self, n_contexts: int = N_CONTEXTS) -> None:
        torch.manual_seed(0)
        config = LlamaConfig(**TINY_DECODER, attn_implementation="eager")
        self.model = LlamaForCausalLM(config).double()
        generator = torch.Generator().manual_seed(1)
        texts = [{"input_ids": torch.randint(2, 16, (6,), generator=generator).tolist()} for _ in range(n_contexts)]
        self.rows = build_masked_contexts(texts, mask_token_id=None, causal=True, seed=0)
        contexts = TraceContexts.from_rows(self.rows, causal=True)
        self.batch = contexts.model_inputs(list(range(len(contexts))), self.model)
        self.positions = torch.tensor(contexts.positions)
        self.targets = torch.tensor(contexts.targets)
        self.params = measured_parameters(self.model)

    def loss(self, model: torch.nn.Module | None = None) -> torch.Tensor:
        logits = logits_at_positions(model or self.model, self.batch, self.positions)[:, 0]
        return torch.nn.functional.cross_entropy(logits, self.targets)

    def gradient(self) -> list[torch.Tensor]:
        return list(torch.autograd.grad(self.loss(), self.params))

    def gradient_step(self, eta: float) -> None:
        gradient = self.gradient()
        with torch.no_grad():
            for param, grad in zip(self.params, gradient, strict=True):
                param.sub_(grad, alpha=eta)

    def top_eigenvalue(self, **options) -> float:
        return estimate_top_eigenvalues(self.model, self.rows, k=1, max_iterations=80, **options).top


@pytest.mark.parametrize("eta", [0.25, 0.5])
def test_gradient_descent_settles_at_the_edge_of_stability(eta):
    """From 31.7 at initialisation (4-8x the threshold) the top Hessian eigenvalue falls to 2/eta and stays there.
    Measured at steps 160, 180, 200: 0.995-0.999 x 2/eta at eta 0.25, 0.961-0.969 at eta 0.5 (with 64 contexts it
    settles above instead: 1.07-1.17 and 1.06-1.12, as the 1.11-1.13 of NOTES.md). The band [0.9, 1.2] is the issue's;
    two step sizes a factor 2 apart make a reading that ignores eta fail one of them."""
    problem = Problem()
    threshold = 2 / eta
    assert problem.top_eigenvalue(matrix="hessian", tol=1e-4) > 2 * threshold
    late = []
    for step in range(1, 201):
        problem.gradient_step(eta)
        if step in (160, 180, 200):
            late.append(problem.top_eigenvalue(matrix="hessian", tol=1e-4))
    ratios = [value / threshold for value in late]
    assert all(0.9 <= ratio <= 1.2 for ratio in ratios), ratios


def test_full_batch_adam_rises_to_the_adaptive_edge_of_stability():
    """Adam at lr 0.03, betas (0.9, 0.999), full batch: the top eigenvalue of P^-1 H climbs steadily (0.63 x 38/lr at
    step 150), peaks, the loss spikes and the eigenvalue collapses (0.4 x by step 280); training then climbs again.
    Measured every 10 steps from 150 to 290: peak 1.078 x 38/lr at step 250, loss spike at 260, 0.39-0.50 after.
    The law is the peak, where stability is lost, so the band is on the largest reading, [0.9, 1.2]: the peak is
    sampled every 10 steps on a climb of about 4.5% of 38/lr per 10 steps, and lr 0.01 peaked at 0.96 and 1.07 of it
    (beta2 0.999 and 0.99, sampled every 100 steps). The tiny LM settles in a few seconds; no MLP stand-in needed."""
    problem = Problem()
    lr, beta1 = 0.03, 0.9
    threshold = (2 + 2 * beta1) / ((1 - beta1) * lr)
    optimizer = torch.optim.Adam(problem.params, lr=lr, betas=(beta1, 0.999))
    readings, losses = {}, {}
    for step in range(1, 291):
        optimizer.zero_grad()
        loss = problem.loss()
        loss.backward()
        optimizer.step()
        losses[step] = loss.item()
        if step >= 150 and step % 10 == 0:
            readings[step] = problem.top_eigenvalue(matrix="adam_preconditioned", optimizer=optimizer, tol=1e-4)
    peak_step = max(readings, key=readings.get)
    assert 0.9 <= readings[peak_step] / threshold <= 1.2, readings
    assert readings[150] < 0.8 * threshold  # it climbed to the edge, not started there
    assert max(losses[s] for s in range(peak_step, 291)) > 1.02 * losses[peak_step]  # instability at the edge
    assert readings[290] < 0.7 * threshold  # and the collapse after it


def test_critical_sharpness_along_gradient_steps_is_at_most_the_top_eigenvalue():
    """Along -g the loss rises back to L0 at eta_c = 2 g'g / g'Hg up to the cubic term, so lambda_c = 2 / eta_c is
    the gradient's Rayleigh quotient, at most lambda_max. Every 20 steps of gradient descent at eta 0.05 (200 steps):
    lambda_c / lambda_max from 0.01 at initialisation to 0.77 at most. At eta 0.25 the same holds up to the edge of
    stability (0.99); at eta 0.5 (same model and contexts) lambda_c sits at 2/eta while lambda_max settles below it,
    1.02-1.07 x lambda_max (1.18 once, at the step the edge is reached): there the line's cubic term is not small,
    and the bound is quadratic."""
    problem = Problem()
    eta = 0.05
    for step in range(201):
        if step % 20 == 0:
            top = problem.top_eigenvalue(matrix="hessian", tol=1e-6)
            update = [-eta * grad for grad in problem.gradient()]
            critical = estimate_critical_sharpness(
                problem.model, problem.loss, update, learning_rate=eta, rtol=1e-4, max_forward_passes=40
            )
            assert critical.converged and critical.lambda_c <= top, (step, critical.lambda_c, top)
        problem.gradient_step(eta)


def test_the_hessian_of_an_output_layer_is_its_closed_form():
    """With only the output layer W trainable (logits = W h_n, h_n the final hidden state, fixed), the Hessian of the
    mean cross-entropy over vec(W) (row-major) is (1/N) sum_n (diag p_n - p_n p_n^T) kron h_n h_n^T. Compared to the
    dense autograd Hessian and to the columns of `CurvatureOperator`'s Hessian product (the package's), to 1e-10;
    and the top eigenvalue by Lanczos to the closed form's."""
    problem = Problem(n_contexts=8)
    model = problem.model
    model.requires_grad_(False)
    model.lm_head.weight.requires_grad_(True)
    with torch.no_grad():
        hidden = model.model(**problem.batch).last_hidden_state
        h = hidden[torch.arange(len(problem.positions)), problem.positions]  # (N, d)
        p = torch.softmax(model.lm_head(h), dim=-1)  # (N, V)
    covariances = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    closed_form = torch.stack([torch.kron(c, torch.outer(x, x)) for c, x in zip(covariances, h, strict=True)]).mean(
        dim=0
    )

    weight = model.lm_head.weight

    def loss_of(flat: torch.Tensor) -> torch.Tensor:
        logits = h @ flat.reshape(weight.shape).T
        return torch.nn.functional.cross_entropy(logits, problem.targets)

    dense = torch.autograd.functional.hessian(loss_of, weight.detach().reshape(-1).clone())
    assert torch.allclose(dense, closed_form, rtol=0, atol=1e-10 * closed_form.abs().max())

    operator = CurvatureOperator(
        model, TraceContexts.from_rows(problem.rows, causal=True), 8, [weight], matrix="hessian", batch_size=8
    )
    columns = torch.stack([operator(e) for e in torch.eye(weight.numel(), dtype=torch.float64)], dim=1)
    assert torch.allclose(columns, closed_form, rtol=0, atol=1e-10 * closed_form.abs().max())

    top = estimate_top_eigenvalues(model, problem.rows, k=1, matrix="hessian", tol=1e-10, max_iterations=200).top
    assert top == pytest.approx(torch.linalg.eigvalsh(closed_form)[-1].item(), rel=1e-10)
