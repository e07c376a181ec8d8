"""Cost of a Momentum-SAM step relative to a plain AdamW step on the same small BERT, measured in one run.

Momentum-SAM takes no extra gradient: its step is the plain forward/backward at ``w + e`` plus reading ``e`` from
AdamW's state (a few elementwise passes over the parameters), saving and restoring ``w``. The goal is <= 1.1. The
step time is CPU time of this process (one thread), so load on a shared machine does not inflate it; the arms are
interleaved over the repeats so that what remains of the load hits both alike. The first two steps of every run are
left out (allocation, and Momentum-SAM's first update, which is plain: the optimizer has no state yet).

    python benchmarks/momentum_sam_cost.py [--quick] [--repeats N]

The last line is ``momentum_sam_step_ratio=X`` (median Momentum-SAM step / median plain step).
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from _common import (  # noqa: E402
    TIMING_ARGUMENTS,
    build_model,
    choose_sizes,
    interleaved_step_times,
    masked_lm_rows,
    median_step,
    run_timed_trainer,
    step_ratio,
    timing_parser,
)

from hf_flatbias import FlatBiasConfig, FlatBiasTrainer  # noqa: E402

HEAD_SIZE = 64  # attention heads = hidden // HEAD_SIZE
ARMS = {"plain": {"flatness_method": "none"}, "momentum_sam": {"flatness_method": "momentum_sam", "sam_rho": 0.05}}


def main() -> None:
    args = timing_parser(__doc__, "a smaller model and fewer repeats (under 2 minutes)").parse_args()
    model_kwargs, repeats, steps, batch = choose_sizes(
        args,
        quick=(dict(hidden=128, layers=2, vocab=2000, seq_len=64), 3, 12, 16),
        full=(dict(hidden=256, layers=4, vocab=8000, seq_len=64), 5, 20, 32),
    )
    rows = masked_lm_rows(steps * batch, model_kwargs["seq_len"], model_kwargs["vocab"])
    n_params = sum(p.numel() for p in build_model(**model_kwargs, head_size=HEAD_SIZE).parameters())

    def time_arm(arm: str) -> list[float]:
        def make_trainer(out: str) -> FlatBiasTrainer:
            config = FlatBiasConfig(
                out, max_steps=steps, per_device_train_batch_size=batch, **ARMS[arm], **TIMING_ARGUMENTS
            )
            return FlatBiasTrainer(
                model=build_model(**model_kwargs, head_size=HEAD_SIZE), args=config, train_dataset=rows
            )

        return run_timed_trainer(make_trainer, clock=time.process_time)

    times = interleaved_step_times(list(ARMS), time_arm, repeats)
    ratio, low, high = step_ratio(times["momentum_sam"], times["plain"])
    print(
        f"model: BERT-MLM {n_params / 1e6:.2f}M parameters, batch {batch} x {model_kwargs['seq_len']} tokens, "
        f"torch threads {torch.get_num_threads()}, {repeats} repeats of {steps} steps (CPU time)"
    )
    print(f"plain AdamW step:   median {median_step(times['plain']) * 1e3:.1f} ms")
    print(f"Momentum-SAM step:  median {median_step(times['momentum_sam']) * 1e3:.1f} ms")
    print(f"per-repeat ratios: {low:.3f}-{high:.3f}")
    print(f"momentum_sam_step_ratio={ratio:.3f}")


if __name__ == "__main__":
    main()
