"""``hf-flatbias select``: pick the flattest checkpoint among those whose validation loss is near the best."""

from __future__ import annotations

import argparse
import json
import os
from typing import TYPE_CHECKING

from ..argparsing import number
from ..constants import TRACE_METRIC, TRACE_STDERR_METRIC, TRACE_SUMMARIES
from .paths import check_not_demo_folder, existing_local_path

if TYPE_CHECKING:
    from ..selection import CheckpointRecord

TRAINER_STATE = "trainer_state.json"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "select",
        help="Choose the flattest checkpoint within a loss tolerance of the best.",
        description=(
            "Among checkpoints whose validation loss is within a tolerance of the lowest, choose the one with the "
            "smallest Hessian trace (Liu et al., 2023: at equal pre-training loss, flatter models transfer better)."
        ),
    )
    parser.add_argument(
        "source",
        help="a training output folder (its newest checkpoint-*/trainer_state.json, or trainer_state.json, is read), "
        "a trainer_state.json file, or a JSON file holding a list of records {step, eval_loss, hessian_trace, "
        "stderr, path} (or an object with such a 'records' list; other key names via --loss-key/--trace-key/"
        "--stderr-key)",
    )
    parser.add_argument("--loss-tolerance", type=number, default=0.01, help="slack on the best loss (default 0.01)")
    parser.add_argument("--relative", action="store_true", help="read --loss-tolerance as a fraction of the best loss")
    parser.add_argument(
        "--trace-margin",
        type=number,
        default=0.0,
        help="traces within this many combined standard errors of the smallest count as equally flat; the lowest "
        "loss among them wins (default 0: smallest trace wins)",
    )
    parser.add_argument("--loss-key", default="eval_loss", help="log_history key of the validation loss")
    parser.add_argument(
        "--trace-summary",
        choices=tuple(TRACE_SUMMARIES),
        default="mean",
        help="rank by the trace's mean (default) or by its median of means, which a few contexts with huge "
        f"gradients cannot carry ({TRACE_SUMMARIES['median_of_means']}); --trace-margin still uses the mean's error",
    )
    parser.add_argument(
        "--trace-key", default=None, help=f"log_history key of the trace (default: --trace-summary's, {TRACE_METRIC})"
    )
    parser.add_argument("--stderr-key", default=TRACE_STDERR_METRIC, help="log_history key of its standard error")
    parser.add_argument("--json", action="store_true", help="print the selection as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.trace_key is None:
        args.trace_key = TRACE_SUMMARIES[args.trace_summary]
    records = _load_records(args)
    from ..selection import select_flattest_checkpoint

    selection = select_flattest_checkpoint(
        records,
        loss_tolerance=args.loss_tolerance,
        relative_tolerance=args.relative,
        trace_margin=args.trace_margin,
    )
    if args.json:
        print(json.dumps(selection.to_dict(), indent=2))
        return 0
    print(f"{'step':>8} {'eval_loss':>12} {'trace':>12} {'stderr':>10}")
    for record in sorted(records, key=lambda r: r.step):
        marks = []
        if record in selection.candidates:
            marks.append("candidate")
        if record == selection.lowest_loss:
            marks.append("lowest loss")
        if record == selection.chosen:
            marks.append("CHOSEN")
        row = f"{record.step:>8} {record.eval_loss:>12.6g} {_fmt(record.hessian_trace):>12} {_fmt(record.stderr):>10}"
        print(f"{row}  {', '.join(marks)}" if marks else row)
    print(selection.reason)
    print(f"chosen: {selection.chosen.path or f'step {selection.chosen.step}'}")
    return 0


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


def _load_records(args: argparse.Namespace) -> list[CheckpointRecord]:
    path = existing_local_path(args.source, "SOURCE")
    check_not_demo_folder(path, "SOURCE")
    from ..selection import CheckpointRecord, records_from_log_history

    checkpoint_dir = None
    if os.path.isdir(path):
        checkpoint_dir = path
        state_path = _newest_trainer_state(path)
    else:
        state_path = path
    with open(state_path) as handle:
        payload = json.load(handle)
    if isinstance(payload, dict) and isinstance(payload.get("records"), list):
        payload = payload["records"]  # a recipe's result file: {"records": [...], ...}
    if isinstance(payload, list):
        return [CheckpointRecord.from_mapping(_canonical_keys(item, args)) for item in payload]
    if isinstance(payload, dict) and "log_history" in payload:
        if checkpoint_dir is None:
            # trainer_state.json lives in <output_dir>/checkpoint-N/ or <output_dir>/.
            parent = os.path.dirname(os.path.abspath(state_path))
            checkpoint_dir = os.path.dirname(parent) if os.path.basename(parent).startswith("checkpoint-") else parent
        records = records_from_log_history(
            payload["log_history"],
            loss_key=args.loss_key,
            trace_key=args.trace_key,
            stderr_key=args.stderr_key,
            checkpoint_dir=checkpoint_dir,
        )
        if not records:
            raise ValueError(f"{state_path} logs no {args.loss_key!r}; was the run evaluated (eval_strategy)?")
        return records
    raise ValueError(f"{state_path} is neither a list of checkpoint records nor a trainer_state.json.")


def _canonical_keys(item: dict, args: argparse.Namespace) -> dict:
    """A record's own keys win; otherwise the --loss-key / --trace-key / --stderr-key names are read."""
    renamed = dict(item)
    for flag_key, canonical in (
        (args.loss_key, "eval_loss"),
        (args.trace_key, "hessian_trace"),
        (args.stderr_key, "stderr"),
    ):
        if canonical not in renamed and flag_key in item:
            renamed[canonical] = item[flag_key]
    return renamed


def _newest_trainer_state(folder: str) -> str:
    checkpoints = [
        name
        for name in os.listdir(folder)
        if name.startswith("checkpoint-")
        and name.split("-", 1)[1].isdigit()
        and os.path.isfile(os.path.join(folder, name, TRAINER_STATE))
    ]
    if checkpoints:
        newest = max(checkpoints, key=lambda name: int(name.split("-", 1)[1]))
        return os.path.join(folder, newest, TRAINER_STATE)
    if os.path.isfile(os.path.join(folder, TRAINER_STATE)):
        return os.path.join(folder, TRAINER_STATE)
    raise ValueError(f"{folder} holds no trainer_state.json (neither directly nor in a checkpoint-* folder).")
