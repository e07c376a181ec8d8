"""Flatness model cards: what a checkpoint's flatness was, written into its README.md and read back.

A card carries, for people, a summary rendered from ``templates/flatness_card.md`` and, for programs, two metadata
blocks in the README's YAML front matter:

- ``model-index``: [`huggingface_hub.EvalResult`] entries, the Hub's standard place for results. The Hessian trace of
  the pre-training loss is a metric of type ``hessian_trace`` (its standard error and estimator settings in the
  metric's ``args``), next to the pre-training loss and any GLUE results;
- ``flatness``: the same numbers flat and typed (``hessian_trace``, ``hessian_trace_stderr``, ``trace_step``,
  ``estimator``, ``n_contexts``, ``n_draws``, ``method`` and the hyperparameters that method reads,
  ``pretraining_loss``...), which [`load_flatness_card`] reads. Keys without a value are left out. Measures beyond
  the trace, when taken, are one mapping each (``top_eigenvalue``, ``sam_sharpness``) holding the ``value``, its
  settings and the ``step`` it was measured at.

The list of methods and the hyperparameters each one reads come from `hf_flatbias.constants`
(``FLATNESS_METHOD_HYPERPARAMETERS``), so a card exists for every method the trainer runs and records exactly what
that method used.

Nothing here imports the Trainer: [`flatness_card_from_trainer`] reads a trainer duck-typed, so the card can be
built, tested and rendered on its own.
"""

from __future__ import annotations

import functools
import math
import os
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2
import yaml
from huggingface_hub import EvalResult, ModelCard, ModelCardData

from .constants import (
    FLATNESS_METHOD_HYPERPARAMETERS,
    FLATNESS_METHODS,
    MEASURES,
    SAM_STEP_OPTIONS,
    TRACE_METRIC,
    TRACE_STDERR_METRIC,
)

HESSIAN_TRACE_METRIC = "hessian_trace"
PRETRAINING_LOSS_METRIC = "loss"
FLATNESS_TAG = "hf_flatbias"
CARD_FILENAME = "README.md"
TEMPLATE_NAME = "flatness_card.md"
PRETRAINING_TASK = "fill-mask"
GLUE_DATASET = "glue"
GLUE_TASK_TYPE = "text-classification"
# GLUE results in the trainer's log history: "glue/<task>/<metric>", optionally with the Trainer's "eval_" prefix.
GLUE_LOG_KEY = re.compile(r"^(?:eval_)?glue/(?P<task>[a-z0-9_-]+)/(?P<metric>[a-z0-9_]+)$")
# How the card names each method of `FlatBiasConfig.flatness_method`; its hyperparameters follow in parentheses.
METHOD_TITLES = {
    "none": "none (plain optimizer steps)",
    "sam": "SAM",
    "asam": "ASAM",
    "functional_sam": "Functional-SAM",
    "looksam": "LookSAM",
    "fisher_penalty": "Fisher-trace penalty",
    "grad_norm_penalty": "gradient-norm penalty",
}
# Every hyperparameter any method reads, in a stable order; each is a field of FlatnessCard.
METHOD_HYPERPARAMETERS = tuple(
    dict.fromkeys(name for names in FLATNESS_METHOD_HYPERPARAMETERS.values() for name in names)
)
_INTEGER_HYPERPARAMETERS = ("sam_every_k",)
# The measures besides the trace, each recorded as {"value": ..., settings..., "step": ...}; numbers in these keys
# are read back as numbers, integers where named here.
EXTRA_MEASURES = tuple(name for name in MEASURES if name != "trace")
_MEASURE_NUMBERS = {
    "top_eigenvalue": ("value", "residual", "k", "n_contexts", "n_matvecs", "seconds", "step"),
    "sam_sharpness": ("value", "stderr", "rho", "eta", "batch_size", "n_contexts", "seconds", "step"),
}
_MEASURE_INTEGERS = ("k", "n_contexts", "n_matvecs", "batch_size", "step")
_YAML_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)

PAPER_CITATION = """@inproceedings{liu2023same,
  title     = {Same Pre-training Loss, Better Downstream: Implicit Bias Matters for Language Models},
  author    = {Liu, Hong and Xie, Sang Michael and Li, Zhiyuan and Ma, Tengyu},
  booktitle = {Proceedings of the 40th International Conference on Machine Learning},
  series    = {Proceedings of Machine Learning Research},
  volume    = {202},
  year      = {2023},
  url       = {https://arxiv.org/abs/2210.14199}
}"""


@dataclass
class FlatnessCard:
    """The machine-readable content of a flatness model card.

    Every number is optional except the model name: a card written before the first trace estimate simply has no
    trace. Non-finite numbers are refused (see [`FlatnessCard.validate`]): a card is a published claim.

    Attributes:
        model_name: name in the ``model-index`` (the repo name by default).
        method: how training sought flatness, one of `FlatBiasConfig.flatness_method`'s choices.
        sam_rho, asam_eta, sam_every_k, looksam_alpha, penalty_lambda, penalty_fd_step: the method's
            hyperparameters, set for the ones the method reads and ``None`` for the others.
        pretraining_loss: the pre-training (masked-LM) loss; ``pretraining_loss_source`` says ``"eval"`` or
            ``"train"``.
        hessian_trace, hessian_trace_stderr: Tr(H) of the pre-training loss and its standard error.
        trace_step: the training step whose weights the trace was measured on.
        hessian_trace_by_group: the trace split by parameter group, ``{group: {"mean": ..., "stderr": ...}}``
            (`hf_flatbias.flatness.TraceEstimate.by_group`), when it was measured.
        estimator, n_contexts, n_draws, trace_seconds: how the trace was estimated and how long it took.
        glue: GLUE validation results, ``{task: {metric: value}}``.
        global_step, epoch: where in training the card was written.
        model_type, num_parameters: the architecture (``config.model_type``) and its size.
        base_model, datasets, language, license, tags: the Hub's usual card metadata (``tags`` beyond the
            automatic ``hf_flatbias``/method tags).
        training_hyperparameters: learning rate, batch sizes, schedule, seed... as recorded from the arguments.
        pretraining_corpus: the pre-training text and its held-out split, as the recipe that trained the model
            recorded them (e.g. ``{"dataset": "bbc_news", "text_column": "text", "validation_texts": 3000,
            "split_seed": 0}``), so that a later comparison measures the loss on text the model never saw.
        measures: the measures beyond the trace that were taken, by name (``"top_eigenvalue"``,
            ``"sam_sharpness"``): ``{"value": ..., "step": ..., settings...}`` (see `measure_record`).
    """

    model_name: str
    method: str = "none"
    sam_rho: float | None = None
    asam_eta: float | None = None
    sam_every_k: int | None = None
    looksam_alpha: float | None = None
    penalty_lambda: float | None = None
    penalty_fd_step: float | None = None
    pretraining_loss: float | None = None
    pretraining_loss_source: str | None = None
    hessian_trace: float | None = None
    hessian_trace_stderr: float | None = None
    trace_step: int | None = None
    estimator: str | None = None
    n_contexts: int | None = None
    n_draws: int | None = None
    trace_seconds: float | None = None
    hessian_trace_by_group: dict[str, dict[str, float]] | None = None
    glue: dict[str, dict[str, float]] = field(default_factory=dict)
    global_step: int | None = None
    epoch: float | None = None
    model_type: str | None = None
    num_parameters: int | None = None
    base_model: str | None = None
    datasets: list[str] = field(default_factory=list)
    language: str | list[str] | None = None
    license: str | None = None
    tags: list[str] = field(default_factory=list)
    training_hyperparameters: dict[str, Any] = field(default_factory=dict)
    pretraining_corpus: dict[str, Any] | None = None
    measures: dict[str, dict[str, Any]] = field(default_factory=dict)

    # ---------------------------------------------------------------- checks

    def validate(self) -> None:
        """Raise ``ValueError`` if the card would publish a non-finite or inconsistent number."""
        if not self.model_name:
            raise ValueError("FlatnessCard.model_name is empty: pass the repository or model name.")
        if self.method not in FLATNESS_METHODS:
            raise ValueError(f"FlatnessCard.method={self.method!r} is unknown; use one of {list(FLATNESS_METHODS)}.")
        used = FLATNESS_METHOD_HYPERPARAMETERS[self.method]
        for name in METHOD_HYPERPARAMETERS:
            if name not in used and getattr(self, name) is not None:
                raise ValueError(
                    f"FlatnessCard.{name} is set but method {self.method!r} does not use it (it reads "
                    f"{list(used) or 'no hyperparameter'}); set {name}=None."
                )
        floats = [name for name in METHOD_HYPERPARAMETERS if name not in _INTEGER_HYPERPARAMETERS]
        for name in ("hessian_trace", "hessian_trace_stderr", "pretraining_loss", *floats):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ValueError(
                    f"Refusing to write a flatness card with {name}={value}: the number is not finite. A non-finite "
                    "Hessian trace or loss usually means training diverged or the estimate overflowed; re-estimate "
                    "it (e.g. HessianTraceCallback on more contexts, or a lower learning rate), or set "
                    f"{name}=None to publish the card without it."
                )
        if self.hessian_trace_stderr is not None and self.hessian_trace_stderr < 0:
            raise ValueError(f"hessian_trace_stderr must be >= 0 (got {self.hessian_trace_stderr}).")
        if self.hessian_trace_stderr is not None and self.hessian_trace is None:
            raise ValueError("hessian_trace_stderr is set but hessian_trace is None: set both or neither.")
        for name in ("n_contexts", "n_draws", *_INTEGER_HYPERPARAMETERS):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer (got {value!r}).")
        if self.trace_step is not None and (not isinstance(self.trace_step, int) or self.trace_step < 0):
            raise ValueError(f"trace_step must be an integer >= 0 (got {self.trace_step!r}).")
        if self.trace_step is not None and self.hessian_trace is None:
            raise ValueError("trace_step is set but hessian_trace is None: set both or neither.")
        for task, metrics in self.glue.items():
            for metric, value in metrics.items():
                if not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise ValueError(f"GLUE result {task}/{metric}={value!r} is not a finite number.")
        for group, part in (self.hessian_trace_by_group or {}).items():
            for key, value in part.items():
                if not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise ValueError(
                        f"hessian_trace_by_group[{group!r}][{key!r}]={value!r} is not a finite number; set "
                        "hessian_trace_by_group=None to publish the card without the split."
                    )
        for name, record in self.measures.items():
            _check_measure_record(name, record)

    # ---------------------------------------------------------------- metadata

    def method_hyperparameters(self) -> dict[str, float | int]:
        """The hyperparameters of the card's method that are known, in the config's order."""
        names = FLATNESS_METHOD_HYPERPARAMETERS.get(self.method, ())
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def flatness_metadata(self) -> dict[str, Any]:
        """The ``flatness:`` block of the README's front matter; keys without a value are left out."""
        metadata = {
            "hessian_trace": self.hessian_trace,
            "hessian_trace_stderr": self.hessian_trace_stderr,
            "trace_step": self.trace_step,
            "estimator": self.estimator,
            "n_contexts": self.n_contexts,
            "n_draws": self.n_draws,
            "method": self.method,
            **self.method_hyperparameters(),
            "pretraining_loss": self.pretraining_loss,
            "pretraining_loss_source": self.pretraining_loss_source,
            "trace_seconds": self.trace_seconds,
            "hessian_trace_by_group": (
                {group: dict(part) for group, part in self.hessian_trace_by_group.items()}
                if self.hessian_trace_by_group
                else None
            ),
            **{name: dict(self.measures[name]) for name in EXTRA_MEASURES if name in self.measures},
            "global_step": self.global_step,
            "epoch": self.epoch,
            "model_type": self.model_type,
            "num_parameters": self.num_parameters,
            "training": dict(self.training_hyperparameters) or None,
            "pretraining_corpus": dict(self.pretraining_corpus) if self.pretraining_corpus else None,
        }
        return {key: value for key, value in metadata.items() if value is not None}

    def eval_results(self) -> list[EvalResult]:
        """The card's results as ``model-index`` entries: pre-training loss and trace, then GLUE."""
        results: list[EvalResult] = []
        pretraining = {
            "task_type": PRETRAINING_TASK,
            "task_name": "Masked language modeling (pre-training loss)",
            "dataset_type": self.datasets[0] if self.datasets else "pretraining-corpus",
            "dataset_name": self.datasets[0] if self.datasets else "pre-training corpus",
        }
        if self.pretraining_loss is not None:
            results.append(
                EvalResult(
                    **pretraining,
                    metric_type=PRETRAINING_LOSS_METRIC,
                    metric_value=float(self.pretraining_loss),
                    metric_name=f"Pre-training loss ({self.pretraining_loss_source or 'unknown split'})",
                )
            )
        if self.hessian_trace is not None:
            trace_args = {
                "stderr": self.hessian_trace_stderr,
                "step": self.trace_step,
                "estimator": self.estimator,
                "n_contexts": self.n_contexts,
                "n_draws": self.n_draws,
            }
            results.append(
                EvalResult(
                    **pretraining,
                    metric_type=HESSIAN_TRACE_METRIC,
                    metric_value=float(self.hessian_trace),
                    metric_name="Hessian trace of the pre-training loss (Fisher trace, Liu et al. 2023)",
                    metric_args={k: v for k, v in trace_args.items() if v is not None} or None,
                )
            )
        for task in sorted(self.glue):
            for metric in sorted(self.glue[task]):
                results.append(
                    EvalResult(
                        task_type=GLUE_TASK_TYPE,
                        task_name="GLUE fine-tuning",
                        dataset_type=GLUE_DATASET,
                        dataset_name=f"GLUE {task.upper()}",
                        dataset_config=task,
                        dataset_split="validation",
                        metric_type=metric,
                        metric_value=float(self.glue[task][metric]),
                    )
                )
        return results

    def all_tags(self) -> list[str]:
        tags = [FLATNESS_TAG]
        if self.method != "none":
            tags.append(self.method)
        tags.append("flatness")
        return _unique([*tags, *self.tags])

    def to_card_data(self) -> ModelCardData:
        return ModelCardData(
            model_name=self.model_name,
            base_model=self.base_model,
            datasets=list(self.datasets) or None,
            language=self.language,
            license=self.license,
            library_name="transformers",
            tags=self.all_tags(),
            eval_results=self.eval_results() or None,
            flatness=self.flatness_metadata(),
        )

    # ---------------------------------------------------------------- rendering and files

    def render(self) -> str:
        """The README text, rendered from the package's template (after [`validate`])."""
        self.validate()
        # libyaml's dumper when present: the pure-Python one dominated the cost of writing a card.
        metadata = yaml.dump(
            self.to_card_data().to_dict(), Dumper=_YAML_DUMPER, sort_keys=False, allow_unicode=True
        ).strip()
        return _card_template().render(
            card_data=metadata,
            card=self,
            trace_text=_format_trace(self.hessian_trace, self.hessian_trace_stderr),
            loss_text=_format_number(self.pretraining_loss),
            method_text=_format_method(self),
            glue_rows=_glue_rows(self.glue),
            measure_rows=measure_summaries(self),
            hyperparameters=self.training_hyperparameters,
            citation=PAPER_CITATION,
        )

    def to_model_card(self) -> ModelCard:
        """The rendered card as a `huggingface_hub.ModelCard` (to validate or push it with that API)."""
        return ModelCard(self.render())

    def save(self, directory: str | os.PathLike) -> Path:
        """Write the card as ``README.md`` in ``directory`` (created if missing); returns the file's path."""
        text = self.render()
        path = Path(directory) / CARD_FILENAME
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        return path

    @classmethod
    def from_model_card(cls, card: ModelCard, source: str = "README.md") -> FlatnessCard:
        """Read the card back from a parsed README.

        A number that is not finite (``.nan``, ``.inf``) is read as unknown, with a warning naming the file and the
        field, since a card must not rank or compare on it.

        Raises:
            ValueError: without a ``flatness:`` block, or with a field that is not a number where one is expected
                (the message names the file and the field).
        """
        data = card.data
        flatness = data.get("flatness")
        if not isinstance(flatness, Mapping):
            raise ValueError(
                f"{source} has no `flatness:` metadata block, so it was not written by hf_flatbias. Save a card with "
                "FlatnessCard(...).save(directory), or train with FlatBiasTrainer, which writes one on every save."
            )
        method = flatness.get("method") or "none"
        if method not in FLATNESS_METHODS:
            raise ValueError(
                f"{source}: flatness.method is {method!r}, not one of {list(FLATNESS_METHODS)}. Fix the card's "
                "metadata or write it again with FlatnessCard(...).save(folder)."
            )

        def number(key: str, integer: bool = False) -> float | int | None:
            return _read_number(flatness.get(key), f"flatness.{key}", source, integer=integer)

        glue: dict[str, dict[str, float]] = {}
        for result in data.eval_results or []:
            if result.dataset_type == GLUE_DATASET and result.dataset_config:
                field_name = f"model-index GLUE {result.dataset_config}/{result.metric_type}"
                value = _read_number(result.metric_value, field_name, source)
                if value is not None:
                    glue.setdefault(result.dataset_config, {})[result.metric_type] = value
        training = flatness.get("training") or {}
        if not isinstance(training, Mapping):
            raise ValueError(f"{source}: flatness.training is {training!r}, not a mapping of hyperparameters.")
        corpus = flatness.get("pretraining_corpus") or {}
        if not isinstance(corpus, Mapping):
            raise ValueError(f"{source}: flatness.pretraining_corpus is {corpus!r}, not a mapping.")
        base_model = data.base_model if isinstance(data.base_model, str) or data.base_model is None else None
        datasets = data.datasets if isinstance(data.datasets, list) else ([data.datasets] if data.datasets else [])
        own_tags = {FLATNESS_TAG, "flatness", str(method)}
        hyperparameters = {
            name: number(name, integer=name in _INTEGER_HYPERPARAMETERS)
            for name in FLATNESS_METHOD_HYPERPARAMETERS[method]
        }
        hessian_trace = number("hessian_trace")
        by_group = flatness.get("hessian_trace_by_group") or {}
        if not isinstance(by_group, Mapping) or not all(isinstance(part, Mapping) for part in by_group.values()):
            raise ValueError(f"{source}: flatness.hessian_trace_by_group is {by_group!r}, not a mapping of groups.")
        groups = {
            str(group): {
                key: _read_number(value, f"flatness.hessian_trace_by_group.{group}.{key}", source)
                for key, value in part.items()
            }
            for group, part in by_group.items()
        }
        measures = {}
        for name in EXTRA_MEASURES:
            record = _read_measure_record(flatness.get(name), name, source)
            if record is not None:
                measures[name] = record
        return cls(
            model_name=data.model_name or source,
            method=method,
            **hyperparameters,
            pretraining_loss=number("pretraining_loss"),
            pretraining_loss_source=flatness.get("pretraining_loss_source"),
            hessian_trace=hessian_trace,
            # the error and the step of a trace that could not be read describe nothing
            hessian_trace_stderr=number("hessian_trace_stderr") if hessian_trace is not None else None,
            trace_step=number("trace_step", integer=True) if hessian_trace is not None else None,
            estimator=flatness.get("estimator"),
            n_contexts=number("n_contexts", integer=True),
            n_draws=number("n_draws", integer=True),
            trace_seconds=number("trace_seconds"),
            # a split whose numbers could not all be read is left out, like an unreadable trace
            hessian_trace_by_group=(
                groups if groups and all(v is not None for part in groups.values() for v in part.values()) else None
            ),
            global_step=number("global_step", integer=True),
            epoch=number("epoch"),
            model_type=flatness.get("model_type"),
            num_parameters=number("num_parameters", integer=True),
            training_hyperparameters=dict(training),
            pretraining_corpus=dict(corpus) if corpus else None,
            measures=measures,
            glue=glue,
            base_model=base_model,
            datasets=list(datasets),
            language=data.language,
            license=data.license,
            tags=[tag for tag in (data.tags or []) if tag not in own_tags],
        )


# -------------------------------------------------------------------- loading


def load_flatness_card(
    repo_id_or_path: str | os.PathLike,
    *,
    revision: str | None = None,
    token: str | bool | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> FlatnessCard:
    """Read the flatness card of a local checkpoint folder, a README file, or a Hub repository.

    Args:
        repo_id_or_path: a folder holding ``README.md``, the path of a card file, or a Hub repo id
            (``"user/model"``), downloaded with `huggingface_hub.hf_hub_download` (honours ``HF_ENDPOINT``).
        revision: branch, tag or commit of the Hub repository (ignored for local paths).
        token: Hub token, as for `hf_hub_download`.
        cache_dir: Hub cache folder, as for `hf_hub_download`.

    Raises:
        ValueError: the README has no ``flatness:`` block, its YAML front matter cannot be parsed, a field is not a
            number where one is expected, or a local-looking path does not exist. Non-finite numbers are read as
            unknown, with a warning.
    """
    local = Path(repo_id_or_path)
    if local.is_dir():
        card_path = local / CARD_FILENAME
        if not card_path.is_file():
            raise ValueError(
                f"{local} has no {CARD_FILENAME}: save the checkpoint with FlatBiasTrainer (it writes the card) or "
                "write one with FlatnessCard(...).save(folder)."
            )
    elif local.is_file():
        card_path = local
    else:
        name = str(repo_id_or_path)
        if not _looks_like_repo_id(name):
            raise ValueError(f"{name!r} is neither an existing file or folder nor a Hub repo id like 'user/model'.")
        from huggingface_hub import hf_hub_download

        card_path = Path(hf_hub_download(name, CARD_FILENAME, revision=revision, token=token, cache_dir=cache_dir))
    source = str(card_path) if local.exists() else f"{repo_id_or_path} ({CARD_FILENAME})"
    try:
        card = ModelCard(card_path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, ValueError, KeyError, TypeError) as error:
        # yaml's messages span several lines with a caret; the first line says what is wrong
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(
            f"{source}: the card's YAML metadata cannot be read ({reason}). Fix the front matter between the two "
            "'---' lines, or write the card again with FlatnessCard(...).save(folder)."
        ) from error
    return FlatnessCard.from_model_card(card, source=source)


def add_glue_results(path: str | os.PathLike, glue_results: Mapping[str, Mapping[str, float]]) -> FlatnessCard:
    """Merge GLUE results (``{"sst2": {"accuracy": 0.91}}``) into the card of a local checkpoint and rewrite it.

    For results measured after pre-training, e.g. by fine-tuning the checkpoint; push the folder again to publish.
    """
    card = load_flatness_card(path)
    glue = {task: dict(metrics) for task, metrics in card.glue.items()}
    for task, metrics in glue_results.items():
        glue.setdefault(task, {}).update({metric: float(value) for metric, value in metrics.items()})
    card.glue = glue
    card_path = Path(path) / CARD_FILENAME if Path(path).is_dir() else Path(path)
    card_path.write_text(card.render(), encoding="utf-8")
    return card


# -------------------------------------------------------------------- from a trainer


def flatness_card_from_trainer(
    trainer: Any,
    *,
    model_name: str | None = None,
    language: str | list[str] | None = None,
    license: str | None = None,  # noqa: A002 - the Hub's metadata key
    tags: str | Iterable[str] | None = None,
    finetuned_from: str | None = None,
    dataset: str | Iterable[str] | None = None,
    glue_results: Mapping[str, Mapping[str, float]] | None = None,
    pretraining_corpus: Mapping[str, Any] | None = None,
) -> FlatnessCard:
    """Build the card from a FlatBiasTrainer (or Trainer)'s arguments, state, model and callbacks, read duck-typed.

    - trace: the ``last_estimate`` (``mean``, ``stderr``, ``n_contexts``, ``n_draws``, ``estimator``, ``seconds``)
      of any callback that has one, else the last ``flatness/hessian_trace`` (and ``..._stderr``) in the log history;
    - pre-training loss: the last ``eval_loss`` in the log history, else the last training ``loss``;
    - trace step: the callback's ``last_estimate_step``, else the ``step`` of the log entry the trace came from;
    - method and its hyperparameters: the arguments' ``flatness_method`` (``"none"`` for a plain
      ``TrainingArguments``) and the arguments that method reads (``FLATNESS_METHOD_HYPERPARAMETERS``);
    - GLUE: ``glue_results`` (``{"sst2": {"accuracy": 0.91}}``) merged over ``glue/<task>/<metric>`` log entries;
    - other measures: the ``last_top_eigenvalues`` / ``last_sam_sharpness`` of any callback that has them, with
      their steps (``last_top_eigenvalues_step`` / ``last_sam_sharpness_step``).
    """
    args = trainer.args
    state = trainer.state
    history: list[dict[str, Any]] = list(getattr(state, "log_history", None) or [])
    method = getattr(args, "flatness_method", "none") or "none"

    trace = _trace_from_callbacks(getattr(getattr(trainer, "callback_handler", None), "callbacks", []))
    if trace is None:
        trace = _trace_from_history(history)
    loss, loss_source = _pretraining_loss_from_history(history)

    glue = _glue_from_history(history)
    for task, metrics in (glue_results or {}).items():
        glue.setdefault(task, {}).update({m: float(v) for m, v in metrics.items()})

    model = getattr(trainer, "model", None)
    config = getattr(model, "config", None)
    if model_name is None:
        hub_model_id = getattr(args, "hub_model_id", None)
        model_name = hub_model_id.split("/")[-1] if hub_model_id else Path(args.output_dir).name
    num_parameters = None
    if hasattr(model, "parameters"):
        # Under DeepSpeed ZeRO-3 a parameter's numel() is its local shard (often 0); ds_numel is the full size.
        num_parameters = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())

    hyperparameters = {}
    for name in FLATNESS_METHOD_HYPERPARAMETERS.get(method, ()):
        value = getattr(args, name, None)
        if value is not None:
            hyperparameters[name] = int(value) if name in _INTEGER_HYPERPARAMETERS else float(value)

    return FlatnessCard(
        model_name=model_name,
        method=method,
        **hyperparameters,
        pretraining_loss=loss,
        pretraining_loss_source=loss_source,
        glue=glue,
        global_step=int(state.global_step) if getattr(state, "global_step", None) is not None else None,
        epoch=float(state.epoch) if getattr(state, "epoch", None) is not None else None,
        model_type=getattr(config, "model_type", None),
        num_parameters=num_parameters,
        base_model=finetuned_from,
        datasets=_as_list(dataset),
        language=language,
        license=license,
        tags=_as_list(tags),
        training_hyperparameters=_training_hyperparameters(args),
        pretraining_corpus=dict(pretraining_corpus) if pretraining_corpus else None,
        measures=_measures_from_callbacks(getattr(getattr(trainer, "callback_handler", None), "callbacks", [])),
        **(trace or {}),
    )


def _trace_from_callbacks(callbacks: Iterable[Any]) -> dict[str, Any] | None:
    for callback in callbacks:
        estimate = getattr(callback, "last_estimate", None)
        if estimate is None:
            continue
        stderr = getattr(estimate, "stderr", None)
        seconds = getattr(estimate, "seconds", None)
        n_contexts = getattr(estimate, "n_contexts", None)
        n_draws = getattr(estimate, "n_draws", None)
        step = getattr(callback, "last_estimate_step", None)
        by_group = getattr(estimate, "by_group", None)
        return {
            "hessian_trace": float(estimate.mean),
            "hessian_trace_stderr": float(stderr) if stderr is not None else None,
            "trace_step": int(step) if step is not None else None,
            "estimator": getattr(estimate, "estimator", None),
            "n_contexts": int(n_contexts) if n_contexts is not None else None,
            "n_draws": int(n_draws) if n_draws is not None else None,
            "trace_seconds": float(seconds) if seconds is not None else None,
            "hessian_trace_by_group": (
                {group: {"mean": float(part.mean), "stderr": float(part.stderr)} for group, part in by_group.items()}
                if by_group
                else None
            ),
        }
    return None


def measure_record(result: Any, step: int | None = None) -> dict[str, Any]:
    """A card's record of a measure beyond the trace, from its result (read duck-typed): a `TopEigenvalues`
    (``eigenvalues``...) or a `SharpnessEstimate` (``rho``...), and the training step of the weights measured."""
    if hasattr(result, "eigenvalues"):
        record = {
            "value": float(result.eigenvalues[0]),
            "residual": float(result.residuals[0]),
            "matrix": result.matrix,
            "k": len(result.eigenvalues),
            "eigenvalues": [float(v) for v in result.eigenvalues] if len(result.eigenvalues) > 1 else None,
            "n_contexts": int(result.n_contexts),
            "n_matvecs": int(result.n_matvecs),
            "seconds": float(result.seconds),
        }
    elif hasattr(result, "rho"):
        record = {
            "value": float(result.mean),
            "stderr": float(result.stderr) if math.isfinite(result.stderr) else None,
            "rho": float(result.rho),
            "adaptive": bool(result.adaptive),
            "batch_size": int(result.batch_size),
            "n_contexts": int(result.n_contexts),
            "seconds": float(result.seconds),
        }
    else:
        raise TypeError(f"measure_record takes a TopEigenvalues or a SharpnessEstimate, not {type(result).__name__}.")
    record["step"] = int(step) if step is not None else None
    return {key: value for key, value in record.items() if value is not None}


def _measures_from_callbacks(callbacks: Iterable[Any]) -> dict[str, dict[str, Any]]:
    measures: dict[str, dict[str, Any]] = {}
    for callback in callbacks:
        for name, attribute in (("top_eigenvalue", "last_top_eigenvalues"), ("sam_sharpness", "last_sam_sharpness")):
            result = getattr(callback, attribute, None)
            if result is not None and name not in measures:
                measures[name] = measure_record(result, getattr(callback, f"{attribute}_step", None))
    return measures


def _check_measure_record(name: str, record: Mapping[str, Any]) -> None:
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
    for key in _MEASURE_NUMBERS[name]:
        number = record.get(key)
        if number is not None and (not isinstance(number, (int, float)) or not math.isfinite(number)):
            raise ValueError(f"FlatnessCard.measures[{name!r}][{key!r}] is {number!r}, not a finite number.")
    step = record.get("step")
    if step is not None and (not isinstance(step, int) or step < 0):
        raise ValueError(f"FlatnessCard.measures[{name!r}]['step'] must be an integer >= 0 (got {step!r}).")
    if record.get("stderr") is not None and record["stderr"] < 0:
        raise ValueError(f"FlatnessCard.measures[{name!r}]['stderr'] must be >= 0 (got {record['stderr']}).")


def _read_measure_record(value: Any, name: str, source: str) -> dict[str, Any] | None:
    """A measure's record read from a card: ``None`` when absent or its value is not finite (with a warning)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"{source}: flatness.{name} is {value!r}, not a mapping with a value and its settings.")
    record = dict(value)
    for key in _MEASURE_NUMBERS[name]:
        if key in record:
            record[key] = _read_number(record[key], f"flatness.{name}.{key}", source, integer=key in _MEASURE_INTEGERS)
    if record.get("value") is None:
        return None
    if "eigenvalues" in record:
        record["eigenvalues"] = [
            _read_number(v, f"flatness.{name}.eigenvalues", source) for v in record["eigenvalues"] or []
        ]
    return {key: v for key, v in record.items() if v is not None}


def measure_summaries(card: FlatnessCard) -> list[tuple[str, str]]:
    """``(label, text)`` for each measure beyond the trace on the card, as the card, ``card`` and ``compare`` show
    them."""
    rows = []
    eigenvalue = card.measures.get("top_eigenvalue")
    if eigenvalue is not None:
        matrix = eigenvalue.get("matrix", "?")
        text = _format_number(eigenvalue["value"])
        if "residual" in eigenvalue:
            text += f" (residual {_format_number(eigenvalue['residual'], 2)})"
        rows.append((f"Largest {matrix} eigenvalue", text + _step_text(eigenvalue)))
    sharpness = card.measures.get("sam_sharpness")
    if sharpness is not None:
        text = _format_trace(sharpness["value"], sharpness.get("stderr"))
        settings = [f"rho = {sharpness['rho']:g}" if "rho" in sharpness else None]
        settings.append("adaptive" if sharpness.get("adaptive") else None)
        settings.append(f"batches of {sharpness['batch_size']}" if "batch_size" in sharpness else None)
        text += " (" + ", ".join(s for s in settings if s) + ")" if any(settings) else ""
        rows.append(("SAM sharpness L(w+e) - L(w) ± standard error", text + _step_text(sharpness)))
    return rows


def _step_text(record: Mapping[str, Any]) -> str:
    return f", step {record['step']}" if record.get("step") is not None else ""


def _trace_from_history(history: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    for entry in reversed(history):
        if TRACE_METRIC in entry:
            stderr = entry.get(TRACE_STDERR_METRIC)
            step = entry.get("step")
            return {
                "hessian_trace": float(entry[TRACE_METRIC]),
                "hessian_trace_stderr": float(stderr) if stderr is not None else None,
                "trace_step": int(step) if step is not None else None,
            }
    return None


def _pretraining_loss_from_history(history: Sequence[Mapping[str, Any]]) -> tuple[float | None, str | None]:
    # The held-out loss is what the paper compares models on; the training loss is only a fallback.
    for key, source in (("eval_loss", "eval"), ("loss", "train")):
        for entry in reversed(history):
            if key in entry:
                return float(entry[key]), source
    return None, None


def _glue_from_history(history: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    glue: dict[str, dict[str, float]] = {}
    for entry in history:  # later entries overwrite earlier ones
        for key, value in entry.items():
            match = GLUE_LOG_KEY.match(key)
            if match and isinstance(value, (int, float)):
                glue.setdefault(match["task"], {})[match["metric"]] = float(value)
    return glue


def _training_hyperparameters(args: Any) -> dict[str, Any]:
    names = (
        "learning_rate",
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "num_train_epochs",
        "max_steps",
        "weight_decay",
        "lr_scheduler_type",
        "warmup_steps",
        "optim",
        "seed",
        "sam_scope",
        "sam_perturbation",
        # the SAM step's own options (geometry, ascent rows, parameters, window, rho schedule), for the methods that
        # read them only
        *SAM_STEP_OPTIONS.get(getattr(args, "flatness_method", "none"), ()),
    )
    # max_steps > 0 overrides num_train_epochs: record the one that decided how long training ran
    max_steps = getattr(args, "max_steps", None)
    skipped = {"num_train_epochs"} if isinstance(max_steps, int) and max_steps > 0 else {"max_steps"}
    values: dict[str, Any] = {}
    for name in names:
        value = getattr(args, name, None)
        if value is None or name in skipped:
            continue
        value = getattr(value, "value", value)  # transformers' str enums (SchedulerType, OptimizerNames)
        values[name] = value if type(value) in (int, float, str, bool) else str(value)
    world_size = getattr(args, "world_size", None)
    if world_size is not None and "per_device_train_batch_size" in values:
        values["total_train_batch_size"] = (
            values["per_device_train_batch_size"] * values.get("gradient_accumulation_steps", 1) * int(world_size)
        )
    return values


# -------------------------------------------------------------------- formatting


@functools.cache
def _card_template() -> jinja2.Template:
    # Compiling the template costs more than rendering it; cards are written at every checkpoint.
    source = resources.files("hf_flatbias").joinpath("templates", TEMPLATE_NAME).read_text(encoding="utf-8")
    return jinja2.Template(source, keep_trailing_newline=True)


def _format_number(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "not measured"
    return f"{value:.{digits}g}"


def _format_trace(trace: float | None, stderr: float | None) -> str:
    if trace is None:
        return "not measured"
    return _format_number(trace) if stderr is None else f"{_format_number(trace)} ± {_format_number(stderr, 2)}"


def _format_method(card: FlatnessCard, *, short: bool = False) -> str:
    if card.method == "none":
        return "none" if short else METHOD_TITLES["none"]
    settings = ", ".join(f"{name} = {value:g}" for name, value in card.method_hyperparameters().items())
    title = METHOD_TITLES[card.method]
    return f"{title} ({settings})" if settings else title


def _glue_rows(glue: Mapping[str, Mapping[str, float]]) -> list[tuple[str, str, str]]:
    return [(task, metric, f"{glue[task][metric]:.4f}") for task in sorted(glue) for metric in sorted(glue[task])]


def format_comparison_table(cards: Sequence[tuple[str, FlatnessCard]]) -> str:
    """A markdown table comparing checkpoints: loss, trace ± stderr, method, estimator and GLUE metrics.

    Args:
        cards: ``(label, card)`` pairs in the order of the rows (the label is usually the repo id or path).
    """
    glue_columns = sorted({(task, metric) for _, card in cards for task in card.glue for metric in card.glue[task]})
    measure_columns = [name for name in EXTRA_MEASURES if any(name in card.measures for _, card in cards)]
    header = ["model", "pre-training loss", "Hessian trace ± stderr", "method", "estimator"]
    header += [_MEASURE_COLUMNS[name] for name in measure_columns]
    header += [f"{task}/{metric}" for task, metric in glue_columns]
    rows = [header, ["---"] * len(header)]
    for label, card in cards:
        estimator = "-"
        if card.estimator or card.n_contexts:
            estimator = f"{card.estimator or '?'} ({card.n_contexts or '?'}×{card.n_draws or '?'})"
        row = [
            label,
            _format_number(card.pretraining_loss) if card.pretraining_loss is not None else "-",
            _format_trace(card.hessian_trace, card.hessian_trace_stderr) if card.hessian_trace is not None else "-",
            _format_method(card, short=True),
            estimator,
        ]
        for name in measure_columns:
            row.append(_measure_cell(name, card.measures.get(name)))
        for task, metric in glue_columns:
            value = card.glue.get(task, {}).get(metric)
            row.append(f"{value:.4f}" if value is not None else "-")
        rows.append(row)
    return "\n".join("| " + " | ".join(cells) + " |" for cells in rows)


_MEASURE_COLUMNS = {"top_eigenvalue": "top eigenvalue", "sam_sharpness": "SAM sharpness ± stderr"}


def _measure_cell(name: str, record: Mapping[str, Any] | None) -> str:
    if record is None:
        return "-"
    if name == "top_eigenvalue":
        return f"{_format_number(record['value'])} ({record.get('matrix', '?')})"
    return f"{_format_trace(record['value'], record.get('stderr'))} (ρ={record.get('rho', float('nan')):g})"


# -------------------------------------------------------------------- small helpers


def _looks_like_repo_id(name: str) -> bool:
    return re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name) is not None and not name.startswith(".")


def _read_number(value: Any, field_name: str, source: str, *, integer: bool = False) -> float | int | None:
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


def _as_list(value: str | Iterable[str] | None) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return list(value)


def _unique(values: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(values))


__all__ = [
    "FlatnessCard",
    "add_glue_results",
    "HESSIAN_TRACE_METRIC",
    "PAPER_CITATION",
    "flatness_card_from_trainer",
    "format_comparison_table",
    "load_flatness_card",
    "measure_record",
    "measure_summaries",
]
