"""Checkpoint selection by flatness: among checkpoints whose validation loss is as good as the best, keep the flattest.

Liu et al. (2023) find that models with the same pre-training loss can transfer very differently and that the trace
of the Hessian of the pre-training loss tracks the difference: the flatter model transfers better. "Lowest
validation loss" therefore picks among near-ties by noise; this module picks among them by flatness instead.

The numerical core, [`select_flattest_checkpoint`], is a pure function over per-checkpoint records. Two front ends
use it: [`~hf_flatbias.callbacks.FlatnessCheckpointSelector`] (a `TrainerCallback` that records each evaluation and
points ``state.best_model_checkpoint`` at the selection, so ``load_best_model_at_end`` loads it) and the
``hf-flatbias select`` command (reads a run's ``trainer_state.json`` or a JSON file of records). Nothing here imports
torch or transformers, so the command starts at once.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from .constants import TRACE_METRIC, TRACE_STDERR_METRIC

logger = logging.getLogger(__name__)

__all__ = [
    "CheckpointRecord",
    "CheckpointSelection",
    "records_from_log_history",
    "select_flattest_checkpoint",
]

SELECTION_FILE = "flatness_selection.json"


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
            f"{[r.step for r in candidates]}) has a trace; estimate it (HessianTraceCallback or "
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
        reason += f"step {chosen.step} has the smallest trace ({chosen.hessian_trace:.6g}"
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
