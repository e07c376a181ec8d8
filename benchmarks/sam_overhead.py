"""Cost of a SAM step relative to a plain AdamW step on the same small BERT, measured in one run.

Two forward-backward passes bound the ratio below by about 2.0; the goal is <= 2.05 with at most one extra copy of
the parameters. Plain and SAM runs are interleaved so that load on a shared machine hits both alike.

    python benchmarks/sam_overhead.py [--quick]

The last line is ``sam_step_ratio=X`` (median SAM step time / median plain step time).
"""

from __future__ import annotations

import os
import statistics

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from _common import (  # noqa: E402
    TIMING_ARGUMENTS,
    build_model,
    choose_sizes,
    masked_lm_rows,
    run_timed_trainer,
    timing_parser,
)

from hf_flatbias import FlatBiasConfig, FlatBiasTrainer  # noqa: E402

HEAD_SIZE = 64  # attention heads = hidden // HEAD_SIZE


def time_steps(method: str, rows, model_kwargs, steps: int, batch_size: int) -> list[float]:
    def make_trainer(out: str) -> FlatBiasTrainer:
        args = FlatBiasConfig(
            out, flatness_method=method, max_steps=steps, per_device_train_batch_size=batch_size, **TIMING_ARGUMENTS
        )
        model = build_model(**model_kwargs, head_size=HEAD_SIZE)
        return FlatBiasTrainer(model=model, args=args, train_dataset=rows)

    return run_timed_trainer(make_trainer)


def main() -> None:
    args = timing_parser(__doc__, "a smaller model and fewer repeats (under 2 minutes)").parse_args()
    model_kwargs, repeats, steps, batch = choose_sizes(
        args,
        quick=(dict(hidden=128, layers=2, vocab=2000, seq_len=64), 3, 12, 16),
        full=(dict(hidden=256, layers=4, vocab=8000, seq_len=64), 5, 20, 32),
    )
    rows = masked_lm_rows(steps * batch, model_kwargs["seq_len"], model_kwargs["vocab"])
    n_params = sum(p.numel() for p in build_model(**model_kwargs, head_size=HEAD_SIZE).parameters())
    plain, sam = [], []
    for _ in range(repeats):
        plain += time_steps("none", rows, model_kwargs, steps, batch)
        sam += time_steps("sam", rows, model_kwargs, steps, batch)
    plain_median, sam_median = statistics.median(plain), statistics.median(sam)
    print(
        f"model: BERT-MLM {n_params / 1e6:.2f}M parameters, batch {batch} x {model_kwargs['seq_len']} tokens, "
        f"torch threads {torch.get_num_threads()}"
    )
    print(f"plain AdamW step: median {plain_median * 1e3:.1f} ms over {len(plain)} steps")
    print(f"SAM step:         median {sam_median * 1e3:.1f} ms over {len(sam)} steps")
    print(
        f"extra memory held during the SAM step: one parameter copy ({4 * n_params / 2**20:.1f} MiB in fp32): "
        "the first-gradient buffers are reused to save the weights"
    )
    print(f"sam_step_ratio={sam_median / plain_median:.3f}")


if __name__ == "__main__":
    main()
