"""Hutch++ (Meyer, Musco, Musco & Woodruff, SOSA 2021): the trace of a symmetric matrix from products with it,
with the error of Hutchinson's estimator at a fraction of the products when the spectrum decays.

A third of the products sketch the dominant range, ``Q = orth(A S)``; its trace ``tr(Q^T A Q)`` is taken exactly
(another third), and Hutchinson's estimator with the last third of the probes projected off ``Q`` estimates what is
left, ``tr((I - QQ^T) A (I - QQ^T))``. Conditionally on ``Q`` the second part is unbiased for the rest of the trace,
so the sum is unbiased whatever ``Q``; its variance is that of Hutchinson's on the deflated matrix. Nothing here
knows about models: ``matvec`` takes and returns flat vectors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def random_probes(
    n: int, dimension: int, *, kind: str, generator: torch.Generator, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """(n, dimension) probes of mean 0 and variance 1 (``"rademacher"`` or ``"gaussian"``)."""
    if kind == "gaussian":
        values = torch.randn(n, dimension, generator=generator, dtype=torch.float64)
    else:
        values = (torch.randint(0, 2, (n, dimension), generator=generator) * 2 - 1).double()
    return values.to(device=device, dtype=dtype)


def hutchpp_split(n_matvecs: int) -> tuple[int, int]:
    """``(sketch size k, residual probes)``: ``k = n_matvecs // 3`` vectors sketch the range (``2k`` products), the
    rest are Hutchinson probes; with fewer than 3 products there is no sketch and it is Hutchinson's estimator."""
    sketch = n_matvecs // 3
    return sketch, n_matvecs - 2 * sketch


def hutchpp_trace(
    matvec: Callable[[torch.Tensor], torch.Tensor],
    dimension: int,
    n_matvecs: int,
    *,
    generator: torch.Generator,
    probe: str = "rademacher",
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
) -> float:
    """Hutch++'s estimate of ``tr(A)`` from exactly ``n_matvecs`` products ``matvec(v) = A v`` (``A`` symmetric).

    Holds ``n_matvecs // 3`` vectors of ``dimension`` entries besides the probe in use. The mean of
    `hutchpp_samples`.
    """
    return float(
        hutchpp_samples(matvec, dimension, n_matvecs, generator=generator, probe=probe, dtype=dtype, device=device)
        .mean()
    )  # fmt: skip


def hutchpp_samples(
    matvec: Callable[[torch.Tensor], torch.Tensor],
    dimension: int,
    n_matvecs: int,
    *,
    generator: torch.Generator,
    probe: str = "rademacher",
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """One value per residual probe (float64): ``tr(Q^T A Q) + v^T (I - QQ^T) A (I - QQ^T) v``. Given the sketch
    ``Q`` they are independent and each is unbiased for ``tr(A)``, so their mean is Hutch++'s estimate and their
    spread over ``sqrt(n)`` its standard error (of this matrix's trace)."""
    if n_matvecs < 1:
        raise ValueError(f"n_matvecs must be >= 1 (got {n_matvecs}).")
    device = torch.device(device)
    sketch, n_probes = hutchpp_split(n_matvecs)
    trace = 0.0
    basis = None
    if sketch:
        sketched = torch.stack(
            [
                matvec(v)
                for v in random_probes(sketch, dimension, kind=probe, generator=generator, dtype=dtype, device=device)
            ]
        )
        basis = torch.linalg.qr(sketched.T.double()).Q.T.to(dtype)  # (k, dimension), orthonormal rows
        trace += float(sum(q.double() @ matvec(q).double() for q in basis))
    residuals = torch.empty(n_probes, dtype=torch.float64)
    for k in range(n_probes):
        v = random_probes(1, dimension, kind=probe, generator=generator, dtype=dtype, device=device)[0]
        if basis is not None:
            v = v - basis.T @ (basis @ v)
        residuals[k] = float(v.double() @ matvec(v).double())
    return trace + residuals
