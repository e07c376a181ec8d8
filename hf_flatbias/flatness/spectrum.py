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

from ..constants import DEFAULT_BATCH_SIZE, DEFAULT_SAM_RHO, SPECTRUM_MATRICES
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
    flat vectors over ``params``.

    With the contexts in one batch its graph is built once and kept between products; with several, each product
    builds and frees one batch's graph at a time (one more forward per batch and product): memory stays that of one
    batch, whatever the number of contexts.
    """

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
        self._n = n_contexts
        names = {id(p): name for name, p in model.named_parameters()}
        self._names = [f"model.{names[id(p)]}" for p in self.params]
        self._function = _LogitsAtPositions(model)
        self._inputs = []
        for start in range(0, n_contexts, batch_size):
            indices = list(range(start, min(start + batch_size, n_contexts)))
            batch = contexts.model_inputs(indices, model)
            positions = torch.tensor([contexts.positions[i] for i in indices], device=batch["input_ids"].device)
            targets = torch.tensor([contexts.targets[i] for i in indices], device=positions.device)
            self._inputs.append({"batch": batch, "positions": positions, "targets": targets})
        self._kept = self._graph(self._inputs[0]) if len(self._inputs) == 1 else None

    def _graph(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """What the products of one batch differentiate: the loss gradients with their graph (Hessian), or the
        logits with theirs and the softmax (Fisher)."""
        # the fused attention kernels have neither a double backward nor forward-mode derivatives
        with torch.enable_grad(), sdpa_kernel(SDPBackend.MATH):
            logits = self._function(inputs["batch"], inputs["positions"])
            if self.matrix == "hessian":
                loss = torch.nn.functional.cross_entropy(logits.float(), inputs["targets"], reduction="sum") / self._n
                grads = torch.autograd.grad(loss, self.params, create_graph=True, allow_unused=True)
                used = _used(grads)
                return {"grads": [grads[i] for i in used], "used": used}
            probs = torch.softmax(logits.detach().double(), dim=-1)
            return {**inputs, "logits": logits, "probs": probs}

    def _unflatten(self, vector: torch.Tensor) -> list[torch.Tensor]:
        pieces, offset = [], 0
        for p in self.params:
            pieces.append(vector[offset : offset + p.numel()].reshape(p.shape).to(p.dtype))
            offset += p.numel()
        return pieces

    def __call__(self, vector: torch.Tensor) -> torch.Tensor:
        self.n_matvecs += 1
        tangents = self._unflatten(vector)
        total = torch.zeros(self.dimension, dtype=self.dtype, device=self.device)
        for inputs in self._inputs:
            keep = self._kept is not None
            part = self._kept if keep else self._graph(inputs)
            if self.matrix == "hessian":
                outputs, grad_outputs = part["grads"], [tangents[i] for i in part["used"]]
            else:
                outputs, grad_outputs = self._fisher_pullback(part, tangents)
            del part
            if outputs:
                self._backward_into(total, outputs, grad_outputs, keep)
            del outputs, grad_outputs
        return total

    def _backward_into(
        self, total: torch.Tensor, outputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor], keep: bool
    ) -> None:
        """``total += d(outputs)/d(params)^T grad_outputs``, each parameter's piece added as soon as the backward
        reaches it and then freed: `torch.autograd.grad` would hold all of them at once, one more full vector in the
        parameters' dtype (measured in `benchmarks/lanczos_memory.py`)."""
        saved = [p.grad for p in self.params]
        handles = []

        def add_and_free(param: torch.Tensor, piece: torch.Tensor) -> None:
            piece.add_(param.grad.reshape(-1))
            param.grad = None

        offset = 0
        for p in self.params:
            p.grad = None
            piece = total[offset : offset + p.numel()]
            handles.append(p.register_post_accumulate_grad_hook(lambda param, piece=piece: add_and_free(param, piece)))
            offset += p.numel()
        try:
            torch.autograd.backward(
                list(outputs), grad_tensors=list(grad_outputs), retain_graph=keep, inputs=self.params
            )
        finally:
            for handle in handles:
                handle.remove()
            for p, grad in zip(self.params, saved, strict=True):
                p.grad = grad

    def _fisher_pullback(
        self, part: dict[str, Any], tangents: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The logits and what to pull back through them for ``F v``: ``(diag(p) - p p^T) J v / n``."""
        primals = {name: p.detach() for name, p in zip(self._names, self.params, strict=True)}
        directions = dict(zip(self._names, tangents, strict=True))

        def logits_of(values: dict[str, torch.Tensor]) -> torch.Tensor:
            return torch.func.functional_call(self._function, values, (part["batch"], part["positions"]))

        with sdpa_kernel(SDPBackend.MATH):
            _, jv = torch.func.jvp(logits_of, (primals,), (directions,))
        probs = part["probs"]
        jv = jv.double()
        weighted = (probs * jv - probs * (probs * jv).sum(dim=-1, keepdim=True)) / self._n
        logits = part["logits"]
        return [logits], [weighted.to(logits.dtype)]


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


@dataclass
class RitzPairs:
    """The largest Ritz values of a restarted Lanczos run, with their vectors and residual bounds."""

    values: list[float]  # largest first
    vectors: torch.Tensor  # (len(values), dimension), unit rows
    residual_bounds: list[float]  # ||A x - theta x|| from the recurrence, without another product
    n_matvecs: int


# In-place changes of basis go this many entries per vector at a time, so a restart needs no second basis.
_COLUMN_CHUNK = 2**20


def _rotate_in_place(basis: torch.Tensor, size: int, rotation: torch.Tensor) -> None:
    """``basis[:r] = rotation^T basis[:size]`` for a (size, r) ``rotation``, a column block at a time."""
    kept = rotation.shape[1]
    rotation = rotation.to(basis.dtype)
    for start in range(0, basis.shape[1], _COLUMN_CHUNK):
        block = slice(start, start + _COLUMN_CHUNK)
        basis[:kept, block] = rotation.T @ basis[:size, block]


def thick_restart_lanczos(
    matvec: Callable[[torch.Tensor], torch.Tensor],
    start: torch.Tensor,
    k: int,
    *,
    max_vectors: int,
    max_matvecs: int,
    tol: float,
    rounding: float | None = None,
) -> RitzPairs:
    """The ``k`` largest eigenpairs of a symmetric operator by thick-restart Lanczos, holding at most
    ``max_vectors`` basis vectors of ``start``'s dtype and device.

    Each step orthogonalises the new product against the whole basis (twice) and records its projections, so the
    projected matrix is ``V^T A V`` entry by entry; when the basis is full it restarts from its largest Ritz vectors
    (``k`` plus half of the room left, rotated in place) and the last residual (Wu & Simon's thick restart), which keeps
    the Krylov relation ``A V = V H + f e^T``: each Ritz pair's residual is ``||f|| |last component|``. Stops when
    every one of the ``k`` residuals is at most ``tol x |value|``, at an invariant subspace (a residual within
    ``1000 x rounding`` of the matrix's scale), or after ``max_matvecs`` products.
    """
    dimension = start.numel()
    max_vectors = min(max_vectors, dimension)
    if max_vectors < min(k + 1, dimension):
        raise ValueError(f"max_vectors={max_vectors} must be at least k + 1 = {k + 1}.")
    basis = torch.empty(max_vectors, dimension, dtype=start.dtype, device=start.device)
    projected = torch.zeros(max_vectors, max_vectors, dtype=torch.float64)
    basis[0] = start / start.norm()
    invariant_tolerance = 1e3 * (torch.finfo(start.dtype).eps if rounding is None else rounding)
    del start  # the caller may hand over its only reference: one vector less for the whole run
    size, n_matvecs = 1, 0
    while True:
        column = basis[:size]
        w = matvec(basis[size - 1])
        n_matvecs += 1
        coefficients = column @ w
        w.addmv_(column.T, coefficients, alpha=-1)  # in place: no temporary vector
        again = column @ w
        w.addmv_(column.T, again, alpha=-1)
        h = (coefficients + again).double().cpu()
        projected[:size, size - 1] = h
        projected[size - 1, :size] = h
        residual_norm = float(w.norm())
        values, vectors = torch.linalg.eigh(projected[:size, :size])
        top = torch.arange(size - 1, max(size - 1 - k, -1), -1)  # largest first
        bounds = residual_norm * vectors[-1, top].abs()
        scale = float(values.abs().max())
        done = len(top) == k and bool((bounds <= tol * values[top].abs()).all())
        invariant = residual_norm <= invariant_tolerance * max(scale, 1e-30)
        if done or invariant or n_matvecs >= max_matvecs or size == dimension:
            _rotate_in_place(basis, size, vectors[:, top])
            return RitzPairs(
                values=values[top].tolist(),
                vectors=basis[: len(top)],
                residual_bounds=bounds.tolist(),
                n_matvecs=n_matvecs,
            )
        if size == max_vectors:
            kept = min(max_vectors - 1, k + (max_vectors - k) // 2)
            order = torch.arange(size - 1, size - 1 - kept, -1)
            _rotate_in_place(basis, size, vectors[:, order])
            projected.zero_()
            projected[:kept, :kept] = torch.diag(values[order])
            size = kept
        torch.div(w, residual_norm, out=basis[size])
        # otherwise the next product is formed while this one is still held: one more vector at the peak
        del w
        size += 1


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

    if max_vectors is None:
        max_vectors = default_max_vectors(k)
    _check_positive_int("max_vectors", max_vectors)
    with evaluation_mode(model), preserved_global_rng():
        operator = CurvatureOperator(
            model, contexts, n_used, params, matrix=matrix, batch_size=batch_size, vector_dtype=vector_dtype
        )
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
    return TopEigenvalues(
        eigenvalues=eigenvalues,
        residuals=residuals,
        matrix=matrix,
        n_contexts=n_used,
        n_parameters=dimension,
        n_matvecs=n_matvecs,
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
