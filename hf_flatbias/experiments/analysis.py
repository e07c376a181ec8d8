"""Comparisons of checkpoints across runs: rank correlations, matched loss, checkpoint selection by flatness."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..selection import CheckpointRecord, select_flattest_checkpoint


def spearman(x, y) -> float | None:
    """Spearman's rank correlation over the pairs where both values are known; None below 3 pairs or when undefined."""
    from scipy.stats import spearmanr

    pairs = [(a, b) for a, b in zip(x, y, strict=True) if a is not None and b is not None]
    if len(pairs) < 3:
        return None
    rho = spearmanr(*zip(*pairs, strict=True)).statistic
    return None if rho is None or not np.isfinite(rho) else float(rho)


def matched_loss(records: list[dict[str, Any]], tolerance: float) -> list[dict[str, Any]]:
    """Checkpoints whose loss is within ``tolerance`` nats of the best: the 'same pre-training loss' set."""
    best = min(r["loss"] for r in records)
    return [r for r in records if r["loss"] <= best + tolerance]


def partial_spearman(x, y, control) -> float | None:
    """Spearman correlation of ``x`` and ``y`` with ``control`` partialled out (first-order partial correlation of
    the ranks): does the trace say anything about accuracy that the loss does not already say?"""
    rho_xy, rho_xc, rho_yc = spearman(x, y), spearman(x, control), spearman(y, control)
    if None in (rho_xy, rho_xc, rho_yc) or max(abs(rho_xc), abs(rho_yc)) >= 1.0:
        return None
    return (rho_xy - rho_xc * rho_yc) / math.sqrt((1 - rho_xc**2) * (1 - rho_yc**2))


def at_common_loss(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Each run's checkpoint nearest to the lowest loss that every run reached: a like-for-like comparison of runs
    that converge at different speeds (the paper compares at the same, saturated loss)."""
    trained = {label: [r for r in records if r["step"] > 0] for label, records in runs.items()}
    untrained = [label for label, records in trained.items() if not records]
    if untrained:
        raise ValueError(
            f"runs {untrained} have no checkpoint after step 0; evaluate them at least once (--eval-every)."
        )
    target = max(min(r["loss"] for r in records) for records in trained.values())
    return {
        "target_loss": target,
        "checkpoints": {
            label: min(records, key=lambda r: (abs(r["loss"] - target), r["step"]))
            for label, records in trained.items()
        },
    }


def correlations(records: list[dict[str, Any]]) -> dict[str, float | None]:
    """Spearman correlations of trace and of loss with probe accuracy, and of trace with accuracy at fixed loss."""
    trace, loss = [r["hessian_trace"] for r in records], [r["loss"] for r in records]
    out: dict[str, float | None] = {"n_checkpoints": len(records)}
    for suffix, key in (("", "probe_accuracy"), ("_mean_pooled", "probe_accuracy_mean_pooled")):
        if not all(key in r for r in records):
            continue
        accuracy = [r[key] for r in records]
        out[f"spearman_trace_vs_accuracy{suffix}"] = spearman(trace, accuracy)
        out[f"spearman_loss_vs_accuracy{suffix}"] = spearman(loss, accuracy)
        out[f"partial_spearman_trace_vs_accuracy_given_loss{suffix}"] = partial_spearman(trace, accuracy, loss)
    return out


def flatness_selection(records: list[dict[str, Any]], tolerance: float) -> dict[str, Any] | None:
    """What `select_flattest_checkpoint` keeps among ``records`` next to the lowest-loss checkpoint, with the probe
    accuracy of each (which the selector never sees): the paper's advice, applied to one run's checkpoints. None when
    no checkpoint has a trace (``--trace-contexts 0``): there is nothing to select by."""
    if all(r["hessian_trace"] is None for r in records):
        return None

    by_step = {r["step"]: r for r in records}
    selection = select_flattest_checkpoint(
        [
            CheckpointRecord(
                step=r["step"], eval_loss=r["loss"], hessian_trace=r["hessian_trace"], stderr=r["hessian_trace_stderr"]
            )
            for r in records
            if r["hessian_trace"] is not None
        ],
        loss_tolerance=tolerance,
    )
    chosen, lowest = by_step[selection.chosen.step], by_step[selection.lowest_loss.step]
    return {
        "loss_tolerance": tolerance,
        "candidates": [c.step for c in selection.candidates],
        "flattest": {k: chosen[k] for k in ("step", "loss", "hessian_trace", "probe_accuracy")},
        "lowest_loss": {k: lowest[k] for k in ("step", "loss", "hessian_trace", "probe_accuracy")},
        "accuracy_gain": chosen["probe_accuracy"] - lowest["probe_accuracy"],
    }
