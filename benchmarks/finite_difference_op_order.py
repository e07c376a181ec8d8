"""How far two equally valid float32 operation orders put finite-difference curvature products and top eigenvalues
apart in one plain process: the floor under the agreement of a sharded float32 measurement with one process's.

A sharded run (FSDP2, ZeRO-3, DDP) forms the same products as one process from bit-identical moved weights (the same
start vector, drawn per parameter, and the same move ``w +- h v``), but its forwards and backwards sum in another
order: the contexts are split over the ranks, ZeRO-3 runs its own linear function, the gradients are reduced over
ranks. One process with another batch size changes the order just as much, so the spread between batch sizes is what
no sharded layout can be held below. For a random unit vector ``v`` (the Lanczos start) and each step ``h``:

- ``f32 vs exact``: ``||A_fd v - A v|| / ||A v||`` for the float32 model (batches of all contexts) against the exact
  product of the same weights in float64 (double backward, Llama's RMSNorm kept in float64, which transformers
  computes in float32 whatever the dtype);
- ``f32 batch n vs 2``: the same product with batches of 2 against it (bit-identical moved weights, so only the
  gradients' rounding differs), the op-order noise;
- ``f64 vs exact``: the float64 model's finite difference against the exact product: the truncation error ``O(h^2)``;
- ``moved-weight rounding``: ``||A (u - v)|| / ||A v||`` with ``u = (fl(w + h v) - fl(w - h v)) / 2h`` the move the
  float32 weights actually made (exact float64 product), at the first step only.

Then the top Hessian eigenvalue (``estimate_top_eigenvalues``, finite differences, float32 vectors, ``--products``
Lanczos products and one residual check, as `sharded_trace_memory.py --measure spectrum`) at each batch size, and its
relative spread over them.

    OMP_NUM_THREADS=1 PYTHONPATH=.:benchmarks python benchmarks/finite_difference_op_order.py --model tiny  # 1.5 min
    OMP_NUM_THREADS=1 PYTHONPATH=.:benchmarks python benchmarks/finite_difference_op_order.py --model llama100m \
        --steps 3e-4,3e-3,3e-2,0.3,3 --eigenvalue-steps 3e-4,0.3 --products 2 --batch-sizes 8,2

The 100M product table holds the float64 model's double backward (about 12 GB resident) and takes about 25 CPU-minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

from hf_flatbias.flatness.contexts import TraceContexts  # noqa: E402
from hf_flatbias.flatness.curvature import CurvatureOperator  # noqa: E402
from hf_flatbias.flatness.finite_difference import FiniteDifferenceOperator  # noqa: E402
from hf_flatbias.flatness.lm import evaluation_mode, measured_parameters  # noqa: E402
from hf_flatbias.flatness.parameter_space import parameter_space  # noqa: E402
from hf_flatbias.flatness.spectrum import estimate_top_eigenvalues  # noqa: E402


def build(name: str) -> tuple[torch.nn.Module, list[dict]]:
    """The float32 model and its rows: the step table's two small Llamas (8 contexts of 16 tokens), or the 100M
    Llama of `sharded_trace_memory.py` (8 contexts of 64 tokens)."""
    if name == "llama100m":
        from _common import llama_100m
        from sharded_trace_memory import rows as long_rows

        model = llama_100m()
        return model, long_rows(8, 64, model.config.vocab_size)
    from finite_difference_step import rows, small_llama, tiny_llama

    model = small_llama() if name == "small" else tiny_llama()
    return model, rows(model.config.vocab_size, 8)


@contextlib.contextmanager
def float64_rms_norm():
    """Llama's RMSNorm in the input's dtype when it is float64 (transformers casts to float32), so that the float64
    reference carries no float32 rounding."""
    original = modeling_llama.LlamaRMSNorm.forward

    def forward(self, hidden):
        if hidden.dtype != torch.float64:
            return original(self, hidden)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))

    modeling_llama.LlamaRMSNorm.forward = forward
    try:
        yield
    finally:
        modeling_llama.LlamaRMSNorm.forward = original


def fd_product(model, contexts, space, vector, batch_size: int, step: float) -> torch.Tensor:
    n = len(contexts)
    operator = FiniteDifferenceOperator(
        model, contexts, list(range(n)), n, n, space, matrix="hessian", batch_size=batch_size, step=step
    )
    return operator(vector)


def moved(space, vector: torch.Tensor, step: float) -> torch.Tensor:
    """``(fl(w + h v) - fl(w - h v)) / 2h``: the move the weights make, as `FiniteDifferenceOperator` moves them."""
    pieces = []
    for tensor, piece in zip(space.tensors, space.unflatten(vector), strict=True):
        plus = tensor.detach().clone().add_(piece, alpha=step)
        minus = tensor.detach().clone().add_(piece, alpha=-step)
        pieces.append((plus.double() - minus.double()).reshape(-1) / (2 * step))
    return torch.cat(pieces)


def products(name: str, steps: list[float], small_batch: int) -> None:
    model32, data = build(name)
    model64, _ = build(name)
    model64 = model64.double()
    contexts = TraceContexts.from_rows(data, causal=True)
    n = len(contexts)
    with evaluation_mode(model32), evaluation_mode(model64), float64_rms_norm():
        space32, space64 = parameter_space(model32), parameter_space(model64)
        vector = space32.random_vector(0, torch.float64)
        vector /= vector.norm()
        exact = CurvatureOperator(model64, contexts, n, measured_parameters(model64), matrix="hessian", batch_size=n)
        reference = exact(vector.clone())
        norm = float(reference.norm())
        rounding = exact(moved(space32, vector, steps[0]) - vector)
        weights = float(torch.cat([t.detach().reshape(-1) for t in space32.tensors]).norm())
        print(f"{name}: {space32.dimension} parameters, ||w|| = {weights:.4g}, {n} contexts; random unit v: "
              f"||Hv|| = {norm:.4g}, v^T H v = {float(vector @ reference):.4g}")  # fmt: skip
        print(f"moved-weight rounding at h={steps[0]:g}: ||H(u - v)|| / ||Hv|| = {float(rounding.norm()) / norm:.2e}")
        print(f"h | f32 vs exact | f32 batch {n} vs {small_batch} | f64 vs exact (truncation) | seconds")
        for step in steps:
            start = time.perf_counter()
            whole = fd_product(model32, contexts, space32, vector, n, step)
            split = fd_product(model32, contexts, space32, vector, small_batch, step)
            wide = fd_product(model64, contexts, space64, vector, n, step)
            errors = [(whole - reference).norm(), (whole - split).norm(), (wide - reference).norm()]
            cells = " | ".join(f"{float(e) / norm:.2e}" for e in errors)
            print(f"{step:g} | {cells} | {time.perf_counter() - start:.0f}", flush=True)


def eigenvalues(name: str, steps: list[float], batch_sizes: list[int], n_products: int) -> None:
    model, data = build(name)
    for step in steps:
        values = []
        for batch_size in batch_sizes:
            top = estimate_top_eigenvalues(
                model,
                data,
                k=1,
                matrix="hessian",
                product="finite_difference",
                max_iterations=n_products,
                tol=1e-12,
                batch_size=batch_size,
                vector_dtype=torch.float32,
                finite_difference_step=step,
            )
            values.append(top.eigenvalues[0])
            print(f"h={step:g} batch {batch_size}: top {top.eigenvalues[0]:.9g} (residual {top.residuals[0]:.3g})")
        spread = (max(values) - min(values)) / abs(values[0])
        print(f"spread[{name}:h={step:g}]={spread:.2e}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", choices=["tiny", "small", "llama100m"])
    parser.add_argument("--steps", default="3e-4,3e-3,3e-2,1e-1", help="steps h of the product table (empty: none)")
    parser.add_argument("--eigenvalue-steps", default="3e-4,3e-3,3e-2,1e-1", help="empty: no eigenvalues")
    parser.add_argument("--products", type=int, default=10, help="Lanczos products per eigenvalue")
    parser.add_argument("--batch-sizes", default="8,2,1")
    args = parser.parse_args()
    floats = lambda text: [float(x) for x in text.split(",") if x]  # noqa: E731
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    torch.set_num_threads(1)
    if floats(args.steps):
        products(args.model, floats(args.steps), min(b for b in batch_sizes if b > 1))
    eigenvalues(args.model, floats(args.eigenvalue_steps), batch_sizes, args.products)


if __name__ == "__main__":
    main()
