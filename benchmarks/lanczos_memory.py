"""Peak memory and products of `estimate_top_eigenvalues` (thick-restart Lanczos) on ~100M and ~350M models.

The bound it should keep: the model, one product's working memory (one batch's graph, the vector in formation, a
few parameters' gradients at a time) and the basis of ``max_vectors`` vectors of ``parameters x vector_dtype`` bytes;
nothing grows with the number of batches or of products. The script measures one product's peak alone (its input
vector left out: in the run it is a basis vector), then the whole run's peak, and prints
``run peak / (one product's peak + basis)``: 1.0 or less means the bound holds. Peak memory is the process's
resident-set peak above what it held before (``large_model_trace.PeakMemory``: malloc_trim, then clear_refs; Linux).

Models (random init, from configs): BERT-base (110M) and a Llama shape (hidden 1024, 24 layers, 16 heads, gated MLP
2,816, vocabulary 32,000, tied head: 341M). The Fisher over all parameters, ``--n-contexts`` random contexts of
``--seq-len`` tokens in batches of ``--batch-size`` (with one batch its graph is kept through the run; with several
each product rebuilds one graph at a time), vectors in ``--vector-dtype``. A product's cost grows with the tokens, its
memory hardly: a memory measurement at 341M can afford only a few short contexts on a shared CPU.
``--product-only`` times and measures one product per model and stops (the cost to expect of each of the run's
``--max-iterations`` products); during a run every fifth product's CPU seconds go to stderr.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/lanczos_memory.py --models bert:1,bert:3 --n-contexts 4 \
        --seq-len 16 --batch-size 2
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/lanczos_memory.py --models llama350m:1:4,llama350m:3:6 \
        --n-contexts 2 --seq-len 16 --batch-size 2 --tol 1e-3 --max-iterations 40 [--product-only]

Last lines: ``bound_ratio[MODEL:k]=X``."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from large_model_trace import FIRST_WORD, MASK_ID, PeakMemory, build  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from hf_flatbias.flatness import TraceContexts, build_masked_contexts  # noqa: E402
from hf_flatbias.flatness.curvature import CurvatureOperator  # noqa: E402
from hf_flatbias.flatness.lm import evaluation_mode, measured_parameters  # noqa: E402
from hf_flatbias.flatness.spectrum import default_max_vectors, estimate_top_eigenvalues  # noqa: E402

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def log_products(every: int) -> None:
    """Print every ``every``-th product's count and CPU seconds to stderr: a long run shows how far it got."""
    product = CurvatureOperator.__call__
    start = time.process_time()

    def logged(self, vector):
        result = product(self, vector)
        if self.n_matvecs % every == 0:
            print(f"  product {self.n_matvecs}: {time.process_time() - start:.0f} CPU s", file=sys.stderr, flush=True)
        return result

    CurvatureOperator.__call__ = logged


def build_model(name: str) -> torch.nn.Module:
    if name != "llama350m":
        return build(name)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32_000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config)


def masked_rows(model: torch.nn.Module, causal: bool, n: int, seq_len: int) -> list[dict[str, list[int]]]:
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    rows = [{"input_ids": torch.randint(FIRST_WORD, vocab, (seq_len,), generator=generator).tolist()} for _ in range(n)]
    return build_masked_contexts(rows, mask_token_id=None if causal else MASK_ID, causal=causal, seed=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models",
        default="bert:1,bert:3,llama350m:1:3",
        help="MODEL:k or MODEL:k:max_vectors, comma-separated (max_vectors defaults to default_max_vectors(k))",
    )
    parser.add_argument("--n-contexts", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-iterations", type=int, default=100)
    parser.add_argument("--tol", type=float, default=1e-4)
    parser.add_argument("--vector-dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--product-only", action="store_true", help="time and measure one product, no Lanczos run")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    dtype = DTYPES[args.vector_dtype]
    log_products(5)
    results = []
    for entry in args.models.split(","):
        name, k, *vectors = entry.split(":")
        k = int(k)
        max_vectors = int(vectors[0]) if vectors else default_max_vectors(k)
        model = build_model(name)
        causal = name != "bert"
        rows = masked_rows(model, causal, args.n_contexts, args.seq_len)
        params = measured_parameters(model)
        dimension = sum(p.numel() for p in params)
        vector_bytes = dimension * dtype.itemsize
        device = torch.device("cpu")
        with evaluation_mode(model):
            # the input is left out: in the run it is one of the basis vectors, counted there
            vector = torch.randn(dimension, generator=torch.Generator().manual_seed(0)).to(dtype)
            with PeakMemory(device) as product_memory:
                contexts = TraceContexts.from_rows(rows, causal=causal)
                operator = CurvatureOperator(
                    model, contexts, len(rows), params, matrix="fisher", batch_size=args.batch_size,
                    vector_dtype=dtype,
                )  # fmt: skip
                start, wall = time.process_time(), time.perf_counter()
                operator(vector)
                product_seconds, product_wall = time.process_time() - start, time.perf_counter() - wall
            del operator, vector
            gc.collect()
        print(
            f"{name}: {dimension / 1e6:.0f}M parameters, one product {product_seconds:.1f} CPU s "
            f"({product_wall:.1f} wall s), its peak {product_memory.peak / 2**20:.0f} MiB "
            f"= {product_memory.peak / vector_bytes:.2f} vectors, load average {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        if args.product_only:
            del model, rows, params
            gc.collect()
            continue
        with PeakMemory(device) as run_memory:
            start, wall = time.process_time(), time.perf_counter()
            result = estimate_top_eigenvalues(
                model, rows, k=k, matrix="fisher", batch_size=args.batch_size, vector_dtype=dtype,
                max_vectors=max_vectors, max_iterations=args.max_iterations, tol=args.tol,
            )  # fmt: skip
            run_seconds, run_wall = time.process_time() - start, time.perf_counter() - wall
        bound = product_memory.peak + max_vectors * vector_bytes
        record = {
            "model": name,
            "k": k,
            "parameters": dimension,
            "max_vectors": max_vectors,
            "vector_mib": vector_bytes / 2**20,
            "one_product_peak_mib": product_memory.peak / 2**20,
            "one_product_cpu_seconds": product_seconds,
            "bound_mib": bound / 2**20,
            "run_peak_mib": run_memory.peak / 2**20,
            "bound_ratio": run_memory.peak / bound,
            "eigenvalues": result.eigenvalues,
            "relative_residuals": [r / abs(v) for r, v in zip(result.residuals, result.eigenvalues, strict=True)],
            "converged": result.converged,
            "n_matvecs": result.n_matvecs,
            "run_cpu_seconds": run_seconds,
            "run_wall_seconds": run_wall,
            "load_average": os.getloadavg()[0],
            "process_peak_rss_mib": PeakMemory._rss("VmHWM:") / 2**20,
            "model_mib": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
            "vector_dtype": args.vector_dtype,
            "tol": args.tol,
            "max_iterations": args.max_iterations,
            "n_contexts": args.n_contexts,
            "seq_len": args.seq_len,
            "batch_size": args.batch_size,
            "previous_basis_mib": args.max_iterations * dimension * 8 / 2**20,
        }
        results.append(record)
        print(json.dumps(record), flush=True)
        del model, rows, params
        gc.collect()
    print(
        f"{args.n_contexts} contexts of {args.seq_len} tokens, batches of {args.batch_size}, "
        f"{args.vector_dtype} vectors, {torch.get_num_threads()} thread(s), load average {os.getloadavg()[0]:.1f}"
    )
    print("| model | k | parameters | vectors held | one product's peak MiB | bound MiB | run peak MiB | products |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['model']} | {r['k']} | {r['parameters'] / 1e6:.0f}M | {r['max_vectors']} | "
            f"{r['one_product_peak_mib']:.0f} | {r['bound_mib']:.0f} | {r['run_peak_mib']:.0f} | {r['n_matvecs']} |"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)
    for r in results:
        print(f"bound_ratio[{r['model']}:{r['k']}]={r['bound_ratio']:.3f}")


if __name__ == "__main__":
    main()
