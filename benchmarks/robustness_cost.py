"""Cost of the robustness measures (weight noise, quantization, forgetting) as a ratio to one forward+backward of a
training pass on the same contexts, measured in one run on a ~14M-parameter BERT masked LM (hidden 320, 4 layers,
vocabulary 30522) built from a config.

The reference: the stock masked-LM forward (logits at every position) and backward of the mean loss over the
contexts, as one training step computes it (no optimizer step). Each measure runs on the same contexts; its cost is
this process's CPU time (one torch thread: load from other jobs on a shared machine inflates it less than wall time),
the median over repeats of (measure / reference of the same repeat). Expected from the pass counts, with a backward
about twice a forward and the measures reading logits at the predicted positions only: weight noise
``(1 + 2 n_draws * n_sigmas)`` forwards, about ``(1 + 2 n_draws n_sigmas) / 3``; quantization ``1 + n_bits`` forwards;
forgetting ``steps`` classifier training passes on the task batch plus two LM forwards and a copy of the model.

Measured (2 shared CPU cores, one thread, 3 repeats, 15.0M parameters, 32 contexts of 128 tokens): the reference
6.46 CPU s (most of it the 30522-way logits at all 4096 positions, which the measures compute at the 32 predicted
positions only); weight noise, 4 antithetic pairs at one sigma (9 forwards), 0.80; quantization at 8 and 4 bits,
group 64 (3 forwards plus the rounding of 15M weights), 0.29; forgetting, 10 AdamW steps on 8 task rows plus the
two LM losses and the copies, 1.22.

    python benchmarks/robustness_cost.py [--quick] [--repeats N]

Prints a markdown table and one ``ratio[measure]=X`` line per measure.
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
    estimate_quantization_sensitivity,
    estimate_weight_noise_sensitivity,
    measure_forgetting,
)
from hf_flatbias.flatness.contexts import build_masked_contexts  # noqa: E402

VOCAB = 30522
MASK_ID = 103


def build_bert(hidden: int, layers: int) -> BertForMaskedLM:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        intermediate_size=4 * hidden,
        max_position_embeddings=512,
    )
    return BertForMaskedLM(config)


def rows(n: int, seq_len: int, seed: int) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1000, VOCAB, (seq_len,), generator=g).tolist()} for _ in range(n)]


def cpu_seconds(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 2-layer hidden-128 BERT, 8 contexts of 64 tokens")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    hidden, layers, n_contexts, seq_len = (128, 2, 8, 64) if args.quick else (320, 4, 32, 128)
    model = build_bert(hidden, layers)
    n_params = sum(p.numel() for p in model.parameters())
    contexts = build_masked_contexts(rows(n_contexts, seq_len, 0), mask_token_id=MASK_ID, seed=0)
    task = [{"input_ids": r["input_ids"], "label": i % 2} for i, r in enumerate(rows(n_contexts, seq_len, 1))]
    batch = {k: torch.tensor([c[k] for c in contexts]) for k in ("input_ids", "attention_mask", "labels")}
    noise = dict(sigmas=[1e-2], n_draws=4, batch_size=n_contexts)
    quant = dict(bits=(8, 4), group_size=64, batch_size=n_contexts)
    forget = dict(steps=10, learning_rate=2e-5, batch_size=8, lm_batch_size=n_contexts)

    def reference() -> None:
        model.train()
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)
        model.eval()

    measures = {
        f"weight_noise ({noise['n_draws']} pairs x 1 sigma)": lambda: estimate_weight_noise_sensitivity(
            model, contexts, **noise
        ),
        "quantization (8 and 4 bits, group 64)": lambda: estimate_quantization_sensitivity(model, contexts, **quant),
        f"forgetting ({forget['steps']} steps of 8 rows)": lambda: measure_forgetting(model, contexts, task, **forget),
    }
    reference()  # warm-up
    for fn in measures.values():
        fn()
    ratios: dict[str, list[float]] = {name: [] for name in measures}
    seconds: dict[str, list[float]] = {name: [] for name in ["reference", *measures]}
    for _ in range(args.repeats):
        base = statistics.median(cpu_seconds(reference) for _ in range(3))
        seconds["reference"].append(base)
        for name, fn in measures.items():
            spent = cpu_seconds(fn)
            seconds[name].append(spent)
            ratios[name].append(spent / base)
    print(
        f"BERT MLM hidden {hidden}, {layers} layers, vocab {VOCAB}: {n_params / 1e6:.1f}M parameters; "
        f"{n_contexts} contexts of {seq_len} tokens; one torch thread, CPU time, {args.repeats} repeats\n"
    )
    print("| measure | CPU s (median) | ratio to one training forward+backward |")
    print("|---|---|---|")
    print(f"| training forward+backward (reference) | {statistics.median(seconds['reference']):.3f} | 1 |")
    for name in measures:
        print(f"| {name} | {statistics.median(seconds[name]):.3f} | {statistics.median(ratios[name]):.2f} |")
    print()
    for name in measures:
        print(f"ratio[{name.split(' ')[0]}]={statistics.median(ratios[name]):.3f}")


if __name__ == "__main__":
    main()
