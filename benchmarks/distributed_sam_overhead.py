"""Cost of a SAM step relative to a plain step under DDP and DeepSpeed ZeRO-2/3, 2 CPU processes, in one run.

Run from the repository root (the DeepSpeed configs are read from recipes/configs):

    PYTHONPATH=$PWD accelerate launch --config_file recipes/configs/accelerate_cpu_2proc.yaml \
        benchmarks/distributed_sam_overhead.py [--steps 10] [--rounds 3]

Plain and SAM runs alternate round by round so that load on a shared machine hits both alike. Each line printed by
rank 0 is ``engine method median_step_s ratio_to_plain``. ``zero3-engine-release`` is SAM under ZeRO-3 dropping
the gathered parameters with ``engine.empty_partition_cache()`` (which also runs ``gc.collect()``) instead of the
optimizer's method, to show why the package calls the latter.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from _common import StepTimer, build_model, masked_lm_rows  # noqa: E402

from hf_flatbias import FlatBiasConfig, FlatBiasTrainer  # noqa: E402
from hf_flatbias.sharpness import engines  # noqa: E402
from tests.helpers.distributed_sam_script import (  # noqa: E402
    deepspeed_config,
    reset_accelerate,
    work_around_accelerate_cpu_world_size,
)

VOCAB, SEQ_LEN = 1000, 32


def time_run(engine: str, method: str, steps: int, launch_environment: dict[str, str]) -> list[float]:
    reset_accelerate(launch_environment)
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as out:
        values = dict(
            output_dir=out,
            flatness_method=method,
            max_steps=steps,
            per_device_train_batch_size=8,
            learning_rate=1e-4,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
            optim="adamw_torch",
        )
        if engine == "ddp":
            values["use_cpu"] = True
        else:
            values["deepspeed"] = deepspeed_config(int(engine[len("zero")]), {})
        model = build_model(hidden=64, layers=2, vocab=VOCAB, seq_len=SEQ_LEN, head_size=32)
        trainer = FlatBiasTrainer(
            model=model,
            args=FlatBiasConfig(**values),
            train_dataset=masked_lm_rows(16 * steps, SEQ_LEN, VOCAB),
            callbacks=[timer],
        )
        trainer.train()
    return timer.durations[2:]  # the first steps warm up allocators and the engine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    launch_environment = dict(os.environ)
    work_around_accelerate_cpu_world_size()
    runs = [
        ("ddp", "none"),
        ("ddp", "sam"),
        ("zero2", "none"),
        ("zero2", "sam"),
        ("zero3", "none"),
        ("zero3", "sam"),
        ("zero3-engine-release", "sam"),
    ]
    durations: dict[tuple[str, str], list[float]] = {run: [] for run in runs}
    original_release = engines.ZeroStage3Parameters.release_gathered

    def release_like_the_engine(self):
        original_release(self)
        gc.collect()

    for _ in range(options.rounds):
        for engine, method in runs:
            engines.ZeroStage3Parameters.release_gathered = (
                release_like_the_engine if engine == "zero3-engine-release" else original_release
            )
            durations[(engine, method)] += time_run(engine.split("-")[0], method, options.steps, launch_environment)
    if int(os.environ.get("RANK", "0")) == 0:
        medians = {run: statistics.median(values) for run, values in durations.items()}
        for (engine, method), median in medians.items():
            plain = medians[(engine.split("-")[0], "none")]
            print(f"{engine} {method} {median:.4f} {median / plain:.2f}", flush=True)


if __name__ == "__main__":
    main()
