"""`FlatnessCheckpointSelector`: the flattest checkpoint within a loss tolerance becomes the run's "best" one."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ..constants import TRACE_METRIC, TRACE_STDERR_METRIC, TRACE_SUMMARIES
from ..selection import SELECTION_FILE, CheckpointRecord, CheckpointSelection, select_flattest_checkpoint

logger = logging.getLogger(__name__)

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

    ``trace_summary="median_of_means"`` ranks by the trace's median of means (logged by ``HessianTraceCallback`` as
    ``flatness/hessian_trace_median_of_means``; ``trace_fn``'s result's ``median_of_means``), which one or two
    contexts with huge gradients cannot carry; ``trace_margin`` still scales by the mean's standard error, the
    median of means having none of its own. The default stays ``"mean"`` until an experiment decides.

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
    trace_summary: str = field(
        default="mean",
        metadata={"help": f"What of each trace estimate is ranked: {' or '.join(TRACE_SUMMARIES)} (default mean)."},
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
        if self.trace_summary not in TRACE_SUMMARIES:
            raise ValueError(
                f"trace_summary={self.trace_summary!r}: choose one of {list(TRACE_SUMMARIES)} (e.g. "
                "trace_summary='median_of_means')."
            )
        if self.trace_metric == TRACE_METRIC:  # the default key follows the summary; a key given by hand wins
            self.trace_metric = TRACE_SUMMARIES[self.trace_summary]
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
            self._traces[step] = _mean_and_stderr(self.trace_fn(model), self.trace_summary)

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


def _mean_and_stderr(estimate: Any, summary: str = "mean") -> tuple[float, float | None]:
    if hasattr(estimate, "mean"):
        value = getattr(estimate, summary, None)
        if value is None:
            raise ValueError(
                f"trace_fn's estimate has no {summary}; return a TraceEstimate of 3 or more contexts, or use "
                "trace_summary='mean'."
            )
        return float(value), None if getattr(estimate, "stderr", None) is None else float(estimate.stderr)
    if isinstance(estimate, tuple | list) and len(estimate) == 2:
        return float(estimate[0]), None if estimate[1] is None else float(estimate[1])
    return float(estimate), None
