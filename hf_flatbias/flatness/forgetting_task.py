"""The downstream task forgetting fine-tunes on, loaded once and tokenized before anything is measured: a GLUE
classification task (through `hf_flatbias.glue.load_glue_dataset`: the Hub, or SST-2's offline stand-in) or a file
or ``save_to_disk`` folder of labelled rows (a synthetic language's task columns, say).

Rows are drawn by one seeded permutation, so every checkpoint of a comparison fine-tunes on the same rows and is
evaluated on the same rows; `measure_forgetting` then fixes their order. Rows labelled below 0 (GLUE's hidden test
labels, the synthetic tasks' "no such span") are left out, and counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..glue.tasks import DEFAULT_MAX_LENGTH
from ..measure_settings import checked_forgetting_task

TEXT_COLUMNS = ("text", "sentence")
"""The columns a file's rows may hold their text in when they hold no ``input_ids``."""
EVALUATION_SPLITS = ("validation", "validation_matched", "test")
"""The split of a folder of splits the accuracy is measured on: the first of these it has."""


@dataclass(frozen=True)
class ForgettingTask:
    """Tokenized rows of a classification task: what `measure_forgetting` fine-tunes on and evaluates.

    Attributes:
        source: the GLUE task's name or the path the rows came from; ``label_column`` the class column read.
        num_labels: classes (the GLUE task's, or one more than the largest label in the rows).
        train_rows: ``input_ids``, ``attention_mask`` (and ``token_type_ids``), ``label``.
        eval_rows: the same, of the validation split; ``None`` when the source has none (the accuracy is then that
            of the rows fine-tuned on).
        n_unlabelled: rows left out for a label below 0.
    """

    source: str
    label_column: str
    num_labels: int
    train_rows: list[dict[str, Any]] = field(repr=False)
    eval_rows: list[dict[str, Any]] | None = field(repr=False)
    n_unlabelled: int = 0


def load_forgetting_task(
    source: str,
    *,
    tokenizer: Any = None,
    label_column: str = "label",
    n_train: int = 1000,
    n_eval: int = 500,
    seed: int = 0,
    max_length: int = DEFAULT_MAX_LENGTH,
    vocab_size: int | None = None,
) -> ForgettingTask:
    """The task ``source`` names, ``n_train`` training rows and ``n_eval`` validation rows drawn by ``seed``.

    Args:
        source: a GLUE classification task (``sst2``...) or a data file (.json/.jsonl/.csv/.tsv/.parquet) or a
            ``datasets`` ``save_to_disk`` folder (a ``DatasetDict`` with ``train`` and ``validation``, or one
            split); rows hold ``input_ids`` or text (GLUE's text columns; ``text`` or ``sentence`` in a file).
        tokenizer: the model's tokenizer, needed for text; text that is mostly unknown tokens is refused.
        label_column: the integer class column.
        max_length: tokens per row (text is truncated by the tokenizer, ``input_ids`` cut).
        vocab_size: the model's vocabulary: ``input_ids`` outside it are refused.

    Raises:
        ValueError: an unknown source, missing columns, a label that is not a whole number, fewer than two classes,
            text without a tokenizer, ids outside the vocabulary.
    """
    source = checked_forgetting_task(source)
    if source is None:
        raise ValueError("load_forgetting_task needs a source: a GLUE task (e.g. sst2) or a file of labelled rows.")
    from ..glue.tasks import GLUE_TASKS

    glue_task = GLUE_TASKS.get(source)
    if glue_task is not None:
        from ..glue.data import load_glue_dataset

        splits = load_glue_dataset(glue_task.name)
        train, evaluation = splits["train"], splits[glue_task.validation_split]
        text_columns = glue_task.text_columns
        if label_column != "label":
            raise ValueError(f"forgetting_label_column={label_column!r}: GLUE tasks have their classes in 'label'.")
    else:
        train, evaluation = _local_splits(source)
        text_columns = next(((c,) for c in TEXT_COLUMNS if c in train.column_names), ())
    for split, rows in (("train", train), ("validation", evaluation)):
        if rows is None:
            continue
        if label_column not in rows.column_names:
            raise ValueError(
                f"The {split} rows of {source} have no column {label_column!r} (columns: {rows.column_names}); name "
                "the class column with forgetting_label_column (--forgetting-label-column)."
            )
        if "input_ids" not in rows.column_names and not text_columns:
            raise ValueError(
                f"The {split} rows of {source} hold neither input_ids nor text ({', '.join(TEXT_COLUMNS)}); "
                f"columns: {rows.column_names}."
            )
    train_rows, n_left_train = _drawn_rows(train, label_column, n_train, seed, source)
    eval_rows, n_left_eval = (None, 0)
    if evaluation is not None:
        eval_rows, n_left_eval = _drawn_rows(evaluation, label_column, n_eval, seed, source)
    largest = max(row[label_column] for row in train_rows + (eval_rows or []))
    num_labels = glue_task.num_labels if glue_task is not None else largest + 1
    if len({row[label_column] for row in train_rows}) < 2:
        raise ValueError(
            f"The training rows of {source} drawn for forgetting hold one class only ({label_column}="
            f"{train_rows[0][label_column]}): a classifier has nothing to learn; use more rows or another column."
        )
    tokenize = _tokenizer_of(tokenizer, text_columns, max_length, vocab_size, source)
    return ForgettingTask(
        source=source,
        label_column=label_column,
        num_labels=int(num_labels),
        train_rows=tokenize(train_rows, label_column),
        eval_rows=None if eval_rows is None else tokenize(eval_rows, label_column),
        n_unlabelled=n_left_train + n_left_eval,
    )


def _local_splits(source: str):
    """``(train, validation or None)`` of a data file or a ``save_to_disk`` folder."""
    import datasets

    from ..corpus import load_data_files

    path = Path(source)
    if path.is_dir():
        try:
            loaded = datasets.load_from_disk(str(path))
        except FileNotFoundError:
            raise ValueError(
                f"forgetting_task={source!r} is a folder but not one datasets' save_to_disk wrote; pass a data file "
                "or a saved dataset."
            ) from None
    else:
        loaded = load_data_files(str(path))
    if isinstance(loaded, datasets.Dataset):
        return loaded, None
    if "train" not in loaded:
        raise ValueError(f"forgetting_task={source!r} has splits {list(loaded)}; it needs a 'train' split.")
    evaluation = next((loaded[name] for name in EVALUATION_SPLITS if name in loaded), None)
    return loaded["train"], evaluation


def _drawn_rows(rows, label_column: str, n_rows: int, seed: int, source: str) -> tuple[list[dict[str, Any]], int]:
    """Up to ``n_rows`` rows with a class label >= 0, drawn by a permutation of ``seed``; and how many lacked one."""
    labels = rows[label_column]
    for index, label in enumerate(labels):
        if isinstance(label, bool) or not isinstance(label, (int, float, np.integer)) or float(label) != int(label):
            raise ValueError(
                f"Row {index} of {source} has {label_column}={label!r}, not a whole-number class: forgetting "
                "fine-tunes a classifier (regression tasks such as stsb are not supported)."
            )
    labelled = [index for index, label in enumerate(labels) if label >= 0]
    if not labelled:
        raise ValueError(f"No row of {source} has a class label >= 0 in {label_column!r} (test-split labels are -1).")
    order = np.random.default_rng(seed).permutation(len(labelled))[:n_rows]
    chosen = rows.select([labelled[i] for i in order])
    return [dict(row) | {label_column: int(row[label_column])} for row in chosen], len(labels) - len(labelled)


def _tokenizer_of(tokenizer: Any, text_columns: Sequence[str], max_length: int, vocab_size: int | None, source: str):
    """A function turning drawn rows into `measure_forgetting`'s rows: ids kept (cut to ``max_length``) or text
    tokenized (one sentence or a pair)."""

    def tokenize(rows: list[dict[str, Any]], label_column: str) -> list[dict[str, Any]]:
        if "input_ids" in rows[0]:
            out = []
            for index, row in enumerate(rows):
                ids = [int(token) for token in row["input_ids"]][:max_length]
                if vocab_size is not None and not all(0 <= token < vocab_size for token in ids):
                    raise ValueError(
                        f"Row {index} of {source} holds token ids outside the model's vocabulary of {vocab_size}: "
                        "the task was tokenized for another model."
                    )
                entry = {"input_ids": ids, "label": row[label_column]}
                for key in ("attention_mask", "token_type_ids"):
                    if key in row:
                        entry[key] = [int(v) for v in row[key]][:max_length]
                out.append(entry)
            return out
        if tokenizer is None:
            raise ValueError(
                f"The rows of {source} hold text: forgetting needs the model's tokenizer (save it with the checkpoint, "
                "or give the trainer its processing_class)."
            )
        from .lm import check_tokenizer_fits_model

        encoded = tokenizer(
            *([row[column] for row in rows] for column in text_columns), truncation=True, max_length=max_length
        )
        check_tokenizer_fits_model(
            tokenizer, vocab_size, input_ids=encoded["input_ids"], text_source=f"the forgetting task {source}"
        )
        keys = [key for key in ("input_ids", "attention_mask", "token_type_ids") if key in encoded]
        return [{**{key: encoded[key][i] for key in keys}, "label": row[label_column]} for i, row in enumerate(rows)]

    return tokenize


__all__ = ["ForgettingTask", "load_forgetting_task"]
