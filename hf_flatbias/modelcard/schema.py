"""The card's schema: each field of `FlatnessCard` declares, once, where it lives in the README's front matter, how
it is written there, read back and checked; the writer, the reader and the checks are loops over these declarations.

Kept free of torch and transformers (and of the Hub client's network code) so that ``card``, ``compare`` and
``select`` read cards cheaply.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..corpus import CorpusSpec
from ..measures import EXTRA_MEASURES, MEASURE_TABLE
from ..sharpness.methods.table import FLATNESS_METHOD_HYPERPARAMETERS, FLATNESS_METHODS
from .objective import LEGACY_LOSS_KEY, loss_key

FLATNESS_TAG = "hf_flatbias"
GLUE_DATASET = "glue"
# The measures besides the trace (hf_flatbias.measures.MEASURE_TABLE), each recorded as {"value": ..., "stderr": ...,
# settings..., "step": ...}; the keys its entry names are read back as numbers, whole numbers or lists of numbers.

FLATNESS = "flatness"
"""The block of the README's front matter that hf_flatbias owns."""
CARD_DATA = "card_data"
"""The Hub's own card metadata (``model_name``, ``license``, ``tags``...), `huggingface_hub.ModelCardData`."""
MODEL_INDEX = "model-index"
"""The Hub's ``model-index`` results."""


@dataclasses.dataclass(frozen=True)
class Reading:
    """What a field's reader sees: the parsed card, its ``flatness:`` block, the fields read before it (in the
    schema's order) and the file's name for messages."""

    data: Any
    flatness: Mapping[str, Any]
    values: dict[str, Any]
    source: str


Reader = Callable[[Any, str, Reading], Any]
Writer = Callable[[Any, Any], Any]
Check = Callable[[str, Any], None]


@dataclasses.dataclass(frozen=True)
class CardField:
    """Where a field lives and how it travels: ``block`` (`FLATNESS`, `CARD_DATA` or `MODEL_INDEX`), its ``key``
    there (``None``: the field is spread over several keys, or built by hand as the model-index is), ``write``
    (card, value) -> the YAML value (``None`` leaves the key out), ``read`` (raw value, "block.key", reading) -> the
    value, ``check`` (name, value) raising ``ValueError`` on a value the card must not publish,
    ``hyperparameter`` (written and read only for the methods that read it) and ``requires`` (read only when that
    field was read: a trace's error and step describe nothing without the trace)."""

    block: str
    key: str | None
    read: Reader
    write: Writer
    check: Check | None = None
    hyperparameter: bool = False
    requires: str | None = None


def card_field(
    block: str = FLATNESS,
    *,
    key: str | None = "",
    read: Reader | None = None,
    write: Writer | None = None,
    check: Check | None = None,
    hyperparameter: bool = False,
    requires: str | None = None,
    default: Any = None,
    default_factory: Callable[[], Any] | None = None,
) -> Any:
    """A `FlatnessCard` field with its schema; ``key=""`` means the field's own name."""
    declared = CardField(block, key, read or read_as_is, write or write_as_is, check, hyperparameter, requires)
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata={"card": declared})
    return dataclasses.field(default=default, metadata={"card": declared})


@functools.cache
def schema(card_class: type) -> tuple[tuple[str, CardField], ...]:
    """``(name, field)`` of every field of ``card_class`` declared with `card_field`, in declaration order."""
    return tuple(
        (
            item.name,
            dataclasses.replace(item.metadata["card"], key=item.name)
            if item.metadata["card"].key == ""
            else item.metadata["card"],
        )
        for item in dataclasses.fields(card_class)
        if "card" in item.metadata
    )


def applies(declared: CardField, name: str, method: str) -> bool:
    return not declared.hyperparameter or name in FLATNESS_METHOD_HYPERPARAMETERS.get(method, ())


# -------------------------------------------------------------------- writing and reading


def write_block(card: Any, block: str) -> dict[str, Any]:
    """The ``block`` metadata of ``card`` in the schema's order; keys without a value are left out."""
    metadata: dict[str, Any] = {}
    for name, declared in schema(type(card)):
        if declared.block != block or not applies(declared, name, card.method):
            continue
        value = declared.write(card, getattr(card, name))
        if declared.key is None:
            metadata.update(value or {})
        elif value is not None:
            metadata[declared.key] = value
    return metadata


def read_fields(card_class: type, data: Any, flatness: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Every schema field of ``card_class`` read from a parsed card, in the schema's order (so a hyperparameter is
    read knowing the method); a field its method does not read, or whose ``requires`` was not read, stays unset."""
    reading = Reading(data=data, flatness=flatness, values={}, source=source)
    for name, declared in schema(card_class):
        if declared.requires is not None and reading.values.get(declared.requires) is None:
            continue
        if not applies(declared, name, reading.values.get("method", "none")):
            continue
        if declared.block == FLATNESS:
            raw = flatness.get(declared.key) if declared.key is not None else None
        elif declared.block == CARD_DATA:
            raw = getattr(data, declared.key, None)
        else:
            raw = None
        reading.values[name] = declared.read(raw, f"{declared.block}.{declared.key}", reading)
    return reading.values


def check_fields(card: Any) -> None:
    for name, declared in schema(type(card)):
        if declared.check is not None:
            declared.check(name, getattr(card, name))


# -------------------------------------------------------------------- writers


def write_as_is(card: Any, value: Any) -> Any:
    return value


def write_mapping(card: Any, value: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A copy of a mapping, or ``None`` (the key left out) when it is empty."""
    return dict(value) if value else None


def write_corpus(card: Any, value: CorpusSpec | None) -> dict[str, Any] | None:
    return value.to_record() if value is not None else None


def write_groups(card: Any, value: Mapping[str, Mapping[str, float]] | None) -> dict[str, dict[str, float]] | None:
    return {group: dict(part) for group, part in value.items()} if value else None


def write_measures(card: Any, value: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: dict(value[name]) for name in EXTRA_MEASURES if name in value}


def write_list(card: Any, value: Iterable[str]) -> list[str] | None:
    return list(value) or None


# -------------------------------------------------------------------- readers


def read_as_is(value: Any, where: str, reading: Reading) -> Any:
    return value


def read_float(value: Any, where: str, reading: Reading) -> float | None:
    return read_number(value, where, reading.source)


def read_integer(value: Any, where: str, reading: Reading) -> int | None:
    return read_number(value, where, reading.source, integer=True)


def read_method(value: Any, where: str, reading: Reading) -> str:
    method = value or "none"
    if method not in FLATNESS_METHODS:
        raise ValueError(
            f"{reading.source}: {where} is {method!r}, not one of {list(FLATNESS_METHODS)}. Fix the card's "
            "metadata or write it again with FlatnessCard(...).save(folder)."
        )
    return method


def choice_reader(choices: Iterable[str]) -> Reader:
    """A reader of a name from ``choices`` (``None`` when absent: a card written before the field existed)."""
    allowed = tuple(choices)

    def read(value: Any, where: str, reading: Reading) -> str | None:
        if value is None:
            return None
        if value not in allowed:
            raise ValueError(
                f"{reading.source}: {where} is {value!r}, not one of {list(allowed)}. Fix the card's metadata or "
                "write it again with FlatnessCard(...).save(folder)."
            )
        return value

    return read


def mapping_reader(what: str) -> Reader:
    """A reader of a mapping (``{}`` when absent) whose error says what the mapping should hold."""

    def read(value: Any, where: str, reading: Reading) -> dict[str, Any]:
        value = value or {}
        if not isinstance(value, Mapping):
            raise ValueError(f"{reading.source}: {where} is {value!r}, not {what}.")
        return dict(value)

    return read


def read_corpus(value: Any, where: str, reading: Reading) -> CorpusSpec | None:
    record = mapping_reader("a mapping")(value, where, reading)
    if not record:
        return None
    try:
        return CorpusSpec.from_record(record)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"{reading.source}: {where} is {record!r}, not a corpus record ({error}). Write it as dataset, "
            "text_column, validation_texts and split_seed (what CorpusSpec.to_record gives)."
        ) from error


def read_groups(value: Any, where: str, reading: Reading) -> dict[str, dict[str, float]] | None:
    by_group = value or {}
    if not isinstance(by_group, Mapping) or not all(isinstance(part, Mapping) for part in by_group.values()):
        raise ValueError(f"{reading.source}: {where} is {by_group!r}, not a mapping of groups.")
    groups = {
        str(group): {key: read_number(number, f"{where}.{group}.{key}", reading.source) for key, number in part.items()}
        for group, part in by_group.items()
    }
    # a split whose numbers could not all be read is left out, like an unreadable trace
    complete = all(number is not None for part in groups.values() for number in part.values())
    return groups if groups and complete else None


def read_measures(value: Any, where: str, reading: Reading) -> dict[str, dict[str, Any]]:
    measures = {}
    for name in EXTRA_MEASURES:
        record = read_measure_record(reading.flatness.get(name), name, reading.source)
        if record is not None:
            measures[name] = record
    return measures


def read_glue(value: Any, where: str, reading: Reading) -> dict[str, dict[str, float]]:
    glue: dict[str, dict[str, float]] = {}
    for result in reading.data.eval_results or []:
        if result.dataset_type == GLUE_DATASET and result.dataset_config:
            field_name = f"model-index GLUE {result.dataset_config}/{result.metric_type}"
            number = read_number(result.metric_value, field_name, reading.source)
            if number is not None:
                glue.setdefault(result.dataset_config, {})[result.metric_type] = number
    return glue


def read_model_name(value: Any, where: str, reading: Reading) -> str:
    return value or reading.source


def read_base_model(value: Any, where: str, reading: Reading) -> str | None:
    return value if isinstance(value, str) else None


def read_list(value: Any, where: str, reading: Reading) -> list[str]:
    return list(value) if isinstance(value, list) else ([value] if value else [])


def read_own_tags(value: Any, where: str, reading: Reading) -> list[str]:
    """The card's tags without those every flatness card gets (see `FlatnessCard.all_tags`)."""
    automatic = {FLATNESS_TAG, "flatness", str(reading.values.get("method", "none"))}
    return [tag for tag in (value or []) if tag not in automatic]


def loss_reader(suffix: str, read: Reader) -> Reader:
    """A reader of the loss (``suffix=""``) or of its source (``"_source"``) under the key of the card's objective
    (`loss_key`), or under ``pretraining_loss`` where a card written before keeps it."""

    def reader(value: Any, where: str, reading: Reading) -> Any:
        key = loss_key(reading.values.get("objective")) + suffix
        if key not in reading.flatness:
            key = LEGACY_LOSS_KEY + suffix
        return read(reading.flatness.get(key), f"{FLATNESS}.{key}", reading)

    return reader


def loss_writer(suffix: str) -> Writer:
    """The writer of `loss_reader`: the loss (or its source) under the key of what the run trained on."""

    def write(card: Any, value: Any) -> dict[str, Any] | None:
        return None if value is None else {loss_key(card.objective) + suffix: value}

    return write


def read_number(value: Any, field_name: str, source: str, *, integer: bool = False) -> float | int | None:
    """A number read from a card: ``None`` when absent or not finite (with a warning), ``ValueError`` when not a
    number at all; both name the file and the field."""
    if value is None:
        return None
    number = None
    if not isinstance(value, bool):
        try:
            number = float(value)
        except (TypeError, ValueError):
            pass
    if number is None:
        raise ValueError(
            f"{source}: {field_name} is {value!r}, not a number. Fix the card's metadata, or write it again with "
            "FlatnessCard(...).save(folder)."
        )
    if not math.isfinite(number):
        warnings.warn(
            f"{source}: {field_name} is {number}, not a finite number; it is read as unknown.",
            UserWarning,
            stacklevel=2,
        )
        return None
    if integer:
        if not number.is_integer():
            raise ValueError(f"{source}: {field_name} is {value!r}, not a whole number.")
        return int(number)
    return number


def read_measure_record(value: Any, name: str, source: str) -> dict[str, Any] | None:
    """A measure's record read from a card: ``None`` when absent or its value is not finite (with a warning)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"{source}: flatness.{name} is {value!r}, not a mapping with a value and its settings.")
    record = dict(value)
    spec = MEASURE_TABLE[name]
    for key in spec.numbers:
        if key in record:
            record[key] = read_number(record[key], f"flatness.{name}.{key}", source, integer=key in spec.integers)
    if record.get("value") is None:
        return None
    for key in spec.lists:
        if key in record:
            if not isinstance(record[key], list):
                raise ValueError(f"{source}: flatness.{name}.{key} is {record[key]!r}, not a list of numbers.")
            integer = key in spec.integers  # written as 8, read back as 8 (a float printed "8.0 bit")
            record[key] = [read_number(v, f"flatness.{name}.{key}", source, integer=integer) for v in record[key]]
    outside = value_outside_bounds(name, record)
    if outside is not None:
        key, number, allowed = outside
        raise ValueError(
            f"{source}: flatness.{name}.{key} is {number}, outside {allowed}: no measurement gives it. Fix the card's "
            "metadata, or write it again with FlatnessCard(...).save(folder)."
        )
    return {key: v for key, v in record.items() if v is not None}


def value_outside_bounds(name: str, record: Mapping[str, Any]) -> tuple[str, float, str] | None:
    """The first number of a measure's record outside the range a measurement gives (`MeasureSpec.bounds`; every
    standard error >= 0), as ``(key, number, the range in words)``; ``None`` when all are inside."""
    spec = MEASURE_TABLE[name]
    errors = [key for key in (*spec.numbers, *spec.lists) if key.endswith(("stderr", "stderrs"))]
    limits = {**dict.fromkeys(errors, (0, None)), **spec.bounds}
    for key, (lowest, highest) in limits.items():
        values = record.get(key)
        for number in values if isinstance(values, list) else [values]:
            if not isinstance(number, (int, float)) or isinstance(number, bool):
                continue
            if (lowest is not None and number < lowest) or (highest is not None and number > highest):
                allowed = f">= {lowest:g}" if highest is None else f"{lowest:g} to {highest:g}"
                return key, number, allowed
    return None


# -------------------------------------------------------------------- checks


def check_finite(name: str, value: float | None) -> None:
    if value is not None and not math.isfinite(value):
        raise ValueError(
            f"Refusing to write a flatness card with {name}={value}: the number is not finite. A non-finite "
            "Hessian trace or loss usually means training diverged or the estimate overflowed; re-estimate "
            "it (e.g. HessianTraceCallback on more contexts, or a lower learning rate), or set "
            f"{name}=None to publish the card without it."
        )


def check_positive_integer(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive integer (got {value!r}).")


def choice_check(choices: Iterable[str]) -> Check:
    """A check that a name is one of ``choices`` (or ``None``: not recorded)."""
    allowed = tuple(choices)

    def check(name: str, value: str | None) -> None:
        if value is not None and value not in allowed:
            raise ValueError(f"FlatnessCard.{name}={value!r} is unknown; use one of {list(allowed)} or None.")

    return check


def check_step(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or value < 0):
        raise ValueError(f"{name} must be an integer >= 0 (got {value!r}).")


def check_glue(name: str, glue: Mapping[str, Mapping[str, float]]) -> None:
    for task, metrics in glue.items():
        for metric, value in metrics.items():
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"GLUE result {task}/{metric}={value!r} is not a finite number.")


def check_groups(name: str, by_group: Mapping[str, Mapping[str, float]] | None) -> None:
    for group, part in (by_group or {}).items():
        for key, value in part.items():
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(
                    f"{name}[{group!r}][{key!r}]={value!r} is not a finite number; set "
                    f"{name}=None to publish the card without the split."
                )


def check_measures(name: str, measures: Mapping[str, Mapping[str, Any]]) -> None:
    for measure, record in measures.items():
        check_measure_record(measure, record)


def check_measure_record(name: str, record: Mapping[str, Any]) -> None:
    if name not in EXTRA_MEASURES:
        raise ValueError(
            f"FlatnessCard.measures has {name!r}; the measures beyond the trace are {list(EXTRA_MEASURES)}."
        )
    value = record.get("value")
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(
            f"Refusing to write a flatness card with {name}={value!r}: the number is not finite. Measure it again, or "
            f"leave {name} out of FlatnessCard.measures."
        )
    for key in MEASURE_TABLE[name].numbers:
        number = record.get(key)
        if number is not None and (not isinstance(number, (int, float)) or not math.isfinite(number)):
            raise ValueError(f"FlatnessCard.measures[{name!r}][{key!r}] is {number!r}, not a finite number.")
    step = record.get("step")
    if step is not None and (not isinstance(step, int) or step < 0):
        raise ValueError(f"FlatnessCard.measures[{name!r}]['step'] must be an integer >= 0 (got {step!r}).")
    for key in MEASURE_TABLE[name].lists:
        values = record.get(key)
        # an unknown entry (one draw has no standard error) is written as null, never as .nan
        if values is not None and (
            not isinstance(values, list)
            or not all(v is None or (isinstance(v, (int, float)) and math.isfinite(v)) for v in values)
        ):
            raise ValueError(
                f"FlatnessCard.measures[{name!r}][{key!r}] is {values!r}: write a list of finite numbers (None for "
                "one that is unknown)."
            )
    outside = value_outside_bounds(name, record)
    if outside is not None:
        key, number, allowed = outside
        raise ValueError(
            f"FlatnessCard.measures[{name!r}][{key!r}] is {number}, outside {allowed}: no measurement gives it; "
            "write what the measure returned (its record from hf_flatbias.measures.measure_record)."
        )
