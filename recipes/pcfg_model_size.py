"""Model size at matched pre-training loss (Liu et al., 2023, Sec. 3.2) on the synthetic PCFG.

Trains BERTs of increasing size on the same PCFG sentences, then reports for each: the one-mask MLM loss next to the
grammar's entropy floor, the Hessian trace of the model *embedded into the largest architecture* with
`hf_flatbias.enlarge` (function-preserving, so loss and predictions are unchanged and the traces live in one
parameter space), the trace in its own architecture, and linear-probe accuracy on tasks A, B, C.

The paper's claim: at the same (near-optimal) loss, larger models are flatter and transfer better.

    OMP_NUM_THREADS=1 PYTHONPATH=. python recipes/pcfg_model_size.py --output docs/reproduction/pcfg_model_size.json
    OMP_NUM_THREADS=1 PYTHONPATH=. python recipes/pcfg_model_size.py --quick   # smoke run, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from pcfg_common import (  # noqa: E402
    ModelSize,
    StopAtLoss,
    add_stopping_arguments,
    add_training_arguments,
    build_data,
    format_table,
    measure,
    set_threads,
    train_mlm,
    write_result,
)
from transformers import BertForMaskedLM  # noqa: E402

from hf_flatbias.enlarge import enlarge  # noqa: E402

DEFAULT_SIZES = ("32x2", "64x2", "128x4")


def parse_size(text: str, head_dim: int) -> ModelSize:
    try:
        hidden, layers = (int(part) for part in text.lower().split("x"))
    except ValueError as error:
        raise ValueError(f"model size {text!r} must read HIDDENxLAYERS, e.g. 64x2.") from error
    if hidden % head_dim:
        raise ValueError(f"hidden size {hidden} is not a multiple of the head dimension {head_dim}.")
    return ModelSize(hidden=hidden, layers=layers, heads=hidden // head_dim)


def run(args: argparse.Namespace) -> dict:
    set_threads()
    sizes = [parse_size(text, args.head_dim) for text in args.sizes]
    largest = max(sizes, key=lambda s: (s.hidden, s.layers))
    if any(largest.hidden % s.hidden or largest.layers < s.layers for s in sizes):
        raise ValueError(
            f"every size must embed into the largest ({largest.name}): hidden sizes must divide {largest.hidden} "
            f"and layer counts be at most {largest.layers}."
        )
    data = build_data(args.n_train, args.n_validation, grammar_seed=args.grammar_seed, data_seed=args.seed)
    target_config = largest.config(data.vocab_size)
    rows = []
    for size in sizes:
        torch.manual_seed(args.seed)
        model = BertForMaskedLM(size.config(data.vocab_size))
        start = time.perf_counter()
        stopper = StopAtLoss(model, data.contexts, args.target_loss)
        train_mlm(
            model,
            data,
            steps=args.steps,
            learning_rate=args.learning_rate,
            batch_size=args.batch_size,
            seed=args.seed,
            mask_probability=args.mask_probability,
            callbacks=[stopper],
            eval_strategy="steps",
            eval_steps=args.eval_steps,
        )
        train_seconds = time.perf_counter() - start
        model.eval()
        embedded = enlarge(model, target_config)
        row = {
            "size": size.name,
            "parameters": model.num_parameters(),
            "train_seconds": train_seconds,
            "steps": stopper.final_step,
        }
        row.update(
            measure(
                model, data, n_trace_contexts=args.trace_contexts, trace_model=embedded, n_probe_train=args.probe_train
            )
        )
        row["trace_own_architecture"] = measure_own_trace(model, data, args.trace_contexts)
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"recipe": "pcfg_model_size", "arguments": vars(args), "embedded_into": largest.name, "rows": rows}
    columns = [
        "size",
        "parameters",
        "mlm_loss",
        "floor",
        "trace",
        "trace_stderr",
        "trace_own_architecture",
        "task_a",
        "task_b",
        "task_c",
    ]
    print(format_table(rows, columns))
    return result


def measure_own_trace(model, data, n_contexts: int) -> float:
    from pcfg_common import trace_of

    return trace_of(model, data, n_contexts=n_contexts).mean


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(DEFAULT_SIZES), help="HIDDENxLAYERS per model")
    parser.add_argument("--head-dim", type=int, default=16)
    add_stopping_arguments(parser)
    add_training_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.sizes, args.steps, args.n_train, args.n_validation = ["16x1", "32x2"], 20, 200, 100
        args.trace_contexts, args.probe_train, args.eval_steps = 20, 100, 10
    write_result(run(args), args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
