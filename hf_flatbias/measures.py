"""The measures beyond the trace, in one table: what each is called, how it is computed, which settings it records,
its value with its standard error, and the keys it is logged under.

The callback (``HessianTraceCallback(also_measure=...)``), the command line (``hf-flatbias trace --measures``), the
model card (its schema, writer and reader) and ``hf-flatbias compare`` (its columns) all read `MEASURE_TABLE`. Adding
a measure is one `MeasureSpec` entry here (with its settings in `hf_flatbias.measure_settings.MeasureSettings`) and
its ``compute`` function.

Kept free of torch and transformers: the command line builds its parser from this module, and cards are read
without torch. Each entry names its function as ``"module:function"``, imported only when the measure is taken.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from . import measure_records as records
from .constants import SAM_SHARPNESS_METRIC, SAM_SHARPNESS_STDERR_METRIC, TOP_EIGENVALUE_METRIC
from .measure_settings import QUANTIZATION_BITS, MeasureSettings

# -------------------------------------------------------------------- the table


@dataclasses.dataclass(frozen=True)
class MeasureSpec:
    """One measure beyond the trace.

    Attributes:
        name: its name in ``also_measure``, ``--measures`` and the card's ``flatness:`` block.
        help: one line for the command line's help.
        compute: ``"module:function"``; the function takes ``(model, contexts, *, n_contexts, settings, seed,
            batch_size, causal, optimizer, task)`` and returns the measure's result (a dataclass with ``to_dict``);
            ``task`` is forgetting's downstream task, loaded once by the caller (`load_forgetting_task`).
        record: the result -> the card's record: ``value`` (and ``stderr`` where the measure has one), its settings.
        settings: the `MeasureSettings` fields it reads.
        metric, stderr_metric: the keys of its value and standard error in the trainer's logs.
        result_key: its key in ``hf-flatbias trace``'s JSON output and in `FlatnessRecord.measures`.
        title: its row label on the card and in ``hf-flatbias card``; ``column``: its column in ``compare``.
        numbers, lists: the record's keys read back as numbers, lists of numbers; integers: those of them read as
            whole numbers (a list's every entry).
        describe: the record's settings in a few words (a ``compare`` cell); ``details``: in a few more (the card).
        required: the settings that must be given (not ``None``) to take it, checked before anything is measured.
        bounds: the range ``(lowest, highest)`` (``None``: open) of the record's numbers and lists that a measurement
            can give, which the card refuses a value outside of on write and on read (standard errors are >= 0 for
            every measure).
    """

    name: str
    help: str
    compute: str
    record: Callable[[Any], dict[str, Any]]
    settings: tuple[str, ...]
    metric: str
    stderr_metric: str | None
    result_key: str
    title: Callable[[Mapping[str, Any]], str]
    column: str
    numbers: tuple[str, ...]
    integers: tuple[str, ...] = ("n_contexts", "step")
    lists: tuple[str, ...] = ()
    describe: Callable[[Mapping[str, Any]], str] = lambda record: ""
    details: Callable[[Mapping[str, Any]], str] = lambda record: ""
    required: tuple[str, ...] = ()
    bounds: Mapping[str, tuple[float | None, float | None]] = dataclasses.field(default_factory=dict)

    def function(self) -> Callable[..., Any]:
        module, name = self.compute.split(":")
        return getattr(importlib.import_module(module), name)


MEASURE_TABLE: dict[str, MeasureSpec] = {
    spec.name: spec
    for spec in (
        MeasureSpec(
            name="top_eigenvalue",
            help="the largest eigenvalue(s) of the Fisher or Hessian by Lanczos",
            compute="hf_flatbias.flatness.beyond_trace:top_eigenvalue",
            record=records.eigenvalue_record,
            settings=("eigenvalue_matrix", "top_k", "eigenvalue_product", "eigenvalue_fd_step"),
            metric=TOP_EIGENVALUE_METRIC,
            stderr_metric=None,
            result_key="top_eigenvalues",
            title=lambda record: f"Largest {record.get('matrix', '?')} eigenvalue",
            column="top eigenvalue",
            numbers=("value", "residual", "k", "n_contexts", "n_matvecs", "seconds", "step"),
            integers=("k", "n_contexts", "n_matvecs", "step"),
            lists=("eigenvalues",),
            describe=lambda record: record.get("matrix", "?"),
            details=lambda record: f"residual {record['residual']:.2g}" if "residual" in record else "",
        ),
        MeasureSpec(
            name="spectrum_shape",
            help="the exponent alpha of a power law lambda_k ~ C k^-alpha fitted (least squares on log-log) to the "
            "--power-law-k largest eigenvalues of the Fisher or Hessian; its error is the regression's",
            compute="hf_flatbias.flatness.spectrum_shape:spectrum_shape",
            record=records.spectrum_shape_record,
            settings=("eigenvalue_matrix", "power_law_k", "eigenvalue_product", "eigenvalue_fd_step"),
            metric="flatness/spectrum_shape",
            stderr_metric="flatness/spectrum_shape_stderr",
            result_key="spectrum_shape",
            title=lambda record: f"Spectrum power-law exponent α ({record.get('matrix', '?')}) ± fit standard error",
            column="spectrum α ± fit stderr",
            numbers=(
                "value",
                "stderr",
                "r_squared",
                "log_scale",
                "n_fitted",
                "k",
                "n_contexts",
                "n_matvecs",
                "seconds",
                "step",
            ),
            integers=("n_fitted", "k", "n_contexts", "n_matvecs", "step"),
            lists=("eigenvalues",),
            describe=lambda record: f"{record.get('matrix', '?')}, top {record.get('n_fitted', '?')}",
            details=records.spectrum_shape_details,
        ),
        MeasureSpec(
            name="sam_sharpness",
            help="SAM's L(w + rho g/||g||) - L(w) per batch",
            compute="hf_flatbias.flatness.beyond_trace:sam_sharpness",
            record=records.sam_record,
            settings=("sam_rho", "sam_batch_size"),
            metric=SAM_SHARPNESS_METRIC,
            stderr_metric=SAM_SHARPNESS_STDERR_METRIC,
            result_key="sam_sharpness",
            title=lambda record: "SAM sharpness L(w+e) - L(w) ± standard error",
            column="SAM sharpness ± stderr",
            numbers=("value", "stderr", "rho", "eta", "batch_size", "n_contexts", "seconds", "step"),
            integers=("batch_size", "n_contexts", "step"),
            describe=lambda record: f"ρ={record.get('rho', math.nan):g}",
            details=lambda record: records.join_parts(
                f"rho = {record['rho']:g}" if "rho" in record else None,
                "adaptive" if record.get("adaptive") else None,
                f"batches of {record['batch_size']}" if "batch_size" in record else None,
            ),
        ),
        MeasureSpec(
            name="weight_noise",
            help="E[L(w + sigma eps)] - L(w) under Gaussian weight noise (antithetic pairs, the same noise for every "
            "checkpoint)",
            compute="hf_flatbias.flatness.beyond_trace:weight_noise",
            record=records.noise_record,
            settings=("noise_sigmas", "noise_scale", "noise_draws"),
            metric="flatness/weight_noise",
            stderr_metric="flatness/weight_noise_stderr",
            result_key="weight_noise",
            title=lambda record: "Weight-noise loss increase ± standard error",
            column="weight noise ΔL ± stderr",
            numbers=("value", "stderr", "sigma", "n_draws", "seed", "base_loss", "n_contexts", "seconds", "step"),
            integers=("n_draws", "seed", "n_contexts", "step"),
            lists=("sigmas", "means", "stderrs"),
            bounds={"sigma": (0, None), "sigmas": (0, None)},
            describe=lambda record: f"σ={record.get('sigma', math.nan):g} {record.get('scale', '?')}",
            details=records.noise_details,
        ),
        MeasureSpec(
            name="quantization",
            help="the loss increase after round-to-nearest weight quantization (8 and 4 bits by default)",
            compute="hf_flatbias.flatness.beyond_trace:quantization",
            record=records.quantization_record,
            settings=("quantization_bits", "quantization_group_size"),
            metric="flatness/quantization",
            stderr_metric="flatness/quantization_stderr",
            result_key="quantization",
            title=lambda record: "Quantization loss increase ± standard error",
            column="quantization ΔL ± stderr",
            numbers=(
                "value",
                "stderr",
                "bits",
                "group_size",
                "relative_weight_error",
                "base_loss",
                "n_contexts",
                "seconds",
                "step",
            ),
            integers=("bits", "bit_widths", "group_size", "n_contexts", "step"),
            lists=("bit_widths", "increases", "stderrs"),
            bounds={"bits": QUANTIZATION_BITS, "bit_widths": QUANTIZATION_BITS, "relative_weight_error": (0, None)},
            describe=records.quantization_describe,
            details=records.quantization_details,
        ),
        MeasureSpec(
            name="critical_sharpness",
            help="2/eta_c along the next update by a forward-only line search (in training: the optimizer's update, "
            "nothing applied; on the command line, with no optimizer: the negative gradient, plain gradient descent)",
            compute="hf_flatbias.flatness.beyond_trace:critical_sharpness",
            record=records.critical_record,
            settings=("critical_rtol", "critical_direction", "critical_batch_size", "critical_max_grad_norm"),
            metric="flatness/critical_sharpness",
            stderr_metric="flatness/critical_sharpness_stderr",
            result_key="critical_sharpness",
            title=lambda record: "Critical sharpness 2/η_c ± standard error",
            column="critical sharpness ± stderr",
            numbers=(
                "value",
                "stderr",
                "learning_rate",
                "rtol",
                "batch_size",
                "n_batches",
                "n_converged",
                "n_forward_passes",
                "n_contexts",
                "seconds",
                "step",
            ),
            integers=("batch_size", "n_batches", "n_converged", "n_forward_passes", "n_contexts", "step"),
            describe=lambda record: str(record.get("direction", "?")),
            details=lambda record: records.join_parts(
                f"along {record['direction']}'s next update" if "direction" in record else None,
                f"batches of {record['batch_size']}" if "batch_size" in record else None,
                f"{record['n_converged']}/{record['n_batches']} searches converged"
                if "n_converged" in record and "n_batches" in record
                else None,
            ),
        ),
        MeasureSpec(
            name="relative_critical_sharpness",
            help="2/eta_c of the pre-training loss along the first update a fresh --forgetting-optimizer would take "
            "on a batch of --forgetting-task (Kalra et al.'s relative critical sharpness): how far a fine-tuning step "
            "can go before the pre-training loss rises",
            compute="hf_flatbias.flatness.relative_critical_sharpness:relative_critical_sharpness",
            record=records.relative_critical_record,
            settings=(
                "forgetting_task",
                "forgetting_label_column",
                "forgetting_optimizer",
                "forgetting_learning_rate",
                "forgetting_batch_size",
                "forgetting_train_rows",
                "critical_rtol",
                "critical_batch_size",
            ),
            metric="flatness/relative_critical_sharpness",
            stderr_metric="flatness/relative_critical_sharpness_stderr",
            result_key="relative_critical_sharpness",
            title=lambda record: (
                "Relative critical sharpness 2/η_c (pre-training loss along a fine-tuning step) ± standard error"
            ),
            column="relative critical sharpness ± stderr",
            numbers=(
                "value",
                "stderr",
                "learning_rate",
                "rtol",
                "batch_size",
                "downstream_batch_size",
                "n_batches",
                "n_converged",
                "n_rose_at_once",
                "n_forward_passes",
                "seed",
                "n_contexts",
                "seconds",
                "step",
            ),
            integers=(
                "batch_size",
                "downstream_batch_size",
                "n_batches",
                "n_converged",
                "n_rose_at_once",
                "n_forward_passes",
                "seed",
                "n_contexts",
                "step",
            ),
            describe=lambda record: records.join_parts(str(record.get("task", "?")), record.get("optimizer")),
            details=records.relative_critical_details,
            required=("forgetting_task",),
        ),
        MeasureSpec(
            name="gradient_alignment",
            help="the mean pairwise cosine of the per-source mean gradients of the pre-training loss, sources from "
            "--alignment-column (task_a for the synthetic languages), with a jackknife error over blocks of contexts "
            "within sources",
            compute="hf_flatbias.flatness.gradient_alignment:gradient_alignment",
            record=records.alignment_record,
            settings=("alignment_column", "alignment_blocks"),
            metric="flatness/gradient_alignment",
            stderr_metric="flatness/gradient_alignment_stderr",
            result_key="gradient_alignment",
            title=lambda record: "Gradient alignment across sources (mean pairwise cosine) ± standard error",
            column="gradient alignment ± stderr",
            numbers=("value", "stderr", "n_sources", "n_blocks", "n_contexts", "batch_size", "seconds", "step"),
            integers=("n_sources", "n_blocks", "n_contexts", "batch_size", "step"),
            lists=("pair_cosines", "contexts_per_source"),
            describe=lambda record: f"{record.get('column', '?')}, {record.get('n_sources', '?')} sources",
            details=records.alignment_details,
            required=("alignment_column",),
        ),
        MeasureSpec(
            name="forgetting",
            help="the pre-training loss increase after --forgetting-steps of fine-tuning a copy's encoder on "
            "--forgetting-task (the same rows, order and seed for every checkpoint), the task accuracy beside",
            compute="hf_flatbias.flatness.beyond_trace:forgetting",
            record=records.forgetting_record,
            settings=(
                "forgetting_task",
                "forgetting_label_column",
                "forgetting_steps",
                "forgetting_learning_rate",
                "forgetting_batch_size",
                "forgetting_optimizer",
                "forgetting_train_rows",
                "forgetting_eval_rows",
                "forgetting_trace_draws",
            ),
            metric="flatness/forgetting",
            stderr_metric="flatness/forgetting_stderr",
            result_key="forgetting",
            title=lambda record: "Forgetting: pre-training loss increase after fine-tuning ± standard error",
            column="forgetting ΔL ± stderr",
            numbers=(
                "value",
                "stderr",
                "steps",
                "learning_rate",
                "batch_size",
                "weight_decay",
                "seed",
                "num_labels",
                "lm_loss_before",
                "lm_loss_after",
                "accuracy_before",
                "accuracy_before_stderr",
                "accuracy_after",
                "accuracy_after_stderr",
                "n_task_rows",
                "n_eval_rows",
                "trace_before",
                "trace_before_stderr",
                "trace_after",
                "trace_after_stderr",
                "trace_n_draws",
                "n_contexts",
                "seconds",
                "step",
            ),
            integers=(
                "steps",
                "batch_size",
                "seed",
                "num_labels",
                "n_task_rows",
                "n_eval_rows",
                "trace_n_draws",
                "n_contexts",
                "step",
            ),
            describe=records.forgetting_describe,
            details=records.forgetting_details,
            required=("forgetting_task",),
            bounds={"accuracy_before": (0, 1), "accuracy_after": (0, 1)},
        ),
    )
}
"""Every measure beyond the trace, by name, in the order tables list them."""

EXTRA_MEASURES = tuple(MEASURE_TABLE)
"""The names of the measures beyond the trace: what ``also_measure`` may name."""

MEASURES = ("trace", *EXTRA_MEASURES)
"""Every measure a checkpoint can be given: the Hessian (Fisher) trace and those of `MEASURE_TABLE`."""


TASK_MEASURES = tuple(name for name, spec in MEASURE_TABLE.items() if "forgetting_task" in spec.required)
"""The measures that need a downstream task (``forgetting_task``), loaded once by the caller and passed as ``task``."""


def needs_downstream_task(names: Iterable[str]) -> bool:
    """Whether any of measures ``names`` needs the downstream task loaded."""
    return any(name in TASK_MEASURES for name in names)


def measure_record(name: str, result: Any, step: int | None = None) -> dict[str, Any]:
    """The card's record of measure ``name``: its value, standard error and settings, and the training step."""
    record = MEASURE_TABLE[name].record(result)
    if step is not None:
        record["step"] = int(step)
    return record


def check_required_settings(names: Iterable[str], settings: MeasureSettings) -> None:
    """`ValueError` when a measure of ``names`` lacks a setting it cannot be taken without (forgetting's task)."""
    for name in names:
        for setting in MEASURE_TABLE[name].required if name in MEASURE_TABLE else ():
            if getattr(settings, setting) is None and setting == "forgetting_task":
                raise ValueError(
                    f"{setting} is needed by {name}: name its downstream task, a GLUE task (e.g. sst2) or a file "
                    "of labelled rows (--forgetting-task on the command line, measure_settings={'forgetting_task': "
                    "...} for the callback)."
                )
            if getattr(settings, setting) is None:
                flag = setting.replace("_", "-")
                raise ValueError(
                    f"{setting} is needed by {name}: pass --{flag} on the command line, measure_settings="
                    f"{{{setting!r}: ...}} for the callback."
                )


def format_measure_value(record: Mapping[str, Any]) -> str:
    """``value ± stderr`` (or the value alone) in four significant digits."""
    text = f"{record['value']:.4g}"
    if record.get("stderr") is not None:
        text += f" ± {record['stderr']:.2g}"
    return text


__all__ = [
    "EXTRA_MEASURES",
    "MEASURES",
    "MEASURE_TABLE",
    "MeasureSettings",
    "MeasureSpec",
    "TASK_MEASURES",
    "check_required_settings",
    "format_measure_value",
    "measure_record",
    "needs_downstream_task",
]
