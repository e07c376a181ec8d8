"""Cost of output-layer SAM (logits-SAM) against a plain step, with the trunk's forward run once per step.

Two config-built Llamas: one whose output layer is about a third of a step's matrix-multiply work and one where it is
about a tenth, each trained by `FlatBiasTrainer` (causal-LM loss, full logits), `FlatBiasSFTTrainer` (trl's fused
LM head) and `FlatBiasDPOTrainer` (trl's sigmoid DPO loss through its fused head, with a live reference model; a batch
of ``batch / 2`` preference pairs is ``batch`` sequences, prompt and response each half of ``seq_len`` unless
``--prompt-share`` says otherwise). The arms,
interleaved so that load on a shared machine hits them alike: the plain step (``flatness_method="none"``; for DPO
trl's step, whose loss also runs the reference model's forward), output-layer SAM as it runs now (the second pass
replays the trunk's outputs; in SFT both passes form the head's gradients in the forward instead of trl's fused head;
in DPO both passes keep each trained row's ``softmax - onehot`` to the head's backward, the reference's
log-probabilities computed once at the step's start), for DPO the same step with trl's fused head in both passes
(``sam_kept_softmax_mib=0``, the step before the kept rows), and output-layer SAM with the replay switched off (two
whole forwards through trl's head, the step before the replay).
Step times are this process's CPU time (``time.process_time``), medians over repeats; the spread printed beside each
ratio is the range of the per-repeat ratios (each repeat's median over its plain arm's median).

Before the steps, each model's LM head alone on one batch's rows (interleaved the same way): trl's fused head as a
plain SFT step runs it (forward with the metric fields, backward to the hidden states and the head) and as the replayed
step ran it before (first pass: metrics, head gradient; second: both gradients, no metrics), against
`label_log_probs`'s two passes.

    python benchmarks/logits_sam_cost.py [--quick] [--repeats N] [--trainers NAME ...] [--no-two-forwards]
        [--no-trl-head] [--prompt-share F]

The head share printed is of the per-token multiply-adds: head ``V * H`` against the layers' projections plus the
attention scores (``2 * seq_len * H`` per layer). The last lines are ``<model>_<trainer>_<arm>_ratio=X``: step time
over the plain step's.
"""

from __future__ import annotations

import argparse
import copy
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from _common import (  # noqa: E402
    TIMING_ARGUMENTS,
    interleaved_step_times,
    median_step,
    run_timed_trainer,
    step_ratio,
    timing_parser,
)
from datasets import Dataset  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from trl.trainer.utils import _ChunkedLogProbFunction  # noqa: E402

from hf_flatbias import (  # noqa: E402
    FlatBiasConfig,
    FlatBiasDPOConfig,
    FlatBiasDPOTrainer,
    FlatBiasSFTConfig,
    FlatBiasSFTTrainer,
    FlatBiasTrainer,
)
from hf_flatbias.sharpness.head_gradients import label_log_probs  # noqa: E402
from hf_flatbias.synthetic.tokenizer import make_tokenizer  # noqa: E402
from tests.helpers.tiny_models import word_tokenizer  # noqa: E402

#: name: (vocab, hidden, layers), intermediate 4 x hidden; both at seq_len 128.
MODELS = {"head_third": (2048, 128, 2), "head_tenth": (2000, 256, 4)}
QUICK_MODELS = {"head_third": (1024, 64, 2), "head_tenth": (1024, 128, 4)}
TRAINERS = ("FlatBiasTrainer", "FlatBiasSFTTrainer", "FlatBiasDPOTrainer")
#: trl's defaults that would change what is timed: bf16 autocast and activation checkpointing.
TRL_TIMING_ARGUMENTS = dict(bf16=False, gradient_checkpointing=False, max_length=None, dataset_num_proc=None)
ARMS = {
    "plain": dict(flatness_method="none"),
    "output_layer_sam": dict(flatness_method="sam", sam_parameters="output_layer"),
    # DPO only: trl's fused head in both passes
    "output_layer_sam_trl_head": dict(flatness_method="sam", sam_parameters="output_layer", sam_kept_softmax_mib=0),
    "output_layer_sam_two_forwards": dict(flatness_method="sam", sam_parameters="output_layer"),
}
#: The LM head alone: (head, metric fields computed, the hidden states take a gradient).
HEAD_PASSES = {
    "trl_plain_pass": ("trl", True, True),
    "trl_first_pass": ("trl", True, False),
    "trl_second_pass": ("trl", False, True),
    "head_gradients_first_pass": ("ours", True, False),
    "head_gradients_second_pass": ("ours", False, True),
}
TRL_METRIC_FIELDS = ("log_probs", "entropy", "is_top1")


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
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def head_share(vocab: int, hidden: int, layers: int, seq_len: int) -> float:
    per_layer = 4 * hidden * hidden + 3 * hidden * 4 * hidden + 2 * seq_len * hidden
    return vocab * hidden / (vocab * hidden + layers * per_layer)


def preference_pairs(rows: list[list[int]], prompt_share: float = 0.5) -> Dataset:
    """One preference pair of `word_tokenizer`'s words per two of ``rows`` (token ids from 5): the prompt the first
    ``prompt_share`` of the first row, the responses the rest of both, less one word for the end-of-sequence token
    trl appends, so that every sequence is as long as a row."""
    half = max(1, round(len(rows[0]) * prompt_share))

    def text(ids: list[int]) -> str:
        return " ".join(f"w{token - 5}" for token in ids)

    pairs = zip(rows[::2], rows[1::2], strict=True)
    return Dataset.from_list(
        [
            {
                "prompt": text(first[:half]),
                "chosen": " " + text(first[half:-1]),
                "rejected": " " + text(second[half:-1]),
            }
            for first, second in pairs
        ]
    )


def time_arm(trainer_name: str, arm: str, data, shape, seq_len: int, steps: int, batch: int) -> list[float]:
    common = dict(max_steps=steps, per_device_train_batch_size=batch, **TIMING_ARGUMENTS, **ARMS[arm])
    model = build_llama(*shape, seq_len)

    def make_trainer(out: str):
        if trainer_name == "FlatBiasTrainer":
            rows = [{"input_ids": torch.tensor(r), "labels": torch.tensor(r)} for r in data["rows"]]
            trainer = FlatBiasTrainer(model=model, args=FlatBiasConfig(out, **common), train_dataset=rows)
        elif trainer_name == "FlatBiasSFTTrainer":
            args = FlatBiasSFTConfig(out, **common, **TRL_TIMING_ARGUMENTS)
            rows = Dataset.from_dict({"input_ids": data["rows"]})
            trainer = FlatBiasSFTTrainer(model=model, args=args, train_dataset=rows, processing_class=data["tokenizer"])
        else:
            # a batch of `batch` sequences: chosen and rejected of batch / 2 pairs
            args = FlatBiasDPOConfig(
                out, **{**common, "per_device_train_batch_size": batch // 2}, **TRL_TIMING_ARGUMENTS
            )
            trainer = FlatBiasDPOTrainer(
                model=model,
                ref_model=copy.deepcopy(model),
                args=args,
                train_dataset=data["pairs"],
                processing_class=data["pair_tokenizer"],
            )
        if arm == "output_layer_sam_two_forwards":
            trainer.flatness_method.trunk_replay = lambda module: (None, 1.0)
        return trainer

    return run_timed_trainer(make_trainer, clock=time.process_time)


def time_head_pass(
    arm: str, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, calls: int
) -> list[float]:
    """CPU time of ``calls`` forwards and backwards of the mean token NLL through one head pass of `HEAD_PASSES`."""
    kind, metrics, hidden_gradient = HEAD_PASSES[arm]
    durations = []
    for _ in range(calls):
        rows, head = hidden.clone().requires_grad_(hidden_gradient), weight.clone().requires_grad_()
        start = time.process_time()
        if kind == "trl":
            fields = TRL_METRIC_FIELDS if metrics else ("log_probs",)
            log_probs = _ChunkedLogProbFunction.apply(rows, head, None, labels, 1.0, 32768, None, 1.0, fields)[0]
        else:
            log_probs = label_log_probs(rows, head, None, labels, metrics=metrics).log_probs
        (-log_probs.sum() / labels.numel()).backward()
        durations.append(time.process_time() - start)
    return durations


def head_times(shape, seq_len: int, batch: int, repeats: int) -> dict[str, list[list[float]]]:
    vocab, hidden_size, _ = shape
    generator = torch.Generator().manual_seed(0)
    rows = batch * (seq_len - 1)
    hidden = torch.randn(rows, hidden_size, generator=generator)
    weight = torch.randn(vocab, hidden_size, generator=generator) / hidden_size**0.5
    labels = torch.randint(0, vocab, (rows,), generator=generator)
    return interleaved_step_times(
        list(HEAD_PASSES), lambda arm: time_head_pass(arm, hidden, weight, labels, 8), repeats
    )


def main() -> None:
    parser = timing_parser(__doc__, "smaller models and fewer steps (a few minutes)")
    parser.add_argument("--trainers", nargs="+", choices=TRAINERS, default=list(TRAINERS), help="trainers to time")
    parser.add_argument(
        "--two-forwards", action=argparse.BooleanOptionalAction, default=True, help="time the two-forward arm too"
    )
    parser.add_argument(
        "--trl-head",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time DPO's replayed step with trl's fused head too (sam_kept_softmax_mib=0)",
    )
    parser.add_argument(
        "--prompt-share",
        type=float,
        default=0.5,
        help="DPO: share of each sequence that is prompt (not scored by the loss). On a CPU trl's fused head scores "
        "every position, the head of the replayed SAM step only the response's; a small share puts both on about "
        "the same rows, as trl's GPU kernel (which scores only the response) does",
    )
    args = parser.parse_args()
    trainers = tuple(args.trainers)
    skipped = {"output_layer_sam_two_forwards": not args.two_forwards, "output_layer_sam_trl_head": not args.trl_head}

    def arms_of(trainer_name: str) -> list[str]:
        dpo_only = trainer_name != "FlatBiasDPOTrainer" and "output_layer_sam_trl_head"
        return [arm for arm in ARMS if not skipped.get(arm) and arm != dpo_only]

    models = QUICK_MODELS if args.quick else MODELS
    repeats = args.repeats or (2 if args.quick else 3)
    steps, batch, seq_len = (8, 4, 64) if args.quick else (10, 8, 128)
    heads = {model_name: head_times(shape, seq_len, batch, repeats) for model_name, shape in models.items()}
    data = {}
    for model_name, shape in models.items():
        generator = torch.Generator().manual_seed(0)
        rows = torch.randint(5, shape[0], (steps * batch, seq_len), generator=generator).tolist()
        data[model_name] = dict(
            rows=rows,
            tokenizer=make_tokenizer([f"w{i}" for i in range(shape[0] - 5)]),
            # word i is token 4 + i here (four special tokens, the end-of-sequence one among them)
            pairs=preference_pairs(rows, args.prompt_share),
            pair_tokenizer=word_tokenizer(shape[0] - 4),
        )
    times = interleaved_step_times(
        [(m, t, a) for m in models for t in trainers for a in arms_of(t)],
        lambda key: time_arm(key[1], key[2], data[key[0]], models[key[0]], seq_len, steps, batch),
        repeats,
    )
    print(f"batch {batch} x {seq_len} tokens, AdamW, torch threads {torch.get_num_threads()}, CPU time per step")
    if "FlatBiasDPOTrainer" in trainers:
        print(f"DPO prompt share {args.prompt_share} of each sequence")
    for model_name, shape in models.items():
        n_params = sum(p.numel() for p in build_llama(*shape, seq_len).parameters())
        share = head_share(*shape, seq_len)
        print(f"{model_name}: Llama {n_params / 1e6:.2f}M (vocab {shape[0]}, hidden {shape[1]}, {shape[2]} layers), ")
        print(f"  head share of the multiply-adds {share:.2f}")
        described = ", ".join(f"{arm} {median_step(t) * 1e3:.1f} ms" for arm, t in heads[model_name].items())
        print(f"  LM head alone, {batch * (seq_len - 1)} rows: {described}")
        for trainer_name in trainers:
            medians = {arm: median_step(times[model_name, trainer_name, arm]) for arm in arms_of(trainer_name)}
            count = sum(len(repeat) for repeat in times[model_name, trainer_name, "plain"])
            described = ", ".join(f"{arm} {value * 1e3:.1f} ms" for arm, value in medians.items())
            print(f"  {trainer_name}: {described} (medians of {count})")
    for model_name in models:
        for trainer_name in trainers:
            for arm in arms_of(trainer_name)[1:]:
                ratio, low, high = step_ratio(
                    times[model_name, trainer_name, arm], times[model_name, trainer_name, "plain"]
                )
                print(f"{model_name}_{trainer_name}_{arm}_ratio={ratio:.3f} (per-repeat {low:.3f}-{high:.3f})")


if __name__ == "__main__":
    main()
