"""``hf-flatbias demo``: the paper's comparison in about a minute on an idle 2-core CPU (several on a busy one).

Two tiny BERTs learn the same generated language (a random PCFG in the shape of the paper's) from the same
initialisation and the same batches: one with AdamW, one with SAM (AdamW at a perturbed point, the flatness
regulariser of Liu, Xie, Li & Ma, 2023). Every evaluation logs the validation loss and the Fisher trace; the two runs
are then compared where they reach the same loss, with linear-probe accuracy on the grammar's downstream tasks (the
paper's "downstream"). Everything is generated locally, nothing is downloaded.

Written to OUTPUT_DIR: one folder per run (checkpoints with trainer_state.json, so `hf-flatbias select OUTPUT_DIR/sam`
works; the final model with its flatness card; TensorBoard logs only when tensorboard is installed, which the
plain install does not bring: `pip install tensorboard`), demo.png (loss and
trace per step, both runs) and demo.json (every number printed).
"""

from __future__ import annotations

import argparse
import os
import textwrap
import time
from pathlib import Path
from typing import Any

from ..argparsing import number, whole_number
from ..constants import DEFAULT_SAM_RHO, RECOMMENDED_N_DRAWS, TRACE_METRIC, TRACE_STDERR_METRIC
from .paths import DEMO_JSON, DEMO_PLOT, DEMO_RUNS, check_output_folder, is_demo_entry


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="train AdamW and SAM side by side on a generated language; compare trace and probe at matched loss",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--output-dir", default="flatbias-demo", help="where both runs, the plot and the JSON go (default: %(default)s)"
    )
    parser.add_argument(
        "--sam-rho", type=number, default=DEFAULT_SAM_RHO, help="SAM neighbourhood radius (default: %(default)s)"
    )
    parser.add_argument(
        "--steps", type=whole_number, default=600, help="optimizer steps of each run (default: %(default)s)"
    )
    parser.add_argument(
        "--eval-every",
        type=whole_number,
        default=100,
        help="steps between evaluations and checkpoints (default: %(default)s)",
    )
    parser.add_argument(
        "--n-train", type=whole_number, default=20000, help="generated training sentences (default: %(default)s)"
    )
    parser.add_argument(
        "--n-contexts",
        type=whole_number,
        default=256,
        help="masked contexts per trace measurement (default: %(default)s)",
    )
    # the flags' spellings before they matched `hf-flatbias trace`'s: refused in one line naming the flag to use
    for earlier, flag in RENAMED_FLAGS.items():
        parser.add_argument(
            earlier, nargs="?", action=_Renamed, flag=flag, default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
    parser.add_argument(
        "--n-probe",
        type=whole_number,
        default=500,
        help="sentences to fit the probe, and as many to score (default: %(default)s)",
    )
    parser.add_argument(
        "--seed",
        type=whole_number,
        default=0,
        help="seed of the grammar, the data and the models (default: %(default)s)",
    )
    parser.set_defaults(func=run_demo)


RENAMED_FLAGS = {"--rho": "--sam-rho", "--trace-contexts": "--n-contexts"}
"""The demo's flags before they were spelled as `hf-flatbias trace` spells them: earlier spelling -> flag."""


class _Renamed(argparse.Action):
    def __init__(self, *args: Any, flag: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.flag = flag

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: str | None = None):
        parser.error(f"{option} is now spelled {self.flag}, as in hf-flatbias trace: pass {self.flag}")


def run_demo(args: argparse.Namespace) -> int:
    for name in ("steps", "eval_every", "n_train", "n_contexts", "n_probe"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)}).")
    if not args.sam_rho > 0:
        raise ValueError(f"--sam-rho must be > 0 (got {args.sam_rho}).")
    # before "writing to ..." and the minute of training; a folder of the user's own is never written into
    check_output_folder(args.output_dir, "--output-dir", own_entries=is_demo_entry, own_name="the demo")
    output_dir = Path(args.output_dir)
    earlier = sorted(str(path) for label in DEMO_RUNS for path in (output_dir / label).glob("checkpoint-*"))
    if earlier:
        # the comparison and `hf-flatbias select` read every checkpoint-* folder: an earlier run's would mix in
        raise ValueError(
            f"{output_dir} already holds a demo run ({earlier[0]}, ...); pass another --output-dir or delete it."
        )
    # 0.1M-parameter models and 500-row probes: a second thread (torch's or the BLAS's under numpy and scikit-learn)
    # only adds synchronisation, and on a busy machine it made the demo many times slower. Set before they load.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

    from transformers.utils import logging as transformers_logging

    bars_were_on = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()  # per-checkpoint "Writing model shards" bars drown the demo's lines
    try:
        return _compare_runs(args, output_dir)
    finally:
        if bars_were_on:
            transformers_logging.enable_progress_bar()


def _compare_runs(args: argparse.Namespace, output_dir: Path) -> int:
    """Train both runs, compare them at matched loss, write the plot and the JSON, print the table."""
    from ..results import write_json
    from ..synthetic.demo_language import setup_language

    print(f"hf-flatbias demo: writing to {output_dir.resolve()}", flush=True)
    setup = setup_language(
        "pcfg",
        n_train=args.n_train,
        n_contexts=args.n_contexts,
        n_probe=args.n_probe,
        seed=args.seed,
        probe_pooling="concat",
    )
    histories = {}
    for label, method in DEMO_RUNS.items():
        start = time.perf_counter()
        print(f"training {label}: {args.steps} steps, evaluated every {args.eval_every}...", flush=True)
        histories[label] = _train(setup, label, method, args, output_dir / label)
        last = histories[label][-1]
        print(
            f"  {label}: loss {last['eval_loss']:.4f}, trace {last['trace']:.1f} at step {last['step']} "
            f"({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    comparison = compare_at_matched_loss(histories)
    for label, row in comparison["checkpoints"].items():
        checkpoint = output_dir / label / f"checkpoint-{row['step']}"
        row["probe_accuracy"], row["probe_stderr"] = _probe_accuracy(setup, checkpoint)
    plot_path = _plot(histories, comparison, output_dir / DEMO_PLOT)
    report = summary_text(comparison, args.steps)
    write_json(
        output_dir / DEMO_JSON, {"config": demo_settings(args), "histories": histories, "comparison": comparison}
    )
    print(report)
    print(f"\nplot: {plot_path}\nnumbers: {output_dir / DEMO_JSON}")
    print(f"model cards: {output_dir / 'adamw' / 'README.md'}, {output_dir / 'sam' / 'README.md'}")
    print(f"choose a checkpoint by flatness: hf-flatbias select {output_dir / 'sam'}")
    print(tensorboard_line(output_dir))
    return 0


def tensorboard_line(output_dir: Path) -> str:
    """The closing line on TensorBoard logs, claiming them only when event files were written under ``output_dir``."""
    if any(output_dir.rglob("events.out.tfevents.*")):
        return f"TensorBoard logs: tensorboard --logdir {output_dir}"
    if _tensorboard_installed():
        return f"TensorBoard logs: none written under {output_dir}, although tensorboard is installed"
    return "TensorBoard logs: none written (tensorboard is not installed; pip install tensorboard to get them)"


def _tensorboard_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None


def demo_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Every setting the demo's numbers follow from, as demo.json records them: its flags, the training settings it
    fixes and the trace callback's settings, defaults included (docs/tutorial's test compares a committed run's with
    these, so a changed default cannot leave the tutorial's printed block behind)."""
    from dataclasses import asdict

    from ..callbacks.trace_config import TraceCallbackConfig

    flags = {key: value for key, value in vars(args).items() if key not in ("func", "command", "debug")}
    trace = asdict(TraceCallbackConfig(**_trace_settings(args)))
    return {**flags, "training": _training_settings(args), "trace": trace, "estimator": _estimator_defaults(trace)}


def _estimator_defaults(trace: dict[str, Any]) -> dict[str, Any]:
    """The defaults of `estimate_hessian_trace` that the callback leaves as they are (the output probe, for one: the
    trace's draws changed with it and the tutorial's numbers with them, issue 58)."""
    import inspect

    from ..flatness.api import estimate_hessian_trace

    ignored = {*trace, "n_contexts", "across_processes", "progress"}  # set by the callback, or no effect on numbers
    parameters = inspect.signature(estimate_hessian_trace).parameters.values()
    return {p.name: p.default for p in parameters if p.default is not p.empty and p.name not in ignored}


def _training_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The `FlatBiasConfig` settings the demo fixes beyond its flags."""
    return {
        "per_device_train_batch_size": 64,
        "per_device_eval_batch_size": 256,
        "learning_rate": 2e-3,
        "warmup_steps": min(100, args.steps // 10),
        "lr_scheduler_type": "constant_with_warmup",
    }


def _trace_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The `HessianTraceCallback` settings the demo passes; the rest are the callback's defaults."""
    # the demo shows the trace at every evaluation, whatever it costs
    return {"n_contexts": args.n_contexts, "n_draws": RECOMMENDED_N_DRAWS, "seed": args.seed, "max_overhead": None}


def _train(setup, label: str, method: str, args: argparse.Namespace, run_dir: Path) -> list[dict[str, Any]]:
    """One run through `FlatBiasTrainer`; returns its evaluations ``{step, eval_loss, trace, trace_stderr}``."""
    from transformers.trainer_callback import PrinterCallback

    from ..callbacks import HessianTraceCallback
    from ..config import FlatBiasConfig
    from ..synthetic import MaskedWordCollator, build_model
    from ..trainer import FlatBiasTrainer

    reporters = ["tensorboard"] if _tensorboard_installed() else []
    config = FlatBiasConfig(
        output_dir=str(run_dir),
        flatness_method=method,
        sam_rho=args.sam_rho,
        max_steps=args.steps,
        **_training_settings(args),
        eval_strategy="steps",
        eval_steps=args.eval_every,
        save_strategy="steps",
        save_steps=args.eval_every,
        logging_steps=args.eval_every,
        report_to=reporters,
        disable_tqdm=True,
        seed=args.seed,
        use_cpu=True,
    )
    trainer = FlatBiasTrainer(
        model=build_model(len(setup.tokenizer), seed=args.seed),  # the same initial weights for both runs
        args=config,
        train_dataset=setup.train,
        eval_dataset=setup.contexts,
        data_collator=MaskedWordCollator(seed=args.seed),
        processing_class=setup.tokenizer,
        callbacks=[HessianTraceCallback(**_trace_settings(args))],
    )
    # one line per evaluation instead of the Trainer's raw log dictionaries
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(_evaluation_printer(label))
    trainer.train()
    trainer.save_model()  # the final weights with their flatness card
    setup.tokenizer.save_pretrained(run_dir)
    evaluations: dict[int, dict[str, Any]] = {}
    for entry in trainer.state.log_history:
        if "eval_loss" in entry or TRACE_METRIC in entry:
            row = evaluations.setdefault(entry["step"], {"step": entry["step"]})
            row.update({field: entry[key] for field, key in _LOGGED.items() if key in entry})
    return [evaluations[step] for step in sorted(evaluations)]


def _evaluation_printer(label: str):
    """A callback printing each evaluation as one line (built here: the CLI imports this module before transformers)."""
    from transformers import TrainerCallback

    class EvaluationPrinter(TrainerCallback):
        # the trace of the last step can be logged before that step's evaluation: print once both are in
        def __init__(self):
            self.printed: set[int] = set()

        def on_log(self, args, state, control, logs=None, **kwargs):
            step = state.global_step
            latest = {key: entry[key] for entry in state.log_history if entry.get("step") == step for key in entry}
            if step in self.printed or "eval_loss" not in latest or TRACE_METRIC not in latest:
                return
            self.printed.add(step)
            print(
                f"  {label} step {step:>4}: loss {latest['eval_loss']:.4f}, "
                f"trace {latest[TRACE_METRIC]:.1f} +- {latest[TRACE_STDERR_METRIC]:.1f}",
                flush=True,
            )

    return EvaluationPrinter()


_LOGGED = {"eval_loss": "eval_loss", "trace": TRACE_METRIC, "trace_stderr": TRACE_STDERR_METRIC}  # field -> log key


def compare_at_matched_loss(histories: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Each run's checkpoint closest to the lowest validation loss that every run reached.

    Comparing at the last step would compare a model that fits the language better with one that fits it worse;
    the paper's claim is about models at the *same* loss.
    """
    target = max(min(row["eval_loss"] for row in rows) for rows in histories.values())
    checkpoints = {
        label: dict(min(rows, key=lambda row: (abs(row["eval_loss"] - target), row["step"])))
        for label, rows in histories.items()
    }
    return {"target_loss": target, "checkpoints": checkpoints}


def _probe_accuracy(setup, checkpoint: Path) -> tuple[float, float]:
    """Mean linear-probe accuracy of the frozen encoder over the grammar's tasks (A, B, C), with its standard error
    (binomial, from the held-out sentences of each task)."""
    from transformers import BertForMaskedLM

    from ..synthetic.demo_language import probe_scores

    model = BertForMaskedLM.from_pretrained(checkpoint)
    scores = list(probe_scores(model, setup).values())
    mean = sum(task["accuracy"] for task in scores) / len(scores)
    variance = sum(task["accuracy"] * (1 - task["accuracy"]) / task["n_test"] for task in scores) / len(scores) ** 2
    return mean, variance**0.5


def summary_text(comparison: dict[str, Any], steps: int) -> str:
    """The closing table and what it does and does not show."""
    rows = comparison["checkpoints"]
    lines = [
        f"\nAt matched validation loss (target {comparison['target_loss']:.4f}: the lowest loss both runs reached):",
        f"{'run':<6} {'step':>5} {'loss':>8} {'trace +- s.e.':>16} {'probe acc. +- s.e.':>19}",
    ]
    for label, row in rows.items():
        trace = f"{row['trace']:.1f} +- {row['trace_stderr']:.1f}"
        probe = f"{row['probe_accuracy']:.3f} +- {row['probe_stderr']:.3f}"
        lines.append(f"{label:<6} {row['step']:>5} {row['eval_loss']:>8.4f} {trace:>16} {probe:>19}")
    adamw, sam = rows["adamw"], rows["sam"]
    lines += [
        "",
        "What this shows: at the same loss, " + _difference("SAM's trace", adamw, sam, "trace", "lower (flatter)"),
        "and " + _difference("SAM's probe accuracy", sam, adamw, "probe", "higher") + ".",
        f"What it does not show: the paper's regime. These are 0.1M-parameter models after {steps} steps, far from "
        "the entropy floor of the language, one seed each; the paper's claim is about models trained to the optimal "
        "loss, where flatter models transfer better. docs/reproduction/synthetic.md has longer runs, including where "
        "they do not reproduce.",
    ]
    wrap = textwrap.TextWrapper(width=116, subsequent_indent="  ")
    return "\n".join(wrap.fill(line) if len(line) > wrap.width else line for line in lines)


def _difference(subject: str, larger: dict, smaller: dict, key: str, direction: str) -> str:
    """``subject`` is ``direction`` by a margin beyond two standard errors, or the difference is within noise."""
    value, error = ("trace", "trace_stderr") if key == "trace" else ("probe_accuracy", "probe_stderr")
    gap = larger[value] - smaller[value]
    spread = (larger[error] ** 2 + smaller[error] ** 2) ** 0.5
    digits = 1 if key == "trace" else 3
    if gap > 2 * spread:
        return f"{subject} is {direction} by {gap:.{digits}f} (two standard errors: {2 * spread:.{digits}f})"
    if gap < -2 * spread:
        return f"{subject} is NOT {direction}: the other way by {-gap:.{digits}f} (2 s.e.: {2 * spread:.{digits}f})"
    return f"{subject} differs by {abs(gap):.{digits}f}, within two standard errors ({2 * spread:.{digits}f})"


def _plot(histories: dict[str, list[dict[str, Any]]], comparison: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_axis, trace_axis) = plt.subplots(1, 2, figsize=(10, 3.6))
    for label, rows in histories.items():
        steps = [row["step"] for row in rows]
        (line,) = loss_axis.plot(steps, [row["eval_loss"] for row in rows], marker="o", label=label)
        trace_axis.errorbar(
            steps,
            [row["trace"] for row in rows],
            yerr=[row["trace_stderr"] for row in rows],
            marker="o",
            capsize=2,
            color=line.get_color(),
            label=label,
        )
        matched = comparison["checkpoints"][label]
        for axis, key in ((loss_axis, "eval_loss"), (trace_axis, "trace")):
            axis.plot(matched["step"], matched[key], "s", markersize=11, fillstyle="none", color=line.get_color())
    loss_axis.axhline(comparison["target_loss"], color="grey", linestyle=":", label="matched loss")
    loss_axis.set(xlabel="step", ylabel="validation loss (nats)", title="loss per step")
    trace_axis.set(xlabel="step", ylabel="Tr(F) +- s.e.", title="Fisher trace per step")
    for axis in (loss_axis, trace_axis):
        axis.legend(fontsize=8)
    fig.suptitle("AdamW vs SAM on a generated PCFG language (squares: the matched-loss checkpoints)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
