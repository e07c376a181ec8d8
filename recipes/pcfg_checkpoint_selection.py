"""Checkpoint selection by flatness versus by lowest loss, on a synthetic language (beyond the paper).

One BERT is trained past the point where its MLM loss stops improving (the paper's Sec. 3.1 regime: the loss is flat
while the trace keeps falling and transfer keeps improving). Every ``--eval-every`` steps the Trainer evaluates its
loss on the one-mask validation contexts and `FlatnessCheckpointSelector` records it together with the Hessian trace
(its ``trace_fn``); the recipe's own per-checkpoint records add the linear-probe accuracies (for reporting only: the
selector never sees them). At the end the recipe compares the checkpoint the selector keeps (flattest within
``--loss-tolerance`` nats of the best loss) with the lowest-loss one.

    OMP_NUM_THREADS=1 PYTHONPATH=. python recipes/pcfg_checkpoint_selection.py \
        --output-dir outputs/pcfg_checkpoint_selection
    OMP_NUM_THREADS=1 PYTHONPATH=. python recipes/pcfg_checkpoint_selection.py --language hmm --loss-tolerance 0.05
    OMP_NUM_THREADS=1 PYTHONPATH=. python recipes/pcfg_checkpoint_selection.py --smoke   # smoke run, seconds
"""

from __future__ import annotations

import argparse
import time

from hf_flatbias.callbacks import FlatnessCheckpointSelector
from hf_flatbias.cli import run_recipe
from hf_flatbias.experiments import (
    RunSpec,
    add_common_arguments,
    default_output_dir,
    flatness_selection,
    hessian_trace,
    is_main_process,
    parse_recipe_arguments,
    run_spec_arguments,
    setup_language_from_args,
    train_and_evaluate,
    write_results,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, steps=4000, eval_every=400)
    # a small, fast default (a 32 x 2 BERT with 16-dimensional heads; minutes on 2 cores); the long run whose
    # checkpoints docs/reproduction/enlarge.md selects among is pcfg_continue_training.py's
    parser.set_defaults(hidden=32, layers=2, heads=2, learning_rate=3e-3, n_train=20_000, trace_contexts=300)
    parser.add_argument("--loss-tolerance", type=float, default=0.02, help="nats above the best validation loss")
    return parser


def main(argv=None, *, default_language: str = "pcfg") -> dict:
    args = parse_recipe_arguments(build_parser(), argv, default_language)
    if args.trace_contexts <= 0:
        raise ValueError("--trace-contexts must be positive: the selector chooses by the trace.")
    output_dir = default_output_dir(args, f"{args.language}_checkpoint_selection")
    start = time.perf_counter()
    setup = setup_language_from_args(args)

    def trace_fn(model) -> tuple[float, float]:
        trace = hessian_trace(
            model, setup.contexts, n_contexts=args.trace_contexts, n_draws=args.trace_draws, seed=args.seed
        )
        return trace["mean"], trace["stderr"]

    selector = FlatnessCheckpointSelector(loss_tolerance=args.loss_tolerance, trace_fn=trace_fn)
    spec = RunSpec(label="selection", callbacks=[selector], **run_spec_arguments(args))
    records = train_and_evaluate(
        setup, spec, output_dir, trace_contexts=args.trace_contexts, trace_draws=args.trace_draws
    )
    if not is_main_process():
        return {}
    by_step = {r["step"]: r for r in records}
    selected = selector.records
    rows = [
        {
            "step": step,
            "eval_loss": record.eval_loss,
            "selector_trace": record.hessian_trace,
            "selector_trace_stderr": record.stderr,
            **{k: v for k, v in by_step[step].items() if k != "step"},
        }
        for step, record in sorted(selected.items())
    ]
    selection = selector.selection
    chosen, lowest = by_step[selection.chosen.step], by_step[selection.lowest_loss.step]
    summary = {
        "chosen_step": chosen["step"],
        "lowest_loss_step": lowest["step"],
        "candidates": [r.step for r in selection.candidates],
        "reason": selection.reason,
        **{f"{key}_chosen": chosen[key] for key in ("probe_accuracy", "probe_accuracy_mean_pooled")},
        **{f"{key}_lowest_loss": lowest[key] for key in ("probe_accuracy", "probe_accuracy_mean_pooled")},
        "probe_accuracy_gain": chosen["probe_accuracy"] - lowest["probe_accuracy"],
    }
    columns = ["step", "eval_loss", "selector_trace", "selector_trace_stderr", "probe_accuracy"]
    columns += ["probe_accuracy_mean_pooled"] + [f"probe_{task}" for task in setup.probe_tasks]
    print(summary)
    return write_results(
        output_dir,
        "checkpoint_selection",
        args,
        setup,
        start,
        table=rows,
        columns=columns,
        rows=rows,
        records=records,
        summary=summary,
        # the same rule applied to the recipe's own records (loss on the contexts, trace drawn with the step's seed)
        selection_on_records=flatness_selection([r for r in records if r["step"] > 0], args.loss_tolerance),
    )


if __name__ == "__main__":
    run_recipe(main)
