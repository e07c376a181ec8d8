"""``hf-flatbias trace MODEL --data FILE|DATASET``: measure the Hessian trace of any local or Hub checkpoint."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from ..argparsing import whole_number
from ..constants import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_ESTIMATOR,
    DEFAULT_N_CONTEXTS,
    ESTIMATORS,
    RECOMMENDED_N_DRAWS,
    TRACE_QUANTITIES,
)
from ..corpus import DATA_FILE_BUILDERS
from ..measures import needs_downstream_task
from ..results import write_json
from ..text_data import check_data_file
from .paths import (
    FIGURE_OWNER,
    check_local_checkpoint,
    check_output_file,
    check_outputs_spare_inputs,
    check_plot_file,
    is_matplotlib_figure,
    json_object_with,
    local_path_or_hub_id,
)
from .trace_inputs import (
    check_request_size,
    checked_device,
    checked_token_rows,
    count_labelled,
    load_language_model,
    load_rows,
    load_tokenizer_from,
    peft_base_model,
    token_limit,
    tokenizer_source_of,
)
from .trace_measures import (
    add_measure_arguments,
    check_measure_arguments,
    contexts_fingerprint,
    load_measure_task,
    measure_lines,
    measures_beyond_trace,
)
from .trace_series import add_series_arguments, hub_revision, model_label, run_series, split_model_revision

RESULT_KEYS = ("model", "data", "split", "seed", "device")
"""Keys every result this command writes has (since its first version): a file without them is not its own,
and ``--output`` never writes over it."""
GROUPED_ESTIMATORS = ("per_sample", "naive")
"""The estimators that split the trace by parameter group (per-context ones)."""


def batch_size_argument(value: str) -> int | str:
    """``--batch-size``: a positive integer or ``auto``."""
    if value == "auto":
        return value
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {value!r}")
    return size


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "trace",
        help="Estimate the Fisher trace of the pre-training loss (the paper's flatness measure) or its Hessian trace.",
        description="Estimate Tr(F) = E_x E_{y~f(x)} ||grad log f(x)_y||^2 on masked (or causal) LM contexts (or, "
        "with --estimator hutchinson/hutchpp, the Hessian trace Tr(H) of the data-label loss), print it and write it "
        "as JSON.",
    )
    parser.add_argument(
        "model",
        help="A local checkpoint folder or a Hub model id (masked or causal LM); REPO@REV measures a branch, tag or "
        "commit, as --revision does.",
    )
    parser.add_argument(
        "--data",
        required=True,
        help="A .json/.jsonl/.csv/.txt/.parquet file, a folder written by datasets' save_to_disk, or a Hub dataset "
        "name. Rows hold text (see --text-column) or input_ids; rows with labels (-100 except at predicted "
        "positions) are used as they are.",
    )
    parser.add_argument("--split", default=None, help="Dataset split (default: validation if present, else train).")
    parser.add_argument("--config-name", default=None, help="Hub dataset configuration (e.g. wikitext-2-raw-v1).")
    parser.add_argument("--text-column", default="text", help="Column holding raw text (default: text).")
    parser.add_argument(
        "--tokenizer", default=None, help="Tokenizer folder or Hub id, for a checkpoint saved without its tokenizer."
    )
    parser.add_argument(
        "--max-length",
        type=whole_number,
        default=128,
        help="Cut each row (tokenized text, or input_ids) to this many tokens, and to the model's positions.",
    )
    parser.add_argument(
        "--n-contexts",
        type=whole_number,
        default=DEFAULT_N_CONTEXTS,
        help="Contexts to average over (the paper: 10,000).",
    )
    parser.add_argument(
        "--n-draws",
        type=whole_number,
        default=RECOMMENDED_N_DRAWS,
        help="Draws of y per context (default: %(default)s, which reached the same error several times faster than "
        "the 50 draws a secondary summary gives for the paper (unverified), with the per_sample estimator).",
    )
    parser.add_argument("--estimator", default=DEFAULT_ESTIMATOR, choices=list(ESTIMATORS), help="Estimator to use.")
    parser.add_argument("--seed", type=whole_number, default=0, help="Seed of the masked positions and the draws.")
    parser.add_argument(
        "--batch-size",
        type=batch_size_argument,
        default=DEFAULT_BATCH_SIZE,
        help="Contexts per forward, or 'auto': as many as keep the working memory under 80%% of the free GPU memory "
        "(half the available RAM on CPU). Default: %(default)s.",
    )
    parser.add_argument(
        "--by-group",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Split the trace by parameter group (embeddings, each block, final norm, head, the decoder's own "
        "output-layer term) and print a table of it (default: on for the per_sample and naive estimators).",
    )
    parser.add_argument(
        "--plot", default=None, help="Draw the per-group trace as a bar chart into this .png/.pdf/.svg file."
    )
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu).")
    parser.add_argument(
        "--causal",
        action="store_true",
        help="Measure next-token contexts. Detected from the checkpoint's architecture; refused for a checkpoint whose "
        "head is a masked LM (the trace is defined on the objective the head was trained for).",
    )
    parser.add_argument("--output", default="hessian_trace.json", help="JSON file to write (default: %(default)s).")
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Show a progress bar with the time left on stderr (default: shown).",
    )
    add_measure_arguments(parser)
    add_series_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    split_model_revision(args)
    if args.revisions:
        return run_series(args, measure=measure, check_arguments=check_arguments, inputs_of=trace_inputs)
    check_arguments(args)  # before torch and transformers load (seconds) and before any data is read
    args.model = local_path_or_hub_id(args.model, "MODEL")
    args.data = local_path_or_hub_id(args.data, "--data", file_suffixes=tuple(DATA_FILE_BUILDERS))
    check_local_checkpoint(args.model, "MODEL")  # a damaged config.json, an adapter's missing base: before loading
    if args.tokenizer is not None:
        args.tokenizer = local_path_or_hub_id(args.tokenizer, "--tokenizer")
    check_data_file(args.data, flag="--data")  # an empty file: before torch and datasets load
    check_outputs_spare_inputs({"--output": args.output, "--plot": args.plot}, trace_inputs(args))
    # an existing --output is written over only when it is an earlier result of this command: a user's file is kept
    own_result = json_object_with(*RESULT_KEYS)
    check_output_file(args.output, "--output", own=own_result, own_name="an hf-flatbias trace result")
    if args.plot:
        check_output_file(args.plot, "--plot", own=is_matplotlib_figure, own_name=FIGURE_OWNER)
    result = measure(args)
    estimate = result.get("estimate")
    if estimate is not None:
        if estimate.get("by_group"):
            print(format_group_table(estimate))
        quantity = TRACE_QUANTITIES[estimate["estimator"]]
        print(
            f"{quantity} of {model_label(args)}: {estimate['mean']:.6g} +- {estimate['stderr']:.3g} (standard error; "
            f"{estimate['estimator']}, {estimate['n_contexts']} contexts x {estimate['n_draws']} draws, "
            f"{estimate['seconds']:.1f} s)"
        )
        if estimate.get("median_of_means") is not None:
            print(robust_summary_line(estimate))
        if estimate.get("suggested_n_draws"):
            print(f"Draws per context with the least error per second on this model: {estimate['suggested_n_draws']}")
    for line in measure_lines(result):
        print(line)
    write_json(Path(args.output), result)  # whole or not at all
    print(f"Wrote {args.output}")
    if args.plot:
        plot_groups(
            estimate, args.plot, title=f"{TRACE_QUANTITIES[estimate['estimator']]} by parameter group: {args.model}"
        )
        print(f"Wrote {args.plot}")
    return 0


def trace_inputs(args: argparse.Namespace) -> dict[str, str | None]:
    """What the command reads, by flag: no output may be written over one of them."""
    return {
        "MODEL": args.model,
        "--data": args.data,
        "--tokenizer": args.tokenizer,
        "--forgetting-task": getattr(args, "forgetting_task", None),
    }


def check_arguments(args: argparse.Namespace) -> None:
    """Every check of the flags alone; raises `ValueError` naming the flag."""
    for flag, value in (
        ("--n-draws", args.n_draws),
        ("--n-contexts", args.n_contexts),
        ("--max-length", args.max_length),
    ):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1 (got {value}).")
    check_request_size(args.n_contexts, args.n_draws, args.max_length, args.batch_size)  # before it is allocated
    if args.by_group is None:
        args.by_group = args.estimator in GROUPED_ESTIMATORS
    if (args.by_group or args.plot) and args.estimator not in GROUPED_ESTIMATORS:
        raise ValueError(
            f"--by-group and --plot need a per-context estimator ({', '.join(GROUPED_ESTIMATORS)}), got "
            f"--estimator {args.estimator}."
        )
    if args.plot and not args.by_group:
        raise ValueError("--plot draws the per-group trace: drop --no-by-group.")
    check_plot_file(args.plot)
    check_measure_arguments(args)
    if args.plot and "trace" not in args.measures:
        raise ValueError("--plot draws the per-group trace: add trace to --measures.")


def robust_summary_line(estimate: dict) -> str:
    """The trace's median of means and top-1% share in one line: a mean carried by a few contexts shows here."""
    line = f"Median of means ({estimate['median_of_means_groups']} groups): {estimate['median_of_means']:.6g}"
    if estimate.get("top_share") is not None:
        line += f"; the top {estimate['top_share_units']} contexts carry {100 * estimate['top_share']:.1f}% of it"
    return line


def format_group_table(estimate: dict[str, Any]) -> str:
    """The per-group trace as a text table: mean, standard error and share of the total."""
    total = estimate["mean"]
    width = max(len("group"), *(len(group) for group in estimate["by_group"]))
    lines = [f"{'group':<{width}}  {'trace':>12}  {'stderr':>10}  {'share':>6}"]
    for group, part in estimate["by_group"].items():
        share = f"{part['mean'] / total:6.1%}" if total else "     -"
        lines.append(f"{group:<{width}}  {part['mean']:12.6g}  {part['stderr']:10.3g}  {share}")
    lines.append(f"{'total':<{width}}  {total:12.6g}  {estimate['stderr']:10.3g}  {'100.0%' if total else '     -'}")
    return "\n".join(lines)


def plot_groups(estimate: dict[str, Any], path: str, *, title: str) -> None:
    """A bar per parameter group with its standard error (matplotlib, imported only here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(estimate["by_group"])
    means = [estimate["by_group"][g]["mean"] for g in groups]
    errors = [estimate["by_group"][g]["stderr"] for g in groups]
    figure, axis = plt.subplots(figsize=(max(4.0, 0.6 * len(groups) + 2), 3.5))
    axis.bar(range(len(groups)), means, yerr=errors, capsize=3, color="tab:blue")
    axis.set_xticks(range(len(groups)), groups, rotation=45, ha="right")
    axis.set_ylabel(f"{TRACE_QUANTITIES[estimate['estimator']]}, per group")
    axis.set_title(title, fontsize=9)
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Load the checkpoint and the data, build the contexts and estimate; raises `ValueError` on bad input."""
    from ..utils import quiet_deepspeed_without_accelerator

    quiet_deepspeed_without_accelerator()
    import datasets
    from transformers.utils import logging as transformers_logging

    bars = transformers_logging.is_progress_bar_enabled(), datasets.is_progress_bar_enabled()
    if not args.progress:  # also the loading bars of transformers and datasets, not only the estimate's
        transformers_logging.disable_progress_bar()
        datasets.disable_progress_bars()
    try:
        return _measure(args)
    finally:
        if bars[0]:
            transformers_logging.enable_progress_bar()
        if bars[1]:
            datasets.enable_progress_bars()


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    from ..flatness.api import estimate_hessian_trace
    from ..flatness.contexts import build_masked_contexts
    from ..flatness.lm import check_tokenizer_fits_model, is_causal_lm, output_vocab_size

    device = checked_device(args.device, torch)
    rows = load_rows(args)  # before the model: a bad data file is reported at once
    if not rows:
        raise ValueError(f"{args.data} holds no rows.")
    # gradient alignment groups the contexts by a column of their rows, carried into each context
    kept = (args.alignment_column,) if "gradient_alignment" in args.measures and args.alignment_column else ()
    if kept and kept[0] not in rows[0]:
        raise ValueError(
            f"--alignment-column {kept[0]}: rows of {args.data} have no such column (columns: {sorted(rows[0])})."
        )
    base_model = peft_base_model(args.model)  # a PEFT adapter folder names the model it adapts
    revision = hub_revision(args, base_model)
    config = AutoConfig.from_pretrained(base_model or args.model, revision=revision)
    architectures = list(getattr(config, "architectures", None) or [])
    causal_names, masked_names = (
        set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()),
        set(MODEL_FOR_MASKED_LM_MAPPING_NAMES.values()),
    )
    if architectures and not any(a in causal_names or a in masked_names for a in architectures):
        raise ValueError(
            f"{args.model} is a {architectures} checkpoint without a language-model head; loading it as an LM would "
            "initialise a random head. Measure the pre-trained checkpoint (e.g. ...ForMaskedLM / ...ForCausalLM)."
        )
    detected_causal = is_causal_lm(config)
    if args.causal and architectures and not detected_causal:
        raise ValueError(
            f"--causal: {args.model} is a {', '.join(architectures)} checkpoint, whose head predicts masked tokens; "
            "the trace of a next-token loss it was never trained for is another number. Drop --causal (the "
            "objective is read from the checkpoint)."
        )
    causal = args.causal or detected_causal
    if "input_ids" in rows[0]:
        # ids outside the embedding, or past its positions, fail deep in torch; floats and strings would be cast
        rows = checked_token_rows(rows, config, args.max_length, args.data, _notice)
    model = load_language_model(args.model, base_model, causal, revision=revision)
    model.to(device)
    vocab_size = output_vocab_size(model)
    tokenizer_source = tokenizer_source_of(args.model, base_model, args.tokenizer)
    # the revision is the model repo's: a tokenizer named apart (--tokenizer, a base model) is read at its main
    tokenizer_revision = revision if tokenizer_source == args.model else None
    tokenizer = None
    if "input_ids" not in rows[0]:
        if args.text_column not in rows[0]:
            raise ValueError(
                f"Rows of {args.data} have neither input_ids nor a {args.text_column!r} column (columns: "
                f"{sorted(rows[0])}); name the text column with --text-column."
            )
        tokenizer = load_tokenizer_from(tokenizer_source, revision=tokenizer_revision)
        with_text = [row for row in rows if row[args.text_column] and row[args.text_column].strip()]
        texts = [row[args.text_column] for row in with_text]
        if not texts:
            raise ValueError(f"The {args.text_column!r} column of {args.data} holds no text.")
        encoded = tokenizer(texts, truncation=True, max_length=token_limit(args.max_length, config))
        check_tokenizer_fits_model(
            tokenizer, vocab_size, source=tokenizer_source, input_ids=encoded["input_ids"], text_source=args.data
        )
        rows = [
            {"input_ids": ids, "attention_mask": mask, **{column: row[column] for column in kept if column in row}}
            for ids, mask, row in zip(encoded["input_ids"], encoded["attention_mask"], with_text, strict=True)
        ]
    if "labels" in rows[0]:
        # ready-made contexts: each labelled position is one
        contexts = rows
        n_contexts = min(args.n_contexts, count_labelled(rows))
        if n_contexts < args.n_contexts:
            _notice(f"--n-contexts {args.n_contexts}: {args.data} labels {n_contexts} positions; using those.")
    else:
        if tokenizer is None and not causal:
            tokenizer = load_tokenizer_from(tokenizer_source, revision=tokenizer_revision)
            check_tokenizer_fits_model(
                tokenizer,
                vocab_size,
                source=tokenizer_source,
                input_ids=[row["input_ids"] for row in rows],
                text_source=args.data,
            )
        if len(rows) < args.n_contexts:
            # As HessianTraceCallback and build_masked_contexts do (and the paper, with many masked positions per
            # held-out text): rows are reused with other positions; said here because it is not free.
            _notice(
                f"--n-contexts {args.n_contexts} from {len(rows)} rows: each row is reused with other masked positions "
                f"(about {args.n_contexts / len(rows):.0f} contexts per row). Contexts of one row are correlated, so "
                "the standard error comes out somewhat too small; more rows give independent contexts."
            )
        if not causal and tokenizer.mask_token_id is None:
            raise ValueError(f"The tokenizer of {args.model} has no mask token; is this a masked LM?")
        contexts = build_masked_contexts(
            rows,
            mask_token_id=None if causal else tokenizer.mask_token_id,
            causal=causal,
            n_contexts=args.n_contexts,
            seed=args.seed,
            special_token_ids=list(getattr(tokenizer, "all_special_ids", []) or []),
            keep_columns=kept,
        )
        n_contexts = None
    result = {"model": args.model, "data": args.data, "split": args.split, "seed": args.seed, "device": device}
    if revision is not None:
        result["revision"] = revision
    result["contexts_sha256"] = contexts_fingerprint(contexts, n_contexts)
    if base_model is not None:
        result["base_model"] = base_model  # the trace is over the adapter's parameters, the trainable ones
    if needs_downstream_task(args.measures) and tokenizer is None:
        tokenizer = _tokenizer_if_any(tokenizer_source, tokenizer_revision)  # a pre-tokenized task needs none
    task = load_measure_task(args, model, tokenizer, args.seed)  # before anything is measured
    if "trace" in args.measures:
        estimate = estimate_hessian_trace(
            model,
            contexts,
            n_contexts=n_contexts,
            n_draws=args.n_draws,
            estimator=args.estimator,
            seed=args.seed,
            batch_size=args.batch_size,
            causal=causal,
            by_group=args.by_group,
            progress=args.progress,
        )
        if not math.isfinite(estimate.mean):  # written as nan with exit 0, it would read as a measurement
            raise ValueError(
                f"the trace came out {estimate.mean}: the loss or its gradient is not finite on these contexts; "
                "check the checkpoint (a diverged run?) and the data."
            )
        result["estimate"] = estimate.to_dict()
    result.update(measures_beyond_trace(args, model, contexts, n_contexts, causal, task=task))
    return result


def _tokenizer_if_any(source: str, revision: str | None) -> Any:
    """The checkpoint's tokenizer, or ``None`` when it has none (what needs one then says so)."""
    try:
        return load_tokenizer_from(source, revision=revision)
    except (OSError, ValueError):
        return None


def _notice(text: str) -> None:
    print(f"hf-flatbias trace: {text}", file=sys.stderr, flush=True)
