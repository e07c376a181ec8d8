"""Cost of a SAM step inside trl's trainers: SAM step / plain step of the same trainer, measured in one run.

Three trainers on the same config-built Llama and the same token rows: `FlatBiasTrainer` (plain causal-LM loss),
`FlatBiasSFTTrainer` (trl's SFT loss, fused LM head, its metrics) and `FlatBiasDPOTrainer` (live reference model;
SAM computes the reference log-probabilities once per micro-batch, so its second pass runs the policy only and the
ratio may fall below 2). Plain and SAM runs of each trainer are interleaved so that load on a shared machine hits
both alike; the ratios are medians of step times.

    python benchmarks/trl_sam_overhead.py [--quick] [--functional-sam]

The last lines are ``<trainer>_sam_step_ratio=X`` (and, with ``--functional-sam``,
``<trainer>_functional_sam_step_ratio=X``: in the trl trainers its cotangent and surrogate are computed in chunks
through the fused LM head, in `FlatBiasTrainer` from the logits).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from _common import (  # noqa: E402
    TIMING_ARGUMENTS,
    choose_sizes,
    interleaved_step_times,
    median_step,
    run_timed_trainer,
    step_ratio,
    timing_parser,
)
from datasets import Dataset  # noqa: E402
from tokenizers import processors  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from hf_flatbias import (  # noqa: E402
    FlatBiasConfig,
    FlatBiasDPOConfig,
    FlatBiasDPOTrainer,
    FlatBiasSFTConfig,
    FlatBiasSFTTrainer,
    FlatBiasTrainer,
)
from hf_flatbias.synthetic.tokenizer import make_tokenizer  # noqa: E402

TRAINERS = ("FlatBiasTrainer", "FlatBiasSFTTrainer", "FlatBiasDPOTrainer")


def build_llama(vocab: int, hidden: int, layers: int, seq_len: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        max_position_embeddings=2 * seq_len,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config)


def token_rows(n: int, seq_len: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(5, vocab, (n, seq_len), generator=generator).tolist()


def time_steps(trainer_name: str, method: str, rows, tokenizer, sizes: dict, steps: int, batch: int) -> list[float]:
    common = dict(flatness_method=method, max_steps=steps, per_device_train_batch_size=batch, **TIMING_ARGUMENTS)
    trl_defaults_off = dict(bf16=False, gradient_checkpointing=False)
    model = build_llama(len(tokenizer), **sizes)

    def make_trainer(out: str):
        if trainer_name == "FlatBiasTrainer":
            data = [{"input_ids": torch.tensor(r), "labels": torch.tensor(r)} for r in rows]
            return FlatBiasTrainer(model=model, args=FlatBiasConfig(out, **common), train_dataset=data)
        if trainer_name == "FlatBiasSFTTrainer":
            args = FlatBiasSFTConfig(out, **common, **trl_defaults_off, max_length=None, dataset_num_proc=None)
            data = Dataset.from_dict({"input_ids": rows})
            return FlatBiasSFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
        half = len(rows[0]) // 2  # prompt: the first half; chosen and rejected: the second halves of two rows
        text = [" ".join(tokenizer.convert_ids_to_tokens(r)) for r in rows]
        halves = [(" ".join(t.split()[:half]), " " + " ".join(t.split()[half:])) for t in text]
        pairs = {
            "prompt": [p for p, _ in halves],
            "chosen": [c for _, c in halves],
            "rejected": [c for _, c in halves[1:] + halves[:1]],
        }
        args = FlatBiasDPOConfig(out, **common, **trl_defaults_off, max_length=None)
        return FlatBiasDPOTrainer(
            model=model,
            ref_model=build_llama(len(tokenizer), **sizes),
            args=args,
            train_dataset=Dataset.from_dict(pairs),
            processing_class=tokenizer,
        )

    return run_timed_trainer(make_trainer)


def main() -> None:
    parser = timing_parser(__doc__, "a smaller model and fewer repeats (a few minutes)")
    parser.add_argument("--functional-sam", action="store_true", help="time flatness_method='functional_sam' too")
    args = parser.parse_args()
    methods = ("none", "sam", "functional_sam") if args.functional_sam else ("none", "sam")
    sizes, repeats, steps, batch = choose_sizes(
        args,
        quick=(dict(hidden=64, layers=2, seq_len=64), 2, 10, 8),
        full=(dict(hidden=256, layers=4, seq_len=128), 3, 20, 16),
    )
    vocab = 2000
    tokenizer = make_tokenizer([f"w{i}" for i in range(vocab - 5)])
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B")
    tokenizer.eos_token = tokenizer.sep_token
    rows = token_rows(steps * batch, sizes["seq_len"], vocab)
    n_params = sum(p.numel() for p in build_llama(vocab, **sizes).parameters())
    times = interleaved_step_times(
        [(name, method) for name in TRAINERS for method in methods],
        lambda arm: time_steps(*arm, rows, tokenizer, sizes, steps, batch),
        repeats,
    )
    print(
        f"model: Llama {n_params / 1e6:.2f}M parameters, batch {batch} x {sizes['seq_len']} tokens (DPO: {batch} "
        f"pairs of {sizes['seq_len']} tokens), AdamW, torch threads {torch.get_num_threads()}"
    )
    for name in TRAINERS:
        plain, sam = median_step(times[name, "none"]), median_step(times[name, "sam"])
        count = sum(len(repeat) for repeat in times[name, "sam"])
        print(f"{name}: plain step {plain * 1e3:.1f} ms, SAM step {sam * 1e3:.1f} ms (medians of {count})")
    for name in TRAINERS:
        for method in methods[1:]:
            ratio, low, high = step_ratio(times[name, method], times[name, "none"])
            print(f"{name}_{method}_step_ratio={ratio:.3f} (per-repeat {low:.3f}-{high:.3f})")


if __name__ == "__main__":
    main()
