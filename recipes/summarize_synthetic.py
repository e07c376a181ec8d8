"""Print the synthetic recipes' results.json files as the markdown tables of docs/reproduction/synthetic.md.

python recipes/summarize_synthetic.py outputs/pcfg_continue_training/results.json outputs/pcfg_optimizers/results.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _fmt(value, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def record_rows(label: str, records: list[dict]) -> list[str]:
    rows = []
    for r in records:
        tasks = ", ".join(
            f"{k} {v['accuracy']:.3f} [{v['ci_low']:.3f}, {v['ci_high']:.3f}]" for k, v in r["probe"].items()
        )
        trace = "n/a" if r["hessian_trace"] is None else f"{r['hessian_trace']:.1f} ± {r['hessian_trace_stderr']:.1f}"
        rows.append(
            f"| {label} | {r['step']} | {r['loss']:.4f} | {r['loss_gap_to_entropy']:.4f} | {trace} | "
            f"{r['probe_accuracy']:.3f} | {tasks} |"
        )
    return rows


def summarize(path: Path) -> str:
    payload = json.loads(path.read_text())
    lines = [f"### {payload['recipe']} ({payload['language']}), entropy floor {payload['entropy_bound']:.4f} nats", ""]
    lines.append("| run | step | loss | gap to floor | Tr(H) ± s.e. | mean probe acc. | per task [95% CI] |")
    lines.append("|---|---|---|---|---|---|---|")
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
            lines.append(
                f"{key}: Spearman(trace, acc) = {_fmt(c['spearman_trace_vs_accuracy'])}, "
                f"Spearman(loss, acc) = {_fmt(c['spearman_loss_vs_accuracy'])} over {c['n_checkpoints']} checkpoints"
            )
    lines.append("")
    lines.append(f"Wall time {payload['seconds']:.0f} s; config `{json.dumps(payload['config'])}`")
    return "\n".join(lines)


if __name__ == "__main__":
    print("\n\n".join(summarize(Path(p)) for p in sys.argv[1:]))
