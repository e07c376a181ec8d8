"""`FlatnessCard`, the typed content of a flatness model card: its fields (with their schema), checks, rendering
through ``flatness_card.md`` beside this module, and reading back from a README, a folder or the Hub."""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import jinja2
import yaml
from huggingface_hub import EvalResult, ModelCard, ModelCardData

from ..constants import TRACE_QUANTITIES, TRACE_SYMBOLS
from ..corpus import CorpusSpec
from ..sharpness.methods.table import FLATNESS_METHOD_HYPERPARAMETERS, FLATNESS_METHODS
from . import schema
from .formatting import format_method, format_number, format_trace, glue_rows, measure_summaries
from .objective import (
    LOSS_SOURCES,
    OBJECTIVES,
    TRACE_OBJECTIVE_LABELS,
    TRACE_OBJECTIVES,
    UNKNOWN_OBJECTIVE,
    UNKNOWN_TRACE_OBJECTIVE,
    Objective,
)
from .schema import (
    CARD_DATA,
    FLATNESS,
    FLATNESS_TAG,
    GLUE_DATASET,
    MODEL_INDEX,
    card_field,
    check_finite,
    check_glue,
    check_groups,
    check_measures,
    check_positive_integer,
    check_step,
    choice_check,
    choice_reader,
    loss_reader,
    loss_writer,
    mapping_reader,
    read_as_is,
    read_base_model,
    read_corpus,
    read_float,
    read_glue,
    read_groups,
    read_integer,
    read_list,
    read_measures,
    read_method,
    read_model_name,
    read_own_tags,
    write_corpus,
    write_groups,
    write_list,
    write_mapping,
    write_measures,
)

HESSIAN_TRACE_METRIC = "hessian_trace"
PRETRAINING_LOSS_METRIC = "loss"
CARD_FILENAME = "README.md"
TEMPLATE_NAME = "flatness_card.md"
GLUE_TASK_TYPE = "text-classification"
# Every hyperparameter any method reads, in a stable order; each is a field of FlatnessCard.
METHOD_HYPERPARAMETERS = tuple(
    dict.fromkeys(name for names in FLATNESS_METHOD_HYPERPARAMETERS.values() for name in names)
)
SIGNED_TRACE_ESTIMATORS = tuple(name for name, symbol in TRACE_SYMBOLS.items() if symbol == "Tr(H)")
"""The estimators of the data-label Hessian's trace, which is negative where the model is off the optimum (a Fisher
trace, a sum of squared norms, never is)."""
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


def _hyperparameter(read=read_float, check=check_finite) -> Any:
    return card_field(read=read, check=check, hyperparameter=True)


@dataclass
class FlatnessCard:
    """The machine-readable content of a flatness model card.

    Every number is optional except the model name: a card written before the first trace estimate simply has no
    trace. Non-finite numbers are refused (see [`FlatnessCard.validate`]): a card is a published claim. The fields
    are declared in the order of the ``flatness:`` block; each one's `card_field` says where it is written and how
    it is read back and checked.

    Attributes:
        model_name: name in the ``model-index`` (the repo name by default).
        hessian_trace, hessian_trace_stderr: the trace of the pre-training loss's curvature and its standard error:
            the Fisher trace for the sampled-label estimators, the data-label Hessian's for ``hutchinson`` (see
            `hf_flatbias.constants.TRACE_QUANTITIES`).
        trace_step: the training step whose weights the trace was measured on.
        hessian_trace_median_of_means, median_of_means_groups: the trace's median of means over that many groups of
            contexts (sampling units), which one or two contexts with huge gradients cannot carry.
        hessian_trace_top_share, top_share_contexts: the share of the trace carried by its largest that many
            contexts (the top 1%): about 1% when contexts are alike, near 1 when a few make the estimate.
        estimator, n_contexts, n_draws: how the trace was estimated.
        method: how training sought flatness, one of `FlatBiasConfig.flatness_method`'s choices.
        sam_rho, asam_eta, sam_every_k, looksam_alpha, penalty_lambda, penalty_fd_step: the method's
            hyperparameters, set for the ones the method reads and ``None`` for the others.
        trace_objective: what the trace's contexts predict, a key of
            `hf_flatbias.modelcard.objective.TRACE_OBJECTIVES` (``"masked_position"``, ``"next_token"``,
            ``"next_token_trained"`` for SFT, ``"next_token_chosen"`` for DPO); ``None``: not recorded.
        objective: what was trained, a key of `hf_flatbias.modelcard.objective.OBJECTIVES` (``"masked_lm"``,
            ``"causal_lm"``, ``"sft"``, ``"sft_completion_only"``, ``"sft_assistant_only"``, ``"dpo"``); ``None``
            (cards written before the field existed): not recorded, and the card says so. It names the task and
            the loss.
        pretraining_loss: the loss the card reports, of the ``objective``: a pre-training loss for ``masked_lm``
            and ``causal_lm``, SFT's loss on the trained tokens, DPO's preference loss; its YAML key names it
            (``pretraining_loss``, ``sft_loss``, ``dpo_loss``; cards written before say ``pretraining_loss``);
            ``pretraining_loss_source`` (key ``<loss key>_source``) says ``"eval"`` (held out) or ``"train"`` (the
            last logged training loss).
        trace_seconds: how long the trace estimate took.
        hessian_trace_by_group: the trace split by parameter group, ``{group: {"mean": ..., "stderr": ...}}``
            (`hf_flatbias.flatness.TraceEstimate.by_group`), when it was measured.
        measures: the measures beyond the trace that were taken, by their names in
            `hf_flatbias.measures.MEASURE_TABLE`: ``{"value": ..., "stderr": ..., settings..., "step": ...}`` (see
            `measure_record`).
        global_step, epoch: where in training the card was written.
        model_type, num_parameters: the architecture (``config.model_type``) and its size (all parameters, with
            PEFT the base model's and the adapters').
        trainable_parameters: the parameters that were trained (``requires_grad``), which are those the trace
            covers: with LoRA, the adapters only.
        adapter: the PEFT method (``"LORA"``...) when the model was trained through adapters; its base model is
            ``base_model``.
        training_hyperparameters: learning rate, batch sizes, schedule, seed... as recorded from the arguments.
        pretraining_corpus: the pre-training text and its held-out split, as the recipe that trained the model
            recorded them (a [`CorpusSpec`]; the mapping a card holds, ``{"dataset": "bbc_news", "text_column":
            "text", "validation_texts": 3000, "split_seed": 0}``, is accepted and read as one), so that a later
            comparison measures the loss on text the model never saw.
        glue: GLUE validation results, ``{task: {metric: value}}``.
        base_model, datasets, language, license, tags: the Hub's usual card metadata (``tags`` beyond the
            automatic ``hf_flatbias``/method tags).
    """

    model_name: str = card_field(CARD_DATA, read=read_model_name, default=dataclasses.MISSING)
    _: KW_ONLY
    hessian_trace: float | None = card_field(read=read_float, check=check_finite)
    hessian_trace_stderr: float | None = card_field(read=read_float, check=check_finite, requires="hessian_trace")
    trace_step: int | None = card_field(read=read_integer, check=check_step, requires="hessian_trace")
    # the robust summary beside the mean (hf_flatbias.flatness.robust_summary): a few contexts cannot carry it
    hessian_trace_median_of_means: float | None = card_field(
        read=read_float, check=check_finite, requires="hessian_trace"
    )
    median_of_means_groups: int | None = card_field(
        read=read_integer, check=check_positive_integer, requires="hessian_trace_median_of_means"
    )
    hessian_trace_top_share: float | None = card_field(read=read_float, check=check_finite, requires="hessian_trace")
    top_share_contexts: int | None = card_field(
        read=read_integer, check=check_positive_integer, requires="hessian_trace_top_share"
    )
    estimator: str | None = card_field()
    n_contexts: int | None = card_field(read=read_integer, check=check_positive_integer)
    n_draws: int | None = card_field(read=read_integer, check=check_positive_integer)
    trace_objective: str | None = card_field(read=choice_reader(TRACE_OBJECTIVES), check=choice_check(TRACE_OBJECTIVES))
    method: str = card_field(read=read_method, default="none")
    sam_rho: float | None = _hyperparameter()
    asam_eta: float | None = _hyperparameter()
    sam_every_k: int | None = _hyperparameter(read=read_integer, check=check_positive_integer)
    looksam_alpha: float | None = _hyperparameter()
    penalty_lambda: float | None = _hyperparameter()
    penalty_fd_step: float | None = _hyperparameter()
    objective: str | None = card_field(read=choice_reader(OBJECTIVES), check=choice_check(OBJECTIVES))
    # written under the key of what the run trained on (sft_loss, dpo_loss), read under pretraining_loss from before
    pretraining_loss: float | None = card_field(
        key=None, read=loss_reader("", read_float), write=loss_writer(""), check=check_finite
    )
    pretraining_loss_source: str | None = card_field(
        key=None, read=loss_reader("_source", read_as_is), write=loss_writer("_source")
    )
    trace_seconds: float | None = card_field(read=read_float)
    hessian_trace_by_group: dict[str, dict[str, float]] | None = card_field(
        read=read_groups, write=write_groups, check=check_groups
    )
    # one key per measure taken (hf_flatbias.measures.MEASURE_TABLE)
    measures: dict[str, dict[str, Any]] = card_field(
        key=None, read=read_measures, write=write_measures, check=check_measures, default_factory=dict
    )
    global_step: int | None = card_field(read=read_integer)
    epoch: float | None = card_field(read=read_float)
    model_type: str | None = card_field()
    num_parameters: int | None = card_field(read=read_integer)
    trainable_parameters: int | None = card_field(read=read_integer, check=check_positive_integer)
    adapter: str | None = card_field()
    training_hyperparameters: dict[str, Any] = card_field(
        key="training",
        read=mapping_reader("a mapping of hyperparameters"),
        write=write_mapping,
        default_factory=dict,
    )
    pretraining_corpus: CorpusSpec | None = card_field(read=read_corpus, write=write_corpus)
    # written by eval_results with the pre-training loss and the trace
    glue: dict[str, dict[str, float]] = card_field(
        MODEL_INDEX, key=None, read=read_glue, check=check_glue, default_factory=dict
    )
    base_model: str | None = card_field(CARD_DATA, read=read_base_model)
    datasets: list[str] = card_field(CARD_DATA, read=read_list, write=write_list, default_factory=list)
    language: str | list[str] | None = card_field(CARD_DATA)
    license: str | None = card_field(CARD_DATA)
    tags: list[str] = card_field(
        CARD_DATA, read=read_own_tags, write=lambda card, tags: card.all_tags(), default_factory=list
    )

    def __post_init__(self) -> None:
        if isinstance(self.pretraining_corpus, Mapping):
            # what the card's YAML holds, and what callers passed before the field was typed
            self.pretraining_corpus = (
                CorpusSpec.from_record(self.pretraining_corpus) if self.pretraining_corpus else None
            )

    @property
    def trace_quantity(self) -> str:
        """What the card's trace is, named by what its estimator measured (``"Fisher trace Tr(F)"``...)."""
        return TRACE_QUANTITIES.get(self.estimator, "Curvature trace")

    @property
    def trained_objective(self) -> Objective:
        """The `Objective` of ``objective`` (task, loss name), or one saying that it is not recorded."""
        return OBJECTIVES.get(self.objective, UNKNOWN_OBJECTIVE) if self.objective else UNKNOWN_OBJECTIVE

    @property
    def loss_label(self) -> str:
        """The card's loss named by its objective and its source: ``"DPO preference loss (training, last
        logged)"``, ``"Pre-training loss (masked LM) (held-out evaluation)"``..."""
        source = LOSS_SOURCES.get(self.pretraining_loss_source or "", self.pretraining_loss_source)
        return f"{self.trained_objective.loss_name} ({source or 'source not recorded'})"

    @property
    def trace_objective_text(self) -> str:
        """What the trace's contexts predict, in words (the trained tokens named for SFT)."""
        if self.trace_objective is None:
            return UNKNOWN_TRACE_OBJECTIVE
        text = TRACE_OBJECTIVES[self.trace_objective]
        if self.trace_objective == "next_token_trained" and self.objective is not None:
            text += f" ({self.trained_objective.trained_tokens})"
        return text

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
        schema.check_fields(self)
        impossible = self.impossible_value()
        if impossible:
            raise ValueError(impossible)
        for name in ("hessian_trace_stderr", "trace_step"):
            if getattr(self, name) is not None and self.hessian_trace is None:
                raise ValueError(f"{name} is set but hessian_trace is None: set both or neither.")

    def impossible_value(self) -> str | None:
        """What no measurement could have given, in one sentence, or ``None``: a negative standard error or
        cross-entropy, a negative Fisher trace (the data-label Hessian's, which ``hutchinson`` and ``hutchpp``
        estimate, can be negative away from the optimum), a trace measured after the step the card was written at."""
        if self.hessian_trace_stderr is not None and self.hessian_trace_stderr < 0:
            stderr = self.hessian_trace_stderr
            return f"hessian_trace_stderr must be >= 0 (got {stderr}): a standard error is not negative."
        if self.hessian_trace is not None and self.hessian_trace < 0 and self.estimator not in SIGNED_TRACE_ESTIMATORS:
            return (
                f"hessian_trace is {self.hessian_trace}, but a {self.trace_quantity} (estimator "
                f"{self.estimator or 'not recorded'}) cannot be negative; only the data-label Hessian's trace, "
                f"estimated by {' or '.join(SIGNED_TRACE_ESTIMATORS)}, can."
            )
        if self.pretraining_loss is not None and self.pretraining_loss < 0:
            return f"pretraining_loss must be >= 0 (got {self.pretraining_loss}): a cross-entropy is not negative."
        if None not in (self.trainable_parameters, self.num_parameters) and (
            self.trainable_parameters > self.num_parameters
        ):
            return (
                f"trainable_parameters {self.trainable_parameters} is more than num_parameters "
                f"{self.num_parameters}: the trained parameters are a part of the model's."
            )
        if None not in (self.trace_step, self.global_step) and self.trace_step > self.global_step:
            return (
                f"trace_step {self.trace_step} is past the run's last step, global_step {self.global_step}: the trace "
                "cannot have been measured after the card was written."
            )
        return None

    # ---------------------------------------------------------------- metadata

    def method_hyperparameters(self) -> dict[str, float | int]:
        """The hyperparameters of the card's method that are known, in the config's order."""
        names = FLATNESS_METHOD_HYPERPARAMETERS.get(self.method, ())
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def flatness_metadata(self) -> dict[str, Any]:
        """The ``flatness:`` block of the README's front matter; keys without a value are left out."""
        return schema.write_block(self, FLATNESS)

    def eval_results(self) -> list[EvalResult]:
        """The card's results as ``model-index`` entries: the loss and the trace under the task that was trained
        (`trained_objective`), then GLUE."""
        results: list[EvalResult] = []
        objective = self.trained_objective
        corpus_type, corpus = ("pretraining-corpus", "pre-training corpus") if objective.pretraining else ("data",) * 2
        pretraining = {
            "task_type": objective.task_type,
            "task_name": objective.task_name,
            "dataset_type": self.datasets[0] if self.datasets else corpus_type,
            "dataset_name": self.datasets[0] if self.datasets else corpus,
        }
        if self.pretraining_loss is not None:
            results.append(
                EvalResult(
                    **pretraining,
                    metric_type=PRETRAINING_LOSS_METRIC,
                    metric_value=float(self.pretraining_loss),
                    metric_name=self.loss_label,
                )
            )
        if self.hessian_trace is not None:
            loss = "pre-training loss" if objective.pretraining else "LM loss"
            trace_label = TRACE_OBJECTIVE_LABELS.get(self.trace_objective or "", "objective not recorded")
            trace_args = {
                "stderr": self.hessian_trace_stderr,
                "step": self.trace_step,
                "estimator": self.estimator,
                "n_contexts": self.n_contexts,
                "n_draws": self.n_draws,
                "objective": self.trace_objective,
                "parameters": self.trainable_parameters,
            }
            results.append(
                EvalResult(
                    **pretraining,
                    metric_type=HESSIAN_TRACE_METRIC,
                    metric_value=float(self.hessian_trace),
                    metric_name=f"{self.trace_quantity} of the {loss} ({trace_label})",
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
        return list(dict.fromkeys([*tags, *self.tags]))

    def to_card_data(self) -> ModelCardData:
        return ModelCardData(
            **schema.write_block(self, CARD_DATA),
            library_name="transformers",
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
            objective=self.trained_objective,
            # a PEFT config records the base model's local folder when it was loaded from one: not a Hub link
            base_model_on_hub=bool(self.base_model) and looks_like_repo_id(self.base_model),
            trace_text=format_trace(self.hessian_trace, self.hessian_trace_stderr),
            loss_text=format_number(self.pretraining_loss),
            method_text=format_method(self),
            glue_rows=glue_rows(self.glue),
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
        """Read the card back from a parsed README, field by field as the schema declares.

        A number that is not finite (``.nan``, ``.inf``) is read as unknown, with a warning naming the file and the
        field, since a card must not rank or compare on it.

        Raises:
            ValueError: without a ``flatness:`` block, or with a field that is not a number where one is expected
                (the message names the file and the field).
        """
        flatness = card.data.get("flatness")
        if not isinstance(flatness, Mapping):
            raise ValueError(
                f"{source} has no `flatness:` metadata block, so it was not written by hf_flatbias. Save a card with "
                "FlatnessCard(...).save(directory), or train with FlatBiasTrainer, which writes one on every save."
            )
        read = cls(**schema.read_fields(cls, card.data, flatness, source))
        impossible = read.impossible_value()
        if impossible:
            raise ValueError(
                f"{source}: {impossible} Fix the card's metadata, or measure again and write the card with "
                "FlatnessCard(...).save(folder)."
            )
        return read


def looks_like_repo_id(name: str) -> bool:
    """Whether ``name`` has the form of a Hub repo id (``"model"`` or ``"user/model"``)."""
    return re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name) is not None and not name.startswith(".")


# -------------------------------------------------------------------- formatting


@functools.cache
def _card_template() -> jinja2.Template:
    # Compiling the template costs more than rendering it; cards are written at every checkpoint.
    source = resources.files(__package__).joinpath(TEMPLATE_NAME).read_text(encoding="utf-8")
    return jinja2.Template(source, keep_trailing_newline=True)


__all__ = [
    "CARD_FILENAME",
    "HESSIAN_TRACE_METRIC",
    "METHOD_HYPERPARAMETERS",
    "PAPER_CITATION",
    "FlatnessCard",
]
