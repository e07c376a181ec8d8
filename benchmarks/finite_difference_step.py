"""The error of the finite-difference Hessian and Fisher products against the exact ones, by step ``h`` and dtype.

For each model and dtype, ``A v`` is formed exactly (`CurvatureOperator`: double backward for the Hessian, forward
mode for the Fisher) and by central differences (`FiniteDifferenceOperator`) at each ``h``, and the relative error
``||A_fd v - A v|| / ||A v||`` is reported for two kinds of ``v``: the top eigenvector (from exact Lanczos), which is
what a top eigenvalue is made of, and random unit vectors (Gaussian over all trainable parameters; the median over
them). Central differences err by ``O(h^2)`` (third derivatives) plus
``O(eps / h)`` (rounding of the perturbed weights and of the gradients), so the error is smallest at an
intermediate ``h``: the default steps (`FINITE_DIFFERENCE_STEPS`) were chosen from this table, by the error along the
top eigenvector.

Models: a small Llama at the usual initialisation (std 0.02; the shape of a real model), and the tests' tiny Llama
(std 0.25, far more curved: the worst case); ``--models llama15m`` adds `_common.llama_shape("llama15m")` (14.5M
parameters, std 0.02). Each row also prints the error at the step proportional to the weights' norm,
``h = RELATIVE_STEP * ||w||`` (column ``rule``), the candidate for a size-aware default: the rounding of the moved
weights, ``||fl(w + h v) - (w + h v)|| / h ~ eps ||w|| / h`` for any unit ``v``, stays fixed under it.

    python benchmarks/finite_difference_step.py [--quick]
    PYTHONPATH=.:benchmarks python benchmarks/finite_difference_step.py --quick --models llama15m --dtypes float32 \
        --matrices hessian --steps 3e-4,1e-3,3e-3,1e-2
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from hf_flatbias.flatness.contexts import TraceContexts  # noqa: E402
from hf_flatbias.flatness.curvature import CurvatureOperator  # noqa: E402
from hf_flatbias.flatness.finite_difference import FiniteDifferenceOperator  # noqa: E402
from hf_flatbias.flatness.lanczos import thick_restart_lanczos  # noqa: E402
from hf_flatbias.flatness.lm import evaluation_mode, measured_parameters  # noqa: E402
from hf_flatbias.flatness.parameter_space import parameter_space  # noqa: E402

STEPS = (1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 1e-5, 1e-6)
RELATIVE_STEP = 2e-5
"""``h / ||w||`` of the candidate rule: 3e-4 at the geometric mean of the two small Llamas' norms (10.9, 19.5), where
3e-4 was measured best along the top eigenvector."""


def small_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.02,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # a trained model's norms are not all ones
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model


def tiny_llama() -> torch.nn.Module:
    from tests.helpers.distributed_sam_script import tiny_causal_lm

    return tiny_causal_lm()


def rows(vocab: int, n: int, seq_len: int = 16) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(2, vocab, (n, seq_len), generator=g)
    out = []
    for i in range(n):
        labels = torch.full((seq_len,), -100)
        position = 1 + i % (seq_len - 1)
        labels[position] = ids[i, position]
        out.append({"input_ids": ids[i], "attention_mask": torch.ones(seq_len, dtype=torch.long), "labels": labels})
    return out


def llama15m() -> torch.nn.Module:
    from _common import llama_shape

    return llama_shape("llama15m")


MODELS = {
    "small": ("small Llama (std 0.02)", small_llama, 256),
    "tiny": ("tiny Llama (std 0.25)", tiny_llama, 16),
    "llama15m": ("Llama 15M (std 0.02)", llama15m, 32_000),
}


def errors(
    model: torch.nn.Module, data, matrix: str, n_vectors: int, steps=STEPS, lanczos_products: int = 60
) -> dict[float, tuple[float, float]]:
    contexts = TraceContexts.from_rows(data, causal=True)
    n = len(contexts)
    with evaluation_mode(model):
        exact = CurvatureOperator(model, contexts, n, measured_parameters(model), matrix=matrix, batch_size=n)
        space = parameter_space(model)
        generator = torch.Generator().manual_seed(1)
        vectors = []
        for _ in range(n_vectors):
            v = torch.randn(exact.dimension, generator=generator, dtype=torch.float64)
            vectors.append(v / v.norm())
        start = torch.randn(exact.dimension, generator=generator, dtype=torch.float64)
        top = thick_restart_lanczos(exact, start, 1, max_vectors=8, max_matvecs=lanczos_products, tol=1e-8)
        top = top.vectors[0].clone()
        references = [exact(v) for v in vectors]
        top_reference = exact(top)
        ritz = float(top @ top_reference)
        residual = float((top_reference - ritz * top).norm() / abs(ritz))
        largest = float(top.abs().max())
        print(f"  top Ritz value {ritz:.6g} (relative residual {residual:.1e}, largest |entry| {largest:.3f})")
        table = {}
        for h in steps:
            fd = FiniteDifferenceOperator(
                model, contexts, list(range(n)), n, n, space, matrix=matrix, batch_size=n, step=h
            )
            relative = [float((fd(v) - ref).norm() / ref.norm()) for v, ref in zip(vectors, references, strict=True)]
            along_top = float((fd(top) - top_reference).norm() / top_reference.norm())
            table[h] = (along_top, sorted(relative)[len(relative) // 2])
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 vectors instead of 7")
    parser.add_argument("--models", default="small,tiny", help=f"comma-separated, of {list(MODELS)}")
    parser.add_argument("--dtypes", default="float32,float64")
    parser.add_argument("--matrices", default="hessian,fisher")
    parser.add_argument("--steps", default=",".join(f"{h:g}" for h in STEPS), help="the fixed steps h tried")
    parser.add_argument("--lanczos-products", type=int, default=60, help="exact products for the top eigenvector")
    args = parser.parse_args()
    n_vectors = 3 if args.quick else 7
    fixed = [float(h) for h in args.steps.split(",") if h]
    for key in args.models.split(","):
        name, build, vocab = MODELS[key]
        for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
            model = build().to(dtype)
            n_params = sum(p.numel() for p in model.parameters())
            norm = float(torch.cat([p.detach().double().reshape(-1) for p in model.parameters()]).norm())
            rule = RELATIVE_STEP * norm
            for matrix in args.matrices.split(","):
                table = errors(model, rows(vocab, 8), matrix, n_vectors, (*fixed, rule), args.lanczos_products)
                best = min(fixed, key=lambda h: table[h][0])
                cells = " ".join(f"{h:g}:{table[h][0]:.1e}/{table[h][1]:.1e}" for h in fixed)
                label = f"{name}, {n_params} parameters, ||w|| {norm:.3g}, {str(dtype)[6:]}, {matrix}"
                print(
                    f"{label}: best h along the top eigenvector={best:g} | h:top/random {cells} | "
                    f"rule h={rule:.2e}:{table[rule][0]:.1e}/{table[rule][1]:.1e}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
