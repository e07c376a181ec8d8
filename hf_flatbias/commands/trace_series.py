"""``hf-flatbias trace REPO --revisions r1,r2,...``: follow a series of published checkpoints (a Hub repo's branches,
tags or commits, e.g. Pythia's ``step1000``...) and measure each on the same contexts.

Each revision's result is one JSON row of a JSONL file, written as soon as it is measured (the whole file rewritten
to a temporary file and renamed over it, so a row is there whole or not at all); a rerun skips the revisions already
written at the commit they point at now, so an interrupted series resumes where it stopped. Every revision's commit
is resolved before the first is measured (from the local cache when the Hub client is offline), and a file of lines
that are not series rows is refused, never rewritten. ``--plot`` draws each measure against the revision
order, or the training step parsed from the names (``step1000``, ``step-2000``...) when every name has one.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
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
SERIES_ROW_KEYS = ("revision", "commit", "model", "settings")
"""Keys every row this command writes has: a line without them is not the command's, and is never rewritten."""


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
        f"of --output (a .jsonl file; default {DEFAULT_SERIES_OUTPUT}) as soon as it is done. Every commit is "
        "looked up first (from the local cache under HF_HUB_OFFLINE=1). A rerun skips the revisions already written "
        "at the commit they point at now. With --plot: each measure against the revision order, or the step parsed "
        "from the names (step1000...).",
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

    return _ask_hub(lambda: HfApi().list_repo_refs(repo_id), repo_id)


@dataclasses.dataclass(frozen=True)
class CachedRef:
    """A branch or tag as the local Hub cache remembers it (the shape of huggingface_hub's ``GitRefInfo``)."""

    name: str
    target_commit: str


@dataclasses.dataclass(frozen=True)
class CachedRefs:
    """The refs of the local Hub cache, shaped as `HfApi.list_repo_refs` answers (it cannot tell tags from
    branches, so all are branches here)."""

    branches: list[CachedRef]
    tags: tuple[CachedRef, ...] = ()


def revision_commits(repo_id: str, text: str) -> dict[str, str]:
    """The revisions ``--revisions`` names, in order, each with the commit it points at now: asked of the Hub, or
    read from the local cache when the client is offline (``HF_HUB_OFFLINE``), as offline loading reads it. All are
    resolved before anything is measured, so a missing revision or an unreachable Hub costs no measurement; and
    each revision is then measured at its commit, so a branch that moves meanwhile cannot mislabel a row."""
    from ..hub import cached_commit, cached_refs, hub_offline

    offline = hub_offline()
    if offline:
        cached = cached_refs(repo_id)

        def list_cached_refs(_: str) -> CachedRefs:
            _notice(
                f"{offline} is set: --revisions patterns match the branches and tags in the local cache "
                f"({', '.join(cached) or 'none'}), which may be fewer than the Hub holds."
            )
            return CachedRefs([CachedRef(name, commit) for name, commit in cached.items()])

        commits = {}
        for revision in resolve_revisions(repo_id, text, list_refs=list_cached_refs):
            commits[revision] = cached_commit(repo_id, revision)
            if commits[revision] is None:
                raise ValueError(
                    f"{repo_id}@{revision}: {offline} is set and the local Hub cache does not hold this revision; "
                    f"unset {offline} to download it, or drop it from --revisions."
                )
        return commits
    refs = None

    def list_refs_once(_: str):
        nonlocal refs
        if refs is None:
            refs = _list_refs(repo_id)
        return refs

    revisions = resolve_revisions(repo_id, text, list_refs=list_refs_once)
    refs = list_refs_once(repo_id)
    # the Hub resolves a name that is both a branch and a tag to the branch
    named = {ref.name: ref.target_commit for ref in [*refs.tags, *refs.branches]}
    return {revision: named.get(revision) or _commit_of(repo_id, revision) for revision in revisions}


def _commit_of(repo_id: str, revision: str) -> str:
    from huggingface_hub import HfApi

    return _ask_hub(lambda: HfApi().model_info(repo_id, revision=revision).sha, repo_id, revision)


def _ask_hub(call: Callable[[], Any], repo_id: str, revision: str | None = None) -> Any:
    """``call()``, its Hub errors (a missing repo or revision, an unreachable server) as one-line `ValueError`."""
    from ..hub import hub_call_error

    try:
        return call()
    except Exception as error:
        explained = hub_call_error(error, repo_id, revision, flag="--revisions")
        if explained is None:
            raise
        raise ValueError(explained) from error


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
    """The rows of a series file. A last line cut short after rows of the series (a file copied while it was
    written) is reported and dropped, its revision measured again; any other line that is not a series row raises
    `ValueError` and the file is left as it is: it was named by mistake, and its lines are someone's work."""
    if not path.is_file():
        return []
    refused = (
        f"--output {path} holds lines that are not hf-flatbias series rows (line {{}}); pass another --output. "
        "Nothing was written to it."
    )
    try:
        lines = [(number, line) for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)]
    except UnicodeDecodeError:
        raise ValueError(refused.format(1)) from None
    lines = [(number, line) for number, line in lines if line.strip()]
    rows = []
    for position, (number, line) in enumerate(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if rows and position == len(lines) - 1:
                _notice(f"{path}:{number} is a row cut short; it is dropped and its revision measured again.")
                continue
            raise ValueError(refused.format(number)) from None
        if not isinstance(row, dict) or any(key not in row for key in SERIES_ROW_KEYS):
            raise ValueError(refused.format(number))
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
    inputs_of: Callable[[argparse.Namespace], dict[str, str | None]],
) -> int:
    """Measure each revision of ``--revisions`` in turn, one row each; see the module's docstring. ``measure``,
    ``check_arguments`` and ``inputs_of`` (the paths it reads, by flag) are the trace command's, which measures one
    revision."""
    from .paths import (
        FIGURE_OWNER,
        check_output_file,
        check_outputs_spare_inputs,
        check_plot_file,
        is_matplotlib_figure,
        local_path_or_hub_id,
    )

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
    check_outputs_spare_inputs({"--output": str(output), "--plot": plot}, inputs_of(args))
    if plot:  # an existing one is written over only when it is a figure (a user's file is kept)
        check_output_file(plot, "--plot", own=is_matplotlib_figure, own_name=FIGURE_OWNER)
    settings = series_settings(args)
    rows = read_rows(output)
    for row in rows:
        if row.get("model") != model or row.get("settings") != settings:
            raise ValueError(
                f"--output {output} holds rows of {row.get('model')} measured with other settings "
                f"({row.get('settings')}); write this series to another --output, or delete the file to start over."
            )
    commits = revision_commits(model, args.revisions)
    revisions = list(commits)
    done = {(row["revision"], row["commit"]) for row in rows}
    skipped = [revision for revision in revisions if (revision, commits[revision]) in done]
    if skipped:
        print(f"Already in {output}, skipped: {', '.join(skipped)}")
    for index, revision in enumerate(revisions):
        commit = commits[revision]
        if (revision, commit) in done:
            continue
        earlier = [row["commit"] for row in rows if row["revision"] == revision]
        if earlier:
            print(
                f"{model}@{revision} now points at {commit}, not at {', '.join(earlier)} as when its row in {output} "
                "was measured: measured again (the earlier row is kept).",
                flush=True,
            )
        single = copy.copy(args)
        # measured at the commit resolved above, which the row records, even if the branch moves meanwhile
        single.revision, single.revisions, single.model = commit, None, model
        result = measure(single)
        shared = {row.get("contexts_sha256") for row in rows} - {None}
        if shared and result.get("contexts_sha256") not in shared:
            raise ValueError(
                f"{model}@{revision} builds other contexts than the revisions already in {output} (its tokenizer "
                "differs?): a series is measured on the same contexts. Nothing was written for it."
            )
        row = {
            **result,
            "revision": revision,
            "commit": commit,
            "step": parse_step(revision),
            "order": index,
            "settings": settings,
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
        current = {(revision, commit): index for index, (revision, commit) in enumerate(commits.items())}
        chosen = sorted(
            (row for row in rows if (row["revision"], row["commit"]) in current),
            key=lambda row: current[row["revision"], row["commit"]],
        )
        plot_series(chosen, plot, title=f"{model}: {len(chosen)} revisions")
        print(f"Wrote {plot}")
    return 0


def split_model_revision(args: argparse.Namespace) -> None:
    """``MODEL@REV`` of a Hub model read as ``MODEL --revision REV``, as ``card`` and ``compare`` read it; a local
    path keeps its ``@``."""
    from ..hub import split_revision
    from .paths import looks_like_local_path

    if "@" not in args.model or looks_like_local_path(args.model) or os.path.exists(os.path.expanduser(args.model)):
        return
    if getattr(args, "revisions", None):
        repo_id = args.model.partition("@")[0]
        raise ValueError(
            f"{args.model} and --revisions: name the repository alone ({repo_id}) and its revisions in --revisions."
        )
    args.model, args.revision = split_revision(args.model, args.revision)


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
