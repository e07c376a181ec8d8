"""The spectrum's shape: a power law ``lambda_k ~ C k^-alpha`` fitted to the largest eigenvalues of the Fisher or
Hessian of the pre-training loss (Tang et al., ICML 2025, find the exponent predicts LLM generalisation where the
classical sharpness measures do not).

The fit is ordinary least squares of ``log lambda_k`` on ``log k`` over the ``k`` largest eigenvalues that are
positive (Lanczos, `estimate_top_eigenvalues`); ``alpha`` is minus the slope. Its standard error is the regression's,
``sqrt(RSS / (n - 2) / sum (log k - mean log k)^2)``: it says how far the top of the spectrum is from a straight line
on log-log axes (a pure power law gives 0), NOT how the exponent would vary over fresh contexts, and it treats the
residuals as independent, which ranked eigenvalues are not. Read it as the fit's quality; ``r_squared`` beside says
the same in another unit. Large ``alpha``: the curvature sits in a few directions; small: it is spread.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

MIN_FITTED = 3
"""Eigenvalues a fit needs: with two the line passes through both and its error is undefined."""


@dataclass(frozen=True)
class PowerLawFit:
    """``log lambda_k = log_scale - alpha log k`` by least squares over ranks ``1..n_fitted``.

    Attributes:
        alpha: the exponent (minus the slope); alpha_stderr: the slope's regression standard error (see the module).
        log_scale: ``log C``, the fitted log of the largest eigenvalue's level.
        r_squared: the share of the variance of ``log lambda`` the line explains.
        n_fitted: eigenvalues fitted (the positive ones, largest first).
    """

    alpha: float
    alpha_stderr: float
    log_scale: float
    r_squared: float
    n_fitted: int


def fit_power_law(eigenvalues: Sequence[float]) -> PowerLawFit:
    """The power law through the positive values of ``eigenvalues`` ranked largest first (rank 1 the largest); a
    ``ValueError`` naming the fix with fewer than `MIN_FITTED` positive values."""
    values = torch.as_tensor(list(eigenvalues), dtype=torch.float64)
    if not bool(torch.isfinite(values).all()):
        raise ValueError("eigenvalues must be finite; measure them again (a diverged model gives non-finite ones).")
    positive = values[values > 0].sort(descending=True).values
    n = positive.numel()
    if n < MIN_FITTED:
        raise ValueError(
            f"a power law needs at least {MIN_FITTED} positive eigenvalues (got {n} of {values.numel()}); ask for "
            "more of them (power_law_k) or use matrix='fisher', whose eigenvalues are never negative."
        )
    x = torch.log(torch.arange(1, n + 1, dtype=torch.float64))
    y = torch.log(positive)
    x_centred, y_centred = x - x.mean(), y - y.mean()
    sxx = float(x_centred.square().sum())
    slope = float((x_centred * y_centred).sum()) / sxx
    intercept = float(y.mean()) - slope * float(x.mean())
    residual = y - (intercept + slope * x)
    rss = float(residual.square().sum())
    total = float(y_centred.square().sum())
    stderr = math.sqrt(rss / (n - 2) / sxx) if n > 2 else math.nan
    return PowerLawFit(
        alpha=-slope,
        alpha_stderr=stderr,
        log_scale=intercept,
        r_squared=1.0 - rss / total if total > 0 else 1.0,
        n_fitted=n,
    )


@dataclass
class SpectrumShape:
    """The power-law fit of the top of the spectrum, with the eigenvalues it was fitted to.

    Attributes:
        alpha, alpha_stderr, log_scale, r_squared, n_fitted: the fit (`PowerLawFit`).
        eigenvalues, residuals: the ``k`` largest eigenvalues (largest first) and each one's Lanczos residual.
        matrix, k, n_contexts, n_matvecs, converged, product: how they were found (`TopEigenvalues`).
        seconds: wall-clock time.
    """

    alpha: float
    alpha_stderr: float
    log_scale: float
    r_squared: float
    n_fitted: int
    matrix: str
    k: int
    n_contexts: int
    n_matvecs: int
    converged: bool
    product: str
    seconds: float
    eigenvalues: list[float] = field(default_factory=list)
    residuals: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def spectrum_shape(
    model,
    contexts,
    *,
    n_contexts: int | None,
    settings: Any,
    seed: int = 0,
    batch_size: int,
    causal: bool | None = None,
    optimizer: Any = None,
    task: Any = None,
) -> SpectrumShape:
    """The measures table's entry: the ``settings.power_law_k`` largest eigenvalues of ``settings.eigenvalue_matrix``
    by `estimate_top_eigenvalues` (its products and step as for top_eigenvalue) and the power law through them."""
    from .spectrum import estimate_top_eigenvalues

    start_time = time.perf_counter()
    k = settings.power_law_k
    top = estimate_top_eigenvalues(
        model,
        contexts,
        k=k,
        matrix=settings.eigenvalue_matrix,
        n_contexts=n_contexts,
        # the lower Ritz values of the top k converge last: room for about 8 products per eigenvalue
        max_iterations=max(100, 8 * k),
        seed=seed,
        batch_size=batch_size,
        causal=causal,
        product=settings.eigenvalue_product,
        finite_difference_step=settings.eigenvalue_fd_step,
        optimizer=optimizer,
    )
    fit = fit_power_law(top.eigenvalues)
    return SpectrumShape(
        **asdict(fit),
        matrix=top.matrix,
        k=len(top.eigenvalues),
        n_contexts=top.n_contexts,
        n_matvecs=top.n_matvecs,
        converged=top.converged,
        product=top.product,
        seconds=time.perf_counter() - start_time,
        eigenvalues=list(top.eigenvalues),
        residuals=list(top.residuals),
    )


__all__ = ["PowerLawFit", "SpectrumShape", "fit_power_law", "spectrum_shape"]
