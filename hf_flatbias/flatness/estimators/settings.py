"""The settings of a trace estimate, checked once when they are made."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...constants import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_ESTIMATOR,
    DEFAULT_OUTPUT_PROBE,
    ESTIMATORS,
    HUTCHINSON_PROBES,
    MAX_N_DRAWS,
    OUTPUT_PROBED_ESTIMATORS,
    OUTPUT_PROBES,
    PROBED_ESTIMATORS,
    RECOMMENDED_N_DRAWS,
)
from ..groups import GroupOf


@dataclass(frozen=True)
class TraceSettings:
    """What decides the numbers of a trace estimate (see `hf_flatbias.flatness.estimate_hessian_trace`).

    Invalid values raise `ValueError` here, before any data is read or any model run.
    """

    n_draws: int = field(
        default=RECOMMENDED_N_DRAWS,
        metadata={"help": "Draws per context (probes for hutchinson, Hessian products per batch for hutchpp)."},
    )
    estimator: str = field(default=DEFAULT_ESTIMATOR, metadata={"help": f"One of {', '.join(ESTIMATORS)}."})
    seed: int = field(default=0, metadata={"help": "The draws of context i depend only on (seed, i)."})
    batch_size: int | str = field(
        default=DEFAULT_BATCH_SIZE,
        metadata={"help": "Contexts per forward, or 'auto' to fit the free memory (not read by naive)."},
    )
    exact_output_expectation: bool = field(
        default=True,
        metadata={"help": "per_sample: take the output layer's own term in exact expectation over the label."},
    )
    probe: str = field(
        default="rademacher",
        metadata={"help": f"Probe distribution of hutchinson and hutchpp: {', '.join(HUTCHINSON_PROBES)}."},
    )
    output_probe: str = field(
        default=DEFAULT_OUTPUT_PROBE,
        metadata={"help": "per_sample and naive: the cotangent at the logits per draw, 'rademacher' (default: random "
                  "signs with the covariance diag(p) - pp^T, less draw noise on every trained model measured) or "
                  "'label' (a sampled label, e_y - p, the paper's draw); both unbiased for the same trace."},
    )  # fmt: skip
    by_group: bool | GroupOf = field(
        default=False,
        metadata={"help": "Also split the trace by parameter group: True for the default groups, or a function from "
                  "parameter name to group name (per-context estimators only)."},
    )  # fmt: skip
    positions_per_sequence: int = field(
        default=1,
        metadata={"help": "per_sample on causal LMs: up to this many labelled positions of one row share a forward "
                  "and one backward per draw, their cotangents independent (the cross terms have mean zero); each "
                  "row is then one sampling unit, its value the mean trace over its positions."},
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"estimator={self.estimator!r} is not supported; choose one of {list(ESTIMATORS)}.")
        if self.probe not in HUTCHINSON_PROBES:
            raise ValueError(f"probe={self.probe!r} is not supported; choose one of {list(HUTCHINSON_PROBES)}.")
        if self.probe != "rademacher" and self.estimator not in PROBED_ESTIMATORS:
            probed = " or ".join(repr(name) for name in PROBED_ESTIMATORS)
            raise ValueError(
                f"probe={self.probe!r} applies to estimator={probed} only (got estimator={self.estimator!r})."
            )
        if self.output_probe not in OUTPUT_PROBES:
            raise ValueError(
                f"output_probe={self.output_probe!r} is not supported; choose one of {list(OUTPUT_PROBES)}."
            )
        if self.output_probe != DEFAULT_OUTPUT_PROBE and self.estimator not in OUTPUT_PROBED_ESTIMATORS:
            readers = " or ".join(repr(name) for name in OUTPUT_PROBED_ESTIMATORS)
            raise ValueError(
                f"output_probe={self.output_probe!r} applies to estimator={readers} only (got "
                f"estimator={self.estimator!r})."
            )
        if not isinstance(self.n_draws, int) or self.n_draws < 1:
            raise ValueError(
                f"n_draws must be an integer >= 1 (got {self.n_draws!r}); {RECOMMENDED_N_DRAWS} is usually best."
            )
        if self.n_draws > MAX_N_DRAWS:  # the draws of a batch are allocated at once: 10^9 of them grew past 14 GB
            raise ValueError(
                f"n_draws={self.n_draws} is more than {MAX_N_DRAWS:,}; {RECOMMENDED_N_DRAWS} is usually best."
            )
        if self.batch_size != "auto" and (not isinstance(self.batch_size, int) or self.batch_size < 1):
            raise ValueError(f"batch_size must be an integer >= 1 or 'auto' (got {self.batch_size!r}).")
        if isinstance(self.positions_per_sequence, bool) or not isinstance(self.positions_per_sequence, int):
            raise ValueError(f"positions_per_sequence must be an integer >= 1 (got {self.positions_per_sequence!r}).")
        if self.positions_per_sequence < 1:
            raise ValueError(f"positions_per_sequence must be >= 1 (got {self.positions_per_sequence}).")
        if self.positions_per_sequence > 1 and self.estimator != "per_sample":
            raise ValueError(
                f"positions_per_sequence={self.positions_per_sequence} is read by estimator='per_sample' only (got "
                f"estimator={self.estimator!r}); use estimator='per_sample' or positions_per_sequence=1."
            )
