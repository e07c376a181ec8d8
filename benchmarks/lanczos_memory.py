"""Peak memory and products of `estimate_top_eigenvalues` (thick-restart Lanczos) on ~100M and ~350M models.

The bound it should keep: the model, one product's working memory (one batch's graph, the vector in formation,
the gradients) and the basis of ``max_vectors`` vectors of ``parameters x vector_dtype`` bytes; nothing grows with
the number of batches or of products. The script measures one product's peak alone, then the whole run's peak, and
prints ``run peak / (one product's peak + basis)``: 1.0 or less means the bound holds. Peak memory is the process's
resident-set peak above what it held before (``large_model_trace.PeakMemory``: malloc_trim, then clear_refs; Linux).

Models (random init, from configs): BERT-base (110M) and a Llama shape (hidden 1024, 24 layers, 16 heads, gated MLP
2,816, vocabulary 32,000, tied head: 341M). The Fisher over all parameters, ``--n-contexts`` random contexts of
``--seq-len`` tokens in batches of ``--batch-size`` (two batches by default, so each product rebuilds one graph at a
time), float32 vectors.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/lanczos_memory.py --models bert:1,bert:3,llama350m:1:3

Last lines: ``bound_ratio[MODEL:k]=X``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from large_model_trace import FIRST_WORD, MASK_ID, PeakMemory, build  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from hf_flatbias.flatness import TraceContexts, build_masked_contexts  # noqa: E402
from hf_flatbias.flatness.lm import evaluation_mode, measured_parameters  # noqa: E402
from hf_flatbias.flatness.spectrum import (  # noqa: E402
    CurvatureOperator,
    default_max_vectors,
    estimate_top_eigenvalues,
)


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
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
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
        vector_bytes = dimension * 4
        device = torch.device("cpu")
        with evaluation_mode(model):
            with PeakMemory(device) as product_memory:
                contexts = TraceContexts.from_rows(rows, causal=causal)
                operator = CurvatureOperator(
                    model, contexts, len(rows), params, matrix="fisher", batch_size=args.batch_size,
                    vector_dtype=torch.float32,
                )  # fmt: skip
                vector = torch.randn(dimension, generator=torch.Generator().manual_seed(0))
                start = time.process_time()
                operator(vector)
                product_seconds = time.process_time() - start
            del operator, vector
            gc.collect()
        with PeakMemory(device) as run_memory:
            start = time.process_time()
            result = estimate_top_eigenvalues(
                model, rows, k=k, matrix="fisher", batch_size=args.batch_size, vector_dtype=torch.float32,
                max_vectors=max_vectors, max_iterations=args.max_iterations, tol=args.tol,
            )  # fmt: skip
            run_seconds = time.process_time() - start
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
            "previous_basis_mib": args.max_iterations * dimension * 8 / 2**20,
        }
        results.append(record)
        print(json.dumps(record), flush=True)
        del model, rows, params
        gc.collect()
    print(
        f"{args.n_contexts} contexts of {args.seq_len} tokens, batches of {args.batch_size}, float32 vectors, "
        f"{torch.get_num_threads()} thread(s), load average {os.getloadavg()[0]:.1f}"
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
