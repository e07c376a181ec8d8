"""Cost of each SAM variant relative to a plain AdamW step on the same small Llama, measured in one run.

Variants: SAM, Functional-SAM, Functional-SAM with the Adam-preconditioned perturbation, sub-batch SAM
(``sam_ascent_fraction`` 0.25 and 0.5: expected near 1 + f plus the first pass's fixed costs) and SAM on the output
layer only (``sam_parameters="output_layer"``: its first gradient needs a forward and the head's backward only).
The step time is CPU time of this process (one thread), so load on a shared machine does not inflate it; variants
are interleaved over the repeats so that what remains of the load hits all alike.

    python benchmarks/sam_variants_cost.py [--quick]

Prints one ``<variant>_step_ratio=X`` line per variant (median step / median plain step).
"""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from _common import TIMING_ARGUMENTS, choose_sizes, run_timed_trainer, timing_parser  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from hf_flatbias import FlatBiasConfig, FlatBiasTrainer  # noqa: E402

VARIANTS: dict[str, dict] = {
    "plain": {"flatness_method": "none"},
    "sam": {"flatness_method": "sam"},
    "functional_sam": {"flatness_method": "functional_sam"},
    "precond_functional_sam": {"flatness_method": "functional_sam", "sam_preconditioner": "adam"},
    "subbatch_sam_0.25": {"flatness_method": "sam", "sam_ascent_fraction": 0.25},
    "subbatch_sam_0.5": {"flatness_method": "sam", "sam_ascent_fraction": 0.5},
    "output_layer_sam": {"flatness_method": "sam", "sam_parameters": "output_layer"},
}


def build_model(hidden: int, layers: int, vocab: int, seq_len: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=seq_len,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def causal_rows(n: int, seq_len: int, vocab: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (n, seq_len), generator=g)
    return [{"input_ids": ids[i], "labels": ids[i].clone()} for i in range(n)]


def time_steps(overrides: dict, rows, model_kwargs, steps: int, batch_size: int) -> list[float]:
    def make_trainer(out: str) -> FlatBiasTrainer:
        args = FlatBiasConfig(
            out, max_steps=steps, per_device_train_batch_size=batch_size, **TIMING_ARGUMENTS, **overrides
        )
        return FlatBiasTrainer(model=build_model(**model_kwargs), args=args, train_dataset=rows)

    return run_timed_trainer(make_trainer, clock=time.process_time)


def main() -> None:
    args = timing_parser(__doc__, "a smaller model and fewer repeats (about a minute)").parse_args()
    model_kwargs, repeats, steps, batch = choose_sizes(
        args,
        quick=(dict(hidden=128, layers=2, vocab=2000, seq_len=64), 2, 8, 8),
        full=(dict(hidden=256, layers=4, vocab=8000, seq_len=64), 3, 12, 16),
    )
    rows = causal_rows(steps * batch, model_kwargs["seq_len"], model_kwargs["vocab"])
    durations: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(repeats):
        for name, overrides in VARIANTS.items():
            durations[name] += time_steps(overrides, rows, model_kwargs, steps, batch)
    medians = {name: statistics.median(values) for name, values in durations.items()}
    n_params = sum(p.numel() for p in build_model(**model_kwargs).parameters())
    print(
        f"model: Llama {n_params / 1e6:.2f}M parameters (untied head, vocab {model_kwargs['vocab']}), batch {batch} x "
        f"{model_kwargs['seq_len']} tokens, torch threads {torch.get_num_threads()}, CPU time per step"
    )
    for name, median in medians.items():
        print(f"{name:>24}: median {median * 1e3:.1f} ms over {len(durations[name])} steps")
    for name, median in medians.items():
        if name != "plain":
            print(f"{name}_step_ratio={median / medians['plain']:.3f}")


if __name__ == "__main__":
    main()
