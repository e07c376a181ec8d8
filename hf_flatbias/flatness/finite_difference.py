"""Hessian and Fisher products by central finite differences, on the parameters as the engine holds them.

``H v ~ (g(w + h v) - g(w - h v)) / 2h``: two gradients through the engine's ordinary backward, no double backward.
So the product works where the exact one (`hf_flatbias.flatness.curvature`) cannot: under FSDP2 and ZeRO-3, whose
per-module gather and free a double backward would have to run through, and with fused attention kernels (SDPA's
flash and memory-efficient kernels) that have no second derivative. The Fisher product takes the same route at the
logits: ``J v ~ (f(w + h v) - f(w - h v)) / 2h`` from two gradient-free forwards, then one backward of
``(diag(p) - p p^T) J v`` through the logits at ``w``.

Vectors are over this process's pieces of the parameters (`hf_flatbias.flatness.parameter_space`): under FSDP2 and
ZeRO-3 each process moves its own shards by ``h v`` and the engine's next forward gathers the moved weights; the
weights are copied back bit for bit after every product.

The step ``h`` multiplies a unit vector over all trainable parameters. Its default, `default_finite_difference_step`,
was chosen by measuring the product's error against the exact (double-backward) product on a tiny Llama (see
`FINITE_DIFFERENCE_STEPS` and ``benchmarks/finite_difference_step.py``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from ..constants import CURVATURE_MATRICES, CURVATURE_PRODUCTS
from .contexts import TraceContexts
from .distributed import needs_lockstep, share_of_contexts
from .lanczos import thick_restart_lanczos, vector_norm
from .lm import logits_at_positions
from .parameter_space import ParameterSpace, parameter_space

FINITE_DIFFERENCE_STEPS: dict[torch.dtype, float] = {
    torch.float32: 3e-4,
    torch.float64: 3e-4,
    torch.bfloat16: 1e-2,
    torch.float16: 1e-2,
}
"""The default step ``h`` by the parameters' dtype. float32 and float64: chosen by
`benchmarks/finite_difference_step.py`, which measures the relative error of the product against the exact one
along the top eigenvector (what a top eigenvalue is made of: its Ritz value is ``x^T A x``) and along random unit
vectors. Along the top eigenvector, which is concentrated on few parameters and where the loss is most curved,
``h = 3e-4`` was the best step tried on both a 107k-parameter Llama (std 0.02) and the tests' tiny Llama, in float32
(9e-5 and 3.5e-4) and float64 (5e-5, 8e-5); at ``1e-2``, the best step for random vectors, the error there is 5-7%.
The tiny Llama's top eigenvalue came out within 9e-5 (Hessian) and 8e-6 (Fisher) of the exact one in float32.
Llama's RMSNorm computes in float32 whatever the dtype, so its float64 rows are rounding-limited like float32's.
Half precision: not measured; ``h`` scaled by the cube root of the ratio of unit roundings (the optimum of central
differences), and the products are rough there. On large float32 models this step is rounding-bound (each entry moves
by about ``h / sqrt(n)``): on a 100M Llama a random vector's product is 8% from exact at ``3e-4`` and 1.3e-4 at
``0.3``, and the batch size alone moves a 3-product eigenvalue by 1.7e-2
(``benchmarks/finite_difference_op_order.py``); the error along its top eigenvector was not measured."""


def default_finite_difference_step(dtype: torch.dtype) -> float:
    """`FINITE_DIFFERENCE_STEPS` for the parameters' dtype."""
    return FINITE_DIFFERENCE_STEPS.get(dtype, FINITE_DIFFERENCE_STEPS[torch.float32])


def resolve_product(model: nn.Module, product: str, step: float | None) -> str:
    """``exact`` or ``finite_difference`` for ``product``; refuses what cannot be computed before any pass."""
    if product not in CURVATURE_PRODUCTS:
        raise ValueError(f"product={product!r} is not supported; choose one of {list(CURVATURE_PRODUCTS)}.")
    if step is not None and not (isinstance(step, (int, float)) and math.isfinite(step) and step > 0):
        raise ValueError(f"finite_difference_step must be a finite number > 0 (got {step!r}).")
    sharded = needs_lockstep(model)
    if product == "auto":
        product = "finite_difference" if sharded else "exact"
    if product == "exact" and sharded:
        raise ValueError(
            "product='exact' needs whole parameters on one process (its double backward and forward mode cannot run "
            "through FSDP2's or ZeRO-3's per-module gather); pass product='finite_difference' (or 'auto')."
        )
    return product


class FiniteDifferenceOperator:
    """``v -> A v`` for the Hessian or Fisher of the mean data-label loss over all contexts, by central differences,
    on this process's pieces of the vectors.

    Args:
        model: the module whose forward the engine hooks (the FSDP2 root, ZeRO-3's module, the unwrapped DDP module).
        contexts: all contexts; ``indices`` are this process's share, of which the first ``n_measured`` count (the
            rest keep the processes' passes in step and weigh 0); ``n_total`` contexts are averaged over.
        space: the parameters' layout (`parameter_space`).
        matrix: ``"hessian"`` or ``"fisher"``.
        batch_size: contexts per forward.
        step: ``h``.
        vector_dtype: of the vectors.
    """

    def __init__(
        self,
        model: nn.Module,
        contexts: TraceContexts,
        indices: Sequence[int],
        n_measured: int,
        n_total: int,
        space: ParameterSpace,
        *,
        matrix: str,
        batch_size: int,
        step: float,
        vector_dtype: torch.dtype = torch.float64,
    ) -> None:
        if matrix not in CURVATURE_MATRICES:
            raise ValueError(f"matrix={matrix!r} is not supported; choose one of {list(CURVATURE_MATRICES)}.")
        self.model = model
        self.space = space
        self.matrix = matrix
        self.step = float(step)
        self.dtype = vector_dtype
        self.device = space.tensors[0].device
        self.dimension = space.dimension
        self.rounding = max(torch.finfo(t.dtype).eps for t in space.tensors)
        self.n_matvecs = 0
        self._batches = []
        for start in range(0, len(indices), batch_size):
            chunk = list(indices[start : start + batch_size])
            batch = contexts.model_inputs(chunk, model)
            device = batch["input_ids"].device
            weights = torch.tensor(
                [1.0 if start + j < n_measured else 0.0 for j in range(len(chunk))], dtype=torch.float64, device=device
            )
            self._batches.append(
                {
                    "batch": batch,
                    "positions": torch.tensor([contexts.positions[i] for i in chunk], device=device),
                    "targets": torch.tensor([contexts.targets[i] for i in chunk], device=device),
                    "weights": weights / n_total,
                }
            )
        with torch.no_grad():
            self._saved = [t.detach().clone() for t in space.tensors]

    def _logits(self, inputs: dict) -> torch.Tensor:
        return logits_at_positions(self.model, inputs["batch"], inputs["positions"])[:, 0]

    @torch.no_grad()
    def _move(self, pieces: Sequence[torch.Tensor] | None, scale: float) -> None:
        """The weights to ``w + scale v`` (``w`` itself, bit for bit, with ``pieces=None``)."""
        pieces = pieces or [None] * len(self._saved)
        for tensor, saved, piece in zip(self.space.tensors, self._saved, pieces, strict=True):
            tensor.copy_(saved)
            if piece is not None:
                tensor.add_(piece, alpha=scale)
        self.space.release_gathered()

    def restore(self) -> None:
        self._move(None, 0.0)

    def __call__(self, vector: torch.Tensor) -> torch.Tensor:
        self.n_matvecs += 1
        pieces = self.space.unflatten(vector)
        try:
            if self.matrix == "hessian":
                self._move(pieces, self.step)
                plus = self.space.flatten(self.space.gradient(self._losses()), self.dtype)
                self._move(pieces, -self.step)
                minus = self.space.flatten(self.space.gradient(self._losses()), self.dtype)
                return plus.sub_(minus).div_(2 * self.step)
            self._move(pieces, self.step)
            plus = self._all_logits()
            self._move(pieces, -self.step)
            minus = self._all_logits()
            self.restore()
            tangents = [(p - m) / (2 * self.step) for p, m in zip(plus, minus, strict=True)]
            return self.space.flatten(self.space.gradient(self._fisher_terms(tangents)), self.dtype)
        finally:
            self.restore()

    def _losses(self) -> Iterator[torch.Tensor]:
        """Each batch's share of the mean cross-entropy over all contexts (one graph alive at a time)."""
        for inputs in self._batches:
            with torch.enable_grad():
                logits = self._logits(inputs)
                # float32 at least (half-precision logits), float64 kept: its rounding is divided by h
                wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
                per_context = torch.nn.functional.cross_entropy(wide, inputs["targets"], reduction="none")
                loss = (per_context.double() * inputs["weights"]).sum().to(per_context.dtype)
            yield loss

    @torch.no_grad()
    def _all_logits(self) -> list[torch.Tensor]:
        return [self._logits(inputs).double() for inputs in self._batches]

    def _fisher_terms(self, tangents: Sequence[torch.Tensor]) -> Iterator[torch.Tensor]:
        """``<logits, (diag(p) - p p^T) J v>`` per batch, weighted: its gradient is the batch's share of ``F v``."""
        for inputs, jv in zip(self._batches, tangents, strict=True):
            with torch.enable_grad():
                logits = self._logits(inputs)
                probs = torch.softmax(logits.detach().double(), dim=-1)
                pulled = (probs * jv - probs * (probs * jv).sum(dim=-1, keepdim=True)) * inputs["weights"][:, None]
                term = (logits * pulled.to(logits.dtype)).sum()
            yield term


def finite_difference_top_eigenvalues(
    model: nn.Module,
    contexts: TraceContexts,
    n_contexts: int,
    *,
    k: int,
    matrix: str,
    step: float | None,
    seed: int,
    batch_size: int,
    vector_dtype: torch.dtype,
    max_vectors: int,
    max_iterations: int,
    tol: float,
    optimizer: object | None = None,
) -> tuple[list[float], list[float], int, int]:
    """The ``k`` largest eigenvalues by thick-restart Lanczos on finite-difference products, with the vectors in the
    parameters' layout (sharded under FSDP2 and ZeRO-3) and the contexts split over processes: ``(eigenvalues,
    residuals, products, dimension)``, the same on every process. Every process must call it (each pass may be a
    collective); see `hf_flatbias.flatness.spectrum.estimate_top_eigenvalues`."""
    space = parameter_space(model, optimizer)
    if k > space.dimension:
        raise ValueError(f"k={k} but the model has only {space.dimension} trainable parameters.")
    indices = list(range(n_contexts))
    share = share_of_contexts(indices, space.rank, space.world_size, lockstep=True)
    if step is None:
        step = default_finite_difference_step(space.tensors[0].dtype)
    operator = FiniteDifferenceOperator(
        model,
        contexts,
        share.indices,
        share.n_measured,
        n_contexts,
        space,
        matrix=matrix,
        batch_size=batch_size,
        step=step,
        vector_dtype=vector_dtype,
    )
    pairs = thick_restart_lanczos(
        operator,
        space.random_vector(seed, vector_dtype),
        k,
        max_vectors=max_vectors,
        max_matvecs=max_iterations,
        tol=tol,
        rounding=operator.rounding,
        sum_across=space.sum_across,
        dimension=space.dimension,
    )
    residuals = [
        vector_norm(operator(vector).sub_(vector, alpha=value), space.sum_across)
        for value, vector in zip(pairs.values, pairs.vectors, strict=True)
    ]
    return pairs.values, residuals, pairs.n_matvecs + len(residuals), space.dimension
