"""``hf-flatbias compare A B ...``: one markdown table of loss, Hessian trace and GLUE across checkpoints."""

from __future__ import annotations

import argparse
import math

from ..measures import EXTRA_MEASURES
from .paths import check_not_demo_folder, local_path_or_hub_id

SORT_FIELDS = {
    "trace": "hessian_trace",
    "trace_median_of_means": "hessian_trace_median_of_means",
    "loss": "pretraining_loss",
}
"""The card field each ``--sort`` key orders by; the measures of `hf_flatbias.measures.MEASURE_TABLE` sort by their
value as well (`SORT_KEYS`)."""

SORT_KEYS = (*SORT_FIELDS, *EXTRA_MEASURES)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "compare",
        help="Compare the flatness cards of several checkpoints or Hub repos in one markdown table.",
        description="Read each flatness card (local folder, card file or Hub repo id) and print a markdown table of "
        "pre-training loss, Hessian trace ± standard error, flatness method, estimator and GLUE metrics.",
    )
    parser.add_argument(
        "models",
        nargs="+",
        metavar="REPO_OR_PATH",
        help="Checkpoint folders, cards or repo ids; REPO@REV reads a branch, tag or commit (user/model@step1000).",
    )
    parser.add_argument(
        "--revision", default=None, help="Branch, tag or commit of every Hub repo given without @REV (default: main)."
    )
    parser.add_argument(
        "--sort",
        choices=("none", *SORT_KEYS),
        default="none",
        help="Order the rows by trace, by the trace's median of means (which a few contexts with huge gradients "
        f"cannot carry), by pre-training loss or by a measure the cards carry ({', '.join(EXTRA_MEASURES)}); "
        "unknown values last; default: as given.",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Bad input (not a card, no such file, a Hub error) raises; `cli.main` reports it in one line."""
    # every path is checked before the first card is fetched from the Hub
    sources = [local_path_or_hub_id(name, "REPO_OR_PATH", file_suffixes=(".md",)) for name in args.models]
    for source in sources:
        check_not_demo_folder(source, "REPO_OR_PATH")
    from ..modelcard import format_comparison_table, load_flatness_card
    from .card import read_card_reporting_warnings

    cards = [
        (name, read_card_reporting_warnings("hf-flatbias compare", load_flatness_card, source, _revision(source, args)))
        for name, source in zip(args.models, sources, strict=True)
    ]
    if args.sort != "none":
        cards.sort(key=lambda item: _unknown_last(_sort_value(item[1], args.sort)))
    print(format_comparison_table(cards))
    return 0


def _revision(source: str, args: argparse.Namespace) -> str | None:
    """``--revision`` for a Hub repo without its own ``@REV``; a local path takes none."""
    from pathlib import Path

    return None if "@" in source or Path(source).exists() else args.revision


def _sort_value(card, key: str) -> float | None:
    if key in SORT_FIELDS:
        return getattr(card, SORT_FIELDS[key])
    return (card.measures.get(key) or {}).get("value")


def _unknown_last(value: float | None) -> tuple[bool, float]:
    # NaN compares false with everything, so it must be sorted as unknown explicitly
    unknown = value is None or not math.isfinite(value)
    return unknown, 0.0 if unknown else value
