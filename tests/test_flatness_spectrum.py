"""Top eigenvalues, spectral density and SAM sharpness against exact matrices and direct computations built here with
`torch.func` on the stock forward (logits at every position), in float64, independent of the estimators' products."""

import copy
import math

import pytest
import torch
from torch.func import functional_call, jacrev

from hf_flatbias.constants import IGNORE_INDEX
from hf_flatbias.flatness.exact import exact_fisher_trace
from hf_flatbias.flatness.spectrum import (
    estimate_sam_sharpness,
    estimate_spectral_density,
    estimate_top_eigenvalues,
    gaussian_mixture,
)
from tests.test_flatness_estimators import _contexts, _tiny_bert, _tiny_gpt2

N_CONTEXTS = 6


def _labelled(row, causal):
    """(input ids, position whose logits predict, target) of a one-label row, read with the stock conventions."""
    (t,) = [i for i, label in enumerate(row["labels"]) if label != IGNORE_INDEX]
    return torch.tensor([row["input_ids"]]), t - 1 if causal else t, row["labels"][t]


def _exact_matrices(model, rows, causal):
    """The Hessian of the mean data-label loss and the Fisher mean_c J_c^T (diag p - p p^T) J_c over the trainable
    parameters, as dense float64 matrices."""
    model = copy.deepcopy(model).double()
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    names = [name for name, _ in trainable]
    shapes = [p.shape for _, p in trainable]
    flat = torch.cat([p.detach().reshape(-1) for _, p in trainable])

    def logits_of(vector, ids, position):
        pieces = torch.split(vector, [math.prod(s) for s in shapes])
        values = {name: piece.reshape(shape) for name, piece, shape in zip(names, pieces, shapes, strict=True)}
        return functional_call(model, values, (ids,)).logits[0, position]

    contexts = [_labelled(row, causal) for row in rows]

    def loss(vector):
        return torch.stack(
            [-torch.log_softmax(logits_of(vector, ids, t), -1)[target] for ids, t, target in contexts]
        ).mean()

    # one plain double backward per row: torch.func's vmapped Hessians (jacfwd or jacrev over jacrev) gave cross
    # terms of the LayerNorm weights off by up to 0.17 on this model (torch 2.13), against central differences
    variable = flat.clone().requires_grad_(True)
    (gradient,) = torch.autograd.grad(loss(variable), variable, create_graph=True)
    exact_hessian = torch.stack(
        [torch.autograd.grad(gradient[i], variable, retain_graph=True)[0] for i in range(len(flat))]
    )
    fisher = torch.zeros_like(exact_hessian)
    for ids, t, _ in contexts:
        jacobian = jacrev(logits_of)(flat, ids, t)
        p = torch.softmax(logits_of(flat, ids, t), -1).detach()
        fisher += jacobian.T @ (torch.diag(p) - torch.outer(p, p)) @ jacobian
    fisher /= len(contexts)
    return {"hessian": (exact_hessian + exact_hessian.T) / 2, "fisher": (fisher + fisher.T) / 2}


def _small_bert():
    return _tiny_bert(hidden_size=4, intermediate_size=8)


def _small_gpt2():
    return _tiny_gpt2(n_embd=4)


def _partly_frozen_bert():
    # only the trainable parameters span the matrix, as for the trace
    model = _small_bert()
    model.bert.embeddings.requires_grad_(False)
    model.cls.predictions.bias.requires_grad_(False)
    return model


MODELS = {"bert": (_small_bert, False), "gpt2": (_small_gpt2, True), "bert-partly-frozen": (_partly_frozen_bert, False)}


def _model(name):
    make, causal = MODELS[name]
    return make(), causal


@pytest.fixture(scope="module")
def exact_spectra():
    cache = {}

    def get(name):
        if name not in cache:
            model, causal = _model(name)
            rows = _contexts(N_CONTEXTS, causal=causal)
            cache[name] = (model, rows, causal, _exact_matrices(model, rows, causal))
        return cache[name]

    return get


@pytest.mark.parametrize("matrix", ["fisher", "hessian"])
@pytest.mark.parametrize("name", list(MODELS))
def test_top_eigenvalues_match_the_full_eigendecomposition(exact_spectra, name, matrix):
    model, rows, _, matrices = exact_spectra(name)
    exact = torch.linalg.eigvalsh(matrices[matrix]).flip(0)
    result = estimate_top_eigenvalues(model, rows, k=3, matrix=matrix, batch_size=4, tol=1e-5)
    assert result.n_parameters == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert result.n_parameters == matrices[matrix].shape[0]
    assert result.eigenvalues == pytest.approx(exact[:3].tolist(), rel=1e-4)
    # the reported residuals are those of the returned values on the exact matrix's scale
    assert result.converged and max(result.residuals) <= 1e-5 * abs(result.top)
    assert result.n_matvecs <= 100 + 3


def test_fisher_reference_is_the_trace_the_paper_measures(exact_spectra):
    # ties the exact Fisher used above to the project's trace: the sum of its eigenvalues is exact_fisher_trace
    model, rows, _, matrices = exact_spectra("bert")
    assert float(torch.trace(matrices["fisher"])) == pytest.approx(exact_fisher_trace(model, rows), rel=1e-6)


def test_measuring_leaves_the_model_as_it_was():
    model = _tiny_bert().train()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    rows = _contexts(4)
    rng = torch.random.get_rng_state()
    estimate_top_eigenvalues(model, rows, matrix="fisher")
    estimate_top_eigenvalues(model, rows, matrix="hessian")
    estimate_spectral_density(model, rows, n_steps=4, n_runs=1)
    estimate_sam_sharpness(model, rows, 0.1, batch_size=2)
    assert model.training and all(m.training for m in model.modules())
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.random.get_rng_state(), rng)


@pytest.mark.parametrize("matrix", ["fisher", "hessian"])
def test_spectral_density_is_close_to_the_exact_spectrum(exact_spectra, matrix):
    model, rows, _, matrices = exact_spectra("bert")
    exact = torch.linalg.eigvalsh(matrices[matrix])
    density = estimate_spectral_density(model, rows, matrix=matrix, n_steps=30, n_runs=4, batch_size=4)
    assert density.n_matvecs <= 4 * 30 and len(density.nodes) == 4
    assert all(sum(w) == pytest.approx(1.0, abs=1e-9) for w in density.weights)
    sigma = 0.02 * float(exact.max() - exact.min())
    grid = torch.linspace(float(exact.min()) - 5 * sigma, float(exact.max()) + 5 * sigma, 2000)
    _, estimated = density.smoothed(grid, sigma=sigma)
    reference = gaussian_mixture(grid, exact, torch.full_like(exact, 1 / len(exact)), sigma)
    step = float(grid[1] - grid[0])
    assert float(estimated.sum()) * step == pytest.approx(1.0, abs=1e-3)
    assert float(reference.sum()) * step == pytest.approx(1.0, abs=1e-3)
    # L1 distance between the two smoothed densities (at most 2); measured 0.013 (Fisher) and 0.014 (Hessian)
    distance = float((estimated - reference).abs().sum()) * step
    assert distance < DENSITY_L1_TOLERANCE


DENSITY_L1_TOLERANCE = 0.05


def _direct_sharpness(model, rows, rho, batch_size, causal=False):
    """L_b(w + rho g/||g||) - L_b(w) per batch, by hand on a copy: stock forward, plain backward, in-place step."""
    model = copy.deepcopy(model).eval()
    params = [p for p in model.parameters() if p.requires_grad]
    contexts = [_labelled(row, causal) for row in rows]

    def loss():
        return torch.stack(
            [
                torch.nn.functional.cross_entropy(model(input_ids=ids).logits[0, t : t + 1], torch.tensor([target]))
                for ids, t, target in batch
            ]
        ).mean()

    values = []
    for start in range(0, len(contexts), batch_size):
        batch = contexts[start : start + batch_size]
        saved = [p.detach().clone() for p in params]
        base = loss()
        grads = torch.autograd.grad(base, params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                p.add_(g * (rho / float(norm)))
            values.append(float(loss()) - float(base))
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)
    return values


@pytest.mark.parametrize("causal", [False, True])
def test_sam_sharpness_equals_a_direct_computation(causal):
    model = _tiny_gpt2() if causal else _tiny_bert()
    rows = _contexts(7, causal=causal)
    estimate = estimate_sam_sharpness(model, rows, 0.05, batch_size=3)
    direct = _direct_sharpness(model, rows, 0.05, 3, causal=causal)
    assert len(estimate.per_batch) == 3
    assert estimate.per_batch == pytest.approx(direct, rel=1e-4, abs=1e-6)
    assert estimate.mean == pytest.approx(sum(direct) / 3, rel=1e-4)
    spread = torch.tensor(direct, dtype=torch.float64).std().item() / math.sqrt(3)
    assert estimate.stderr == pytest.approx(spread, rel=1e-3)
    assert estimate.n_contexts == 7 and estimate.rho == 0.05


def test_bad_arguments_are_refused_before_any_compute():
    model, rows = _tiny_bert(), _contexts(3)
    with pytest.raises(ValueError, match="matrix='gauss'"):
        estimate_top_eigenvalues(model, rows, matrix="gauss")
    with pytest.raises(ValueError, match="k=5000"):
        estimate_top_eigenvalues(model, rows, k=5000, max_iterations=6000)
    with pytest.raises(ValueError, match="rho must be"):
        estimate_sam_sharpness(model, rows, 0.0)
    with pytest.raises(ValueError, match="n_contexts=9"):
        estimate_spectral_density(model, rows, n_contexts=9)
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad"):
        estimate_top_eigenvalues(model, rows)


def test_thick_restart_lanczos_restarts_to_the_exact_top_eigenvalues_with_default_rounding():
    """A basis far smaller than the matrix forces restarts; ``rounding`` left to the vectors' dtype."""
    from hf_flatbias.flatness.lanczos import thick_restart_lanczos

    generator = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(60, 60, dtype=torch.float64, generator=generator))
    matrix = q @ torch.diag(1.0 / torch.arange(1, 61, dtype=torch.float64) ** 2) @ q.T
    start = torch.randn(60, dtype=torch.float64, generator=generator)
    pairs = thick_restart_lanczos(lambda v: matrix @ v, start, k=3, max_vectors=9, tol=1e-10, max_matvecs=2000)
    exact = torch.linalg.eigvalsh(matrix).flip(0)[:3]
    assert torch.allclose(torch.as_tensor(pairs.values, dtype=torch.float64), exact, rtol=1e-8)


@pytest.mark.parametrize("matrix", ["fisher", "hessian"])
def test_gradients_already_on_the_model_neither_leak_into_the_products_nor_are_lost(exact_spectra, matrix):
    """The products accumulate into each parameter's ``.grad`` field and free it as the backward goes (so that no
    second full vector of gradients is held): whatever was there before must not enter the product and must be back
    afterwards, the same tensor with the same values."""
    model, rows, _, matrices = exact_spectra("bert")
    exact = torch.linalg.eigvalsh(matrices[matrix]).flip(0)
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    before = {name: (p.grad, p.grad.clone()) for name, p in model.named_parameters()}
    try:
        result = estimate_top_eigenvalues(model, rows, k=3, matrix=matrix, batch_size=3, tol=1e-5)
        assert all(p.grad is before[name][0] for name, p in model.named_parameters())
        assert all(torch.equal(p.grad, before[name][1]) for name, p in model.named_parameters())
    finally:
        for p in model.parameters():
            p.grad = None
    assert result.eigenvalues == pytest.approx(exact[:3].tolist(), rel=1e-4)


@pytest.mark.parametrize("matrix", ["fisher", "hessian"])
@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_float32_vectors_and_a_small_basis_keep_the_top_three_within_1e4(exact_spectra, name, matrix):
    """The setting `benchmarks/lanczos_memory.py` measures at 341M (float32 vectors, a basis of 5 for k=3: restarts)
    keeps the precision the full basis has on the tiny models."""
    model, rows, _, matrices = exact_spectra(name)
    exact = torch.linalg.eigvalsh(matrices[matrix]).flip(0)
    result = estimate_top_eigenvalues(
        model, rows, k=3, matrix=matrix, batch_size=4, tol=1e-5, vector_dtype=torch.float32, max_vectors=5,
        max_iterations=400,
    )  # fmt: skip
    assert result.eigenvalues == pytest.approx(exact[:3].tolist(), rel=1e-4)
