"""Checks that need one GPU, in one run of under 10 minutes; writes one JSON and prints a summary.

1. SAM step cost: median SAM step time over median plain AdamW step time, BERT-base size (110M), bf16 autocast.
2. SAM under reduced precision: the parameter change after a few SAM steps (SGD, fixed batches) in bf16 and in fp16
   (with the Trainer's GradScaler) against the same run in fp32, as ``||delta_half - delta_fp32|| / ||delta_fp32||``;
   tolerances below.
3. Trace throughput: `per_sample` at one draw on the BERT-base-sized model against a training step's forward and
   backward of the same batches (`large_model_trace.py`), with the auto batch size and peak memory.
4. SAM under DeepSpeed ZeRO-2 (fp32 weights, the only precision SAM supports there) in one process: parameters after
   a few steps against the same SAM run without DeepSpeed.

``--dry-run`` runs every part on a tiny BERT on CPU (fp16 is skipped: the GradScaler path needs a GPU), so CI keeps the
script working; its numbers mean nothing.

    PYTHONPATH=. python benchmarks/gpu_check.py --out gpu_check.json
    PYTHONPATH=. python benchmarks/gpu_check.py --dry-run --out /tmp/gpu_check.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from _common import StepTimer, build_model, masked_lm_rows  # noqa: E402
from large_model_trace import measure  # noqa: E402

from hf_flatbias import FlatBiasConfig, FlatBiasTrainer  # noqa: E402

# Relative distance of the parameter change from the fp32 run. bf16 keeps 8 mantissa bits (relative rounding 2^-8 =
# 0.4% per operation, compounding over the layers and steps); fp16 keeps 11 (0.05%), with the loss scaled.
TOLERANCE = {"bf16": 0.10, "fp16": 0.02}
# DeepSpeed ZeRO-2 in fp32 runs the same arithmetic in another order (bucketed reductions).
ZERO2_TOLERANCE = 1e-4
CONFIGS = Path(__file__).resolve().parent.parent / "recipes" / "configs"


def sizes(dry_run: bool) -> dict:
    if dry_run:
        return dict(model=dict(hidden=32, layers=2, vocab=200, seq_len=16), heads=16, batch=8, steps=6, contexts=8)
    # BERT-base: hidden 768, 12 layers, 12 heads, vocabulary 30,522
    return dict(model=dict(hidden=768, layers=12, vocab=30522, seq_len=128), heads=64, batch=32, steps=30, contexts=256)


def trainer_arguments(out: str, method: str, steps: int, batch: int, device: str, **overrides) -> FlatBiasConfig:
    values = dict(
        output_dir=out,
        flatness_method=method,
        max_steps=steps,
        per_device_train_batch_size=batch,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        use_cpu=device == "cpu",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    values.update(overrides)
    return FlatBiasConfig(**values)


def sam_step_ratio(size: dict, device: str, precision: str) -> dict:
    """Plain and SAM runs interleaved three times, so load hits both alike; first 3 steps of each dropped."""
    rows = masked_lm_rows(size["steps"] * size["batch"], size["model"]["seq_len"], size["model"]["vocab"])
    durations: dict[str, list[float]] = {"none": [], "sam": []}
    for _ in range(3):
        for method in ("none", "sam"):
            timer = StepTimer()
            with tempfile.TemporaryDirectory() as out:
                extra = {"bf16": True} if precision == "bf16" else {}
                args = trainer_arguments(
                    out, method, size["steps"], size["batch"], device, optim="adamw_torch", **extra
                )
                model = build_model(**size["model"], head_size=size["heads"])
                FlatBiasTrainer(model=model, args=args, train_dataset=rows, callbacks=[timer]).train()
            durations[method] += timer.durations[3:]
    plain, sam = statistics.median(durations["none"]), statistics.median(durations["sam"])
    return {"precision": precision, "plain_step_s": plain, "sam_step_s": sam, "ratio": sam / plain}


def _sam_parameters(size: dict, device: str, overrides: dict) -> tuple[torch.Tensor, bool]:
    """Parameters after a few SGD SAM steps on fixed, sequential batches, as one fp32 vector, and whether the
    trainer ran under DeepSpeed."""
    rows = masked_lm_rows(6 * size["batch"], size["model"]["seq_len"], size["model"]["vocab"])
    with tempfile.TemporaryDirectory() as out:
        args = trainer_arguments(
            out,
            "sam",
            6,
            size["batch"],
            device,
            optim="sgd",
            learning_rate=0.05,
            lr_scheduler_type="constant",
            max_grad_norm=0.0,
            train_sampling_strategy="sequential",
            **overrides,
        )
        model = build_model(**size["model"], head_size=size["heads"])
        for module in model.modules():  # dropout would draw differently in each precision
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        trainer = FlatBiasTrainer(model=model, args=args, train_dataset=rows)
        trainer.train()
        unwrapped = trainer.accelerator.unwrap_model(trainer.model)
        vector = torch.cat([p.detach().float().reshape(-1).cpu() for p in unwrapped.parameters()])
        return vector, bool(trainer.is_deepspeed_enabled)


def _initial_parameters(size: dict) -> torch.Tensor:
    model = build_model(**size["model"], head_size=size["heads"])
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def _relative_change_distance(result: torch.Tensor, reference: torch.Tensor, start: torch.Tensor) -> float:
    delta, reference_delta = result - start, reference - start
    return float((delta - reference_delta).norm() / reference_delta.norm())


def sam_precision(size: dict, device: str) -> dict:
    start = _initial_parameters(size)
    reference, _ = _sam_parameters(size, device, {})
    results = {}
    for precision, tolerance in TOLERANCE.items():
        if precision == "fp16" and device == "cpu":
            results[precision] = {"skipped": "fp16 with a GradScaler needs a GPU"}
            continue
        if precision == "bf16" and device == "cuda" and not torch.cuda.is_bf16_supported():
            results[precision] = {"skipped": "this GPU has no bf16"}
            continue
        found, _ = _sam_parameters(size, device, {precision: True})
        distance = _relative_change_distance(found, reference, start)
        results[precision] = {"relative_distance": distance, "tolerance": tolerance, "ok": distance <= tolerance}
    return results


def sam_zero2(size: dict, device: str) -> dict:
    """SAM under DeepSpeed ZeRO-2 in this one process against the same run without DeepSpeed."""
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return {"skipped": "deepspeed is not installed"}
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    start = _initial_parameters(size)
    reference, _ = _sam_parameters(size, device, {})
    config = json.loads((CONFIGS / "deepspeed_zero2.json").read_text())
    config["fp16"], config["bf16"] = {"enabled": False}, {"enabled": False}
    found, used_deepspeed = _sam_parameters(size, device, {"deepspeed": config})
    distance = _relative_change_distance(found, reference, start)
    ok = used_deepspeed and distance <= ZERO2_TOLERANCE
    return {
        "relative_distance": distance,
        "tolerance": ZERO2_TOLERANCE,
        "ran_under_deepspeed": used_deepspeed,
        "ok": ok,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="a tiny BERT on CPU: checks that the script runs")
    parser.add_argument("--out", default="gpu_check.json")
    args = parser.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("No GPU visible: run on a GPU machine, or pass --dry-run to check the script on CPU.")
    size = sizes(args.dry_run)
    started = time.perf_counter()
    report: dict = {
        "dry_run": args.dry_run,
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": size["model"],
    }
    timings = {}

    def part(name, fn, *fn_args):
        begin = time.perf_counter()
        report[name] = fn(*fn_args)
        timings[name] = time.perf_counter() - begin
        print(f"{name}: done in {timings[name]:.0f} s", flush=True)

    part("sam_step_ratio", sam_step_ratio, size, device, "bf16" if device == "cuda" else "fp32")
    part("sam_precision", sam_precision, size, device)
    trace_model = build_model(**size["model"], head_size=size["heads"])
    part(
        "trace_throughput",
        lambda: measure(
            "bert",
            trace_model,
            n_contexts=size["contexts"],
            seq_len=size["model"]["seq_len"],
            memory_budget_gib=0.25 if args.dry_run else 40.0,
            device=torch.device(device),
        )[0],  # one row: one draw count
    )
    part("sam_zero2", sam_zero2, size, device)  # last: DeepSpeed leaves process-wide state behind
    report["seconds"] = timings
    report["total_seconds"] = time.perf_counter() - started
    Path(args.out).write_text(json.dumps(report, indent=2))

    ratio = report["sam_step_ratio"]
    trace = report["trace_throughput"]
    print(f"SAM step ratio ({ratio['precision']}): {ratio['ratio']:.3f}")
    for precision, result in report["sam_precision"].items():
        if "skipped" in result:
            print(f"SAM {precision} vs fp32: skipped ({result['skipped']})")
        else:
            verdict = "ok" if result["ok"] else "FAILED"
            print(
                f"SAM {precision} vs fp32: {result['relative_distance']:.2e} "
                f"(tolerance {result['tolerance']}) {verdict}"
            )
    print(
        f"trace: {trace['trace_contexts_per_second']:.1f} contexts/s vs forward+backward "
        f"{trace['reference_contexts_per_second']:.1f} (ratio {trace['ratio']:.3f}), "
        f"auto batch {trace['auto_batch_size']}, "
        f"peak {trace['trace_peak_bytes'] / 2**20:.0f} MiB (predicted {trace['predicted_working_bytes'] / 2**20:.0f})"
    )
    zero2 = report["sam_zero2"]
    if "skipped" in zero2:
        print(f"SAM under ZeRO-2: skipped ({zero2['skipped']})")
    else:
        verdict = "ok" if zero2["ok"] else "FAILED"
        print(
            f"SAM under ZeRO-2 vs without: {zero2['relative_distance']:.2e} (tolerance {zero2['tolerance']}) {verdict}"
        )
    print(f"total {report['total_seconds']:.0f} s; results in {args.out}")


if __name__ == "__main__":
    main()
