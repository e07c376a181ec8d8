"""Flatness beyond the trace: the largest eigenvalues and the eigenvalue density of the Hessian or the Fisher of the
pre-training loss, and the sharpness SAM minimises.

Both matrices are taken over the same contexts (one predicted position each, `TraceContexts`) and the same trainable
parameters as the trace, so ``sum(eigenvalues) == Tr`` of the matrix whose trace `estimate_hessian_trace` estimates:

- ``matrix="hessian"``: the Hessian of the mean data-label cross-entropy ``H = mean_c grad^2 -log p_c(target_c)``
  (what `hf_flatbias.flatness.exact.exact_hessian_trace` sums the diagonal of). Products ``Hv`` are a backward
  through the gradient (double backward).
- ``matrix="fisher"``: the Fisher / Gauss-Newton matrix ``F = mean_c J_c^T (diag(p_c) - p_c p_c^T) J_c``, ``J_c`` the
  Jacobian of context ``c``'s logits (the paper's measure is its trace, `exact_fisher_trace`). Products ``Fv`` take two
  passes and no double backward: ``J v`` forward-mode (`torch.func.jvp`), then ``J^T (M J v)`` one backward.
- ``matrix="adam_preconditioned"``: ``P^-1/2 H P^-1/2`` with ``P = diag(sqrt(v_hat) + eps)`` from the second moments of
  the Adam/AdamW optimizer passed in: the eigenvalues of ``P^-1 H``, which Adam's stability threshold bounds
  (`hf_flatbias.flatness.adam_preconditioner`). Its trace is not the trace's.

Eigenvalues come from Lanczos with full reorthogonalisation (`hf_flatbias.flatness.lanczos`) on these exact
products (`hf_flatbias.flatness.curvature`); the density from stochastic Lanczos quadrature (Ritz values weighted by
the squared first components of their vectors, averaged over random starts, Gaussian-smoothed). Nothing here knows
about the Trainer.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..constants import ADAM_PRECONDITIONED, DEFAULT_BATCH_SIZE, DEFAULT_SAM_RHO
from ..tensors import perturb_weights
from .adam_preconditioner import PreconditionedOperator, inverse_sqrt_preconditioner
from .contexts import TraceContexts, prepare_contexts
from .curvature import CurvatureOperator, check_matrix
from .finite_difference import finite_difference_top_eigenvalues, resolve_product
from .lanczos import lanczos, thick_restart_lanczos
from .lm import (
    evaluation_mode,
    logits_at_positions,
    measured_parameters,
    preserved_global_rng,
)
from .results import SharpnessEstimate, SpectralDensity, TopEigenvalues
from .results import gaussian_mixture as gaussian_mixture  # re-exported: the density's smoothing, as before

# ---------------------------------------------------------------------------------------------------------------------
# public entry points


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1 (got {value!r}).")


def _random_start(dimension: int, seed: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(dimension, generator=generator, dtype=torch.float64).to(device=device, dtype=dtype)


def _preconditioner(
    model: nn.Module, params: Sequence[nn.Parameter], matrix: str, optimizer: object, vector_dtype: torch.dtype
) -> torch.Tensor | None:
    """``P^-1/2`` for ``matrix="adam_preconditioned"`` (read, and refused, before any pass), ``None`` otherwise."""
    if matrix != ADAM_PRECONDITIONED:
        return None
    names = {id(p): name for name, p in model.named_parameters()}
    return inverse_sqrt_preconditioner(optimizer, params, [names[id(p)] for p in params], dtype=vector_dtype)


def _operator(
    model: nn.Module,
    contexts: TraceContexts,
    n_used: int,
    params: Sequence[nn.Parameter],
    matrix: str,
    scale: torch.Tensor | None,
    batch_size: int,
    vector_dtype: torch.dtype,
) -> CurvatureOperator | PreconditionedOperator:
    base = "hessian" if scale is not None else matrix
    operator = CurvatureOperator(
        model, contexts, n_used, params, matrix=base, batch_size=batch_size, vector_dtype=vector_dtype
    )
    return operator if scale is None else PreconditionedOperator(operator, scale.to(operator.device))


def default_max_vectors(k: int) -> int:
    """Lanczos vectors `estimate_top_eigenvalues` holds by default for the ``k`` largest eigenvalues: ``2k + 6``."""
    return 2 * k + 6


def estimate_top_eigenvalues(
    model: nn.Module,
    dataset: Iterable[Mapping[str, Any]],
    *,
    k: int = 1,
    matrix: str = "fisher",
    n_contexts: int | None = None,
    max_iterations: int = 100,
    tol: float = 1e-4,
    seed: int = 0,
    batch_size: int = DEFAULT_BATCH_SIZE,
    causal: bool | None = None,
    vector_dtype: torch.dtype = torch.float64,
    max_vectors: int | None = None,
    product: str = "auto",
    finite_difference_step: float | None = None,
    optimizer: object | None = None,
) -> TopEigenvalues:
    """The ``k`` largest eigenvalues of the Fisher or the Hessian of the pre-training loss, by Lanczos.

    Args:
        model: a masked or causal LM; the matrix is over its trainable parameters. Measured in ``eval()`` mode, every
            module's mode, the ``.grad`` fields and the global random streams left as they were.
        dataset: rows with ``input_ids``, ``attention_mask`` and ``labels`` (one context per labelled position), as
            for `estimate_hessian_trace`.
        k: how many of the largest (algebraic) eigenvalues.
        matrix: ``"fisher"`` (the matrix whose trace is the paper's measure; positive semi-definite), ``"hessian"``
            (of the data-label loss; may have negative eigenvalues) or ``"adam_preconditioned"`` (``P^-1/2 H P^-1/2``
            from ``optimizer``'s state; exact products only).
        n_contexts: use the first ``n_contexts`` contexts; all by default.
        max_iterations: matrix-vector products at most (Lanczos steps, restarts included).
        tol: stop once every one of the ``k`` values has a residual ``<= tol * |value|``: each is then within that
            relative distance of an eigenvalue.
        seed: of the random start vector.
        batch_size: contexts per forward. With all contexts in one batch its graph is kept through the run; with
            several, each product rebuilds one batch's graph at a time (one more forward per batch and product).
        causal: whether the model is a causal LM; detected by default.
        vector_dtype: of the Lanczos vectors, kept on the model's device. In float32 the values of a 0.94M-parameter
            BERT stopped at about 1e-4 relative error (true residual, `benchmarks/RESULTS.md`); float64, the default,
            reaches the products' own precision for twice the memory.
        max_vectors: Lanczos vectors held at most (`default_max_vectors` of ``k`` by default): thick restarts keep
            the basis to that size. Peak memory is the model, one batch's graph and the basis of ``max_vectors``
            vectors of ``parameters x vector_dtype`` bytes, plus about two more vectors for the product being formed
            (the sum, which becomes the next basis vector, and the forward-mode pass's copy of the tangents in the
            parameters' dtype, whose freed memory the allocator keeps for the gradients, a few parameters' at a time):
            1.9-2.4 vectors measured in runs at 110M and 341M in float32 (`benchmarks/RESULTS.md`). Fewer vectors
            cost more products.
        product: ``"exact"`` products (double backward for the Hessian, forward mode for the Fisher), on whole
            parameters in one process; ``"finite_difference"``: ``(g(w + h v) - g(w - h v)) / 2h`` (the Fisher's
            ``J v`` likewise from the logits), through the engine's own forward and backward, so it works with fused
            attention kernels and sharded: under FSDP2 and ZeRO-3 (every process must call this) the Lanczos
            vectors are sharded as the parameters are, dot products summed over processes, the contexts split over
            processes, and the whole model is never gathered; under DDP the contexts are split too. ``"auto"``
            (default): finite differences when the parameters are sharded, exact otherwise. The start vector differs
            between the two (a seeded draw per parameter for finite differences, in any layout).
        finite_difference_step: ``h`` (a step along a unit vector); default by the parameters' dtype,
            `hf_flatbias.flatness.finite_difference.FINITE_DIFFERENCE_STEPS`, chosen by measuring the error
            along the top eigenvector against the exact product (3e-4 in float32 and float64; `benchmarks/RESULTS.md`).
        optimizer: with ``matrix="adam_preconditioned"``, the torch Adam or AdamW (or accelerate's wrapper of one)
            whose bias-corrected second moments and ``eps`` give ``P``; every trainable parameter needs its state
            (after the first step). Under ZeRO-3, the engine's optimizer (it releases the gathered parameters after
            each move).

    Returns:
        A `TopEigenvalues`.
    """
    start_time = time.perf_counter()
    _check_positive_int("k", k)
    _check_positive_int("max_iterations", max_iterations)
    _check_positive_int("batch_size", batch_size)
    check_matrix(matrix)
    if not tol > 0:
        raise ValueError(f"tol must be > 0 (got {tol!r}).")
    if max_iterations < k:
        raise ValueError(f"max_iterations={max_iterations} must be at least k={k}.")
    if max_vectors is None:
        max_vectors = default_max_vectors(k)
    _check_positive_int("max_vectors", max_vectors)
    product = resolve_product(model, product, finite_difference_step)
    if matrix == ADAM_PRECONDITIONED and product != "exact":
        raise ValueError(
            f"matrix={matrix!r} takes exact products on whole parameters in one process; pass product='exact' "
            "(or 'auto' on an unsharded model), or choose matrix='hessian'."
        )
    contexts, n_used = prepare_contexts(model, dataset, n_contexts, causal)
    params = measured_parameters(model)
    scale = _preconditioner(model, params, matrix, optimizer, vector_dtype)
    dimension = sum(p.numel() for p in params)
    if k > dimension and product == "exact":  # ZeRO-3's partitioned parameters count their entries elsewhere
        raise ValueError(f"k={k} but the model has only {dimension} trainable parameters.")
    if product == "finite_difference":
        with evaluation_mode(model), preserved_global_rng():
            eigenvalues, residuals, n_matvecs, dimension = finite_difference_top_eigenvalues(
                model,
                contexts,
                n_used,
                k=k,
                matrix=matrix,
                step=finite_difference_step,
                seed=seed,
                batch_size=batch_size,
                vector_dtype=vector_dtype,
                max_vectors=max_vectors,
                max_iterations=max_iterations,
                tol=tol,
                optimizer=optimizer,
            )
        return _top_eigenvalues(eigenvalues, residuals, matrix, n_used, dimension, n_matvecs, start_time, tol, product)
    with evaluation_mode(model), preserved_global_rng():
        operator = _operator(model, contexts, n_used, params, matrix, scale, batch_size, vector_dtype)
        pairs = thick_restart_lanczos(
            operator,
            _random_start(dimension, seed, operator.dtype, operator.device),
            k,
            max_vectors=max_vectors,
            max_matvecs=max_iterations,
            tol=tol,
            rounding=operator.rounding,
        )
        residuals = [
            float(operator(vector).sub_(vector, alpha=value).norm())
            for value, vector in zip(pairs.values, pairs.vectors, strict=True)
        ]
        eigenvalues, n_matvecs = pairs.values, pairs.n_matvecs + len(residuals)
        del operator, pairs  # the kept graph and the basis
    return _top_eigenvalues(eigenvalues, residuals, matrix, n_used, dimension, n_matvecs, start_time, tol, product)


def _top_eigenvalues(
    eigenvalues: list[float],
    residuals: list[float],
    matrix: str,
    n_contexts: int,
    dimension: int,
    n_matvecs: int,
    start_time: float,
    tol: float,
    product: str,
) -> TopEigenvalues:
    return TopEigenvalues(
        eigenvalues=eigenvalues,
        residuals=residuals,
        matrix=matrix,
        n_contexts=n_contexts,
        n_parameters=dimension,
        n_matvecs=n_matvecs,
        seconds=time.perf_counter() - start_time,
        converged=all(r <= tol * max(abs(v), 1e-30) for v, r in zip(eigenvalues, residuals, strict=True)),
        product=product,
    )


def estimate_spectral_density(
    model: nn.Module,
    dataset: Iterable[Mapping[str, Any]],
    *,
    matrix: str = "fisher",
    n_steps: int = 64,
    n_runs: int = 4,
    n_contexts: int | None = None,
    seed: int = 0,
    batch_size: int = DEFAULT_BATCH_SIZE,
    causal: bool | None = None,
    vector_dtype: torch.dtype = torch.float64,
    optimizer: object | None = None,
) -> SpectralDensity:
    """The eigenvalue density of the Fisher or Hessian of the pre-training loss by stochastic Lanczos quadrature.

    Each run starts Lanczos from a random Rademacher vector and keeps ``n_steps`` Ritz values, weighted by the squared
    first components of their vectors; `SpectralDensity.smoothed` averages the runs into a smooth density.

    Args:
        matrix, n_contexts, batch_size, causal, vector_dtype, optimizer: as for `estimate_top_eigenvalues` (exact
            products).
        n_steps: Lanczos steps per run (the quadrature's nodes; it is exact for polynomials up to degree
            ``2 n_steps - 1``).
        n_runs: random starts averaged over.
        seed: run ``r`` starts from a vector drawn with seed ``seed + r``.

    Returns:
        A `SpectralDensity`.
    """
    start_time = time.perf_counter()
    _check_positive_int("n_steps", n_steps)
    _check_positive_int("n_runs", n_runs)
    _check_positive_int("batch_size", batch_size)
    check_matrix(matrix)
    contexts, n_used = prepare_contexts(model, dataset, n_contexts, causal)
    params = measured_parameters(model)
    scale = _preconditioner(model, params, matrix, optimizer, vector_dtype)
    nodes, weights = [], []
    with evaluation_mode(model), preserved_global_rng():
        operator = _operator(model, contexts, n_used, params, matrix, scale, batch_size, vector_dtype)
        for run_index in range(n_runs):
            generator = torch.Generator().manual_seed(seed + run_index)
            signs = torch.randint(0, 2, (operator.dimension,), generator=generator).mul_(2).sub_(1)
            start = signs.to(device=operator.device, dtype=operator.dtype)
            run = lanczos(operator, start, n_steps, rounding=operator.rounding)
            values, vectors = run.ritz()
            nodes.append(values.tolist())
            weights.append(vectors[0].square().tolist())
        n_matvecs = operator.n_matvecs
        dimension = operator.dimension
        del operator
    return SpectralDensity(
        nodes=nodes,
        weights=weights,
        matrix=matrix,
        n_contexts=n_used,
        n_parameters=dimension,
        n_matvecs=n_matvecs,
        seconds=time.perf_counter() - start_time,
    )


def estimate_sam_sharpness(
    model: nn.Module,
    dataset: Iterable[Mapping[str, Any]],
    rho: float = DEFAULT_SAM_RHO,
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    adaptive: bool = False,
    eta: float = 0.01,
    n_contexts: int | None = None,
    causal: bool | None = None,
) -> SharpnessEstimate:
    """SAM's sharpness of the pre-training loss: ``L_b(w + e_b) - L_b(w)`` with ``e_b = rho g_b / ||g_b||`` the
    normalised ascent step of batch ``b`` (ASAM's with ``adaptive=True``), averaged over batches.

    Each batch of ``batch_size`` consecutive contexts takes its own step, as SAM does per (micro-)batch in training;
    ``L_b`` is the mean data-label cross-entropy over its contexts. The step is `perturb_weights`' (the trainer's), and
    the weights are restored bit for bit after each batch. A batch with a zero or non-finite gradient counts as 0.

    Args:
        rho: the neighbourhood radius (`FlatBiasConfig.sam_rho`).
        batch_size: contexts per batch (the training batch size to measure what SAM saw).
        adaptive, eta: ASAM's neighbourhood ``|w| + eta``.
        n_contexts, causal: as for `estimate_top_eigenvalues`.

    Returns:
        A `SharpnessEstimate` with the standard error over batches.
    """
    start_time = time.perf_counter()
    _check_positive_int("batch_size", batch_size)
    if not (isinstance(rho, (int, float)) and math.isfinite(rho) and rho > 0):
        raise ValueError(f"rho must be a finite number > 0 (got {rho!r}).")
    contexts, n_used = prepare_contexts(model, dataset, n_contexts, causal)
    params = measured_parameters(model)
    values = []
    with evaluation_mode(model), preserved_global_rng():
        for start in range(0, n_used, batch_size):
            indices = list(range(start, min(start + batch_size, n_used)))
            with torch.enable_grad():
                loss = _data_label_loss(model, contexts, indices)
                grads = [
                    torch.zeros_like(p) if g is None else g
                    for p, g in zip(params, torch.autograd.grad(loss, params, allow_unused=True), strict=True)
                ]
            perturbation = perturb_weights(params, grads, rho, adaptive=adaptive, eta=eta)
            if perturbation is None:
                values.append(0.0)
                continue
            try:
                with torch.no_grad():
                    perturbed = _data_label_loss(model, contexts, indices)
            finally:
                perturbation.restore()
            values.append(float(perturbed.double() - loss.detach().double()))
    per_batch = torch.tensor(values, dtype=torch.float64)
    stderr = float(per_batch.std() / math.sqrt(len(values))) if len(values) > 1 else float("nan")
    return SharpnessEstimate(
        mean=float(per_batch.mean()),
        stderr=stderr,
        rho=float(rho),
        adaptive=adaptive,
        batch_size=batch_size,
        n_contexts=n_used,
        seconds=time.perf_counter() - start_time,
        per_batch=values,
    )


def _data_label_loss(model: nn.Module, contexts: TraceContexts, indices: Sequence[int]) -> torch.Tensor:
    batch = contexts.model_inputs(indices, model)
    positions = torch.tensor([contexts.positions[i] for i in indices], device=batch["input_ids"].device)
    targets = torch.tensor([contexts.targets[i] for i in indices], device=positions.device)
    logits = logits_at_positions(model, batch, positions)[:, 0]
    return torch.nn.functional.cross_entropy(logits.float(), targets)
