"""Adversarial pretraining on the synthetic PCFG (Liu et al., 2023, Sec. 3.3; paper: Task A 89.9 -> 83.1, trace
8.01 -> 19.34 at the same MLM loss).

Two BERTs of the same size, seed and number of steps: one trained with the plain MLM objective, one with
`hf_flatbias.adversarial.AdversarialPretrainingModel` (MLM loss plus a confusion term that makes a simultaneously
trained linear read-out of task A uniform; see that module for the exact objective). Reports for each the one-mask
MLM loss (with the grammar's entropy floor), the Hessian trace, and the accuracy of a *fresh* linear probe on the
frozen ``[CLS]`` feature for tasks A, B, C.

    OMP_NUM_THREADS=1 PYTHONPATH=. python recipes/pcfg_adversarial.py --output docs/reproduction/pcfg_adversarial.json
    OMP_NUM_THREADS=1 PYTHONPATH=. python recipes/pcfg_adversarial.py --quick   # smoke run, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
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

from hf_flatbias.adversarial import AdversarialPretrainingModel  # noqa: E402


def run(args: argparse.Namespace) -> dict:
    set_threads()
    size = ModelSize(hidden=args.hidden, layers=args.layers, heads=args.hidden // args.head_dim)
    data = build_data(args.n_train, args.n_validation, grammar_seed=args.grammar_seed, data_seed=args.seed)
    n_classes = int(np.max(data.train[args.task])) + 1
    rows = []
    for weight in args.adversary_weights:
        name = "standard" if weight == 0 else "adversarial"
        torch.manual_seed(args.seed)
        model = BertForMaskedLM(size.config(data.vocab_size))
        start = time.perf_counter()
        stopper = StopAtLoss(model, data.contexts, args.target_loss)
        trained = model if weight == 0 else AdversarialPretrainingModel(model, n_classes, adversary_weight=weight)
        train_mlm(
            trained,
            data,
            steps=args.steps,
            learning_rate=args.learning_rate,
            batch_size=args.batch_size,
            seed=args.seed,
            mask_probability=args.mask_probability,
            task_column=None if weight == 0 else args.task,
            callbacks=[stopper],
            eval_strategy="steps",
            eval_steps=args.eval_steps,
        )
        row = {
            "training": name,
            "adversary_weight": weight,
            "train_seconds": time.perf_counter() - start,
            "steps": stopper.final_step,
        }
        model.eval()
        row.update(measure(model, data, n_trace_contexts=args.trace_contexts, n_probe_train=args.probe_train))
        rows.append(row)
        print(json.dumps(row), flush=True)
    columns = [
        "training",
        "adversary_weight",
        "mlm_loss",
        "floor",
        "trace",
        "trace_stderr",
        "task_a",
        "task_b",
        "task_c",
    ]
    print(format_table(rows, columns))
    return {"recipe": "pcfg_adversarial", "arguments": vars(args), "model": size.name, "rows": rows}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--task", default="task_a", help="the downstream label the adversary hides")
    parser.add_argument(
        "--adversary-weights",
        type=float,
        nargs="+",
        default=[0.0, 1.0],
        help="lambda of the confusion term, one model per value; 0 is standard MLM training (same seed, same data)",
    )
    add_stopping_arguments(parser)
    add_training_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.steps, args.n_train, args.n_validation = 16, 1, 20, 200, 100
        args.trace_contexts, args.probe_train, args.eval_steps = 20, 100, 10
    write_result(run(args), args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
