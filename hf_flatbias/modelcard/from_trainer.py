"""The card of a trainer: `flatness_card_from_trainer` reads a FlatBiasTrainer (or Trainer)'s arguments, state, model
and callbacks duck-typed, so nothing here imports the Trainer and the card can be built and tested on its own."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..constants import (
    TRACE_MEDIAN_OF_MEANS_METRIC,
    TRACE_METRIC,
    TRACE_STDERR_METRIC,
    TRACE_TOP_SHARE_METRIC,
)
from ..measures import MEASURE_TABLE
from ..measures import measure_record as table_measure_record
from ..sharpness.methods.table import FLATNESS_METHOD_HYPERPARAMETERS, SAM_STEP_OPTIONS
from .card import FlatnessCard
from .objective import what_was_trained
from .schema import read_integer, schema

if TYPE_CHECKING:  # the card is built and read without torch; a trainer's callbacks bring it
    from ..corpus import CorpusSpec
    from ..flatness.results import FlatnessRecord

# GLUE results in the trainer's log history: "glue/<task>/<metric>", optionally with the Trainer's "eval_" prefix.
GLUE_LOG_KEY = re.compile(r"^(?:eval_)?glue/(?P<task>[a-z0-9_-]+)/(?P<metric>[a-z0-9_]+)$")


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
    pretraining_corpus: CorpusSpec | Mapping[str, Any] | None = None,
) -> FlatnessCard:
    """Build the card from a FlatBiasTrainer (or Trainer)'s arguments, state, model and callbacks, read duck-typed.

    - trace: the `TraceEstimate` in the ``flatness_record`` (a `FlatnessRecord`) of the first callback that holds
      one (`HessianTraceCallback`), else the last ``flatness/hessian_trace`` (and ``..._stderr``) in the log history;
    - the loss: the last ``eval_loss`` in the log history, else the last training ``loss``, named by what was
      trained (`what_was_trained`: pre-training MLM or causal LM under a ``Trainer``, SFT, DPO) and its source;
    - the trace's objective, the parameters it covers (``requires_grad``: with PEFT the adapters) and, with PEFT,
      the adapter type and the base model (``finetuned_from`` when given, else the PEFT config's);
    - trace step: the record's ``trace_step``, else the ``step`` of the log entry the trace came from;
    - method and its hyperparameters: the arguments' ``flatness_method`` (``"none"`` for a plain
      ``TrainingArguments``) and the arguments that method reads (``FLATNESS_METHOD_HYPERPARAMETERS``);
    - GLUE: ``glue_results`` (``{"sst2": {"accuracy": 0.91}}``) merged over ``glue/<task>/<metric>`` log entries;
    - other measures: the records' ``measures`` (`hf_flatbias.measures.MEASURE_TABLE`), with their steps;
    - pre-training corpus: ``pretraining_corpus``, a `CorpusSpec` (or the mapping a card records).
    """
    args = trainer.args
    state = trainer.state
    history: list[dict[str, Any]] = list(getattr(state, "log_history", None) or [])
    method = getattr(args, "flatness_method", "none") or "none"

    records = _records_of(getattr(getattr(trainer, "callback_handler", None), "callbacks", []))
    trace = _trace_from_records(records)
    if trace is None:
        trace = _trace_from_history(history)
    loss, loss_source = _loss_from_history(history)

    glue = _glue_from_history(history)
    for task, metrics in (glue_results or {}).items():
        glue.setdefault(task, {}).update({m: float(v) for m, v in metrics.items()})

    model = getattr(trainer, "model", None)
    config = getattr(model, "config", None)
    if model_name is None:
        hub_model_id = getattr(args, "hub_model_id", None)
        model_name = hub_model_id.split("/")[-1] if hub_model_id else Path(args.output_dir).name
    num_parameters = trainable_parameters = None
    if hasattr(model, "parameters"):
        # Under DeepSpeed ZeRO-3 a parameter's numel() is its local shard (often 0); ds_numel is the full size.
        sizes = [(int(getattr(p, "ds_numel", p.numel())), p.requires_grad) for p in model.parameters()]
        num_parameters = sum(size for size, _ in sizes)
        trainable_parameters = sum(size for size, trained in sizes if trained) or None
    trained = what_was_trained(
        type(trainer),
        _lm_head(model),
        trained_masks=_sft_loss_masks(trainer),
        peft_config=_active_peft_config(model),
        loss_source=loss_source,
    )

    integers = {name for name, declared in schema(FlatnessCard) if declared.read is read_integer}
    hyperparameters = {}
    for name in FLATNESS_METHOD_HYPERPARAMETERS.get(method, ()):
        value = getattr(args, name, None)
        if value is not None:
            hyperparameters[name] = int(value) if name in integers else float(value)

    return FlatnessCard(
        model_name=model_name,
        method=method,
        **hyperparameters,
        objective=trained.objective,
        pretraining_loss=loss,
        pretraining_loss_source=trained.loss_source,
        glue=glue,
        global_step=int(state.global_step) if getattr(state, "global_step", None) is not None else None,
        epoch=float(state.epoch) if getattr(state, "epoch", None) is not None else None,
        model_type=getattr(config, "model_type", None),
        num_parameters=num_parameters,
        trainable_parameters=trainable_parameters,
        adapter=trained.adapter,
        base_model=finetuned_from or trained.base_model,
        datasets=_as_list(dataset),
        language=language,
        license=license,
        tags=_as_list(tags),
        training_hyperparameters=_training_hyperparameters(args),
        pretraining_corpus=pretraining_corpus or None,
        measures=_measures_from_records(records),
        **(trace or {}),
        trace_objective=trained.trace_objective if trace is not None else None,
    )


def _lm_head(model: Any) -> str | None:
    """``"causal_lm"``, ``"masked_lm"`` or ``None``: what the model's head predicts, decided as
    `HessianTraceCallback` decides how to build its contexts (`hf_flatbias.flatness.lm.is_causal_lm`)."""
    if model is None or not hasattr(model, "parameters"):
        return None
    from ..flatness.lm import lm_head_kind  # torch: only with a model, so the card reads without it

    return lm_head_kind(model)


def _sft_loss_masks(trainer: Any) -> tuple[str, ...]:
    """The loss masks trl's SFT trainer applies: its resolved ``completion_only_loss`` (from the data when the
    config left it ``None``) and the config's ``assistant_only_loss``."""
    masks = []
    if getattr(trainer, "completion_only_loss", False):
        masks.append("completion")
    if getattr(trainer.args, "assistant_only_loss", False):
        masks.append("assistant")
    return tuple(masks)


def _active_peft_config(model: Any) -> Any:
    """The PEFT config of the model's active adapter, ``None`` without PEFT."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, Mapping) or not configs:
        return None
    active = getattr(model, "active_adapter", None)
    active = active[0] if isinstance(active, (list, tuple)) and active else active
    return configs.get(active) or next(iter(configs.values()))


def _records_of(callbacks: Iterable[Any]) -> list[FlatnessRecord]:
    """The `FlatnessRecord` of every callback that keeps one, in the trainer's order (a plain `TrainerCallback` has
    none)."""
    return [record for callback in callbacks if (record := getattr(callback, "flatness_record", None)) is not None]


def _trace_from_records(records: Iterable[FlatnessRecord]) -> dict[str, Any] | None:
    estimate, step = next(((r.trace, r.trace_step) for r in records if r.trace is not None), (None, None))
    if estimate is None:
        return None
    return {
        "hessian_trace": float(estimate.mean),
        "hessian_trace_stderr": float(estimate.stderr) if estimate.stderr is not None else None,
        "trace_step": int(step) if step is not None else None,
        "estimator": estimate.estimator,
        "n_contexts": int(estimate.n_contexts),
        "n_draws": int(estimate.n_draws),
        "trace_seconds": float(estimate.seconds),
        **_robust_summary(estimate),
        "hessian_trace_by_group": (
            {
                group: {"mean": float(part.mean), "stderr": float(part.stderr)}
                for group, part in estimate.by_group.items()
            }
            if estimate.by_group
            else None
        ),
    }


def _robust_summary(estimate: Any) -> dict[str, Any]:
    """The estimate's median of means and top-1% share for the card; left off where undefined (fewer than 3
    units, an estimate of zeros) or absent (an estimate made before they existed)."""
    summary: dict[str, Any] = {}
    mom = getattr(estimate, "median_of_means", None)
    if mom is not None and math.isfinite(mom):
        summary["hessian_trace_median_of_means"] = float(mom)
        summary["median_of_means_groups"] = int(estimate.median_of_means_groups)
    share = getattr(estimate, "top_share", None)
    if share is not None and math.isfinite(share):
        summary["hessian_trace_top_share"] = float(share)
        summary["top_share_contexts"] = int(estimate.top_share_units)
    return summary


def measure_record(result: Any, step: int | None = None, *, name: str | None = None) -> dict[str, Any]:
    """A card's record of a measure beyond the trace, from its result: the record function of measure ``name``'s
    entry in `hf_flatbias.measures.MEASURE_TABLE` (value, standard error, settings), and the training step of the
    weights measured. Without ``name``, a `TopEigenvalues` or a `SharpnessEstimate` is recognised by its fields."""
    if name is None:
        if hasattr(result, "eigenvalues"):
            name = "top_eigenvalue"
        elif hasattr(result, "rho"):
            name = "sam_sharpness"
        else:
            raise TypeError(
                f"measure_record cannot tell which measure a {type(result).__name__} is: pass name= one of "
                f"{list(MEASURE_TABLE)}."
            )
    return table_measure_record(name, result, step)


def _measures_from_records(records: Iterable[FlatnessRecord]) -> dict[str, dict[str, Any]]:
    """The card's record of each measure the callbacks took. One without a finite value (a critical-sharpness
    search that found no bracket on any batch) is left off the card, as an unknown: the card refuses non-finite
    numbers, and a save must not fail over a measure; its logged value says what happened."""
    measures: dict[str, dict[str, Any]] = {}
    for record in records:
        for name, result in record.measures.items():
            if result is not None and name not in measures:
                entry = measure_record(result, record.measure_steps.get(name), name=name)
                if math.isfinite(entry["value"]):
                    measures[name] = entry
    return measures


def _trace_from_history(history: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    for entry in reversed(history):
        if TRACE_METRIC in entry:
            stderr = entry.get(TRACE_STDERR_METRIC)
            step = entry.get("step")
            return {
                "hessian_trace": float(entry[TRACE_METRIC]),
                "hessian_trace_stderr": float(stderr) if stderr is not None else None,
                "trace_step": int(step) if step is not None else None,
                "hessian_trace_median_of_means": _finite_or_none(entry.get(TRACE_MEDIAN_OF_MEANS_METRIC)),
                "hessian_trace_top_share": _finite_or_none(entry.get(TRACE_TOP_SHARE_METRIC)),
            }
    return None


def _finite_or_none(value: Any) -> float | None:
    return float(value) if value is not None and math.isfinite(float(value)) else None


def _loss_from_history(history: Sequence[Mapping[str, Any]]) -> tuple[float | None, str | None]:
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
        # read them only, and of those a trainer alone reads (DPO's sam_kept_softmax_mib) only where its config
        # carries them: the others' configs have no such field, and getattr's None skips it below
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


def _as_list(value: str | Iterable[str] | None) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return list(value)
