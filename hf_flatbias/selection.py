"""Checkpoint selection by flatness: among checkpoints whose validation loss is as good as the best, keep the flattest.

Liu et al. (2023) find that models with the same pre-training loss can transfer very differently and that the trace
of the Hessian of the pre-training loss tracks the difference: the flatter model transfers better. "Lowest
validation loss" therefore picks among near-ties by noise; this module picks among them by flatness instead.

The numerical core, [`select_flattest_checkpoint`], is a pure function over per-checkpoint records. Two front ends
use it: [`FlatnessCheckpointSelector`] (a `TrainerCallback` that records each evaluation and points
``state.best_model_checkpoint`` at the selection, so ``load_best_model_at_end`` loads it) and the ``hf-flatbias
select`` command (reads a run's ``trainer_state.json`` or a JSON file of records).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from .callbacks import TRACE_METRIC, TRACE_STDERR_METRIC

logger = logging.getLogger(__name__)

__all__ = [
    "CheckpointRecord",
    "CheckpointSelection",
    "FlatnessCheckpointSelector",
    "records_from_log_history",
    "select_flattest_checkpoint",
]

SELECTION_FILE = "flatness_selection.json"
# The keys HessianTraceCallback logs (and hf_flatbias.modelcard reads): one name for the trace across the package.


@dataclass(frozen=True)
class CheckpointRecord:
    """What selection needs to know about one checkpoint."""

    step: int
    eval_loss: float
    hessian_trace: float | None = None
    stderr: float | None = None
    path: str | None = None

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> CheckpointRecord:
        """From a dict with keys ``step``, ``eval_loss`` and optionally ``hessian_trace``, ``stderr``, ``path``."""
        missing = [key for key in ("step", "eval_loss") if key not in values]
        if missing:
            raise ValueError(
                f"checkpoint record {dict(values)!r} lacks {missing}; every record needs step and eval_loss."
            )

        def optional_float(key: str) -> float | None:
            return None if values.get(key) is None else float(values[key])

        return cls(
            step=int(values["step"]),
            eval_loss=float(values["eval_loss"]),
            hessian_trace=optional_float("hessian_trace"),
            stderr=optional_float("stderr"),
            path=values.get("path"),
        )


@dataclass(frozen=True)
class CheckpointSelection:
    """The outcome of [`select_flattest_checkpoint`]."""

    chosen: CheckpointRecord
    lowest_loss: CheckpointRecord
    candidates: tuple[CheckpointRecord, ...]
    loss_threshold: float
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "chosen": asdict(self.chosen),
            "lowest_loss": asdict(self.lowest_loss),
            "candidates": [asdict(record) for record in self.candidates],
            "loss_threshold": self.loss_threshold,
            "reason": self.reason,
        }


def select_flattest_checkpoint(
    records: Iterable[CheckpointRecord],
    *,
    loss_tolerance: float = 0.01,
    relative_tolerance: bool = False,
    trace_margin: float = 0.0,
) -> CheckpointSelection:
    """Among checkpoints whose ``eval_loss`` is within `loss_tolerance` of the lowest, choose the flattest.

    Args:
        records: One record per checkpoint (distinct steps). Records with a non-finite loss are ignored.
        loss_tolerance: How much worse than the lowest validation loss a checkpoint may be and still count as "the
            same loss": absolute (in nats) by default, or a fraction of the lowest loss with `relative_tolerance`.
        relative_tolerance: Read `loss_tolerance` as a fraction of the lowest loss.
        trace_margin: Trace estimates are noisy. Candidates whose trace exceeds the smallest by at most
            ``trace_margin`` combined standard errors (``sqrt(se_a**2 + se_b**2)``) count as equally flat, and the one
            with the lowest loss among them is chosen. 0 (default): the smallest estimate wins outright.

    Returns:
        A [`CheckpointSelection`]: the chosen record, the lowest-loss record, the candidates and why.

    Raises:
        ValueError: on no usable records, duplicate steps, a negative tolerance or margin, or when no candidate has a
            Hessian trace.
    """
    records = list(records)
    if loss_tolerance < 0 or not math.isfinite(loss_tolerance):
        raise ValueError(f"loss_tolerance must be a finite number >= 0 (got {loss_tolerance!r}).")
    if trace_margin < 0 or not math.isfinite(trace_margin):
        raise ValueError(f"trace_margin must be a finite number >= 0 (got {trace_margin!r}).")
    steps = [record.step for record in records]
    duplicates = sorted({step for step in steps if steps.count(step) > 1})
    if duplicates:
        raise ValueError(f"steps {duplicates} appear more than once; pass one record per checkpoint.")
    usable = [record for record in records if math.isfinite(record.eval_loss)]
    if not usable:
        raise ValueError("no checkpoint has a finite eval_loss; evaluate the checkpoints before selecting among them.")

    lowest_loss = min(usable, key=lambda record: (record.eval_loss, record.step))
    allowance = loss_tolerance * abs(lowest_loss.eval_loss) if relative_tolerance else loss_tolerance
    threshold = lowest_loss.eval_loss + allowance
    candidates = tuple(sorted((r for r in usable if r.eval_loss <= threshold), key=lambda r: r.step))
    measured = [r for r in candidates if r.hessian_trace is not None and math.isfinite(r.hessian_trace)]
    if not measured:
        raise ValueError(
            f"none of the {len(candidates)} checkpoints within the loss tolerance (steps "
            f"{[r.step for r in candidates]}) has a Hessian trace; estimate it (HessianTraceCallback or "
            "`hf-flatbias trace`) before selecting."
        )
    unmeasured = [r.step for r in candidates if r not in measured]
    if unmeasured:
        logger.warning("Checkpoints at steps %s are within the loss tolerance but have no trace; skipped.", unmeasured)

    flattest = min(measured, key=lambda r: (r.hessian_trace, r.eval_loss, r.step))
    if trace_margin > 0:
        tied = [
            r for r in measured if r.hessian_trace - flattest.hessian_trace <= trace_margin * _combined(r, flattest)
        ]
        chosen = min(tied, key=lambda r: (r.eval_loss, r.step))
    else:
        chosen = flattest
    reason = (
        f"{len(candidates)} checkpoint(s) have eval_loss <= {threshold:.6g} (lowest {lowest_loss.eval_loss:.6g} at "
        f"step {lowest_loss.step}); "
    )
    if chosen is flattest:
        reason += f"step {chosen.step} has the smallest Hessian trace ({chosen.hessian_trace:.6g}"
        reason += f" vs {lowest_loss.hessian_trace:.6g} at the lowest-loss step)" if lowest_loss.hessian_trace else ")"
    else:
        reason += (
            f"step {chosen.step} (trace {chosen.hessian_trace:.6g}) is within {trace_margin} standard error(s) of the "
            f"flattest, step {flattest.step} ({flattest.hessian_trace:.6g}), and has the lowest loss among those"
        )
    return CheckpointSelection(chosen, lowest_loss, candidates, threshold, reason + ".")


def _combined(a: CheckpointRecord, b: CheckpointRecord) -> float:
    return math.sqrt((a.stderr or 0.0) ** 2 + (b.stderr or 0.0) ** 2)


def records_from_log_history(
    log_history: Iterable[Mapping[str, Any]],
    *,
    loss_key: str = "eval_loss",
    trace_key: str = TRACE_METRIC,
    stderr_key: str = TRACE_STDERR_METRIC,
    checkpoint_dir: str | None = None,
) -> list[CheckpointRecord]:
    """Merge a Trainer ``log_history`` (as in ``trainer_state.json``) into one record per evaluated step.

    Loss and trace may be logged in separate entries of the same step. With `checkpoint_dir`, each record's ``path``
    is ``checkpoint_dir/checkpoint-<step>`` when that folder exists.
    """
    merged: dict[int, dict[str, Any]] = {}
    for entry in log_history:
        if "step" not in entry:
            continue
        step = int(entry["step"])
        for source_key, record_key in ((loss_key, "eval_loss"), (trace_key, "hessian_trace"), (stderr_key, "stderr")):
            if source_key in entry:
                merged.setdefault(step, {"step": step})[record_key] = entry[source_key]
    records = []
    for step, values in sorted(merged.items()):
        if "eval_loss" not in values:
            continue
        if checkpoint_dir is not None:
            folder = os.path.join(checkpoint_dir, f"checkpoint-{step}")
            values["path"] = folder if os.path.isdir(folder) else None
        records.append(CheckpointRecord.from_mapping(values))
    return records


TraceFunction = Callable[[Any], Any]


@dataclass
class FlatnessCheckpointSelector(TrainerCallback):
    """Trainer callback: make the flattest checkpoint within a loss tolerance the run's "best" checkpoint.

    After every evaluation it records the step's validation loss and Hessian trace; after every save it re-runs
    [`select_flattest_checkpoint`] over the saved checkpoints and sets ``state.best_model_checkpoint`` (and
    ``state.best_global_step``) to the choice, so ``load_best_model_at_end=True`` loads the flattest near-best
    checkpoint instead of the lowest-loss one. At the end of training it writes the selection to
    ``<output_dir>/flatness_selection.json``.

    Where the trace comes from, first found wins: a ``trace_metric`` entry logged at the step (what
    ``HessianTraceCallback`` logs on every evaluation, ``flatness/hessian_trace``), the same key in the evaluation
    metrics, or ``trace_fn(model)``, which returns an object with ``mean`` and ``stderr`` (such as a
    ``TraceEstimate``) or a ``(mean, stderr)`` pair.

    Use with ``save_total_limit=None``: the Trainer's checkpoint rotation protects the lowest-loss checkpoint only.
    """

    loss_tolerance: float = field(
        default=0.01, metadata={"help": "Absolute (or, with relative_tolerance, fractional) slack on the best loss."}
    )
    relative_tolerance: bool = field(default=False, metadata={"help": "Read loss_tolerance as a fraction."})
    trace_margin: float = field(
        default=0.0, metadata={"help": "Traces within this many combined standard errors count as equally flat."}
    )
    loss_metric: str = field(default="eval_loss", metadata={"help": "Evaluation metric holding the validation loss."})
    trace_metric: str = field(
        default=TRACE_METRIC, metadata={"help": "Logged (or evaluation) key holding the trace estimate."}
    )
    stderr_metric: str = field(
        default=TRACE_STDERR_METRIC, metadata={"help": "Logged (or evaluation) key holding its standard error."}
    )
    trace_fn: TraceFunction | None = field(
        default=None, metadata={"help": "Called with the model at an evaluation that logged no trace."}
    )
    selection: CheckpointSelection | None = field(default=None, init=False)
    _losses: dict[int, float] = field(default_factory=dict, init=False, repr=False)
    _traces: dict[int, tuple[float, float | None]] = field(default_factory=dict, init=False, repr=False)
    _paths: dict[int, str] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        # Fail at construction, not after the first evaluation has been paid for.
        select_flattest_checkpoint(
            [CheckpointRecord(0, 0.0, 0.0)],
            loss_tolerance=self.loss_tolerance,
            relative_tolerance=self.relative_tolerance,
            trace_margin=self.trace_margin,
        )

    @property
    def records(self) -> dict[int, CheckpointRecord]:
        """One record per evaluated step: its loss, its trace when one was measured, its checkpoint when saved."""
        records = {}
        for step, loss in sorted(self._losses.items()):
            trace, stderr = self._traces.get(step, (None, None))
            records[step] = CheckpointRecord(step, loss, trace, stderr, self._paths.get(step))
        return records

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if args.save_total_limit is not None:
            raise ValueError(
                f"FlatnessCheckpointSelector needs every evaluated checkpoint kept, but save_total_limit="
                f"{args.save_total_limit} lets the Trainer delete the flattest one; set save_total_limit=None."
            )
        if args.eval_strategy == "no":
            raise ValueError("FlatnessCheckpointSelector needs evaluations: set eval_strategy to 'steps' or 'epoch'.")

    def on_log(self, args, state, control, logs: dict[str, float] | None = None, **kwargs):
        if logs and self.trace_metric in logs:
            self._traces[state.global_step] = (float(logs[self.trace_metric]), _optional(logs.get(self.stderr_metric)))

    def on_evaluate(self, args, state, control, metrics: dict[str, float] | None = None, model=None, **kwargs):
        metrics = metrics or {}
        if self.loss_metric not in metrics:
            return
        step = state.global_step
        self._losses[step] = float(metrics[self.loss_metric])
        if self.trace_metric in metrics:
            self._traces[step] = (float(metrics[self.trace_metric]), _optional(metrics.get(self.stderr_metric)))
        elif step not in self._traces and self.trace_fn is not None and model is not None:
            # A HessianTraceCallback placed after this one logs later in the same evaluation and overwrites this.
            self._traces[step] = _mean_and_stderr(self.trace_fn(model))

    def on_save(self, args, state, control, **kwargs):
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if os.path.isdir(folder):
            self._paths[state.global_step] = folder
        saved = [r for r in self.records.values() if r.path and os.path.isdir(r.path) and r.hessian_trace is not None]
        if not saved:
            return
        self.selection = self._select(saved)
        state.best_model_checkpoint = self.selection.chosen.path
        state.best_global_step = self.selection.chosen.step
        state.best_metric = self.selection.chosen.eval_loss

    def on_train_end(self, args, state, control, **kwargs):
        if self.selection is None and any(r.hessian_trace is not None for r in self.records.values()):
            # No checkpoint saved: still report which evaluated step would have been chosen.
            self.selection = self._select(list(self.records.values()))
        if self.selection is not None and state.is_world_process_zero:
            os.makedirs(args.output_dir, exist_ok=True)
            with open(os.path.join(args.output_dir, SELECTION_FILE), "w") as handle:
                json.dump(self.selection.to_dict(), handle, indent=2)
            logger.info("Flatness checkpoint selection: %s", self.selection.reason)

    def _select(self, records: list[CheckpointRecord]) -> CheckpointSelection:
        return select_flattest_checkpoint(
            records,
            loss_tolerance=self.loss_tolerance,
            relative_tolerance=self.relative_tolerance,
            trace_margin=self.trace_margin,
        )


def _optional(value: Any) -> float | None:
    return None if value is None else float(value)


def _mean_and_stderr(estimate: Any) -> tuple[float, float | None]:
    if hasattr(estimate, "mean"):
        return float(estimate.mean), None if getattr(estimate, "stderr", None) is None else float(estimate.stderr)
    if isinstance(estimate, tuple | list) and len(estimate) == 2:
        return float(estimate[0]), None if estimate[1] is None else float(estimate[1])
    return float(estimate), None
