"""Model size at matched pre-training loss (Liu et al., 2023, Sec. 3.2) on a synthetic language.

Trains BERTs of increasing size on the same sentences, then reports for each the final (or first matched-loss)
checkpoint: the one-mask MLM loss next to the language's entropy floor, the Hessian trace of the model *embedded into
the largest architecture* with `hf_flatbias.enlarge` (function-preserving, so loss and predictions are unchanged and
the traces live in one parameter space), the trace in its own architecture, and linear-probe accuracy on the
language's tasks (concatenated features, and mean-pooled).

The paper's claim: at the same (near-optimal) loss, larger models are flatter and transfer better.

    OMP_NUM_THREADS=1 PYTHONPATH=. python recipes/pcfg_model_size.py --output-dir outputs/pcfg_model_size
    OMP_NUM_THREADS=1 python recipes/pcfg_model_size.py --target-loss 1.9 --sizes 32x2 64x2 128x4 --steps 3000
    OMP_NUM_THREADS=1 PYTHONPATH=. python recipes/pcfg_model_size.py --language hmm --smoke
    OMP_NUM_THREADS=1 PYTHONPATH=. python recipes/pcfg_model_size.py --smoke   # smoke run, well under a minute
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from hf_flatbias.cli import run_recipe
from hf_flatbias.enlarge import enlarge
from hf_flatbias.experiments import (
    RunSpec,
    add_common_arguments,
    add_target_loss_argument,
    at_common_loss,
    bert_config,
    default_output_dir,
    final_row,
    is_main_process,
    parse_recipe_arguments,
    run_spec_arguments,
    setup_language_from_args,
    train_and_evaluate,
    write_results,
)

DEFAULT_SIZES = ("32x2", "64x2", "128x2")
SMOKE_SIZES = ("16x1", "32x2")


@dataclass(frozen=True)
class ModelSize:
    hidden: int
    layers: int
    heads: int

    @property
    def name(self) -> str:
        return f"H{self.hidden}-L{self.layers}-A{self.heads}"


def parse_size(text: str, head_dim: int) -> ModelSize:
    try:
        hidden, layers = (int(part) for part in text.lower().split("x"))
    except ValueError as error:
        raise ValueError(f"model size {text!r} must read HIDDENxLAYERS, e.g. 64x2.") from error
    if hidden % head_dim:
        raise ValueError(f"hidden size {hidden} is not a multiple of the head dimension {head_dim}.")
    return ModelSize(hidden=hidden, layers=layers, heads=hidden // head_dim)


def check_sizes(sizes: list[ModelSize]) -> ModelSize:
    """The largest size, after checking that every other one embeds into it."""
    largest = max(sizes, key=lambda s: (s.hidden, s.layers))
    if any(largest.hidden % s.hidden or largest.layers < s.layers for s in sizes):
        raise ValueError(
            f"every size must embed into the largest ({largest.name}): hidden sizes must divide {largest.hidden} "
            f"and layer counts be at most {largest.layers}."
        )
    return largest


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # defaults: the run of docs/reproduction/enlarge.md with 8,000 instead of 12,000 steps per size, to stay inside
    # 30 minutes on 2 cores (1e-3: the 128-wide model was unstable at 2e-3)
    add_common_arguments(parser, steps=8000, eval_every=1000)
    parser.set_defaults(learning_rate=1e-3, trace_contexts=500)
    parser.add_argument("--sizes", nargs="+", default=list(DEFAULT_SIZES), help="HIDDENxLAYERS per model")
    parser.add_argument("--head-dim", type=int, default=16, help="attention head dimension of every size")
    add_target_loss_argument(parser)
    return parser


def main(argv=None, *, default_language: str = "pcfg") -> dict:
    args = parse_recipe_arguments(build_parser(), argv, default_language)
    if args.smoke:
        args.sizes = list(SMOKE_SIZES)
    sizes = [parse_size(text, args.head_dim) for text in args.sizes]
    largest = check_sizes(sizes)  # before any data is built or model trained
    output_dir = default_output_dir(args, f"{args.language}_model_size")
    start = time.perf_counter()
    setup = setup_language_from_args(args)
    target_config = bert_config(len(setup.tokenizer), hidden=largest.hidden, layers=largest.layers, heads=largest.heads)
    common = {**run_spec_arguments(args), "target_loss": args.target_loss}
    runs, rows = {}, []
    for size in sizes:
        common.update(hidden=size.hidden, layers=size.layers, heads=size.heads)
        spec = RunSpec(
            label=size.name,
            trace_model_fn=lambda model: enlarge(model, target_config),
            extra_metrics=lambda model: {"parameters": model.num_parameters()},
            **common,
        )
        run_start = time.perf_counter()
        records = train_and_evaluate(
            setup, spec, output_dir, trace_contexts=args.trace_contexts, trace_draws=args.trace_draws
        )
        if not records:
            continue  # not the main process of `accelerate launch`
        runs[size.name] = records
        rows.append(
            final_row(
                records,
                target_loss=args.target_loss,
                train_seconds=time.perf_counter() - run_start,
                size=size.name,
            )
        )
    if not is_main_process():
        return {}
    columns = ["size", "parameters", "steps", "loss", "loss_gap_to_entropy", "hessian_trace", "hessian_trace_stderr"]
    columns += ["hessian_trace_own_architecture", "probe_accuracy", "probe_accuracy_mean_pooled"]
    return write_results(
        output_dir,
        "model_size",
        args,
        setup,
        start,
        table=rows,
        columns=columns + [f"probe_{task}" for task in setup.probe_tasks],
        embedded_into=largest.name,
        rows=rows,
        runs=runs,
        at_common_loss=at_common_loss(runs),
    )


if __name__ == "__main__":
    run_recipe(main)
