"""The settings of `HessianTraceCallback`, checked when the callback is made rather than at its first measurement,
which may come hours into training."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from numbers import Integral
from typing import Any

from ..constants import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_ESTIMATOR,
    DEFAULT_SAM_RHO,
    ESTIMATORS,
    MAX_N_CONTEXTS,
    MAX_N_DRAWS,
    RECOMMENDED_N_DRAWS,
    SPECTRUM_MATRICES,
)
from ..measure_settings import is_number
from ..measures import EXTRA_MEASURES, MEASURE_TABLE, MeasureSettings, check_required_settings


@dataclass(frozen=True)
class TraceCallbackConfig:
    """What `HessianTraceCallback` measures and when; its keyword arguments are these fields.

    Every value is checked when the config is made; a wrong one raises `ValueError` with one line saying what to pass.
    """

    n_contexts: int = field(
        default=256, metadata={"help": "Contexts per measurement (rows are reused with other positions if fewer)."}
    )
    n_draws: int = field(
        default=RECOMMENDED_N_DRAWS,
        metadata={"help": "Draws of y per context; 2 measured a better error per second than the paper's 50."},
    )
    every_n_steps: int | None = field(
        default=None, metadata={"help": "Also measure every that many optimizer steps; None: only on evaluation."}
    )
    on_evaluate: bool = field(default=True, metadata={"help": "Measure after each evaluation."})
    measure_at_end: bool = field(
        default=True,
        metadata={"help": "Measure at the end of training unless the latest measurement was on those weights."},
    )
    estimator: str = field(
        default=DEFAULT_ESTIMATOR, metadata={"help": f"The trace estimator, one of {', '.join(ESTIMATORS)}."}
    )
    seed: int = field(default=0, metadata={"help": "Fixes both the contexts and the draws."})
    batch_size: int = field(
        default=DEFAULT_BATCH_SIZE,
        metadata={"help": "Contexts per forward; also the smallest measurement max_overhead allows."},
    )
    mask_token_id: int | None = field(
        default=None, metadata={"help": "The mask id of a masked LM; from the trainer's processing_class when None."}
    )
    by_group: bool = field(
        default=False, metadata={"help": "Also split the trace by parameter group and log each group's trace."}
    )
    also_measure: tuple[str, ...] = field(
        default=(),
        metadata={"help": f"Measures taken with the trace on the same contexts: {', '.join(EXTRA_MEASURES)}."},
    )
    eigenvalue_matrix: str = field(
        default="fisher", metadata={"help": f"The matrix of top_eigenvalue: {' or '.join(SPECTRUM_MATRICES)}."}
    )
    sam_rho: float = field(default=DEFAULT_SAM_RHO, metadata={"help": "The radius of sam_sharpness."})
    measure_settings: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": "Settings of the also_measure measures by the names of hf_flatbias.measures.MeasureSettings "
            "(noise_sigmas, noise_scale, noise_draws, quantization_bits, quantization_group_size, critical_rtol, "
            "critical_batch_size, top_k, power_law_k, alignment_column, alignment_blocks, sam_batch_size, "
            "forgetting_task, forgetting_steps and the other forgetting_* settings)."
        },
    )
    max_overhead: float | None = field(
        default=0.05,
        metadata={"help": "The share of the training time measuring may take; None measures every context always."},
    )
    full_final_measurement: bool = field(
        default=True,
        metadata={"help": "Take the final measurement (the one the model card reports) on all n_contexts contexts "
                  "whatever max_overhead leaves: as precise as a measurement without a budget, at the cost of one "
                  "full estimate on top of the budget. Measured at 256 contexts, 2 draws: 9.0 training steps of 16 "
                  "sequences on a 15M BERT at 32 tokens (8.6% of a 100-step run, the whole callback 10%), 10.4 steps "
                  "at 128 tokens; about 20 steps on a 110M BERT at 32 tokens (projected; benchmarks/RESULTS.md). "
                  "False: sized by the budget like the interim measurements."},
    )  # fmt: skip

    def __post_init__(self) -> None:
        for name in ("n_contexts", "n_draws", "batch_size"):
            _check_int(name, getattr(self, name), minimum=1)
        for name, most in (("n_contexts", MAX_N_CONTEXTS), ("n_draws", MAX_N_DRAWS)):
            if getattr(self, name) > most:  # refused at construction, not when the first measurement allocates
                raise ValueError(f"{name}={getattr(self, name)} is more than {most:,}; pass at most {name}={most}.")
        _check_int("every_n_steps", self.every_n_steps, minimum=1, optional=True)
        _check_int("seed", self.seed)
        _check_int("mask_token_id", self.mask_token_id, minimum=0, optional=True)
        for name in ("on_evaluate", "measure_at_end", "by_group", "full_final_measurement"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False (got {getattr(self, name)!r}).")
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"estimator={self.estimator!r} is not one of {list(ESTIMATORS)}.")
        also_measure = (self.also_measure,) if isinstance(self.also_measure, str) else tuple(self.also_measure)
        unknown = [name for name in also_measure if name not in EXTRA_MEASURES]
        if unknown:
            raise ValueError(
                f"also_measure={list(also_measure)}: {unknown} unknown; choose from {list(EXTRA_MEASURES)}."
            )
        object.__setattr__(self, "also_measure", also_measure)
        if self.eigenvalue_matrix not in SPECTRUM_MATRICES:
            raise ValueError(f"eigenvalue_matrix={self.eigenvalue_matrix!r}; choose one of {list(SPECTRUM_MATRICES)}.")
        if not (is_number(self.sam_rho) and self.sam_rho > 0):
            raise ValueError(f"sam_rho must be a number > 0 (got {self.sam_rho!r}).")
        settings = dict(self.measure_settings or {})
        for name in ("eigenvalue_matrix", "sam_rho"):
            if name in settings:
                raise ValueError(f"measure_settings={{{name!r}: ...}}: pass {name}= to the callback itself.")
        known = {f.name for f in fields(MeasureSettings)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ValueError(f"measure_settings: {unknown} unknown; choose from {sorted(known)}.")
        for name in settings:  # a setting no requested measure reads would be ignored without a word
            owners = [spec.name for spec in MEASURE_TABLE.values() if name in spec.settings]
            if owners and not any(owner in self.also_measure for owner in owners):
                raise ValueError(
                    f"measure_settings: {name} is a setting of {' and '.join(owners)}, which also_measure does not "
                    f"name: add {owners[0]} to also_measure, or drop {name}."
                )
        object.__setattr__(self, "measure_settings", settings)
        check_required_settings(self.also_measure, self.settings())  # checks every value now
        if self.max_overhead is not None and not (is_number(self.max_overhead) and self.max_overhead > 0):
            raise ValueError(f"max_overhead must be a number > 0 or None for no budget (got {self.max_overhead!r}).")

    def settings(self) -> MeasureSettings:
        """The `MeasureSettings` of the measures beyond the trace."""
        return MeasureSettings(eigenvalue_matrix=self.eigenvalue_matrix, sam_rho=self.sam_rho, **self.measure_settings)


def _check_int(name: str, value: Any, *, minimum: int | None = None, optional: bool = False) -> None:
    if value is None and optional:
        return
    # bool is an int to Python, but True contexts or steps is a slip, not a count
    if isinstance(value, bool) or not isinstance(value, Integral) or (minimum is not None and value < minimum):
        whole = int(value) if is_number(value) and math.isfinite(value) else None
        example = whole if whole is not None and (minimum is None or whole >= minimum) else (minimum or 0)
        wanted = "a whole number" + ("" if minimum is None else f" >= {minimum}") + (" or None" if optional else "")
        raise ValueError(f"{name} must be {wanted} (got {value!r}); pass e.g. {name}={example}.")
