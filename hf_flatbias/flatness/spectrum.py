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

Eigenvalues come from Lanczos with full reorthogonalisation on these exact products; the density from stochastic
Lanczos quadrature (Ritz values weighted by the squared first components of their vectors, averaged over random
starts, Gaussian-smoothed). Nothing here knows about the Trainer.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..constants import DEFAULT_BATCH_SIZE, SPECTRUM_MATRICES
from ..tensors import perturb_weights
from .contexts import TraceContexts
from .lm import (
    check_lm_model,
    evaluation_mode,
    is_causal_lm,
    logits_at_positions,
    measured_parameters,
    preserved_global_rng,
)

MATRICES = SPECTRUM_MATRICES


# ---------------------------------------------------------------------------------------------------------------------
# results


@dataclass
class TopEigenvalues:
    """The largest eigenvalues of the Hessian or Fisher of the pre-training loss.

    Attributes:
        eigenvalues: the ``k`` largest (algebraic) Ritz values, largest first.
        residuals: ``||A x - lambda x||`` of each one's unit Ritz vector ``x``, computed with one more product each.
            For a symmetric matrix some eigenvalue lies within the residual of each value.
        matrix: ``"fisher"`` or ``"hessian"``.
        n_contexts: contexts the matrix averages over.
        n_parameters: the dimension (trainable parameters).
        n_matvecs: matrix-vector products spent (Lanczos steps plus the ``k`` residual checks).
        seconds: wall-clock time.
        converged: whether every residual reached ``tol * |eigenvalue|`` within ``max_iterations``.
    """

    eigenvalues: list[float]
    residuals: list[float]
    matrix: str
    n_contexts: int
    n_parameters: int
    n_matvecs: int
    seconds: float
    converged: bool

    @property
    def top(self) -> float:
        return self.eigenvalues[0]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SpectralDensity:
    """Stochastic Lanczos quadrature of the eigenvalue density, normalised to integrate to 1 (multiply by
    ``n_parameters`` for eigenvalue counts).

    ``nodes[r]`` and ``weights[r]`` are run ``r``'s Ritz values and the squared first components of their vectors
    (each run's weights sum to 1): the quadrature of ``q^T g(A) q`` for its random unit start ``q``.
    """

    nodes: list[list[float]]
    weights: list[list[float]]
    matrix: str
    n_contexts: int
    n_parameters: int
    n_matvecs: int
    seconds: float

    def smoothed(
        self, grid: torch.Tensor | Sequence[float] | None = None, *, sigma: float | None = None, n_points: int = 512
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(grid, density)``: the Ritz values of every run, each a Gaussian of width ``sigma`` weighted by its
        weight, averaged over runs. ``sigma`` defaults to 1% of the span of the nodes; the default grid spans the
        nodes with ``5 sigma`` on each side."""
        nodes = torch.tensor([x for run in self.nodes for x in run], dtype=torch.float64)
        weights = torch.tensor([w for run in self.weights for w in run], dtype=torch.float64) / len(self.nodes)
        span = float(nodes.max() - nodes.min())
        if sigma is None:
            sigma = 0.01 * span if span > 0 else 1e-3 * max(1.0, float(nodes.abs().max()))
        if sigma <= 0:
            raise ValueError(f"sigma must be > 0 (got {sigma}).")
        if grid is None:
            grid = torch.linspace(float(nodes.min()) - 5 * sigma, float(nodes.max()) + 5 * sigma, n_points)
        grid = torch.as_tensor(grid, dtype=torch.float64)
        return grid, gaussian_mixture(grid, nodes, weights, sigma)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SharpnessEstimate:
    """SAM's sharpness ``L(w + rho g/||g||) - L(w)`` of the pre-training loss, per batch, averaged over batches.

    Attributes:
        mean: the mean over batches.
        stderr: its standard error over batches (``nan`` with one batch).
        rho: the neighbourhood radius.
        adaptive: ASAM's scale-invariant neighbourhood instead of SAM's.
        batch_size: contexts per batch (each batch takes its own ascent step, as in training).
        n_contexts: contexts used.
        seconds: wall-clock time.
        per_batch: the sharpness of each batch.
    """

    mean: float
    stderr: float
    rho: float
    adaptive: bool
    batch_size: int
    n_contexts: int
    seconds: float
    per_batch: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def gaussian_mixture(grid: torch.Tensor, nodes: torch.Tensor, weights: torch.Tensor, sigma: float) -> torch.Tensor:
    """``sum_j weights_j N(grid; nodes_j, sigma^2)``: a weighted set of eigenvalues as a smooth density."""
    z = (grid.reshape(-1, 1) - nodes.reshape(1, -1)) / sigma
    return (torch.exp(-0.5 * z.square()) * weights.reshape(1, -1)).sum(dim=1) / (sigma * math.sqrt(2 * math.pi))


# ---------------------------------------------------------------------------------------------------------------------
# exact matrix-vector products


class _LogitsAtPositions(nn.Module):
    """The model's logits at the predicted positions as a module, so `torch.func` can call it on other parameters."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: Mapping[str, torch.Tensor], positions: torch.Tensor) -> torch.Tensor:
        return logits_at_positions(self.model, batch, positions)[:, 0]


class CurvatureOperator:
    """``v -> A v`` for the Hessian or Fisher of the mean pre-training loss over the first ``n_contexts`` contexts, on
    flat vectors over ``params``. The graphs of every batch are kept between products (one forward per batch)."""

    def __init__(
        self,
        model: nn.Module,
        contexts: TraceContexts,
        n_contexts: int,
        params: Sequence[nn.Parameter],
        *,
        matrix: str,
        batch_size: int,
        vector_dtype: torch.dtype = torch.float64,
    ) -> None:
        _check_matrix(matrix)
        self.matrix = matrix
        self.params = list(params)
        self.dtype = vector_dtype
        # the products are only as exact as the parameters' dtype, whatever the vectors' dtype
        self.rounding = max(torch.finfo(p.dtype).eps for p in self.params)
        self.device = self.params[0].device
        self.dimension = sum(p.numel() for p in self.params)
        self.n_matvecs = 0
        n = n_contexts
        self._batches: list[dict[str, Any]] = []
        names = {id(p): name for name, p in model.named_parameters()}
        self._names = [f"model.{names[id(p)]}" for p in self.params]
        self._function = _LogitsAtPositions(model)
        for start in range(0, n, batch_size):
            indices = list(range(start, min(start + batch_size, n)))
            batch = contexts.model_inputs(indices, model)
            positions = torch.tensor([contexts.positions[i] for i in indices], device=batch["input_ids"].device)
            targets = torch.tensor([contexts.targets[i] for i in indices], device=positions.device)
            # the fused attention kernels have neither a double backward nor forward-mode derivatives
            with torch.enable_grad(), sdpa_kernel(SDPBackend.MATH):
                logits = self._function(batch, positions)
                if matrix == "hessian":
                    loss = torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum") / n
                    grads = torch.autograd.grad(loss, self.params, create_graph=True, allow_unused=True)
                    used = _used(grads)
                    self._batches.append({"grads": [grads[i] for i in used], "used": used})
                else:
                    probs = torch.softmax(logits.detach().double(), dim=-1)
                    self._batches.append({"batch": batch, "positions": positions, "logits": logits, "probs": probs})
        self._n = n

    def _unflatten(self, vector: torch.Tensor) -> list[torch.Tensor]:
        pieces, offset = [], 0
        for p in self.params:
            pieces.append(vector[offset : offset + p.numel()].reshape(p.shape).to(p.dtype))
            offset += p.numel()
        return pieces

    def _flatten(self, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
        return torch.cat(
            [
                (torch.zeros(p.numel(), dtype=self.dtype, device=self.device) if t is None else t.reshape(-1)).to(
                    self.dtype
                )
                for p, t in zip(self.params, tensors, strict=True)
            ]
        )

    def __call__(self, vector: torch.Tensor) -> torch.Tensor:
        self.n_matvecs += 1
        tangents = self._unflatten(vector)
        total = torch.zeros(self.dimension, dtype=self.dtype, device=self.device)
        for part in self._batches:
            if self.matrix == "hessian":
                used = part["used"]
                if not used:
                    continue
                products = torch.autograd.grad(
                    part["grads"],
                    self.params,
                    grad_outputs=[tangents[i] for i in used],
                    retain_graph=True,
                    allow_unused=True,
                )
            else:
                products = self._fisher_product(part, tangents)
            total += self._flatten(products)
        return total

    def _fisher_product(self, part: dict[str, Any], tangents: list[torch.Tensor]) -> Sequence[torch.Tensor | None]:
        primals = {name: p.detach() for name, p in zip(self._names, self.params, strict=True)}
        directions = dict(zip(self._names, tangents, strict=True))

        def logits_of(values: dict[str, torch.Tensor]) -> torch.Tensor:
            return torch.func.functional_call(self._function, values, (part["batch"], part["positions"]))

        with sdpa_kernel(SDPBackend.MATH):
            _, jv = torch.func.jvp(logits_of, (primals,), (directions,))
        probs = part["probs"]
        jv = jv.double()
        # (diag(p) - p p^T) J v, averaged over all contexts
        weighted = (probs * jv - probs * (probs * jv).sum(dim=-1, keepdim=True)) / self._n
        logits = part["logits"]
        return torch.autograd.grad(
            logits, self.params, grad_outputs=weighted.to(logits.dtype), retain_graph=True, allow_unused=True
        )


def _used(grads: Sequence[torch.Tensor | None]) -> list[int]:
    # a gradient that does not depend on the parameters (or is absent) has no second derivative to take
    return [i for i, g in enumerate(grads) if g is not None and g.requires_grad]


# ---------------------------------------------------------------------------------------------------------------------
# Lanczos


@dataclass
class LanczosRun:
    """``n`` steps of Lanczos: ``A Q = Q T + beta q e_n^T`` with ``T = tridiag(betas, alphas, betas)``."""

    alphas: list[float]
    betas: list[float]
    basis: torch.Tensor  # (n, dimension), orthonormal rows
    residual_norm: float  # the norm of the next (unnormalised) Lanczos vector

    def ritz(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Ritz values (ascending) and the eigenvectors of ``T`` (columns), in float64."""
        n = len(self.alphas)
        tridiagonal = torch.diag(torch.tensor(self.alphas, dtype=torch.float64))
        if n > 1:
            off = torch.tensor(self.betas[: n - 1], dtype=torch.float64)
            tridiagonal += torch.diag(off, 1) + torch.diag(off, -1)
        return torch.linalg.eigh(tridiagonal)


def lanczos(
    matvec: Callable[[torch.Tensor], torch.Tensor],
    start: torch.Tensor,
    n_steps: int,
    *,
    stop: Callable[[LanczosRun], bool] | None = None,
    rounding: float | None = None,
) -> LanczosRun:
    """Lanczos with full reorthogonalisation (twice, which keeps the basis orthonormal to working precision).

    Stops after ``n_steps``, at an invariant subspace (the next vector vanishes to within ``1000 x rounding`` of the
    matrix's scale; ``rounding``, the products' unit rounding, defaults to that of ``start``'s dtype), or when
    ``stop(run)`` says so.
    """
    dimension = start.numel()
    n_steps = min(n_steps, dimension)
    basis = torch.zeros(n_steps, dimension, dtype=start.dtype, device=start.device)
    q = start / start.norm()
    alphas: list[float] = []
    betas: list[float] = []
    residual_norm = 0.0
    invariant_tolerance = 1e3 * (torch.finfo(start.dtype).eps if rounding is None else rounding)
    for j in range(n_steps):
        basis[j] = q
        w = matvec(q)
        alpha = float(w @ q)
        alphas.append(alpha)
        previous = basis[: j + 1]
        for _ in range(2):
            w = w - previous.T @ (previous @ w)
        residual_norm = float(w.norm())
        scale = max(abs(a) for a in alphas) + (max(betas) if betas else 0.0)
        run = LanczosRun(alphas, betas, basis[: j + 1], residual_norm)
        # an invariant subspace, up to the rounding of the products (low-rank Fisher matrices reach one early)
        if (
            residual_norm <= invariant_tolerance * max(scale, 1e-30)
            or j == n_steps - 1
            or (stop is not None and stop(run))
        ):
            return run
        betas.append(residual_norm)
        q = w / residual_norm
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------------------------------------------------
# public entry points


def _prepare(
    model: nn.Module, dataset: Iterable[Mapping[str, Any]], n_contexts: int | None, causal: bool | None
) -> tuple[TraceContexts, list[nn.Parameter], int]:
    check_lm_model(model)
    params = measured_parameters(model)
    contexts = TraceContexts.from_rows(dataset, causal=is_causal_lm(model) if causal is None else causal)
    if n_contexts is not None:
        if n_contexts < 1 or n_contexts > len(contexts):
            raise ValueError(
                f"n_contexts={n_contexts} but the data holds {len(contexts)} contexts (labelled positions)."
            )
        return contexts, params, n_contexts
    return contexts, params, len(contexts)


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1 (got {value!r}).")


def _check_matrix(matrix: str) -> None:
    if matrix not in MATRICES:
        raise ValueError(f"matrix={matrix!r} is not supported; choose one of {list(MATRICES)}.")


def _random_start(dimension: int, seed: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(dimension, generator=generator, dtype=torch.float64).to(device=device, dtype=dtype)


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
) -> TopEigenvalues:
    """The ``k`` largest eigenvalues of the Fisher or the Hessian of the pre-training loss, by Lanczos.

    Args:
        model: a masked or causal LM; the matrix is over its trainable parameters. Measured in ``eval()`` mode, every
            module's mode, the ``.grad`` fields and the global random streams left as they were.
        dataset: rows with ``input_ids``, ``attention_mask`` and ``labels`` (one context per labelled position), as
            for `estimate_hessian_trace`.
        k: how many of the largest (algebraic) eigenvalues.
        matrix: ``"fisher"`` (the matrix whose trace is the paper's measure; positive semi-definite) or ``"hessian"``
            (of the data-label loss; may have negative eigenvalues).
        n_contexts: use the first ``n_contexts`` contexts; all by default.
        max_iterations: Lanczos steps at most (each one matrix-vector product).
        tol: stop once every one of the ``k`` values has a residual ``<= tol * |value|``: each is then within that
            relative distance of an eigenvalue.
        seed: of the random start vector.
        batch_size: contexts per forward; the graphs of all batches are kept during the run.
        causal: whether the model is a causal LM; detected by default.
        vector_dtype: of the Lanczos vectors, kept on the model's device (``max_iterations x parameters`` of them at
            most). In float32 the values of a 0.94M-parameter BERT stopped at about 1e-4 relative error (true
            residual, `benchmarks/RESULTS.md`); float64, the default, reaches the products' own precision for twice
            the memory.

    Returns:
        A `TopEigenvalues`.
    """
    start_time = time.perf_counter()
    _check_positive_int("k", k)
    _check_positive_int("max_iterations", max_iterations)
    _check_positive_int("batch_size", batch_size)
    _check_matrix(matrix)
    if not tol > 0:
        raise ValueError(f"tol must be > 0 (got {tol!r}).")
    contexts, params, n_used = _prepare(model, dataset, n_contexts, causal)
    dimension = sum(p.numel() for p in params)
    if k > dimension:
        raise ValueError(f"k={k} but the model has only {dimension} trainable parameters.")
    if max_iterations < k:
        raise ValueError(f"max_iterations={max_iterations} must be at least k={k}.")

    def converged(run: LanczosRun) -> bool:
        if len(run.alphas) < k:
            return False
        values, vectors = run.ritz()
        top_values, top_last = values[-k:], vectors[-1, -k:]
        # |beta * last component| is the residual of each Ritz pair
        return bool((run.residual_norm * top_last.abs() <= tol * top_values.abs()).all())

    with evaluation_mode(model), preserved_global_rng():
        operator = CurvatureOperator(
            model, contexts, n_used, params, matrix=matrix, batch_size=batch_size, vector_dtype=vector_dtype
        )
        start = _random_start(dimension, seed, operator.dtype, operator.device)
        run = lanczos(operator, start, max_iterations, stop=converged, rounding=operator.rounding)
        values, vectors = run.ritz()
        order = torch.argsort(values, descending=True)[:k]
        eigenvalues, residuals = [], []
        for i in order.tolist():
            ritz_vector = run.basis.T @ vectors[:, i].to(run.basis.dtype)
            ritz_vector = ritz_vector / ritz_vector.norm()
            value = float(values[i])
            eigenvalues.append(value)
            residuals.append(float((operator(ritz_vector) - value * ritz_vector).norm()))
        del operator  # the kept graphs
    return TopEigenvalues(
        eigenvalues=eigenvalues,
        residuals=residuals,
        matrix=matrix,
        n_contexts=n_used,
        n_parameters=dimension,
        n_matvecs=len(run.alphas) + len(eigenvalues),
        seconds=time.perf_counter() - start_time,
        converged=all(r <= tol * max(abs(v), 1e-30) for v, r in zip(eigenvalues, residuals, strict=True)),
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
) -> SpectralDensity:
    """The eigenvalue density of the Fisher or Hessian of the pre-training loss by stochastic Lanczos quadrature.

    Each run starts Lanczos from a random Rademacher vector and keeps ``n_steps`` Ritz values, weighted by the squared
    first components of their vectors; `SpectralDensity.smoothed` averages the runs into a smooth density.

    Args:
        matrix, n_contexts, batch_size, causal, vector_dtype: as for `estimate_top_eigenvalues`.
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
    _check_matrix(matrix)
    contexts, params, n_used = _prepare(model, dataset, n_contexts, causal)
    nodes, weights = [], []
    with evaluation_mode(model), preserved_global_rng():
        operator = CurvatureOperator(
            model, contexts, n_used, params, matrix=matrix, batch_size=batch_size, vector_dtype=vector_dtype
        )
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
    rho: float = 0.05,
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
    contexts, params, n_used = _prepare(model, dataset, n_contexts, causal)
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
