"""Figures of the synthetic experiments (matplotlib, imported only when a figure is drawn)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_runs(runs: dict[str, list[dict[str, Any]]], path: Path, title: str, matched: dict[str, list] | None = None):
    """Panels: loss gap to the entropy floor, trace and probe accuracy against the step; accuracy against the trace
    at matched loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for label, records in runs.items():
        steps = [r["step"] for r in records]
        axes[0].semilogy(steps, [r["loss_gap_to_entropy"] for r in records], marker="o", label=label)
        if any(r["hessian_trace"] is not None for r in records):
            axes[1].plot(steps, [r["hessian_trace"] for r in records], marker="o", label=label)
        axes[2].plot(steps, [r["probe_accuracy"] for r in records], marker="o", label=label)
        chosen = (matched or {}).get(label, records)
        if any(r["hessian_trace"] is not None for r in chosen):
            axes[3].scatter([r["hessian_trace"] for r in chosen], [r["probe_accuracy"] for r in chosen], label=label)
    axes[0].set(xlabel="step", ylabel="loss - entropy floor (nats)", title="loss gap vs step")
    axes[1].set(xlabel="step", ylabel="Tr(H) (Fisher)", title="trace vs step")
    axes[2].set(xlabel="step", ylabel="mean probe accuracy", title="probe accuracy vs step")
    axes[3].set(xlabel="Tr(H) (Fisher)", ylabel="mean probe accuracy", title="accuracy vs trace (matched loss)")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
