"""The measures beyond the trace, in one table: what each is called, how it is computed, which settings it records,
its value with its standard error, and the keys it is logged under.

The callback (``HessianTraceCallback(also_measure=...)``), the command line (``hf-flatbias trace --measures``), the
model card (its schema, writer and reader) and ``hf-flatbias compare`` (its columns) all read `MEASURE_TABLE`. Adding
a measure is one `MeasureSpec` entry here (with its settings in `MeasureSettings`) and its ``compute`` function.

Kept free of torch and transformers: the command line builds its parser from this module, and cards are read
without torch. Each entry names its function as ``"module:function"``, imported only when the measure is taken.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from numbers import Integral, Real
from typing import Any

from .constants import (
    CRITICAL_DIRECTIONS,
    CURVATURE_PRODUCTS,
    DEFAULT_SAM_RHO,
    NOISE_SCALES,
    SAM_SHARPNESS_METRIC,
    SAM_SHARPNESS_STDERR_METRIC,
    SPECTRUM_MATRICES,
    TOP_EIGENVALUE_METRIC,
)

# -------------------------------------------------------------------- settings


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(part) for part in str(text).split(",") if part.strip())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in str(text).split(",") if part.strip())


def _optional_int(text: str) -> int | None:
    return None if str(text).lower() in ("", "none") else int(text)


def _optional_float(text: str) -> float | None:
    return None if str(text).lower() in ("", "none") else float(text)


def _setting(default: Any, help: str, parse: Callable[[str], Any], choices: Sequence[str] | None = None) -> Any:  # noqa: A002
    return dataclasses.field(default=default, metadata={"help": help, "parse": parse, "choices": choices})


@dataclasses.dataclass(frozen=True)
class MeasureSettings:
    """The settings of the measures beyond the trace; each measure reads the fields its `MeasureSpec.settings` names
    and records them with its value. The command line offers each field as ``--field-name``; the callback takes them
    as keyword arguments. Every value is checked when the settings are made."""

    eigenvalue_matrix: str = _setting(
        "fisher",
        "Matrix of top_eigenvalue (default: fisher, whose trace is the paper's measure).",
        str,
        SPECTRUM_MATRICES,
    )
    top_k: int = _setting(1, "How many of the largest eigenvalues top_eigenvalue finds (default: 1).", int)
    eigenvalue_product: str = _setting(
        "auto",
        "How top_eigenvalue forms its matrix-vector products: exact (double backward, whole parameters on one "
        "process), finite_difference ((g(w+hv) - g(w-hv))/2h through the engine's own backward: works under FSDP2 "
        "and ZeRO-3 without gathering the model, and with fused attention), or auto (default: finite_difference "
        "when the parameters are sharded, exact otherwise).",
        str,
        CURVATURE_PRODUCTS,
    )
    eigenvalue_fd_step: float | None = _setting(
        None,
        "The step h of top_eigenvalue's finite differences, along a unit vector; none (default): 3e-4 for float32 "
        "and float64 parameters, the best step measured along the top eigenvector on two Llamas (1e-4 to 4e-4 "
        "relative error against the exact product; benchmarks/finite_difference_step.py).",
        _optional_float,
    )
    sam_rho: float = _setting(DEFAULT_SAM_RHO, "Radius of sam_sharpness (default: 0.05).", float)
    sam_batch_size: int | None = _setting(
        None, "Contexts per ascent step of sam_sharpness, as the training batch (default: --batch-size).", int
    )
    noise_sigmas: tuple[float, ...] = _setting(
        (0.01,),
        "Comma-separated noise levels of weight_noise (default: 0.01); the card's value is the last one's.",
        _floats,
    )
    noise_scale: str = _setting(
        "rms", "weight_noise: rms (sigma times each tensor's RMS; default) or absolute noise.", str, NOISE_SCALES
    )
    noise_draws: int = _setting(8, "Antithetic noise pairs per sigma of weight_noise (default: 8).", int)
    quantization_bits: tuple[int, ...] = _setting(
        (8, 4),
        "Comma-separated bit widths of quantization (default: 8,4); the card's value is the last one's.",
        _ints,
    )
    quantization_group_size: int | None = _setting(
        None, "Input entries per scale of quantization; none (default): one scale per output channel.", _optional_int
    )
    critical_rtol: float = _setting(
        1e-3, "Relative precision of critical_sharpness's line search (default: 1e-3).", float
    )
    critical_direction: str = _setting(
        "optimizer",
        "The line of critical_sharpness: optimizer (default: the optimizer's next update in training, the negative "
        "gradient where there is no optimizer, as on the command line) or gradient_descent (the negative gradient; "
        "the one that works under DeepSpeed, whose optimizer's update cannot be proposed and undone).",
        str,
        CRITICAL_DIRECTIONS,
    )
    critical_batch_size: int | None = _setting(
        None, "Contexts per line search of critical_sharpness (default: --batch-size); the error is over them.", int
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "noise_sigmas", _as_tuple(self.noise_sigmas))
        object.__setattr__(self, "quantization_bits", _as_tuple(self.quantization_bits))
        for item in dataclasses.fields(self):
            choices = item.metadata.get("choices")
            if choices and getattr(self, item.name) not in choices:
                raise ValueError(f"{item.name}={getattr(self, item.name)!r}: choose one of {list(choices)}.")
        for name in ("top_k", "noise_draws"):
            _check_count(name, getattr(self, name))
        for name in ("sam_batch_size", "quantization_group_size", "critical_batch_size"):
            if getattr(self, name) is not None:
                _check_count(name, getattr(self, name))
        step = self.eigenvalue_fd_step
        if step is not None and not (_is_number(step) and math.isfinite(step) and step > 0):
            raise ValueError(f"eigenvalue_fd_step must be a finite number > 0 (got {step!r}).")
        for name in ("sam_rho", "critical_rtol"):
            value = getattr(self, name)
            if not (_is_number(value) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0 (got {value!r}).")
        if not self.noise_sigmas or not all(_is_number(s) and math.isfinite(s) and s > 0 for s in self.noise_sigmas):
            raise ValueError(f"noise_sigmas must be one or more finite numbers > 0 (got {self.noise_sigmas!r}).")
        if not self.quantization_bits or not all(
            isinstance(b, Integral) and not isinstance(b, bool) and 2 <= b <= 8 for b in self.quantization_bits
        ):
            raise ValueError(
                f"quantization_bits must be one or more whole numbers from 2 to 8 (got {self.quantization_bits!r})."
            )

    @classmethod
    def from_namespace(cls, namespace: Any) -> MeasureSettings:
        """The settings of parsed command-line flags (attributes of the fields' names)."""
        return cls(
            **{f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls) if hasattr(namespace, f.name)}
        )


def _as_tuple(value: Any) -> tuple:
    return (value,) if isinstance(value, (int, float)) else tuple(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _check_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise ValueError(f"{name} must be a whole number >= 1 (got {value!r}).")


# -------------------------------------------------------------------- the table


@dataclasses.dataclass(frozen=True)
class MeasureSpec:
    """One measure beyond the trace.

    Attributes:
        name: its name in ``also_measure``, ``--measures`` and the card's ``flatness:`` block.
        help: one line for the command line's help.
        compute: ``"module:function"``; the function takes ``(model, contexts, *, n_contexts, settings, seed,
            batch_size, causal, optimizer)`` and returns the measure's result (a dataclass with ``to_dict``).
        record: the result -> the card's record: ``value`` (and ``stderr`` where the measure has one), its settings.
        settings: the `MeasureSettings` fields it reads.
        metric, stderr_metric: the keys of its value and standard error in the trainer's logs.
        result_key: its key in ``hf-flatbias trace``'s JSON output and in `FlatnessRecord.measures`.
        title: its row label on the card and in ``hf-flatbias card``; ``column``: its column in ``compare``.
        numbers, integers, lists: the record's keys read back as numbers, whole numbers, lists of numbers.
        describe: the record's settings in a few words (a ``compare`` cell); ``details``: in a few more (the card).
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

    def function(self) -> Callable[..., Any]:
        module, name = self.compute.split(":")
        return getattr(importlib.import_module(module), name)


def _finite(value: Any) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def _drop_none(record: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in record.items() if value is not None}


def _join(*parts: str | None) -> str:
    return ", ".join(part for part in parts if part)


def _eigenvalue_record(result: Any) -> dict[str, Any]:
    return _drop_none(
        {
            "value": float(result.eigenvalues[0]),
            "residual": float(result.residuals[0]),
            "matrix": result.matrix,
            "k": len(result.eigenvalues),
            "eigenvalues": [float(v) for v in result.eigenvalues] if len(result.eigenvalues) > 1 else None,
            "n_contexts": int(result.n_contexts),
            "n_matvecs": int(result.n_matvecs),
            "product": getattr(result, "product", None),
            "seconds": float(result.seconds),
        }
    )


def _sam_record(result: Any) -> dict[str, Any]:
    return _drop_none(
        {
            "value": float(result.mean),
            "stderr": _finite(result.stderr),
            "rho": float(result.rho),
            "adaptive": bool(result.adaptive),
            "batch_size": int(result.batch_size),
            "n_contexts": int(result.n_contexts),
            "seconds": float(result.seconds),
        }
    )


def _noise_record(result: Any) -> dict[str, Any]:
    headline = result.points[-1]
    several = len(result.points) > 1
    return _drop_none(
        {
            "value": float(headline.mean),
            "stderr": _finite(headline.stderr),
            "sigma": float(headline.sigma),
            "scale": result.scale,
            "antithetic": bool(result.antithetic),
            "n_draws": int(result.n_draws),
            "seed": int(result.seed),
            "base_loss": float(result.base_loss),
            "n_contexts": int(result.n_contexts),
            "seconds": float(result.seconds),
            "sigmas": [float(p.sigma) for p in result.points] if several else None,
            "means": [float(p.mean) for p in result.points] if several else None,
            "stderrs": [float(p.stderr) for p in result.points] if several else None,
        }
    )


def _quantization_record(result: Any) -> dict[str, Any]:
    headline = result.points[-1]
    several = len(result.points) > 1
    return _drop_none(
        {
            "value": float(headline.loss_increase),
            "stderr": _finite(headline.stderr),
            "bits": int(headline.bits),
            "granularity": result.granularity,
            "group_size": result.group_size,
            "include_embeddings": bool(result.include_embeddings),
            "relative_weight_error": float(headline.relative_weight_error),
            "base_loss": float(result.base_loss),
            "n_contexts": int(result.n_contexts),
            "seconds": float(result.seconds),
            "bit_widths": [int(p.bits) for p in result.points] if several else None,
            "increases": [float(p.loss_increase) for p in result.points] if several else None,
            "stderrs": [float(p.stderr) for p in result.points] if several else None,
        }
    )


def _critical_record(result: Any) -> dict[str, Any]:
    return _drop_none(
        {
            "value": float(result.mean),
            "stderr": _finite(result.stderr),
            "direction": result.direction,
            "learning_rate": _finite(result.learning_rate) if result.learning_rate is not None else None,
            "rtol": float(result.rtol),
            "batch_size": int(result.batch_size),
            "n_batches": int(result.n_batches),
            "n_converged": int(result.n_converged),
            "n_forward_passes": int(result.n_forward_passes),
            "n_contexts": int(result.n_contexts),
            "seconds": float(result.seconds),
        }
    )


MEASURE_TABLE: dict[str, MeasureSpec] = {
    spec.name: spec
    for spec in (
        MeasureSpec(
            name="top_eigenvalue",
            help="the largest eigenvalue(s) of the Fisher or Hessian by Lanczos",
            compute="hf_flatbias.flatness.beyond_trace:top_eigenvalue",
            record=_eigenvalue_record,
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
            name="sam_sharpness",
            help="SAM's L(w + rho g/||g||) - L(w) per batch",
            compute="hf_flatbias.flatness.beyond_trace:sam_sharpness",
            record=_sam_record,
            settings=("sam_rho", "sam_batch_size"),
            metric=SAM_SHARPNESS_METRIC,
            stderr_metric=SAM_SHARPNESS_STDERR_METRIC,
            result_key="sam_sharpness",
            title=lambda record: "SAM sharpness L(w+e) - L(w) ± standard error",
            column="SAM sharpness ± stderr",
            numbers=("value", "stderr", "rho", "eta", "batch_size", "n_contexts", "seconds", "step"),
            integers=("batch_size", "n_contexts", "step"),
            describe=lambda record: f"ρ={record.get('rho', math.nan):g}",
            details=lambda record: _join(
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
            record=_noise_record,
            settings=("noise_sigmas", "noise_scale", "noise_draws"),
            metric="flatness/weight_noise",
            stderr_metric="flatness/weight_noise_stderr",
            result_key="weight_noise",
            title=lambda record: "Weight-noise loss increase ± standard error",
            column="weight noise ΔL ± stderr",
            numbers=("value", "stderr", "sigma", "n_draws", "seed", "base_loss", "n_contexts", "seconds", "step"),
            integers=("n_draws", "seed", "n_contexts", "step"),
            lists=("sigmas", "means", "stderrs"),
            describe=lambda record: f"σ={record.get('sigma', math.nan):g} {record.get('scale', '?')}",
            details=lambda record: _join(
                f"sigma = {record['sigma']:g}" if "sigma" in record else None,
                f"{record['scale']} noise" if "scale" in record else None,
                f"{record['n_draws']} {'antithetic ' if record.get('antithetic') else ''}draws"
                if "n_draws" in record
                else None,
            ),
        ),
        MeasureSpec(
            name="quantization",
            help="the loss increase after round-to-nearest weight quantization (8 and 4 bits by default)",
            compute="hf_flatbias.flatness.beyond_trace:quantization",
            record=_quantization_record,
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
            integers=("bits", "group_size", "n_contexts", "step"),
            lists=("bit_widths", "increases", "stderrs"),
            describe=lambda record: f"{record.get('bits', '?')} bit, {record.get('granularity', '?')}".replace(
                "_", "-"
            ),
            details=lambda record: _join(
                f"{record['bits']} bit" if "bits" in record else None,
                str(record.get("granularity", "")).replace("_", "-") or None,
                f"groups of {record['group_size']}" if "group_size" in record else None,
                "embeddings kept" if record.get("include_embeddings") is False else None,
            ),
        ),
        MeasureSpec(
            name="critical_sharpness",
            help="2/eta_c along the next update by a forward-only line search (in training: the optimizer's update, "
            "nothing applied; on the command line, with no optimizer: the negative gradient, plain gradient descent)",
            compute="hf_flatbias.flatness.beyond_trace:critical_sharpness",
            record=_critical_record,
            settings=("critical_rtol", "critical_direction", "critical_batch_size"),
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
            details=lambda record: _join(
                f"along {record['direction']}'s next update" if "direction" in record else None,
                f"batches of {record['batch_size']}" if "batch_size" in record else None,
                f"{record['n_converged']}/{record['n_batches']} searches converged"
                if "n_converged" in record and "n_batches" in record
                else None,
            ),
        ),
    )
}
"""Every measure beyond the trace, by name, in the order tables list them."""

EXTRA_MEASURES = tuple(MEASURE_TABLE)
"""The names of the measures beyond the trace: what ``also_measure`` may name."""

MEASURES = ("trace", *EXTRA_MEASURES)
"""Every measure a checkpoint can be given: the Hessian (Fisher) trace and those of `MEASURE_TABLE`."""


def measure_record(name: str, result: Any, step: int | None = None) -> dict[str, Any]:
    """The card's record of measure ``name``: its value, standard error and settings, and the training step."""
    record = MEASURE_TABLE[name].record(result)
    if step is not None:
        record["step"] = int(step)
    return record


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
    "format_measure_value",
    "measure_record",
]
