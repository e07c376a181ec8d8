"""Figures of the research recipes (matplotlib, imported only when a figure is drawn)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_branches(
    seeds: dict[str, list[dict[str, Any]]], path: Path, title: str, references: dict[str, Any] | None = None
):
    """Panels against the step, one line per seed: KL to the exact conditionals, Fisher trace (and its part
    outside the output layer), Hutchinson trace of the data-label loss, primary probe accuracy (with the
    reference rows as horizontal lines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for seed, records in seeds.items():
        steps = [r["step"] for r in records]
        axes[0].semilogy(steps, [r["kl"] for r in records], marker="o", label=f"seed {seed}")
        line = axes[1].plot(steps, [r["fisher_trace"] for r in records], marker="o", label=f"seed {seed}")[0]
        axes[1].plot(steps, [r["fisher_trace_rest"] for r in records], ls="--", color=line.get_color())
        axes[2].plot(steps, [r["hutchinson_trace_data_loss"] for r in records], marker="o", label=f"seed {seed}")
        axes[3].plot(steps, [r["probe_accuracy"] for r in records], marker="o", label=f"seed {seed}")
    axes[0].axhline(0.010, color="k", lw=0.8, ls=":", label="saturated (0.010)")
    for name, row in (references or {}).items():
        axes[3].axhline(row["probe_accuracy"], lw=0.8, ls=":", color="gray")
        axes[3].annotate(name, (0, row["probe_accuracy"]), fontsize=7, color="gray")
    axes[0].set(xlabel="step", ylabel="KL to exact conditionals (nats)", title="saturation")
    axes[1].set(xlabel="step", ylabel="Fisher trace (dashed: without output layer)", title="Fisher trace")
    axes[2].set(xlabel="step", ylabel="v^T H v, data-label loss", title="Hutchinson trace (released code's)")
    axes[3].set(xlabel="step", ylabel="mean probe accuracy (A/B/C)", title="primary probe (last layer)")
    _save(fig, axes, title, path)


def _save(fig, axes, title: str, path: Path) -> None:
    """Legends, title and layout of a row of panels, written to ``path`` and closed."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
