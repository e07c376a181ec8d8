"""Campaign v3's docs tables (issue 55), generated from ``contrasts.json`` and the reads on disk, never typed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import rules_v3 as rules
from .campaign_v3 import Checkpoint

CONTRASTS = {
    "a_last_minus_first": "(a) C1 last minus first branch",
    "a_last_minus_start": "(a) beside: C1 last branch minus start",
    "b_sam_minus_plain": "(b) C3 `adamw_plain_sam` minus `adamw_plain`",
    "b_side_adamw_sam_minus_adamw": "(b) beside: `adamw_sam` minus `adamw`",
}


def _interval(row: Mapping[str, Any] | None) -> str:
    if not row or not row.get("difference"):
        return "-"
    d = row["difference"]
    return f"{d['mean']:+.4f} [{d['ci'][0]:+.4f}, {d['ci'][1]:+.4f}]"


def progress_table(checkpoints: Mapping[str, Checkpoint], raw: Mapping[str, Any], gate: Mapping[str, Any]) -> str:
    """Per stage: checkpoints, those fully fine-tuned at the gate's rung, reads done, CPU-hours spent."""
    lines = ["| stage | checkpoints | fully read | reads done | CPU-h |", "|---|---|---|---|---|"]
    for stage, title in rules.STAGES:
        keys = [c.key for c in checkpoints.values() if c.stage == stage]
        wanted = gate["seeds"] * 5
        done = sum(min(len(raw.get(k, {})), wanted) for k in keys)
        full = sum(len(raw.get(k, {})) >= wanted for k in keys)
        hours = sum(read["cpu_seconds"] for k in keys for read in raw.get(k, {}).values()) / 3600
        lines.append(f"| {title} | {len(keys)} | {full} | {done} of {wanted * len(keys)} | {hours:.2f} |")
    return "\n".join(lines)


def gate_table(gate: Mapping[str, Any]) -> str:
    lines = [
        "| rung | seeds per split | rows | s.d. of the paired difference | passes (<= 0.002) |",
        "|---|---|---|---|---|",
    ]
    for i, rung in enumerate(gate["rungs"]):
        lines.append(
            f"| {i + 1} | {rung['seeds']} | {rung['rows']} | {rung['sd']:.4f} | {'yes' if rung['passed'] else 'no'} |"
        )
    if not gate["decided"]:
        lines.append(f"| {gate['rung'] + 1} | {gate['seeds']} | {gate['rows']} | being read | - |")
    return "\n".join(lines)


def contrasts_table(payload: Mapping[str, Any]) -> str:
    """Each contrast on each read-out: unadjusted and KL-adjusted two-way intervals, the KL gap, the verdict."""
    lines = [
        "| contrast | read-out | difference [95%] | at equal KL [95%] | KL gap (mean, range) | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for readout in ("finetune", "probe"):
        rows = payload.get(readout)
        if rows is None:
            lines.append(f"| every contrast | {readout} | waits for the gate | | | |")
            continue
        for name, title in CONTRASTS.items():
            row = rows.get(name, {})
            gap = (
                f"{row['kl_difference_mean']:+.4f} ({row['kl_difference_range'][0]:+.4f}, "
                f"{row['kl_difference_range'][1]:+.4f})"
                if "kl_difference_mean" in row
                else "-"
            )
            verdict = row.get("verdict", "-") if readout == "finetune" else f"beside ({row.get('verdict', '-')})"
            lines.append(
                f"| {title} | {readout} | {_interval(row.get('unadjusted'))} | {_interval(row.get('adjusted'))} "
                f"| {gap} | {verdict} |"
            )
        dose = rows.get("c_dose_response", {})
        if "trace" in dose:
            b = dose["trace"]
            cell = f"{1000 * b['coefficient']:+.3f} [{1000 * b['ci'][0]:+.3f}, {1000 * b['ci'][1]:+.3f}]"
            kl = dose["kl"]
            verdict = dose["verdict"] if readout == "finetune" else f"beside ({dose['verdict']})"
            lines.append(
                f"| (c) dose-response: accuracy per 1,000 units of Fisher trace, KL held | {readout} | {cell} | "
                f"KL coefficient {kl['coefficient']:+.3f} per nat | - | {verdict} |"
            )
        else:
            lines.append(f"| (c) dose-response | {readout} | {dose.get('verdict', '-')} | | | |")
    return "\n".join(lines)
