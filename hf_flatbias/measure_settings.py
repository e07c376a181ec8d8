"""The settings of the measures beyond the trace (`MeasureSettings`), one field per setting with its help, its
command-line parser and its check; `hf_flatbias.measures.MEASURE_TABLE` names the fields each measure reads.

Kept free of torch and transformers, as the table is: the command line builds its flags from these fields.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from numbers import Integral, Real
from pathlib import Path
from typing import Any

from .argparsing import number, parsed_as, whole_number
from .constants import (
    CRITICAL_DIRECTIONS,
    CURVATURE_PRODUCTS,
    DEFAULT_SAM_RHO,
    FORGETTING_OPTIMIZERS,
    MAX_N_DRAWS,
    NOISE_SCALES,
    SPECTRUM_MATRICES,
)

QUANTIZATION_BITS = (2, 8)
"""The bit widths round-to-nearest quantization supports, fewest and most (`hf_flatbias.flatness.quantization`)."""

MAX_FORGETTING_STEPS = 100_000
"""The most optimizer steps forgetting fine-tunes for: 2,000x its default of 50, a long fine-tuning run; past it a
typo (10^9) would run for days without a line of output."""

MAX_NOISE_SIGMA = 10.0
"""The largest weight-noise level: noise ten times each tensor's RMS (or of 10 per weight, absolute) has replaced
the model, and far above it the perturbed loss overflows to nan; the robustness studies use 1e-3 to 1e-1."""

BOUNDED_COUNTS = {
    # the draws allocate as the trace's do (a 10^9 draws' buffer is 8 GB), so they share its bound
    "noise_draws": (MAX_N_DRAWS, "the default is 8"),
    "forgetting_trace_draws": (MAX_N_DRAWS, "2 draws per context is usually best"),
    "forgetting_steps": (MAX_FORGETTING_STEPS, "the default is 50"),
}
"""The counts whose size is the cost of the measurement, with their largest sane value and a hint."""


def _floats(text: str) -> tuple[float, ...]:
    return parsed_as(
        text,
        lambda text: tuple(float(part) for part in str(text).split(",") if part.strip()),
        "comma-separated numbers such as 0.01,0.05",
    )


def _ints(text: str) -> tuple[int, ...]:
    return parsed_as(
        text,
        lambda text: tuple(int(part) for part in str(text).split(",") if part.strip()),
        "comma-separated whole numbers such as 8,4",
    )


def _optional_int(text: str) -> int | None:
    return None if str(text).lower() in ("", "none") else parsed_as(text, int, "a whole number or none")


def _optional_float(text: str) -> float | None:
    return None if str(text).lower() in ("", "none") else parsed_as(text, float, "a number or none")


def _optional_text(text: str) -> str | None:
    return None if str(text).lower() in ("", "none") else str(text)


def _setting(default: Any, help: str, parse: Callable[[str], Any], choices: Sequence[str] | None = None) -> Any:  # noqa: A002
    return dataclasses.field(default=default, metadata={"help": help, "parse": parse, "choices": choices})


@dataclasses.dataclass(frozen=True)
class MeasureSettings:
    """The settings of the measures beyond the trace; each measure reads the fields its `MeasureSpec.settings` names
    and records them with its value. The command line offers each field as ``--field-name``; the callback takes them
    as keyword arguments. Every value is checked when the settings are made."""

    eigenvalue_matrix: str = _setting(
        "fisher",
        "Matrix of top_eigenvalue (default: fisher, whose trace is the paper's measure); hessian; or "
        "adam_preconditioned, P^-1/2 H P^-1/2 with P = sqrt(v_hat) + eps from the Trainer's AdamW (the matrix Adam's "
        "stability threshold 38/lr bounds; measured in training only).",
        str,
        SPECTRUM_MATRICES,
    )
    top_k: int = _setting(1, "How many of the largest eigenvalues top_eigenvalue finds (default: 1).", whole_number)
    power_law_k: int = _setting(
        16,
        "How many of the largest eigenvalues spectrum_shape fits its power law to (default: 16; at least 3), of "
        "--eigenvalue-matrix by the same products.",
        whole_number,
    )
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
    sam_rho: float = _setting(DEFAULT_SAM_RHO, "Radius of sam_sharpness (default: 0.05).", number)
    sam_batch_size: int | None = _setting(
        None, "Contexts per ascent step of sam_sharpness, as the training batch (default: --batch-size).", whole_number
    )
    noise_sigmas: tuple[float, ...] = _setting(
        (0.01,),
        "Comma-separated noise levels of weight_noise (default: 0.01); the card's value is the last one's.",
        _floats,
    )
    noise_scale: str = _setting(
        "rms", "weight_noise: rms (sigma times each tensor's RMS; default) or absolute noise.", str, NOISE_SCALES
    )
    noise_draws: int = _setting(8, "Antithetic noise pairs per sigma of weight_noise (default: 8).", whole_number)
    quantization_bits: tuple[int, ...] = _setting(
        (8, 4),
        "Comma-separated bit widths of quantization (default: 8,4); the card's value is the last one's.",
        _ints,
    )
    quantization_group_size: int | None = _setting(
        None, "Input entries per scale of quantization; none (default): one scale per output channel.", _optional_int
    )
    critical_rtol: float = _setting(
        1e-3, "Relative precision of critical_sharpness's line search (default: 1e-3).", number
    )
    critical_direction: str = _setting(
        "optimizer",
        "The line of critical_sharpness: optimizer (default: the optimizer's next update in training, the negative "
        "gradient where there is no optimizer, as on the command line; under DeepSpeed ZeRO-1/2/3 the ZeRO "
        "optimizer's update) or gradient_descent (the negative gradient; also where the update cannot be proposed: "
        "an offloaded ZeRO optimizer).",
        str,
        CRITICAL_DIRECTIONS,
    )
    critical_batch_size: int | None = _setting(
        None,
        "Contexts per line search of critical_sharpness (default: --batch-size); the error is over them.",
        whole_number,
    )
    critical_max_grad_norm: float | None = _setting(
        None,
        "Global gradient norm the batch's gradient is clipped to before the optimizer proposes its update, as the "
        "Trainer clips before its step (default in training: the Trainer's max_grad_norm; 0: no clipping). Under "
        "DeepSpeed the engine's own gradient_clipping applies instead.",
        _optional_float,
    )
    forgetting_task: str | None = _setting(
        None,
        "The downstream task forgetting fine-tunes on: a GLUE classification task (sst2 works offline through its "
        "stand-in; the others need the Hub) or a data file or save_to_disk folder of rows holding input_ids (or "
        "text) and an integer class (a synthetic language's task columns, say); write ./NAME for a folder named as "
        "a GLUE task. Required by forgetting and relative_critical_sharpness (whose direction is a fresh "
        "--forgetting-optimizer's first step on a batch of its rows).",
        _optional_text,
    )
    forgetting_label_column: str = _setting(
        "label", "The class column of --forgetting-task's rows (default: label; task_a... for synthetic data).", str
    )
    forgetting_steps: int = _setting(50, "Optimizer steps of forgetting's fine-tuning (default: 50).", whole_number)
    forgetting_learning_rate: float = _setting(
        2e-5, "Learning rate of forgetting's fine-tuning, constant (default: 2e-5, BERT's GLUE rate).", number
    )
    forgetting_batch_size: int = _setting(
        8, "Task rows per step of forgetting's fine-tuning (default: 8).", whole_number
    )
    forgetting_optimizer: str = _setting(
        "adamw", "Optimizer of forgetting's fine-tuning: adamw (default) or sgd.", str, FORGETTING_OPTIMIZERS
    )
    forgetting_train_rows: int = _setting(
        1000,
        "Task rows fine-tuned on, the same ones drawn by --seed for every checkpoint (default: 1000).",
        whole_number,
    )
    forgetting_eval_rows: int = _setting(
        500, "Rows of the task's validation split the accuracy is measured on (default: 500).", whole_number
    )
    forgetting_trace_draws: int | None = _setting(
        None,
        "Also the Fisher trace of the pre-training loss before and after fine-tuning, at this many draws per context "
        "(per_sample estimator); none (default): the loss only.",
        _optional_int,
    )
    alignment_column: str | None = _setting(
        None,
        "The column of the rows naming each row's data source, whose per-source mean gradients gradient_alignment "
        "compares (task_a, the sentence type, for the synthetic languages). Required by gradient_alignment.",
        _optional_text,
    )
    alignment_blocks: int = _setting(
        8,
        "Blocks each source's contexts are split into for gradient_alignment's jackknife error (default: 8; at "
        "least 2); one summed gradient per block is held.",
        whole_number,
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "noise_sigmas", _as_tuple(self.noise_sigmas))
        object.__setattr__(self, "quantization_bits", _as_tuple(self.quantization_bits))
        for item in dataclasses.fields(self):
            choices = item.metadata.get("choices")
            if choices and getattr(self, item.name) not in choices:
                raise ValueError(f"{item.name}={getattr(self, item.name)!r}: choose one of {list(choices)}.")
        for name in (
            "top_k",
            "noise_draws",
            "forgetting_steps",
            "forgetting_batch_size",
            "forgetting_train_rows",
            "forgetting_eval_rows",
        ):
            _check_count(name, getattr(self, name))
        for name in ("sam_batch_size", "quantization_group_size", "critical_batch_size", "forgetting_trace_draws"):
            if getattr(self, name) is not None:
                _check_count(name, getattr(self, name))
        _check_count("power_law_k", self.power_law_k)
        _check_count("alignment_blocks", self.alignment_blocks)
        if self.alignment_blocks < 2:  # one block per source leaves nothing to drop
            raise ValueError(f"alignment_blocks must be at least 2 (got {self.alignment_blocks!r}); e.g. 8.")
        if self.alignment_column is not None and (
            not isinstance(self.alignment_column, str) or not self.alignment_column.strip()
        ):
            raise ValueError(f"alignment_column must name a column (got {self.alignment_column!r}); e.g. task_a.")
        if self.power_law_k < 3:  # two points fit any line exactly: no error, no shape
            raise ValueError(f"power_law_k must be at least 3 (got {self.power_law_k!r}); e.g. power_law_k=16.")
        for name, (most, hint) in BOUNDED_COUNTS.items():
            value = getattr(self, name)
            if value is not None and value > most:  # checked when the settings are made, before anything loads
                raise ValueError(f"{name}={value} is outside the sane range 1..{most:,} ({hint}).")
        clip = self.critical_max_grad_norm
        if clip is not None and not (is_number(clip) and math.isfinite(clip) and clip >= 0):
            raise ValueError(f"critical_max_grad_norm must be a finite number >= 0, 0 for no clipping (got {clip!r}).")
        step = self.eigenvalue_fd_step
        if step is not None and not (is_number(step) and math.isfinite(step) and step > 0):
            raise ValueError(f"eigenvalue_fd_step must be a finite number > 0 (got {step!r}).")
        for name in ("sam_rho", "critical_rtol", "forgetting_learning_rate"):
            value = getattr(self, name)
            if not (is_number(value) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0 (got {value!r}).")
        if not self.noise_sigmas or not all(is_number(s) and math.isfinite(s) and s > 0 for s in self.noise_sigmas):
            raise ValueError(f"noise_sigmas must be one or more finite numbers > 0 (got {self.noise_sigmas!r}).")
        if max(self.noise_sigmas) > MAX_NOISE_SIGMA:
            shown = ", ".join(f"{sigma:g}" for sigma in self.noise_sigmas)
            raise ValueError(
                f"noise_sigmas=({shown}) is outside the sane range (0, {MAX_NOISE_SIGMA:g}]: noise that large replaces "
                "the weights (the robustness studies use 0.001 to 0.1)."
            )
        fewest, most = QUANTIZATION_BITS
        if not self.quantization_bits or not all(
            isinstance(b, Integral) and not isinstance(b, bool) and fewest <= b <= most for b in self.quantization_bits
        ):
            raise ValueError(
                f"quantization_bits must be one or more whole numbers from {fewest} to {most} (got "
                f"{self.quantization_bits!r})."
            )

        object.__setattr__(self, "forgetting_task", checked_forgetting_task(self.forgetting_task))
        if not isinstance(self.forgetting_label_column, str) or not self.forgetting_label_column:
            raise ValueError(
                f"forgetting_label_column must name a column (got {self.forgetting_label_column!r}); e.g. label."
            )

    @classmethod
    def from_namespace(cls, namespace: Any) -> MeasureSettings:
        """The settings of parsed command-line flags (attributes of the fields' names)."""
        return cls(
            **{f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls) if hasattr(namespace, f.name)}
        )


def _as_tuple(value: Any) -> tuple:
    return (value,) if isinstance(value, (int, float)) else tuple(value)


def is_number(value: Any) -> bool:
    """Whether ``value`` is a real number: True and False are ints to Python, never a radius, a weight or a count."""
    return isinstance(value, Real) and not isinstance(value, bool)


def _check_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise ValueError(f"{name} must be a whole number >= 1 (got {value!r}).")


def checked_forgetting_task(source: Any) -> str | None:
    """``forgetting_task`` checked without reading it: ``None``, a GLUE classification task (returned by its canonical
    name, ``SST-2`` -> ``sst2``) or a file or folder that exists; `ValueError` otherwise."""
    from .glue.tasks import GLUE_TASKS

    if source is None:
        return None
    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"forgetting_task must be a GLUE task name or a path (got {source!r}); e.g. sst2.")
    key = source.strip().lower().replace("-", "")
    if key in GLUE_TASKS:
        if GLUE_TASKS[key].is_regression:
            classification = [name for name, task in GLUE_TASKS.items() if not task.is_regression]
            raise ValueError(
                f"forgetting_task={source!r} is a regression task; forgetting reports an accuracy: choose one of "
                f"{', '.join(classification)}."
            )
        return key
    if not Path(source).exists():
        raise ValueError(
            f"forgetting_task={source!r} is neither a GLUE task ({', '.join(GLUE_TASKS)}) nor an existing file or "
            "folder of labelled rows."
        )
    return source


__all__ = ["MAX_FORGETTING_STEPS", "MAX_NOISE_SIGMA", "QUANTIZATION_BITS", "MeasureSettings", "checked_forgetting_task"]
