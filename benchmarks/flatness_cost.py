"""Cost of every flatness method relative to a plain AdamW step on the same small BERT, measured in one run.

Expected from the pass counts: SAM, ASAM and both penalties about 2 (two forward/backward passes per step); SAM or
LookSAM every k updates about 1 + 1/k (goal: <= 1 + 1.1/k). Runs of all methods are interleaved, repeat by repeat,
so load on a shared machine hits them alike; a run's cost is its mean CPU time per step (one torch thread) over a
whole number of k-cycles, and
each ratio is the median over repeats of (method run / plain run of the same repeat).

    python benchmarks/flatness_cost.py [--quick] [--repeats N]

Prints a markdown table and one ``ratio[method]=X`` line per method.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from _common import TIMING_ARGUMENTS, build_model, masked_lm_rows  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from hf_flatbias import FlatBiasConfig, FlatBiasTrainer  # noqa: E402

WARMUP_STEPS = 2
HEAD_SIZE = 32  # attention heads = hidden // HEAD_SIZE
# (label, config overrides, expected ratio from the pass count)
METHODS = [
    ("sam", {"flatness_method": "sam"}, 2.0),
    ("asam", {"flatness_method": "asam", "sam_rho": 0.5}, 2.0),
    ("fisher_penalty", {"flatness_method": "fisher_penalty"}, 2.0),
    ("grad_norm_penalty", {"flatness_method": "grad_norm_penalty"}, 2.0),
    ("sam_every_2", {"flatness_method": "sam", "sam_every_k": 2}, 1.5),
    ("sam_every_4", {"flatness_method": "sam", "sam_every_k": 4}, 1.25),
    ("sam_every_8", {"flatness_method": "sam", "sam_every_k": 8}, 1.125),
    ("looksam_every_4", {"flatness_method": "looksam", "sam_every_k": 4}, 1.25),
]


class StepClock(TrainerCallback):
    """CPU time of this process from the first timed step's start to the last step's end.

    With one torch thread, CPU time is the step's compute; wall time on a machine shared with other jobs also counts
    the time the process waited for a core, which varied 3x between identical runs here.
    """

    def __init__(self) -> None:
        self.start: float | None = None
        self.end = 0.0
        self.timed_steps = 0

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == WARMUP_STEPS:
            self.start = time.process_time()

    def on_step_end(self, args, state, control, **kwargs):
        if self.start is not None:
            self.end = time.process_time()
            self.timed_steps += 1

    @property
    def seconds_per_step(self) -> float:
        return (self.end - self.start) / self.timed_steps


def seconds_per_step(overrides: dict, rows, model_kwargs: dict, timed_steps: int, batch_size: int) -> float:
    clock = StepClock()
    with tempfile.TemporaryDirectory() as out:
        args = FlatBiasConfig(
            out,
            max_steps=WARMUP_STEPS + timed_steps,
            per_device_train_batch_size=batch_size,
            **TIMING_ARGUMENTS,
            **overrides,
        )
        model = build_model(**model_kwargs, head_size=HEAD_SIZE)
        trainer = FlatBiasTrainer(model=model, args=args, train_dataset=rows, callbacks=[clock])
        trainer.train()
    return clock.seconds_per_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer steps (under 2 minutes)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--timed-steps", type=int, default=None, help="steps timed per run (a multiple of 8)")
    args = parser.parse_args()
    if args.quick:
        model_kwargs = dict(hidden=64, layers=2, vocab=1000, seq_len=32)
        repeats, timed_steps, batch = args.repeats or 3, args.timed_steps or 8, 16
    else:
        model_kwargs = dict(hidden=128, layers=2, vocab=2000, seq_len=64)
        repeats, timed_steps, batch = args.repeats or 5, args.timed_steps or 16, 16
    rows = masked_lm_rows((WARMUP_STEPS + timed_steps) * batch, model_kwargs["seq_len"], model_kwargs["vocab"])
    n_params = sum(p.numel() for p in build_model(**model_kwargs, head_size=HEAD_SIZE).parameters())

    plain_runs: list[float] = []
    ratios: dict[str, list[float]] = {label: [] for label, _, _ in METHODS}
    runs: dict[str, list[float]] = {label: [] for label, _, _ in METHODS}
    started = time.perf_counter()
    for _ in range(repeats):
        plain = seconds_per_step({"flatness_method": "none"}, rows, model_kwargs, timed_steps, batch)
        plain_runs.append(plain)
        for label, overrides, _ in METHODS:
            runs[label].append(seconds_per_step(overrides, rows, model_kwargs, timed_steps, batch))
            ratios[label].append(runs[label][-1] / plain)

    print(
        f"model: BERT-MLM {n_params / 1e6:.2f}M parameters, batch {batch} x {model_kwargs['seq_len']} tokens, "
        f"torch threads {torch.get_num_threads()}, {repeats} repeats x {timed_steps} timed steps, "
        f"plain AdamW step median {statistics.median(plain_runs) * 1e3:.1f} ms, "
        f"benchmark wall time {time.perf_counter() - started:.0f} s"
    )
    # Load on a shared machine only ever adds time, so the fastest run of each method is a second, steadier view.
    print("| method | expected ratio | median ratio | min-max over repeats | fastest run / fastest plain run |")
    print("|---|---|---|---|---|")
    for label, _, expected in METHODS:
        values = ratios[label]
        print(
            f"| {label} | {expected:.3f} | **{statistics.median(values):.3f}** | {min(values):.3f}-{max(values):.3f} | "
            f"{min(runs[label]) / min(plain_runs):.3f} |"
        )
    for label, _, _ in METHODS:
        print(f"ratio[{label}]={statistics.median(ratios[label]):.3f}")


if __name__ == "__main__":
    main()
