"""Lanczos with full reorthogonalisation, plain and thick-restarted: eigenvalues of a symmetric operator from
products with it. Nothing here knows about models: ``matvec`` takes and returns flat vectors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


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


def _summed(partial: torch.Tensor, sum_across: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
    return partial if sum_across is None else sum_across(partial)


def vector_norm(vector: torch.Tensor, sum_across: Callable[[torch.Tensor], torch.Tensor] | None = None) -> float:
    """The Euclidean norm of a vector, or of a sharded one whose slices ``sum_across`` sums over (see
    `thick_restart_lanczos`)."""
    if sum_across is None:
        return float(vector.norm())
    return float(sum_across(torch.linalg.vector_norm(vector, dtype=torch.float64).square().reshape(1))) ** 0.5


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
    sum_across: Callable[[torch.Tensor], torch.Tensor] | None = None,
    dimension: int | None = None,
) -> RitzPairs:
    """The ``k`` largest eigenpairs of a symmetric operator by thick-restart Lanczos, holding at most
    ``max_vectors`` basis vectors of ``start``'s dtype and device.

    Each step orthogonalises the new product against the whole basis (twice) and records its projections, so the
    projected matrix is ``V^T A V`` entry by entry; when the basis is full it restarts from its largest Ritz vectors
    (``k`` plus half of the room left, rotated in place) and the last residual (Wu & Simon's thick restart), which keeps
    the Krylov relation ``A V = V H + f e^T``: each Ritz pair's residual is ``||f|| |last component|``. Stops when
    every one of the ``k`` residuals is at most ``tol x |value|``, at an invariant subspace (a residual within
    ``1000 x rounding`` of the matrix's scale), or after ``max_matvecs`` products.

    Sharded vectors: when each process holds a slice of every vector (``start`` and the products are this process's
    slices), ``sum_across`` sums a tensor of partial dot products over the processes (an all-reduce) and
    ``dimension`` is the whole vectors' length. Every process then takes the same decisions from the same numbers.
    """
    dimension = start.numel() if dimension is None else dimension
    max_vectors = min(max_vectors, dimension)
    if max_vectors < min(k + 1, dimension):
        raise ValueError(f"max_vectors={max_vectors} must be at least k + 1 = {k + 1}.")
    basis = torch.empty(max_vectors, start.numel(), dtype=start.dtype, device=start.device)
    projected = torch.zeros(max_vectors, max_vectors, dtype=torch.float64)
    basis[0] = start / vector_norm(start, sum_across)
    invariant_tolerance = 1e3 * (torch.finfo(start.dtype).eps if rounding is None else rounding)
    del start  # the caller may hand over its only reference: one vector less for the whole run
    size, n_matvecs = 1, 0
    while True:
        column = basis[:size]
        w = matvec(basis[size - 1])
        n_matvecs += 1
        coefficients = _summed(column @ w, sum_across)
        w.addmv_(column.T, coefficients, alpha=-1)  # in place: no temporary vector
        again = _summed(column @ w, sum_across)
        w.addmv_(column.T, again, alpha=-1)
        h = (coefficients + again).double().cpu()
        projected[:size, size - 1] = h
        projected[size - 1, :size] = h
        residual_norm = vector_norm(w, sum_across)
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
