"""Checkpoint selection by flatness versus by lowest loss, on the synthetic PCFG (beyond the paper).

One BERT is trained past the point where its MLM loss stops improving (the paper's Sec. 3.1 regime: the loss is flat
while the trace keeps falling and transfer keeps improving). Every ``--eval-steps`` the Trainer evaluates the one-mask
validation loss, `FlatnessCheckpointSelector` records it together with the Hessian trace, and a recorder measures the
linear-probe accuracy of task A (for reporting only: the selector never sees it). At the end the recipe compares the
checkpoint the selector keeps (flattest within ``--loss-tolerance`` nats of the best loss) with the lowest-loss one.

    OMP_NUM_THREADS=1 PYTHONPATH=. python recipes/pcfg_checkpoint_selection.py \
        --output docs/reproduction/pcfg_checkpoint_selection.json
    OMP_NUM_THREADS=1 PYTHONPATH=. python recipes/pcfg_checkpoint_selection.py --quick   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from pcfg_common import (  # noqa: E402
    ModelSize,
    add_training_arguments,
    build_data,
    format_table,
    probe_tasks,
    set_threads,
    trace_of,
    train_mlm,
    write_result,
)
from transformers import BertForMaskedLM, TrainerCallback  # noqa: E402

from hf_flatbias.selection import FlatnessCheckpointSelector  # noqa: E402


class ProbeRecorder(TrainerCallback):
    """Probe accuracy at every evaluation, kept aside to judge the selection afterwards."""

    def __init__(self, data, n_probe_train: int):
        self.data, self.n_probe_train, self.accuracy = data, n_probe_train, {}

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        self.accuracy[state.global_step] = probe_tasks(model, self.data, n_probe_train=self.n_probe_train)


def run(args: argparse.Namespace) -> dict:
    set_threads()
    size = ModelSize(hidden=args.hidden, layers=args.layers, heads=args.hidden // args.head_dim)
    data = build_data(args.n_train, args.n_validation, grammar_seed=args.grammar_seed, data_seed=args.seed)
    torch.manual_seed(args.seed)
    model = BertForMaskedLM(size.config(data.vocab_size))
    selector = FlatnessCheckpointSelector(
        loss_tolerance=args.loss_tolerance,
        trace_fn=lambda m: trace_of(m, data, n_contexts=args.trace_contexts, seed=args.seed),
    )
    recorder = ProbeRecorder(data, args.probe_train)
    train_mlm(
        model,
        data,
        steps=args.steps,
        learning_rate=args.learning_rate,
        batch_size=args.batch_size,
        seed=args.seed,
        mask_probability=args.mask_probability,
        callbacks=[selector, recorder],
        eval_strategy="steps",
        eval_steps=args.eval_steps,
    )
    rows = []
    for step, record in sorted(selector.records.items()):
        row = {"step": step, "eval_loss": record.eval_loss, "trace": record.hessian_trace, "stderr": record.stderr}
        row.update(recorder.accuracy[step])
        rows.append(row)
    selection = selector.selection
    chosen, lowest = selection.chosen.step, selection.lowest_loss.step
    summary = {
        "floor": data.floor,
        "chosen_step": chosen,
        "lowest_loss_step": lowest,
        "candidates": [r.step for r in selection.candidates],
        "task_a_chosen": recorder.accuracy[chosen]["task_a"],
        "task_a_lowest_loss": recorder.accuracy[lowest]["task_a"],
        "reason": selection.reason,
    }
    print(format_table(rows, ["step", "eval_loss", "trace", "stderr", "task_a", "task_b", "task_c"]))
    print(json.dumps(summary, indent=2))
    return {
        "recipe": "pcfg_checkpoint_selection",
        "arguments": vars(args),
        "model": size.name,
        "rows": rows,
        "summary": summary,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--eval-steps", type=int, default=400)
    parser.add_argument("--loss-tolerance", type=float, default=0.02, help="nats above the best validation loss")
    add_training_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.steps, args.eval_steps = 16, 1, 30, 10
        args.n_train, args.n_validation, args.trace_contexts, args.probe_train = 200, 100, 20, 100
        args.loss_tolerance = 10.0
    write_result(run(args), args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
