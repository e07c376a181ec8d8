"""``hf-flatbias card REPO_OR_PATH``: print the flatness card of a checkpoint folder, card file or Hub repo."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings

from .paths import check_not_demo_folder, local_path_or_hub_id


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "card",
        help="Show the flatness card (trace, loss, method, GLUE) of a checkpoint or Hub repo.",
        description="Read the flatness metadata of a local checkpoint folder, a README.md, or a Hub repository "
        "(HF_ENDPOINT is honoured) and print it.",
    )
    parser.add_argument(
        "repo_or_path", help="Checkpoint folder, card file, or Hub repo id (user/model, or user/model@REV)."
    )
    parser.add_argument(
        "--revision", default=None, help="Branch, tag or commit of a Hub repository (the same as REPO@REV)."
    )
    parser.add_argument("--json", action="store_true", help="Print the card as JSON instead of a table.")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Bad input (not a card, no such file, a Hub error) raises; `cli.main` reports it in one line."""
    source = local_path_or_hub_id(args.repo_or_path, "REPO_OR_PATH", file_suffixes=(".md",))
    check_not_demo_folder(source, "REPO_OR_PATH")
    from ..modelcard import load_flatness_card

    card = read_card_reporting_warnings("hf-flatbias card", load_flatness_card, source, args.revision)
    if args.json:
        print(json.dumps(dataclasses.asdict(card), indent=2, sort_keys=True))
    else:
        print(format_card_summary(args.repo_or_path, card))
    return 0


def read_card_reporting_warnings(program: str, load, repo_or_path: str, revision: str | None = None):
    """``load(repo_or_path)``, its warnings (e.g. a non-finite trace read as unknown) printed as one line each."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        card = load(repo_or_path, revision=revision)
    for warning in caught:
        print(f"{program}: warning: {warning.message}", file=sys.stderr)
    return card


def format_card_summary(label: str, card) -> str:
    """A two-column markdown table of what the card records (unknown fields left out)."""
    from ..modelcard import measure_summaries

    trace = None
    if card.hessian_trace is not None:
        trace = f"{card.hessian_trace:.6g}"
        if card.hessian_trace_stderr is not None:
            trace += f" ± {card.hessian_trace_stderr:.3g}"
    estimator = None
    if card.estimator is not None or card.n_contexts is not None:
        estimator = f"{card.estimator or '?'}, {card.n_contexts or '?'} contexts × {card.n_draws or '?'} draws"
    loss = None
    if card.pretraining_loss is not None:
        loss = f"{card.pretraining_loss:.6g}" + (
            f" ({card.pretraining_loss_source})" if card.pretraining_loss_source else ""
        )
    rows = [
        ("model", label),
        ("method", card.method),
        *card.method_hyperparameters().items(),
        ("objective", card.objective or "not recorded"),
        (card.trained_objective.loss_name, loss),
        (f"{card.trace_quantity} ± stderr", trace),
        ("trace, median of means", _median_of_means_text(card)),
        ("trace's top 1% of contexts carry", _top_share_text(card)),
        ("trace measured on", card.trace_objective_text if card.hessian_trace is not None else None),
        ("trace measured at step", card.trace_step),
        ("parameters the trace covers", card.trainable_parameters),
        ("parameters", card.num_parameters),
        ("adapter", card.adapter),
        ("base model", card.base_model),
        ("estimator", estimator),
        *measure_summaries(card),
        ("step", card.global_step),
    ]
    rows += [
        (f"GLUE {task}/{metric}", f"{value:.4f}")
        for task in sorted(card.glue)
        for metric, value in sorted(card.glue[task].items())
    ]
    lines = ["| field | value |", "| --- | --- |"]
    lines += [f"| {name} | {value} |" for name, value in rows if value is not None]
    return "\n".join(lines)


def _median_of_means_text(card) -> str | None:
    if card.hessian_trace_median_of_means is None:
        return None
    groups = f" ({card.median_of_means_groups} groups)" if card.median_of_means_groups else ""
    return f"{card.hessian_trace_median_of_means:.6g}{groups}"


def _top_share_text(card) -> str | None:
    if card.hessian_trace_top_share is None:
        return None
    contexts = f" ({card.top_share_contexts} contexts)" if card.top_share_contexts else ""
    return f"{100 * card.hessian_trace_top_share:.1f}%{contexts}"
