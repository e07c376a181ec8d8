"""Fine-tuning a checkpoint on a GLUE task over several seeds: what to run (`GlueArguments`), how to train
(`GlueConfig`), and the scores per seed (`GlueResult`)."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from transformers.trainer_utils import IntervalStrategy, SaveStrategy

from ..config import FlatBiasConfig
from ..stats import mean_interval
from .data import check_labels, check_task_text_fits_tokenizer, load_glue_dataset, load_glue_metric
from .models import LinearProbeClassifier, freeze_all_but, load_classifier, probe_parameter_names
from .tasks import (
    DEFAULT_MAX_LENGTH,
    DEFAULT_SEEDS,
    DEFAULT_TRAIN_BATCH_SIZE,
    FINETUNE_MODES,
    FROZEN_ENCODER_LEARNING_RATE,
    FULL_FINETUNE_LEARNING_RATE,
    LINEAR_PROBE_MODES,
    GlueTask,
    get_glue_task,
    resolve_finetune_mode,
    run_folder_name,
)

logger = logging.getLogger(__name__)


@dataclass
class GlueArguments:
    """What is fine-tuned and on which rows; how it trains is the [`GlueConfig`]."""

    mode: str = field(
        default="full",
        metadata={
            "help": "full fine-tuning; linear_cls / linear_tokens: one linear layer on frozen [CLS] / token states; "
            "pooler_head: a new pooler and classifier on the frozen encoder.",
            "choices": list(FINETUNE_MODES),
        },
    )
    seeds: list[int] = field(
        default_factory=lambda: list(DEFAULT_SEEDS),
        metadata={"help": "One fine-tuning run per seed; a seed gives every checkpoint the same data order and head."},
    )
    max_length: int = field(default=DEFAULT_MAX_LENGTH, metadata={"help": "Maximum tokens per GLUE example."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Cap on training rows per task."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Cap on validation rows per task."})
    probe_positions: int = field(default=18, metadata={"help": "Token states concatenated by --mode linear_tokens."})
    reinitialize_head: bool = field(
        default=False,
        metadata={"help": "Replace an existing classification head whose label count differs from the task's."},
    )


@dataclass
class GlueConfig(FlatBiasConfig):
    """[`FlatBiasConfig`] with GLUE's defaults, as trl's configs set their own: a learning rate chosen by the mode
    unless one is given, BERT's batch sizes, and nothing saved, evaluated or logged during a run."""

    learning_rate: float | None = field(
        default=None,
        metadata={
            "help": f"Peak learning rate; default {FULL_FINETUNE_LEARNING_RATE:g} for --mode full and "
            f"{FROZEN_ENCODER_LEARNING_RATE:g} for the frozen-encoder modes."
        },
    )
    per_device_train_batch_size: int = field(
        default=DEFAULT_TRAIN_BATCH_SIZE, metadata={"help": "Training batch size per device."}
    )
    per_device_eval_batch_size: int = field(default=64, metadata={"help": "Evaluation batch size per device."})
    save_strategy: SaveStrategy | str = field(
        default="no", metadata={"help": "Checkpoints during a GLUE run (default: none)."}
    )
    eval_strategy: IntervalStrategy | str = field(
        default="no", metadata={"help": "Evaluation during a GLUE run (default: at the end)."}
    )
    logging_strategy: IntervalStrategy | str = field(
        default="no", metadata={"help": "Logging during a GLUE run (default: none)."}
    )

    def learning_rate_for(self, mode: str) -> float:
        """The learning rate a run in ``mode`` uses: the one given, else the mode's default."""
        if self.learning_rate is not None:
            return self.learning_rate
        return FULL_FINETUNE_LEARNING_RATE if resolve_finetune_mode(mode) == "full" else FROZEN_ENCODER_LEARNING_RATE


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


def _predictions_for_metric(task: GlueTask, logits: np.ndarray) -> np.ndarray:
    return logits.squeeze(-1) if task.is_regression else logits.argmax(-1)


def finetune_glue(
    model_name_or_path: str,
    task: str,
    arguments: GlueArguments | None = None,
    config: GlueConfig | None = None,
    *,
    dataset=None,
    data_dir: str | os.PathLike | None = None,
    tokenizer_name_or_path: str | None = None,
    output_dir: str | os.PathLike | None = None,
) -> GlueResult:
    """Fine-tune a checkpoint on a GLUE task once per seed and report the validation metric's mean and std.

    Args:
        model_name_or_path: a local folder or Hub id holding the model and its tokenizer.
        task: one of cola, sst2, mrpc, qqp, stsb, mnli, qnli, rte, wnli.
        arguments: the mode, seeds and row caps ([`GlueArguments`]; default: its defaults). ``mode`` is ``full``
            (all weights train), ``linear_cls`` / ``linear_tokens`` (one linear layer on the frozen encoder's
            ``[CLS]`` state / first ``probe_positions`` token states, see [`LinearProbeClassifier`]) or
            ``pooler_head`` (a new pooler and classifier on the frozen encoder); a seed sets the head's
            initialisation and the data order.
        config: how each run trains ([`GlueConfig`]; default: its defaults): learning rate, epochs, batch sizes, and
            any [`FlatBiasConfig`] field such as ``flatness_method="sam"``; its ``output_dir`` and ``seed`` are set
            per run. Its learning rate, when unset, is ``FULL_FINETUNE_LEARNING_RATE`` (2e-5, BERT's recipe) for
            ``full`` and ``FROZEN_ENCODER_LEARNING_RATE`` (1e-3) otherwise.
        dataset: a ``DatasetDict`` to use instead of [`load_glue_dataset`] (``train`` and the task's validation split).
        data_dir: local GLUE files, see [`load_glue_dataset`].
        output_dir: where the runs go (default: a temporary folder, removed at the end).

    Returns:
        A [`GlueResult`] with the main metric per seed, its mean and std, and every metric per seed.
    """
    from transformers import DataCollatorWithPadding, set_seed

    from ..trainer import FlatBiasTrainer

    arguments = GlueArguments() if arguments is None else arguments
    if config is None:
        config = GlueConfig()
    elif not isinstance(config, GlueConfig):
        raise TypeError(
            f"finetune_glue takes a GlueConfig, not a {type(config).__name__}: GlueConfig keeps the learning rate "
            "unset until the mode chooses it, where another config would carry its own default."
        )
    spec = get_glue_task(task)
    mode = resolve_finetune_mode(arguments.mode)
    seeds = [int(seed) for seed in arguments.seeds]
    if not seeds:
        raise ValueError("finetune_glue needs at least one seed.")
    if config.max_steps <= 0 and not (config.num_train_epochs > 0 and math.isfinite(config.num_train_epochs)):
        raise ValueError("Give max_steps > 0 or num_train_epochs > 0.")
    learning_rate = config.learning_rate_for(mode)
    # Check the checkpoint (tokenizer, head, label count) before any data is read or tokenized.
    _, tokenizer, _ = load_classifier(
        model_name_or_path,
        spec,
        tokenizer_name_or_path=tokenizer_name_or_path,
        reinitialize_head=arguments.reinitialize_head,
    )
    if dataset is None:
        dataset = load_glue_dataset(spec.name, data_dir=data_dir)
    if spec.validation_split not in dataset:
        raise ValueError(f"The {spec.name} data has no {spec.validation_split!r} split (it has {list(dataset)}).")
    train = dataset["train"].shuffle(seed=0)
    evaluation = dataset[spec.validation_split]
    if arguments.max_train_samples is not None:
        train = train.select(range(min(arguments.max_train_samples, len(train))))
    if arguments.max_eval_samples is not None:
        evaluation = evaluation.select(range(min(arguments.max_eval_samples, len(evaluation))))
    check_labels(spec, train["label"])
    check_labels(spec, evaluation["label"])
    check_task_text_fits_tokenizer(tokenizer, spec, train, source=tokenizer_name_or_path or str(model_name_or_path))

    def tokenize(batch):
        encoded = tokenizer(*(batch[c] for c in spec.text_columns), truncation=True, max_length=arguments.max_length)
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
                reinitialize_head=arguments.reinitialize_head,
            )
            if mode == "pooler_head":
                freeze_all_but(model, probe_parameter_names(model, new_names))
            elif mode in LINEAR_PROBE_MODES:
                model = LinearProbeClassifier(
                    model.base_model,
                    spec.num_labels,
                    features=mode.removeprefix("linear_"),
                    n_positions=arguments.probe_positions,
                )
            run_config = dataclasses.replace(
                config,
                output_dir=str(root / run_folder_name(spec.name, mode, seed)),
                learning_rate=learning_rate,
                seed=seed,
                data_seed=seed,
            )
            trainer = FlatBiasTrainer(
                model=model,
                args=run_config,
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
                if key.removeprefix("eval_") in spec.metric_names
            }
            result.seeds.append(seed)
            result.scores.append(metrics[spec.main_metric])
            result.metrics.append(metrics)
            logger.info("%s %s %s seed %d: %s", model_name_or_path, spec.name, mode, seed, metrics)
    finally:
        if scratch is not None:
            scratch.cleanup()
    return result
