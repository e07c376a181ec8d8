"""Statistical efficiency of the Hessian-trace estimators against a per-draw reference loop, measured in one run.

Efficiency is ``stderr^2 x seconds`` (lower is better): the squared standard error an estimator reaches times the
time it took. Seconds are the process's CPU seconds: on a shared machine wall-clock time mostly measures the
neighbours (wall seconds are printed too). Efficiency does not depend on how many contexts were used (the variance
falls as 1/n while the time grows as n), so every estimator runs on as many contexts as its speed allows.

The reference is the per-draw loop written as efficiently as a loop can be: one forward per context with the LM
head applied at the masked position only, then one backward per draw through that graph. At 50 draws per context
it is the paper's procedure (App. B.1); at 1 draw it is the best a per-draw loop can do. The package's own
``estimator="naive"`` (stock forward with logits at every position, and a separate forward to sample the labels)
is timed too, as what a straightforward loop costs.

Every measurement is repeated ``--repeats`` times on fresh contexts and draws; the ratios are reported as the median
and the range over repeats, because one run's stderr^2 on a few contexts is itself uncertain. A steadier figure for
the reference loops comes from a variance model: ``per_sample`` with the sampled output term draws the same
per-draw values as the loop, so its split of the variance (between contexts, one draw within a context) over 128
contexts predicts the loop's variance per context at K draws, ``context + draw / K``, which times the loop's
measured CPU seconds per context gives its efficiency.

Model: a ~4.5M-parameter BERT (hidden 256, 4 layers, 4 heads, intermediate 1024, vocabulary 5,000), sequences of
64 tokens, one masked position per context. The last line is ``trace_speedup_vs_paper_loop=X``: the median
efficiency of the 50-draw reference loop over ``per_sample`` at 2 draws.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/trace_speed.py --quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from transformers import BertConfig, BertForMaskedLM  # noqa: E402

from hf_flatbias.flatness import (  # noqa: E402
    TraceEstimate,
    TraceSamples,
    build_masked_contexts,
    estimate_hessian_trace,
    summarize_trace_samples,
)

VOCAB, SEQ_LEN, MASK_ID, FIRST_WORD = 5000, 64, 4, 5
PAPER_LOOP = "reference loop, 50 draws (paper, unverified)"
LOOP_1 = "reference loop, 1 draw"
STOCK_NAIVE_1 = "estimator='naive', 1 draw"
PER_SAMPLE_2 = "per_sample, 2 draws"
SAMPLED_2 = "per_sample, 2 draws, sampled output term"


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


def reference_loop(model: BertForMaskedLM, contexts, n_contexts: int, n_draws: int, seed: int) -> TraceEstimate:
    """Per-draw squared score norms: one forward per context, the head at the masked position, a backward per draw.

    Written against BERT's modules directly, independently of the package's estimators.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(seed)
    values = torch.empty(n_contexts, n_draws, dtype=torch.float64)
    start = time.perf_counter()
    for c, row in enumerate(contexts[:n_contexts]):
        input_ids = torch.as_tensor(row["input_ids"]).unsqueeze(0)
        position = next(i for i, label in enumerate(row["labels"]) if label != -100)
        hidden = model.bert(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).last_hidden_state
        log_probs = torch.log_softmax(model.cls(hidden[0, position]).float(), dim=-1)
        labels = torch.multinomial(log_probs.detach().exp(), n_draws, replacement=True, generator=generator)
        for k, label in enumerate(labels.tolist()):
            grads = torch.autograd.grad(log_probs[label], params, retain_graph=k < n_draws - 1, allow_unused=True)
            values[c, k] = sum(float(g.double().square().sum()) for g in grads if g is not None)
    samples = TraceSamples(values=values, weights=torch.ones(n_contexts), n_draws=n_draws, estimator="reference")
    return summarize_trace_samples(samples, seconds=time.perf_counter() - start)


def efficiency(estimate: TraceEstimate, cpu_seconds: float) -> float:
    return estimate.stderr**2 * cpu_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer contexts: a few minutes on one CPU thread")
    parser.add_argument("--repeats", type=int, default=3, help="independent repeats (fresh contexts and draws)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    scale = 1 if args.quick else 4
    model = build_model(args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    # (label, estimator or None for the reference loop, n_contexts, n_draws, extra keyword arguments)
    runs = [
        (PAPER_LOOP, None, 16 * scale, 50, {}),
        (LOOP_1, None, 64 * scale, 1, {}),
        (STOCK_NAIVE_1, "naive", 64 * scale, 1, {}),
        (PER_SAMPLE_2, "per_sample", 128 * scale, 2, {}),
        ("per_sample, 1 draw", "per_sample", 128 * scale, 1, {}),
        (SAMPLED_2, "per_sample", 128 * scale, 2, {"exact_output_expectation": False}),
        ("per_sample, 50 draws", "per_sample", 6 * scale, 50, {}),
        ("summed, 2 draws, batches of 8", "summed", 128 * scale, 2, {"batch_size": 8}),
        ("hutchinson, 2 probes, batches of 8", "hutchinson", 32 * scale, 2, {"batch_size": 8}),
    ]
    print(
        f"BERT with {n_params / 1e6:.2f}M parameters, {SEQ_LEN} tokens, vocabulary {VOCAB}, "
        f"{torch.get_num_threads()} thread(s), {args.repeats} repeat(s)"
    )
    header = (
        f"| repeat | {'estimator':36s} | contexts | draws |     mean | stderr | CPU s | wall s "
        "| CPU s/draw | stderr^2 x CPU s |"
    )
    print(header)
    print("|" + "|".join("-" * (len(cell)) for cell in header.split("|")[1:-1]) + "|")
    efficiencies: dict[str, list[float]] = {label: [] for label, *_ in runs}
    per_draw: dict[str, list[float]] = {label: [] for label, *_ in runs}
    modelled: dict[str, list[float]] = {label: [] for label, estimator, *_ in runs if estimator in (None, "naive")}
    for repeat in range(args.repeats):
        seed = args.seed + repeat
        contexts = build_contexts(160 * scale, seed)
        estimates_this_repeat: dict[str, tuple[int, float]] = {}
        split = None
        for label, estimator, n_contexts, n_draws, extra in runs:
            start = time.process_time()
            if estimator is None:
                estimate = reference_loop(model, contexts, n_contexts, n_draws, seed)
            else:
                estimate = estimate_hessian_trace(
                    model, contexts, n_contexts=n_contexts, n_draws=n_draws, estimator=estimator, seed=seed, **extra
                )
            cpu = time.process_time() - start
            efficiencies[label].append(efficiency(estimate, cpu))
            per_draw[label].append(cpu / (n_contexts * n_draws))
            if estimator is None or estimator == "naive":
                estimates_this_repeat[label] = (n_draws, cpu / n_contexts)
            if label == SAMPLED_2:
                split = estimate
            print(
                f"| {repeat:6d} | {label:36s} | {n_contexts:8d} | {n_draws:5d} | {estimate.mean:8.1f} | "
                f"{estimate.stderr:6.2f} | {cpu:5.1f} | {estimate.seconds:6.1f} | {per_draw[label][-1]:10.4f} | "
                f"{efficiencies[label][-1]:16.1f} |",
                flush=True,
            )
        for label, (n_draws, cpu_per_context) in estimates_this_repeat.items():
            variance_per_context = split.context_variance + split.draw_variance / n_draws
            modelled[label].append(variance_per_context * cpu_per_context / efficiencies[PER_SAMPLE_2][-1])

    def ratios(numerators: list[float], denominators: list[float]) -> list[float]:
        return [a / b for a, b in zip(numerators, denominators, strict=True)]

    print(f"\nmedian (range) over {args.repeats} repeats of the efficiency ratio, row / {PER_SAMPLE_2}:")
    for label in efficiencies:
        if label != PER_SAMPLE_2:
            print(f"  {label:40s} {spread(ratios(efficiencies[label], efficiencies[PER_SAMPLE_2]))}")
    print(f"the same ratios from the variance model (split of '{SAMPLED_2}'):")
    for label, values in modelled.items():
        print(f"  {label:40s} {spread(values)}")
    per_draw_50 = spread(ratios(per_draw[PAPER_LOOP], per_draw["per_sample, 50 draws"]))
    print(f"CPU time per draw at 50 draws, reference loop / per_sample: {per_draw_50}")
    per_draw_1 = spread(ratios(per_draw[STOCK_NAIVE_1], per_draw[LOOP_1]))
    print(f"CPU time per draw at 1 draw, estimator='naive' / reference loop: {per_draw_1}")
    speedups = ratios(efficiencies[PAPER_LOOP], efficiencies[PER_SAMPLE_2])
    print(f"trace_speedup_vs_paper_loop={statistics.median(speedups):.1f}")


def spread(values: list[float]) -> str:
    """Median and range, e.g. ``36.5x (7.1-55.7)``."""
    return f"{statistics.median(values):.1f}x ({min(values):.1f}-{max(values):.1f})"


if __name__ == "__main__":
    main()
