"""``hf-flatbias glue MODEL --task sst2``: fine-tune a checkpoint on one GLUE task over several seeds."""

from __future__ import annotations

import argparse
import json

from ..argparsing import number, whole_number
from ..glue.tasks import (
    DEFAULT_MAX_LENGTH,
    DEFAULT_SEEDS,
    DEFAULT_TRAIN_BATCH_SIZE,
    FINETUNE_MODES,
    FROZEN_ENCODER_LEARNING_RATE,
    FULL_FINETUNE_LEARNING_RATE,
    is_run_folder_name,
)
from .paths import (
    check_local_checkpoint,
    check_output_folder,
    check_outputs_spare_inputs,
    existing_local_path,
    local_path_or_hub_id,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "glue",
        help="Fine-tune a checkpoint on a GLUE task over several seeds (mean and std of the validation metric).",
        description="Fine-tune (or linearly probe) a checkpoint on one GLUE task once per seed. Offline, SST-2 is "
        "replaced by Rotten Tomatoes snippets and other tasks need --data-dir.",
    )
    parser.add_argument("model", help="Checkpoint folder or Hub id (with its tokenizer).")
    parser.add_argument("--task", required=True, help="cola, sst2, mrpc, qqp, stsb, mnli, qnli, rte or wnli.")
    parser.add_argument(
        "--mode",
        default="full",
        choices=list(FINETUNE_MODES),
        help="full fine-tuning; one linear layer on frozen [CLS] / token states; a new pooler and classifier on the "
        "frozen encoder.",
    )
    parser.add_argument(
        "--seeds", type=whole_number, nargs="+", default=list(DEFAULT_SEEDS), help="Default: %(default)s."
    )
    parser.add_argument("--data-dir", default=None, help="Local GLUE files (train.* and validation.*).")
    parser.add_argument(
        "--tokenizer", default=None, help="Tokenizer folder or Hub id, for a checkpoint saved without its tokenizer."
    )
    parser.add_argument(
        "--learning-rate",
        type=number,
        default=None,
        help=f"Default: {_rate(FULL_FINETUNE_LEARNING_RATE)} full, {_rate(FROZEN_ENCODER_LEARNING_RATE)} probe.",
    )
    parser.add_argument("--num-train-epochs", type=number, default=3.0, help="Default: %(default)s.")
    parser.add_argument(
        "--max-steps", type=whole_number, default=-1, help="Stop after this many steps (default: epochs)."
    )
    parser.add_argument(
        "--batch-size",
        type=whole_number,
        default=DEFAULT_TRAIN_BATCH_SIZE,
        help="Training batch size (default: %(default)s).",
    )
    parser.add_argument(
        "--max-length",
        type=whole_number,
        default=DEFAULT_MAX_LENGTH,
        help="Truncate inputs (default: %(default)s tokens).",
    )
    parser.add_argument(
        "--max-train-samples", type=whole_number, default=None, help="Use at most this many training rows."
    )
    parser.add_argument(
        "--max-eval-samples", type=whole_number, default=None, help="Use at most this many validation rows."
    )
    parser.add_argument("--output-dir", default=None, help="Keep the runs here (default: a temporary folder).")
    parser.add_argument("--json", action="store_true", help="Print the result as JSON.")
    parser.set_defaults(func=run)


def _rate(value: float) -> str:
    """A learning rate as people write it, ``2e-5`` (Python's own forms are ``2e-05`` and ``0.001``)."""
    return f"{value:.0e}".replace("e-0", "e-")


def run(args: argparse.Namespace) -> int:
    check_arguments(args)  # before torch and transformers load
    model = local_path_or_hub_id(args.model, "MODEL")
    data_dir = None if args.data_dir is None else existing_local_path(args.data_dir, "--data-dir")
    tokenizer = None if args.tokenizer is None else local_path_or_hub_id(args.tokenizer, "--tokenizer")
    check_local_checkpoint(model, "MODEL")
    check_outputs_spare_inputs(
        {"--output-dir": args.output_dir},
        {"MODEL": model, "--data-dir": data_dir, "--tokenizer": tokenizer},
        folders=True,
    )
    if args.output_dir is not None:  # a folder of the user's own is never written into; one of earlier runs of glue is
        check_output_folder(
            args.output_dir, "--output-dir", own_entries=is_run_folder_name, own_name="hf-flatbias glue"
        )
    from ..glue.data import glue_data_source

    glue_data_source(args.task, data_dir=data_dir)  # an unknown task, no data offline, empty files: before transformers
    from ..glue import GlueArguments, GlueConfig, finetune_glue
    from ..utils import quiet_deepspeed_without_accelerator

    quiet_deepspeed_without_accelerator()

    arguments = GlueArguments(
        mode=args.mode,
        seeds=args.seeds,
        max_length=args.max_length,
        max_train_samples=args.max_train_samples,
        max_eval_samples=args.max_eval_samples,
    )
    config = GlueConfig(
        learning_rate=args.learning_rate,
        num_train_epochs=args.num_train_epochs,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
    )
    result = finetune_glue(
        model,
        args.task,
        arguments,
        config,
        data_dir=data_dir,
        tokenizer_name_or_path=tokenizer,
        output_dir=args.output_dir,
    )
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        scores = ", ".join(f"{100 * s:.2f}" for s in result.scores)
        print(
            f"{result.model} {result.task} ({result.mode}) {result.metric}: "
            f"{100 * result.mean:.2f} ± {100 * result.std:.2f} over seeds {result.seeds} [{scores}]"
        )
    return 0


def check_arguments(args: argparse.Namespace) -> None:
    """Every check of the flags alone; raises `ValueError` naming the flag."""
    if not args.seeds:
        raise ValueError("--seeds needs at least one seed.")
    for flag, value in (
        ("--batch-size", args.batch_size),
        ("--max-length", args.max_length),
        ("--max-train-samples", args.max_train_samples),
        ("--max-eval-samples", args.max_eval_samples),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1 (got {value}).")
    if args.max_steps <= 0 and not args.num_train_epochs > 0:
        raise ValueError(f"Give --max-steps > 0 or --num-train-epochs > 0 (got {args.num_train_epochs}).")
    if args.learning_rate is not None and not args.learning_rate > 0:
        raise ValueError(f"--learning-rate must be > 0 (got {args.learning_rate}).")
