"""The synthetic recipes' ``results.json`` files as the markdown tables of docs/reproduction/synthetic.md
(``recipes/summarize_synthetic.py`` prints them)."""

from __future__ import annotations

import json
from pathlib import Path


def _fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def record_rows(label: str, records: list[dict]) -> list[str]:
    """One markdown table row per evaluated checkpoint of the run ``label``."""
    rows = []
    for r in records:
        tasks = ", ".join(
            f"{k} {v['accuracy']:.3f} [{v['ci_low']:.3f}, {v['ci_high']:.3f}]" for k, v in r["probe"].items()
        )
        trace = "n/a" if r["hessian_trace"] is None else f"{r['hessian_trace']:.1f} ± {r['hessian_trace_stderr']:.1f}"
        mean_pooled = _fmt(r.get("probe_accuracy_mean_pooled"))
        rows.append(
            f"| {label} | {r['step']} | {r['loss']:.4f} | {r['loss_gap_to_entropy']:.4f} | {trace} | "
            f"{r['probe_accuracy']:.3f} | {mean_pooled} | {tasks} |"
        )
    return rows


def checkpoint_line(label: str, r: dict) -> str:
    """One checkpoint as a bullet: step, loss, trace and probe accuracy."""
    mean_pooled = r.get("probe_accuracy_mean_pooled")
    return (
        f"- {label}: step {r['step']}, loss {r['loss']:.4f}, trace {_fmt(r['hessian_trace'], 1)}, "
        f"probe acc. {r['probe_accuracy']:.3f}" + ("" if mean_pooled is None else f" (mean-pooled {mean_pooled:.3f})")
    )


def summarize(path: Path) -> str:
    """The tables and summary lines of one recipe's ``results.json``, as markdown."""
    payload = json.loads(path.read_text())
    lines = [f"### {payload['recipe']} ({payload['language']}), entropy floor {payload['entropy_bound']:.4f} nats", ""]
    lines.append(
        "| run | step | loss | gap to floor | Tr(H) ± s.e. | probe acc. | mean-pooled probe acc. | per task [95% CI] |"
    )
    lines.append("|---|---|---|---|---|---|---|---|")
    if payload["recipe"] == "continue_training":
        lines += record_rows("adamw", payload["records"])
    elif payload["recipe"] == "optimizers":
        for label, records in payload["runs"].items():
            lines += record_rows(label, records)
    else:
        lines += record_rows("transformer", payload["transformer"])
        table = payload["lookup_table"]
        lines.append("")
        lines.append(
            f"Lookup table: loss {table['loss']:.4f} (gap {table['loss_gap_to_entropy']:.1e}); probe on one-hot input "
            f"{table['probe_accuracy_onehot']:.3f}, on its own conditionals {table['probe_accuracy_conditionals']:.3f}"
        )
        for kind in ("onehot", "conditionals"):
            tasks = ", ".join(
                f"{k} {v['accuracy']:.3f} [{v['ci_low']:.3f}, {v['ci_high']:.3f}]"
                for k, v in table[f"probe_{kind}"].items()
            )
            lines.append(f"- lookup table features `{kind}`: {tasks}")
    for key in ("correlations_all_checkpoints", "correlations_matched_loss"):
        if key in payload:
            c = payload[key]
            lines.append("")
            for suffix in ("", "_mean_pooled"):
                if f"spearman_trace_vs_accuracy{suffix}" not in c:
                    continue
                lines.append(
                    f"{key}{suffix}: Spearman(trace, acc) = {_fmt(c[f'spearman_trace_vs_accuracy{suffix}'])}, "
                    f"Spearman(loss, acc) = {_fmt(c[f'spearman_loss_vs_accuracy{suffix}'])}, partial Spearman(trace, "
                    f"acc | loss) = {_fmt(c.get(f'partial_spearman_trace_vs_accuracy_given_loss{suffix}'))} over "
                    f"{c['n_checkpoints']} checkpoints"
                )
    if "at_common_loss" in payload:
        common = payload["at_common_loss"]
        lines += ["", f"At the lowest loss every run reached ({common['target_loss']:.4f}):"]
        lines += [checkpoint_line(label, r) for label, r in common["checkpoints"].items()]
    if payload.get("flatness_selection"):
        selection = payload["flatness_selection"]
        lines += ["", f"Checkpoint selection (loss within {selection['loss_tolerance']} nats of the best):"]
        lines += [checkpoint_line(kind, selection[kind]) for kind in ("flattest", "lowest_loss")]
    lines.append("")
    lines.append(f"Wall time {payload['seconds']:.0f} s; config `{json.dumps(payload['config'])}`")
    return "\n".join(lines)
