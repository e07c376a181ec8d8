"""Adversarial pretraining on the synthetic PCFG (Liu et al., 2023, Sec. 3.3; paper: Task A 89.9 -> 83.1, trace
8.01 -> 19.34 at the same MLM loss).

BERTs of the same size, seed and data order: one trained with the plain MLM objective (``--adversary-weights 0``),
the others with `hf_flatbias.adversarial.AdversarialPretrainingModel` (MLM loss plus a confusion term that makes a
simultaneously trained linear read-out of ``--task`` from ``[CLS]`` uniform; see that module for the exact
objective). Each is evaluated every ``--eval-every`` steps like the other synthetic recipes (one-mask loss, its gap to
the entropy floor, Hessian trace, linear probes on concatenated and on mean-pooled features) and, in addition, by the
accuracy of a *fresh* linear probe on the frozen ``[CLS]`` feature (what the adversary hid the task from).

Only the PCFG has sentence-level tasks to hide; ``--language hmm`` is refused.

    OMP_NUM_THREADS=1 PYTHONPATH=. python recipes/pcfg_adversarial.py --output-dir outputs/pcfg_adversarial
    OMP_NUM_THREADS=1 PYTHONPATH=. python recipes/pcfg_adversarial.py --target-loss 1.9 --adversary-weights 0 1 3
    OMP_NUM_THREADS=1 PYTHONPATH=. python recipes/pcfg_adversarial.py --smoke   # smoke run, seconds
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from hf_flatbias.adversarial import AdversarialPretrainingModel
from hf_flatbias.cli import run_recipe
from hf_flatbias.experiments import (
    RunSpec,
    add_common_arguments,
    add_target_loss_argument,
    at_common_loss,
    default_output_dir,
    final_row,
    is_main_process,
    parse_recipe_arguments,
    probe_scores,
    run_spec_arguments,
    setup_language_from_args,
    train_and_evaluate,
    write_results,
)

# training column of each PCFG task -> its name in LanguageSetup.probe_tasks
TASK_COLUMNS = {"task_a": "A", "task_b": "B", "task_c": "C"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # defaults: the run of docs/reproduction/enlarge.md (two 12,000-step runs, about 27 minutes on 2 cores)
    add_common_arguments(parser, steps=12_000, eval_every=1000)
    parser.add_argument("--task", choices=sorted(TASK_COLUMNS), default="task_a", help="the label the adversary hides")
    parser.add_argument(
        "--adversary-weights",
        type=float,
        nargs="+",
        default=[0.0, 1.0],
        help="lambda of the confusion term, one model per value; 0 is standard MLM training (same seed, same data)",
    )
    add_target_loss_argument(parser)
    return parser


def main(argv=None, *, default_language: str = "pcfg") -> dict:
    args = parse_recipe_arguments(build_parser(), argv, default_language)
    if args.language != "pcfg":
        raise ValueError(
            f"the adversarial recipe hides a sentence-level PCFG task from [CLS]; --language {args.language} has none "
            "(its tasks are per-position hidden states). Run it with --language pcfg."
        )
    if any(weight < 0 for weight in args.adversary_weights):
        raise ValueError(f"--adversary-weights must be >= 0 (got {args.adversary_weights}); 0 is plain MLM.")
    output_dir = default_output_dir(args, f"{args.language}_adversarial")
    start = time.perf_counter()
    setup = setup_language_from_args(args, train_columns=[args.task])
    n_classes = int(np.max(setup.train[args.task])) + 1
    hidden_task = TASK_COLUMNS[args.task]

    def cls_probe(model) -> dict:
        probes = probe_scores(model, setup, "cls")
        return {"probe_cls": probes, "cls_probe_accuracy_hidden_task": probes[hidden_task]["accuracy"]}

    common = {**run_spec_arguments(args), "target_loss": args.target_loss, "extra_metrics": cls_probe}
    runs, rows = {}, []
    for weight in args.adversary_weights:
        label = "standard" if weight == 0 else f"adversarial_{weight:g}"
        adversarial = (
            {} if weight == 0 else {"task_column": args.task, "wrap_model": adversary_wrapper(n_classes, weight)}
        )
        spec = RunSpec(label=label, **adversarial, **common)
        run_start = time.perf_counter()
        records = train_and_evaluate(
            setup, spec, output_dir, trace_contexts=args.trace_contexts, trace_draws=args.trace_draws
        )
        if not records:
            continue  # not the main process of `accelerate launch`
        runs[label] = records
        rows.append(
            final_row(
                records,
                target_loss=args.target_loss,
                train_seconds=time.perf_counter() - run_start,
                training=label,
                adversary_weight=weight,
            )
        )
    if not is_main_process():
        return {}
    columns = ["training", "adversary_weight", "steps", "loss", "loss_gap_to_entropy", "hessian_trace"]
    columns += ["hessian_trace_stderr", "probe_accuracy", "probe_accuracy_mean_pooled"]
    columns += ["cls_probe_accuracy_hidden_task"] + [f"probe_{task}" for task in setup.probe_tasks]
    return write_results(
        output_dir,
        "adversarial",
        args,
        setup,
        start,
        table=rows,
        columns=columns,
        hidden_task=args.task,
        rows=rows,
        runs=runs,
        at_common_loss=at_common_loss(runs),
    )


def adversary_wrapper(n_classes: int, weight: float):
    """``wrap_model`` for `RunSpec`: the masked LM inside the adversarial pre-training objective."""
    return lambda model: AdversarialPretrainingModel(model, n_classes, adversary_weight=weight)


if __name__ == "__main__":
    run_recipe(main)
