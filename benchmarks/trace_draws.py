"""How many draws per context, and what the output-layer expectation buys, on a model that uses its context.

A small BERT is trained on sentences of a synthetic Markov chain (an HMM with one word per state and two
successors per state, so the masked word depends strongly on its neighbours), then `per_sample` is run with and
without the exact expectation of the output layer's term. Prints the one-draw and between-context variances, the
suggested draws per context and the efficiency (stderr^2 x CPU seconds) at 1, 2 and 8 draws, all from one run.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/trace_draws.py
"""

from __future__ import annotations

import argparse
import math
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from transformers import BertConfig, BertForMaskedLM  # noqa: E402

from hf_flatbias.flatness import build_masked_contexts, estimate_hessian_trace  # noqa: E402
from hf_flatbias.synthetic import HMM  # noqa: E402
from hf_flatbias.synthetic.tokenizer import MASK_ID, N_SPECIAL, PAD_ID, word_ids_to_token_ids  # noqa: E402

N_WORDS, LENGTH = 40, 24


def train(model: BertForMaskedLM, sequences: torch.Tensor, steps: int, seed: int) -> list[float]:
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    model.train()
    for _ in range(steps):
        batch = sequences[torch.randint(len(sequences), (32,), generator=generator)]
        labels = batch.clone()
        masked = (torch.rand(batch.shape, generator=generator) < 0.15) & (batch >= N_SPECIAL)
        labels[~masked] = -100
        inputs = batch.masked_fill(masked, MASK_ID)
        loss = model(input_ids=inputs, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--contexts", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    # one word per state and two successors each: a Markov chain whose masked word its neighbours nearly determine
    hmm = HMM.from_seed(args.seed, n_states=N_WORDS, n_words=N_WORDS, successors=2, words_per_state=1)
    sample = hmm.sample(4000, LENGTH, seed=args.seed)
    sequences = torch.tensor([word_ids_to_token_ids(row) for row in sample.word_ids])
    torch.manual_seed(args.seed)
    config = BertConfig(
        vocab_size=N_SPECIAL + N_WORDS,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=LENGTH + 2,
        pad_token_id=PAD_ID,
    )
    model = BertForMaskedLM(config)
    start = time.process_time()
    losses = train(model, sequences, args.steps, args.seed)
    counts = torch.bincount(sequences[:, 1:-1].reshape(-1), minlength=config.vocab_size).double()
    unigram = -(counts / counts.sum() * (counts / counts.sum()).clamp_min(1e-12).log()).sum()
    print(
        f"BERT {sum(p.numel() for p in model.parameters()) / 1e3:.0f}k parameters, {args.steps} steps "
        f"({time.process_time() - start:.0f} CPU s): MLM loss {sum(losses[-50:]) / 50:.3f} nats vs unigram entropy "
        f"{float(unigram):.3f} (lower means the model uses its context)"
    )
    heldout = hmm.sample(args.contexts, LENGTH, seed=args.seed + 1)
    rows = [{"input_ids": word_ids_to_token_ids(row)} for row in heldout.word_ids]
    contexts = build_masked_contexts(rows, mask_token_id=MASK_ID, seed=args.seed, special_token_ids=range(N_SPECIAL))
    print(
        "| output term | draws | mean | stderr | one-draw var | between-context var | suggested K | stderr^2 x CPU s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for exact in (True, False):
        for n_draws in (8, 2, 1):
            begin = time.process_time()
            estimate = estimate_hessian_trace(
                model, contexts, n_draws=n_draws, seed=args.seed, exact_output_expectation=exact
            )
            cpu = time.process_time() - begin
            draw_var = f"{estimate.draw_variance:.1f}" if estimate.draw_variance is not None else "-"
            ctx_var = f"{estimate.context_variance:.1f}" if estimate.context_variance is not None else "-"
            print(
                f"| {'exact' if exact else 'sampled'} | {n_draws} | {estimate.mean:.2f} | {estimate.stderr:.3f} | "
                f"{draw_var} | {ctx_var} | {estimate.suggested_n_draws or '-'} | "
                f"{estimate.stderr**2 * cpu:.4f} |",
                flush=True,
            )
    assert math.isfinite(estimate.mean)


if __name__ == "__main__":
    main()
