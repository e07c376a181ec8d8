"""``hf-flatbias trace REPO --revisions r1,r2,...``: follow a series of published checkpoints (a Hub repo's branches,
tags or commits, e.g. Pythia's ``step1000``...) and measure each on the same contexts.

Each revision's result is one JSON row of a JSONL file, written as soon as it is measured (the whole file rewritten
to a temporary file and renamed over it, so a row is there whole or not at all); a rerun skips the revisions already
written, so an interrupted series resumes where it stopped. ``--plot`` draws each measure against the revision
order, or the training step parsed from the names (``step1000``, ``step-2000``...) when every name has one.
"""

from __future__ import annotations

import argparse
import copy
import fnmatch
import json
import os
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..measures import MEASURE_TABLE

DEFAULT_OUTPUT = "hessian_trace.json"
"""``--output``'s default, as the one-checkpoint command writes it; a series writes `DEFAULT_SERIES_OUTPUT`."""
DEFAULT_SERIES_OUTPUT = "hessian_trace_series.jsonl"
PATTERN_CHARACTERS = "*?["
STEP_PATTERN = re.compile(r"(?:^|[^a-z])(?:step|steps|global_step|checkpoint|ckpt)[-_]?(\d+)", re.IGNORECASE)
SERIES_SETTINGS = (
    "data",
    "split",
    "config_name",
    "text_column",
    "max_length",
    "n_contexts",
    "n_draws",
    "estimator",
    "seed",
    "batch_size",
    "causal",
    "measures",
)
"""The flags that decide what a row measures: rows written under other values are not mixed into one file."""


def add_series_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--revision",
        default=None,
        help="Branch, tag or commit of a Hub MODEL to measure (default: main).",
    )
    parser.add_argument(
        "--revisions",
        default=None,
        help="Comma-separated branches, tags or commits of a Hub MODEL, or glob patterns over its branches and tags "
        "(e.g. 'step*'; quote it for the shell): each is measured on the same contexts and written as one JSON row "
        f"of --output (a .jsonl file; default {DEFAULT_SERIES_OUTPUT}) as soon as it is done. A rerun skips the "
        "revisions already written. With --plot: each measure against the revision order, or the step parsed from "
        "the names (step1000...).",
    )


def hub_revision(args: argparse.Namespace, base_model: str | None) -> str | None:
    """``--revision`` for a Hub model; refused for a local folder or a PEFT adapter folder (which have none)."""
    revision = getattr(args, "revision", None)
    if revision is not None and (base_model is not None or Path(args.model).exists()):
        raise ValueError(f"--revision {revision}: {args.model} is a local folder, which has no revisions.")
    return revision


def model_label(args: argparse.Namespace) -> str:
    """``MODEL`` or ``MODEL@REVISION`` in printed lines."""
    revision = getattr(args, "revision", None)
    return f"{args.model}@{revision}" if revision else args.model


def parse_step(revision: str) -> int | None:
    """The training step a revision's name carries (``step1000``, ``step-1000``, ``checkpoint_500``), else None."""
    match = STEP_PATTERN.search(revision)
    return int(match.group(1)) if match else None


def resolve_revisions(repo_id: str, text: str, *, list_refs=None) -> list[str]:
    """The revisions ``--revisions`` names, in order: each literal as given, each glob pattern expanded to the
    repo's matching branches and tags (by the step in their names when all have one, else by name). Duplicates are
    dropped. `ValueError` for an empty list or a pattern that matches nothing (naming the refs there are)."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise ValueError("--revisions is empty: name branches, tags or commits, e.g. --revisions step1000,step2000.")
    names: list[str] | None = None
    revisions: list[str] = []
    for item in items:
        if not any(character in item for character in PATTERN_CHARACTERS):
            revisions.append(item)
            continue
        if names is None:
            refs = (list_refs or _list_refs)(repo_id)
            names = [ref.name for ref in [*refs.branches, *refs.tags]]
        matched = [name for name in names if fnmatch.fnmatchcase(name, item)]
        if not matched:
            raise ValueError(
                f"--revisions {item!r} matches none of the branches and tags of {repo_id} ({', '.join(sorted(names))})."
            )
        steps = [parse_step(name) for name in matched]
        if all(step is not None for step in steps):
            matched = [name for _, name in sorted(zip(steps, matched, strict=True))]
        else:
            matched = sorted(matched)
        revisions.extend(matched)
    return list(dict.fromkeys(revisions))


def _list_refs(repo_id: str):
    from huggingface_hub import HfApi

    return HfApi().list_repo_refs(repo_id)


def _commit_of(repo_id: str, revision: str) -> str | None:
    from huggingface_hub import HfApi

    return HfApi().model_info(repo_id, revision=revision).sha


def series_settings(args: argparse.Namespace) -> dict[str, Any]:
    settings = {name: getattr(args, name, None) for name in SERIES_SETTINGS}
    settings["measures"] = list(settings["measures"] or ())
    from .trace_measures import check_measure_arguments

    measure_settings = check_measure_arguments(args)
    for spec in MEASURE_TABLE.values():
        if spec.name in settings["measures"]:
            for name in spec.settings:
                value = getattr(measure_settings, name)
                settings[name] = list(value) if isinstance(value, tuple) else value
    return settings


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a series file; a line that does not parse (a file cut short by hand) is reported and dropped."""
    if not path.is_file():
        return []
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            _notice(f"{path}:{number} is not a JSON row; it is dropped and its revision measured again.")
            continue
        if isinstance(row, dict) and "revision" in row:
            rows.append(row)
    return rows


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """All rows, one JSON object a line, written to a temporary file beside ``path`` and renamed over it: a reader
    (or a crash) sees the old file or the new one, never a row cut in half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.writelines(json.dumps(row, sort_keys=True) + "\n" for row in rows)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def row_values(row: dict[str, Any]) -> dict[str, tuple[float, float | None]]:
    """``{measure: (value, stderr)}`` of a row: the trace and each measure beyond it."""
    values = {}
    estimate = row.get("estimate")
    if estimate is not None:
        values["trace"] = (estimate["mean"], estimate.get("stderr"))
    for name, record in (row.get("measures") or {}).items():
        values[name] = (record["value"], record.get("stderr"))
    return values


def run_series(
    args: argparse.Namespace,
    *,
    measure: Callable[[argparse.Namespace], dict[str, Any]],
    check_arguments: Callable[[argparse.Namespace], None],
) -> int:
    """Measure each revision of ``--revisions`` in turn, one row each; see the module's docstring. ``measure`` and
    ``check_arguments`` are the trace command's, which measures one revision."""
    from .paths import check_output_file, check_plot_file, local_path_or_hub_id

    if args.revision is not None:
        raise ValueError("--revision and --revisions: give one revision with --revision or several with --revisions.")
    plot = args.plot
    args.plot = None  # --plot draws the series here, not the per-group trace
    check_arguments(args)
    check_plot_file(plot)
    from ..corpus import DATA_FILE_BUILDERS

    model = local_path_or_hub_id(args.model, "MODEL")
    args.data = local_path_or_hub_id(args.data, "--data", file_suffixes=tuple(DATA_FILE_BUILDERS))
    if Path(model).exists():
        raise ValueError(f"--revisions needs a Hub repository; {model} is a local folder (measure it without them).")
    output = Path(DEFAULT_SERIES_OUTPUT if args.output == DEFAULT_OUTPUT else args.output)
    check_output_file(str(output), "--output")
    if plot:
        check_output_file(plot, "--plot")
    settings = series_settings(args)
    rows = read_rows(output)
    for row in rows:
        if row.get("model") != model or row.get("settings") != settings:
            raise ValueError(
                f"--output {output} holds rows of {row.get('model')} measured with other settings "
                f"({row.get('settings')}); write this series to another --output, or delete the file to start over."
            )
    revisions = resolve_revisions(model, args.revisions)
    done = {row["revision"] for row in rows}
    todo = [revision for revision in revisions if revision not in done]
    if done & set(revisions):
        skipped = [revision for revision in revisions if revision in done]
        print(f"Already in {output}, skipped: {', '.join(skipped)}")
    for index, revision in enumerate(revisions):
        if revision not in todo:
            continue
        single = copy.copy(args)
        single.revision, single.revisions, single.model = revision, None, model
        result = measure(single)
        shared = {row.get("contexts_sha256") for row in rows} - {None}
        if shared and result.get("contexts_sha256") not in shared:
            raise ValueError(
                f"{model}@{revision} builds other contexts than the revisions already in {output} (its tokenizer "
                "differs?): a series is measured on the same contexts. Nothing was written for it."
            )
        row = {
            "revision": revision,
            "commit": result.get("commit") or _commit_of(model, revision),
            "step": parse_step(revision),
            "order": index,
            "settings": settings,
            **result,
        }
        rows.append(row)
        write_rows(output, rows)
        summary = ", ".join(
            f"{name} {value:.6g}" + (f" ± {stderr:.2g}" if stderr is not None else "")
            for name, (value, stderr) in row_values(row).items()
        )
        print(f"{model}@{revision}: {summary}", flush=True)
    print(f"Wrote {output} ({len(rows)} revisions)")
    if plot:
        order = {revision: index for index, revision in enumerate(revisions)}
        chosen = sorted((row for row in rows if row["revision"] in order), key=lambda row: order[row["revision"]])
        plot_series(chosen, plot, title=f"{model}: {len(chosen)} revisions")
        print(f"Wrote {plot}")
    return 0


def plot_series(rows: list[dict[str, Any]], path: str, *, title: str) -> None:
    """One panel per measure, its value (with standard-error bars) against the step parsed from each revision's
    name when every row has one, else the revision order with the names as ticks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(name for row in rows for name in row_values(row)))
    if not names:
        raise ValueError("The series holds no measured values to plot.")
    steps = [row.get("step") for row in rows]
    by_step = all(step is not None for step in steps)
    x = steps if by_step else list(range(len(rows)))
    figure, axes = plt.subplots(len(names), 1, figsize=(6, 2.4 * len(names)), sharex=True, squeeze=False)
    for axis, name in zip(axes[:, 0], names, strict=True):
        points = [(xi, row_values(row).get(name)) for xi, row in zip(x, rows, strict=True)]
        points = [(xi, value) for xi, value in points if value is not None]
        axis.errorbar(
            [xi for xi, _ in points],
            [value for _, (value, _) in points],
            yerr=[stderr or 0.0 for _, (_, stderr) in points],
            marker="o",
            capsize=3,
        )
        axis.set_ylabel(name, fontsize=8)
    axes[-1, 0].set_xlabel("training step (from the revision's name)" if by_step else "revision")
    if not by_step:
        axes[-1, 0].set_xticks(x, [row["revision"] for row in rows], rotation=45, ha="right")
    axes[0, 0].set_title(title, fontsize=9)
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _notice(text: str) -> None:
    print(f"hf-flatbias trace: {text}", file=sys.stderr, flush=True)
