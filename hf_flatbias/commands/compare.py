"""``hf-flatbias compare A B ...``: one markdown table of loss, Hessian trace and GLUE across checkpoints."""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "compare",
        help="Compare the flatness cards of several checkpoints or Hub repos in one markdown table.",
        description="Read each flatness card (local folder, card file or Hub repo id) and print a markdown table of "
        "pre-training loss, Hessian trace ± standard error, flatness method, estimator and GLUE metrics.",
    )
    parser.add_argument("models", nargs="+", metavar="REPO_OR_PATH", help="Checkpoint folders, cards or repo ids.")
    parser.add_argument(
        "--sort",
        choices=("none", "trace", "loss"),
        default="none",
        help="Order the rows by Hessian trace or pre-training loss (unknown values last); default: as given.",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from huggingface_hub.errors import HfHubHTTPError

    from ..modelcard import format_comparison_table, load_flatness_card

    cards = []
    for name in args.models:
        try:
            cards.append((name, load_flatness_card(name)))
        except (ValueError, OSError, HfHubHTTPError) as error:  # not a card, no such file, Hub errors
            print(f"hf-flatbias compare: {error}", file=sys.stderr)
            return 2
    if args.sort != "none":
        field = "hessian_trace" if args.sort == "trace" else "pretraining_loss"
        cards.sort(key=lambda item: (getattr(item[1], field) is None, getattr(item[1], field) or 0.0))
    print(format_comparison_table(cards))
    return 0
