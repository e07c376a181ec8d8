"""What a synthetic recipe writes and prints: ``results.json``, table rows and markdown tables."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .language import LanguageSetup


def is_main_process() -> bool:
    """True on the process that writes results (the only one under plain ``python``)."""
    from accelerate import PartialState

    return PartialState().is_main_process


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """``payload`` as indented JSON at ``path`` (numpy numbers as floats), creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=float))


def config_of(args) -> dict[str, Any]:
    """The arguments as a JSON-ready dict (paths as strings), for a recipe's ``results.json``."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def final_row(
    records: list[dict[str, Any]], *, target_loss: float | None, train_seconds: float, **fields: Any
) -> dict[str, Any]:
    """A run's last record as one row of a recipe's table: ``fields`` (the run's name...), ``steps``, whether the
    loss reached ``target_loss`` (None without one), ``train_seconds``, then the record's measurements."""
    final = records[-1]
    return {
        **fields,
        "steps": final["step"],
        "reached_target": None if target_loss is None else final["loss"] <= target_loss,
        "train_seconds": train_seconds,
        **{k: v for k, v in final.items() if k != "step"},
    }


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """``rows`` as a markdown table of ``columns`` (floats to 4 significant digits, missing cells empty)."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return "nan" if math.isnan(value) else f"{value:.4g}"
        return "" if value is None else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def task_accuracies(record: dict[str, Any], key: str = "probe") -> dict[str, float]:
    """``{"probe_<task>": accuracy}`` of a record's per-task probe results, for flat tables."""
    return {f"{key}_{task}": result["accuracy"] for task, result in record[key].items()}


def write_results(
    output_dir: Path,
    recipe: str,
    args,
    setup: LanguageSetup,
    started: float,
    *,
    table: Sequence[dict[str, Any]] = (),
    columns: Sequence[str] = (),
    **fields: Any,
) -> dict[str, Any]:
    """Write ``output_dir/results.json`` (``recipe``, ``language``, ``entropy_bound``, ``config``, ``fields``,
    ``seconds`` since ``started``), print ``table`` as markdown (with each row's per-task probe accuracies as
    ``probe_<task>`` columns) and return the payload."""
    payload = {
        "recipe": recipe,
        "language": setup.name,
        "entropy_bound": setup.entropy,
        "config": config_of(args),
        **fields,
        "seconds": time.perf_counter() - started,
    }
    write_json(output_dir / "results.json", payload)
    if table:
        print(markdown_table([{**row, **task_accuracies(row)} if "probe" in row else row for row in table], columns))
    print(f"wrote {output_dir / 'results.json'} in {payload['seconds']:.0f} s")
    return payload
