"""How a card's numbers read as text: in the rendered card, in `hf-flatbias card` and in `hf-flatbias compare`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from ..measures import EXTRA_MEASURES, MEASURE_TABLE
from ..sharpness.methods.table import METHOD_TABLE
from .objective import Objective


class CardFields(Protocol):
    """The fields of `hf_flatbias.modelcard.FlatnessCard` that its text is made from (a protocol, so that the card,
    which renders itself with these functions, and its formatting do not import each other)."""

    method: str
    objective: str | None
    hessian_trace: float | None
    hessian_trace_stderr: float | None
    pretraining_loss: float | None
    estimator: str | None
    n_contexts: int | None
    n_draws: int | None
    measures: dict[str, dict[str, Any]]
    glue: dict[str, dict[str, float]]

    @property
    def trace_quantity(self) -> str: ...

    @property
    def trained_objective(self) -> Objective: ...

    def method_hyperparameters(self) -> dict[str, float | int]: ...


# How the card names each method of `FlatBiasConfig.flatness_method` (its table entry's title); its hyperparameters
# follow in parentheses.
METHOD_TITLES = {name: spec.title for name, spec in METHOD_TABLE.items()}


def format_number(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "not measured"
    return f"{value:.{digits}g}"


def format_trace(trace: float | None, stderr: float | None) -> str:
    if trace is None:
        return "not measured"
    return format_number(trace) if stderr is None else f"{format_number(trace)} ± {format_number(stderr, 2)}"


def format_method(card: CardFields, *, short: bool = False) -> str:
    if card.method == "none":
        return "none" if short else METHOD_TITLES["none"]
    settings = ", ".join(f"{name} = {value:g}" for name, value in card.method_hyperparameters().items())
    title = METHOD_TITLES[card.method]
    return f"{title} ({settings})" if settings else title


def glue_rows(glue: Mapping[str, Mapping[str, float]]) -> list[tuple[str, str, str]]:
    return [(task, metric, f"{glue[task][metric]:.4f}") for task in sorted(glue) for metric in sorted(glue[task])]


def measure_summaries(card: CardFields) -> list[tuple[str, str]]:
    """``(label, text)`` for each measure beyond the trace on the card, as the card and ``card`` show them, in the
    order of `hf_flatbias.measures.MEASURE_TABLE`."""
    rows = []
    for name, spec in MEASURE_TABLE.items():
        record = card.measures.get(name)
        if record is not None:
            rows.append((spec.title(record), measure_text(name, record)))
    return rows


def measure_text(name: str, record: Mapping[str, Any]) -> str:
    """A measure's value (± its standard error), its settings in parentheses and its step."""
    text = format_trace(record["value"], record.get("stderr"))
    details = MEASURE_TABLE[name].details(record)
    return text + (f" ({details})" if details else "") + _step_text(record)


def _step_text(record: Mapping[str, Any]) -> str:
    return f", step {record['step']}" if record.get("step") is not None else ""


def format_comparison_table(cards: Sequence[tuple[str, CardFields]]) -> str:
    """A markdown table comparing checkpoints: loss, trace ± stderr, method, estimator and GLUE metrics.

    Args:
        cards: ``(label, card)`` pairs in the order of the rows (the label is usually the repo id or path).
    """
    glue_columns = sorted({(task, metric) for _, card in cards for task in card.glue for metric in card.glue[task]})
    measure_columns = [name for name in EXTRA_MEASURES if any(name in card.measures for _, card in cards)]
    # one column, one quantity: named by the estimators when they all measured the same one
    quantities = {card.trace_quantity for _, card in cards if card.hessian_trace is not None}
    trace_header = f"{quantities.pop() if len(quantities) == 1 else 'trace'} ± stderr"
    # "pre-training loss" only when every row's is one; otherwise each loss says what it is (its objective)
    pretraining = all(card.trained_objective.pretraining for _, card in cards if card.pretraining_loss is not None)
    header = ["model", "pre-training loss" if pretraining else "loss (objective)", trace_header, "method", "estimator"]
    header += [MEASURE_TABLE[name].column for name in measure_columns]
    header += [f"{task}/{metric}" for task, metric in glue_columns]
    rows = [header, ["---"] * len(header)]
    for label, card in cards:
        estimator = "-"
        if card.estimator or card.n_contexts:
            estimator = f"{card.estimator or '?'} ({card.n_contexts or '?'}×{card.n_draws or '?'})"
        row = [
            label,
            _loss_cell(card, with_objective=not pretraining),
            _trace_cell(card),
            format_method(card, short=True),
            estimator,
        ]
        for name in measure_columns:
            row.append(_measure_cell(name, card.measures.get(name)))
        for task, metric in glue_columns:
            value = card.glue.get(task, {}).get(metric)
            row.append(f"{value:.4f}" if value is not None else "-")
        rows.append(row)
    return "\n".join("| " + " | ".join(cells) + " |" for cells in rows)


def _trace_cell(card: CardFields) -> str:
    if card.hessian_trace is None:
        return "-"
    text = format_trace(card.hessian_trace, card.hessian_trace_stderr)
    # a mean carried by a few contexts shows as a median of means far below it
    robust = getattr(card, "hessian_trace_median_of_means", None)
    return text if robust is None else f"{text} (MoM {format_number(robust)})"


def _loss_cell(card: CardFields, *, with_objective: bool) -> str:
    if card.pretraining_loss is None:
        return "-"
    text = format_number(card.pretraining_loss)
    return f"{text} ({card.objective or 'not recorded'})" if with_objective else text


def _measure_cell(name: str, record: Mapping[str, Any] | None) -> str:
    if record is None:
        return "-"
    return f"{format_trace(record['value'], record.get('stderr'))} ({MEASURE_TABLE[name].describe(record)})"


__all__ = [
    "METHOD_TITLES",
    "format_comparison_table",
    "format_method",
    "format_number",
    "format_trace",
    "measure_summaries",
    "measure_text",
]
