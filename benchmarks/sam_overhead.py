"""Cost of a SAM step relative to a plain AdamW step on the same small BERT, measured in one run.

Two forward-backward passes bound the ratio below by about 2.0; the goal is <= 2.05 with at most one extra copy of
the parameters. Plain and SAM runs are interleaved so that load on a shared machine hits both alike.

    python benchmarks/sam_overhead.py [--quick]

The last line is ``sam_step_ratio=X`` (median SAM step time / median plain step time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from _common import StepTimer, build_model, masked_lm_rows  # noqa: E402

from hf_flatbias import FlatBiasConfig, FlatBiasTrainer  # noqa: E402

HEAD_SIZE = 64  # attention heads = hidden // HEAD_SIZE


def time_steps(method: str, rows, model_kwargs, steps: int, batch_size: int) -> list[float]:
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as out:
        args = FlatBiasConfig(
            out,
            flatness_method=method,
            max_steps=steps,
            per_device_train_batch_size=batch_size,
            optim="adamw_torch",
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            use_cpu=True,
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        model = build_model(**model_kwargs, head_size=HEAD_SIZE)
        trainer = FlatBiasTrainer(model=model, args=args, train_dataset=rows, callbacks=[timer])
        trainer.train()
    return timer.durations[2:]  # the first steps pay for allocation and lazy initialisation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer repeats (under 2 minutes)")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    if args.quick:
        model_kwargs = dict(hidden=128, layers=2, vocab=2000, seq_len=64)
        repeats, steps, batch = args.repeats or 3, 12, 16
    else:
        model_kwargs = dict(hidden=256, layers=4, vocab=8000, seq_len=64)
        repeats, steps, batch = args.repeats or 5, 20, 32
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
