"""What measuring a small model's trace inside a larger architecture costs, as ratios measured in one run.

For a small BERT and the larger architecture it is embedded into, prints the time of ``enlarge`` itself and of
``estimate_hessian_trace`` on the same contexts in the own and in the embedded architecture (the same function, so
the same sampled labels), and the two trace values.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/enlarge_trace_cost.py
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import BertConfig, BertForMaskedLM

from hf_flatbias.enlarge import enlarge
from hf_flatbias.flatness import estimate_hessian_trace


def config(hidden: int, layers: int, vocab: int = 45) -> BertConfig:
    return BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 16,
        intermediate_size=4 * hidden,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )


def contexts(n: int, length: int = 16, vocab: int = 45, seed: int = 0) -> list[dict[str, list[int]]]:
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(5, vocab, (length,), generator=generator).tolist()
        position = int(torch.randint(1, length - 1, (1,), generator=generator))
        labels = [-100] * length
        labels[position], ids[position] = ids[position], 4
        rows.append({"input_ids": ids, "attention_mask": [1] * length, "labels": labels})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", default="32x2")
    parser.add_argument("--large", default="128x4")
    parser.add_argument("--contexts", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    (small_hidden, small_layers), (large_hidden, large_layers) = (
        tuple(int(v) for v in text.split("x")) for text in (args.small, args.large)
    )
    torch.manual_seed(0)
    small = BertForMaskedLM(config(small_hidden, small_layers)).eval()
    start = time.perf_counter()
    large = enlarge(small, config(large_hidden, large_layers))
    enlarge_seconds = time.perf_counter() - start
    rows = contexts(args.contexts)
    own = estimate_hessian_trace(small, rows, n_draws=2)
    embedded = estimate_hessian_trace(large, rows, n_draws=2)
    print(
        f"model {args.small} ({small.num_parameters():,} parameters) into {args.large} "
        f"({large.num_parameters():,}); {args.contexts} contexts x 2 draws, 1 thread"
    )
    print(f"enlarge: {enlarge_seconds:.3f} s")
    print(f"trace, own architecture: {own.mean:.2f} +- {own.stderr:.2f} in {own.seconds:.2f} s")
    print(f"trace, embedded:         {embedded.mean:.2f} +- {embedded.stderr:.2f} in {embedded.seconds:.2f} s")
    print(
        f"time ratio embedded / own: {embedded.seconds / own.seconds:.2f}x; "
        f"enlarge / embedded trace: {enlarge_seconds / embedded.seconds:.3f}x"
    )


if __name__ == "__main__":
    main()
