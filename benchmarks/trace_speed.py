"""Statistical efficiency of the Hessian-trace estimators against the naive loop, measured in one run.

Efficiency is ``stderr^2 x seconds`` (lower is better): the squared standard error an estimator reaches times the
time it took. Seconds are the process's CPU seconds: on a shared machine wall-clock time mostly measures the
neighbours (wall seconds are printed too). Efficiency does not depend on how many contexts were used (the variance
falls as 1/n while the time grows as n), so every estimator runs on as many contexts as its speed allows. The naive
loop is the paper's procedure: 50 draws per context, one forward and one backward each.

Model: a ~4.5M-parameter BERT (hidden 256, 4 layers, 4 heads, intermediate 1024, vocabulary 5,000), sequences of
64 tokens, one masked position per context. Prints a table and, as its last line, ``trace_speedup_vs_naive=X``: the
naive loop's efficiency over the best estimator's.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/trace_speed.py --quick
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from transformers import BertConfig, BertForMaskedLM  # noqa: E402

from hf_flatbias.flatness import TraceEstimate, build_masked_contexts, estimate_hessian_trace  # noqa: E402

VOCAB, SEQ_LEN, MASK_ID, FIRST_WORD = 5000, 64, 4, 5


def build_model(seed: int) -> BertForMaskedLM:
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=1024,
        max_position_embeddings=SEQ_LEN,
    )
    return BertForMaskedLM(config).eval()


def build_contexts(n: int, seed: int) -> list[dict[str, list[int]]]:
    """Zipf-distributed tokens, so that frequent and rare words (and their embedding rows) both occur."""
    generator = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, VOCAB - FIRST_WORD + 1, dtype=torch.float64)
    rows = [
        {
            "input_ids": (
                torch.multinomial(weights, SEQ_LEN, replacement=True, generator=generator) + FIRST_WORD
            ).tolist()
        }
        for _ in range(n)
    ]
    return build_masked_contexts(rows, mask_token_id=MASK_ID, seed=seed)


def efficiency(estimate: TraceEstimate, cpu_seconds: float) -> float:
    return estimate.stderr**2 * cpu_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer contexts: under 3 minutes on one CPU thread")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    scale = 1 if args.quick else 4
    model = build_model(args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    contexts = build_contexts(160 * scale, args.seed)
    # (label, estimator, n_contexts, n_draws, extra keyword arguments)
    runs = [
        ("naive, 50 draws (paper)", "naive", 4 * scale, 50, {}),
        ("naive, 1 draw", "naive", 24 * scale, 1, {}),
        ("per_sample, 50 draws", "per_sample", 6 * scale, 50, {}),
        ("per_sample, 2 draws", "per_sample", 128 * scale, 2, {}),
        ("per_sample, 1 draw", "per_sample", 128 * scale, 1, {}),
        ("per_sample, 2 draws, sampled output term", "per_sample", 128 * scale, 2, {"exact_output_expectation": False}),
        ("summed, 2 draws, batches of 8", "summed", 128 * scale, 2, {"batch_size": 8}),
        ("hutchinson, 2 probes, batches of 8", "hutchinson", 48 * scale, 2, {"batch_size": 8}),
    ]
    print(
        f"BERT with {n_params / 1e6:.2f}M parameters, {SEQ_LEN} tokens, vocabulary {VOCAB}, "
        f"{torch.get_num_threads()} thread(s)"
    )
    header = (
        f"| {'estimator':42s} | contexts | draws |     mean | stderr | CPU s | wall s "
        "| CPU s/context | stderr^2 x CPU s |"
    )
    print(header)
    print("|" + "|".join("-" * (len(cell)) for cell in header.split("|")[1:-1]) + "|")
    results: dict[str, TraceEstimate] = {}
    cpu: dict[str, float] = {}
    for label, estimator, n_contexts, n_draws, extra in runs:
        start = time.process_time()
        estimate = estimate_hessian_trace(
            model, contexts, n_contexts=n_contexts, n_draws=n_draws, estimator=estimator, seed=args.seed, **extra
        )
        results[label], cpu[label] = estimate, time.process_time() - start
        print(
            f"| {label:42s} | {n_contexts:8d} | {n_draws:5d} | {estimate.mean:8.1f} | {estimate.stderr:6.2f} | "
            f"{cpu[label]:5.1f} | {estimate.seconds:6.1f} | {cpu[label] / n_contexts:13.3f} | "
            f"{efficiency(estimate, cpu[label]):16.1f} |",
            flush=True,
        )
    per_sample = results["per_sample, 2 draws"]
    print(
        f"per_sample variance split: one-draw variance {per_sample.draw_variance:.1f}, between contexts "
        f"{per_sample.context_variance:.1f}, suggested draws per context {per_sample.suggested_n_draws}"
    )

    def eff(label: str) -> float:
        return efficiency(results[label], cpu[label])

    naive = "naive, 50 draws (paper)"
    fisher_estimators = [k for k in results if not k.startswith(("naive", "hutchinson"))]
    best = min(fisher_estimators, key=eff)
    per_draw_naive = cpu[naive] / (results[naive].n_contexts * 50)
    per_draw_fast = cpu["per_sample, 50 draws"] / (results["per_sample, 50 draws"].n_contexts * 50)
    print(
        f"CPU time per draw at 50 draws/context: naive {per_draw_naive:.3f} s, per_sample {per_draw_fast:.4f} s "
        f"({per_draw_naive / per_draw_fast:.1f}x)"
    )
    print(f"efficiency of the best estimator vs naive at 1 draw/context: {eff('naive, 1 draw') / eff(best):.1f}x")
    print(f"efficiency of per_sample vs naive, both at 50 draws: {eff(naive) / eff('per_sample, 50 draws'):.1f}x")
    print(f"best estimator: {best}")
    print(f"trace_speedup_vs_naive={eff(naive) / eff(best):.1f}")


if __name__ == "__main__":
    main()
