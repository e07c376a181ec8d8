"""Figures of the research recipes (matplotlib, imported only when a figure is drawn)."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path
from typing import Any

from .saturation import SATURATED_KL, SATURATED_KL_UPPER
from .verdicts import CLAIM_FILES
from .verdicts_v2 import in_tier


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


def plot_claims(results_dir: Path, path: Path) -> dict[str, list[tuple]]:
    """One figure of the saturated-start claims C2-C6 from their JSON files in ``results_dir``, a panel per claim
    titled with its verdict (a note instead of points while its file is missing or holds no seeds). Filled markers
    are saturated records, hollow ones are not: every verdict depends on the regime. Returns the plotted numbers per
    claim, each row ending with the record's ``saturated``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(2, 3, figsize=(18, 10))
    panels, note = list(grid.flat[:5]), grid.flat[5]
    data: dict[str, list[tuple]] = {}
    for ax, (claim, draw) in zip(panels, _PANELS.items(), strict=True):
        file = results_dir / CLAIM_FILES[claim]
        payload = json.loads(file.read_text()) if file.exists() else None
        verdict = payload["verdict"]["verdict"] if payload else f"{CLAIM_FILES[claim]} not written"
        ax.set_title(f"{claim} {_TITLES[claim]}\n" + textwrap.fill(verdict, 60), fontsize=10)
        # C2's seeds sit under each width: a file with only empty widths has no seeds yet
        if not payload or not any(payload["seeds"].values()):
            data[claim] = []
            ax.text(0.5, 0.5, "no seeds yet", ha="center", va="center", transform=ax.transAxes, color="gray")
            ax.set(xticks=[], yticks=[])
            continue
        data[claim] = draw(ax, payload)
        _tier_legend(ax)
    note.axis("off")
    note.text(
        0.0,
        0.95,
        _TIER_NOTE + "Accuracy: the primary probe (last layer), mean over tasks A/B/C\n"
        "unless a task is named. Fisher trace: the per-sample Fisher\n"
        "(labels drawn from the model) summed over the parameters,\n"
        "dimensionless, in the model's own space unless noted.",
        va="top",
        fontsize=9,
    )
    _save(fig, panels, "Saturated-start claims (one point per record; verdicts from each claim's JSON)", path)
    return data


_TIER_NOTE = (
    f"Filled marker: saturated record (KL to the exact conditionals <= {SATURATED_KL:.3f} nats,\n"
    f"bootstrap upper end <= {SATURATED_KL_UPPER:.3f}); hollow: not saturated.\n\n"
)


def _tier_legend(ax) -> None:
    ax.plot([], [], ls="none", marker="o", color="gray", label="saturated")
    ax.plot([], [], ls="none", marker="o", color="gray", mfc="none", label="not saturated")


def _point(ax, x: float, y: float, saturated: bool, color, marker: str = "o") -> None:
    ax.plot([x], [y], ls="none", marker=marker, ms=7, color=color, mfc=color if saturated else "none")


def _colors(names) -> dict[str, Any]:
    import matplotlib.pyplot as plt

    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {name: cycle[i % len(cycle)] for i, name in enumerate(names)}


def _by_seed(seeds) -> list[str]:
    return sorted(seeds, key=int)


def _c3(ax, payload) -> list[tuple]:
    """Per seed and arm, Fisher trace (bars: its standard error) against accuracy; a faint line joins a seed's arms
    so that a seed-level shift is not read as an arm effect."""
    arms = list(payload["arms"])
    colors, markers = _colors(arms), dict(zip(arms, "osD^", strict=False))
    rows = []
    for seed in _by_seed(payload["seeds"]):
        records = [(arm, payload["seeds"][seed][arm]) for arm in arms if arm in payload["seeds"][seed]]
        ax.plot([r["fisher_trace"] for _, r in records], [r["probe_accuracy"] for _, r in records], color="gray",
                lw=0.7, alpha=0.35)  # fmt: skip
        for arm, r in records:
            rows.append((seed, arm, r["fisher_trace"], r["probe_accuracy"], r["saturated"]))
            trace, accuracy, saturated = rows[-1][2:]  # drawn from the returned row: a test of it tests the figure
            ax.errorbar(trace, accuracy, xerr=r.get("fisher_trace_stderr"), fmt="none", ecolor=colors[arm], alpha=0.4,
                        lw=0.8)  # fmt: skip
            _point(ax, trace, accuracy, saturated, colors[arm], markers[arm])
        if records:
            _, first = records[0]
            ax.annotate(f"seed {seed}", (first["fisher_trace"], first["probe_accuracy"]), xytext=(6, 4),
                        textcoords="offset points", fontsize=7, color="gray")  # fmt: skip
    for arm in arms:  # one legend entry per arm, not per point
        ax.plot([], [], ls="none", marker=markers[arm], color=colors[arm], label=arm)
    ax.set(xlabel="Fisher trace of the last branch (bars: ±1 s.e.)", ylabel="primary probe accuracy (fraction)")
    return rows


def _c2(ax, payload) -> list[tuple]:
    """Per seed across widths: the trace in the model's own space and in H128's (the rule compares the latter), and
    the accuracy on a twin axis."""
    seeds = sorted({s for rows in payload["seeds"].values() for s in rows}, key=int)
    colors, twin, rows = _colors(seeds), ax.twinx(), []
    for seed in seeds:
        widths = sorted(int(w) for w, by_seed in payload["seeds"].items() if seed in by_seed)
        records = [payload["seeds"][str(w)][seed] for w in widths]
        saturated = [r["saturated"] for r in records]
        own, accuracy = [r["fisher_trace"] for r in records], [r["probe_accuracy"] for r in records]
        enlarged = [r.get("fisher_trace_enlarged", math.nan) for r in records]  # NaN: no point, a gap in the line
        rows += list(zip(widths, [seed] * len(widths), own, enlarged, accuracy, saturated, strict=True))
        for axis, values, marker, ls in ((ax, own, "o", "-"), (ax, enlarged, "s", "--"), (twin, accuracy, "^", ":")):
            axis.plot(widths, values, color=colors[seed], lw=0.8, ls=ls)
            for w, v, sat in zip(widths, values, saturated, strict=True):
                _point(axis, w, v, sat, colors[seed], marker)
        ax.plot([], [], color=colors[seed], label=f"seed {seed}")
    # the twin's points are listed in the main legend, which is the one _save draws
    ax.plot([], [], ls="-", marker="o", color="k", lw=0.8, label="trace, own space (left)")
    ax.plot([], [], ls="--", marker="s", color="k", lw=0.8, label="trace, H128 space (left)")
    ax.plot([], [], ls=":", marker="^", color="k", lw=0.8, label="accuracy (right)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(payload["sizes"], [str(w) for w in payload["sizes"]])
    ax.set_xlim(min(payload["sizes"]) / 1.3, max(payload["sizes"]) * 1.3)
    ax.set(xlabel="hidden size (log2)", ylabel="Fisher trace of the last branch")
    twin.set_ylabel("primary probe accuracy (fraction)")
    return rows


def _c4(ax, payload) -> list[tuple]:
    """Per task, each seed's start beside the others, the lookup-table row as a horizontal tick across the group."""
    lookup = payload["references"]["exact_conditionals"]["probe"]
    tasks, seeds = list(lookup), _by_seed(payload["seeds"])
    colors, rows = _colors(seeds), []
    for i, task in enumerate(tasks):
        # a line, not hlines: the legend's placement avoids lines but not line collections
        ax.plot([i - 0.35, i + 0.35], [lookup[task]["accuracy"]] * 2, color="k", lw=1.5,
                label="lookup table (exact conditionals)" if i == 0 else None)  # fmt: skip
        for j, seed in enumerate(seeds):
            start = payload["seeds"][seed]["start"]
            rows.append((seed, task, start["probe"][task]["accuracy"], lookup[task]["accuracy"], start["saturated"]))
            _point(ax, i + 0.5 * (j + 0.5) / len(seeds) - 0.25, rows[-1][2], rows[-1][4], colors[seed])
    for seed in seeds:
        ax.plot([], [], ls="none", marker="o", color=colors[seed], label=f"seed {seed}")
    ax.set_xticks(range(len(tasks)), [f"task {t}" for t in tasks])
    ax.set(xlabel="probe task (points: each seed's distilled start)", ylabel="primary probe accuracy (fraction)")
    return rows


def _c5(ax, payload) -> list[tuple]:
    """Per seed, an arrow from C1's last branch to the adversarial branch in (trace, accuracy): its direction is the
    pair of differences the rule and its companion read."""
    seeds = _by_seed(payload["seeds"])
    colors, markers, rows = _colors(seeds), {"c1_last_branch": "o", "adversarial": "X"}, []
    for seed in seeds:
        pair = {role: payload["seeds"][seed][role] for role in markers if payload["seeds"][seed][role]}
        for role, r in pair.items():
            rows.append((seed, role, r["fisher_trace"], r["probe_accuracy"], r["saturated"]))
            _point(ax, *rows[-1][2:], colors[seed], markers[role])
        if len(pair) == 2:
            (x0, y0), (x1, y1) = (row[2:4] for row in rows[-2:])
            ax.annotate("", (x1, y1), (x0, y0), arrowprops={"arrowstyle": "->", "color": colors[seed], "lw": 0.8})
        ax.plot([], [], color=colors[seed], label=f"seed {seed}")
    ax.plot([], [], ls="none", marker="o", color="k", label="C1 last branch")
    ax.plot([], [], ls="none", marker="X", color="k", label="adversarial")
    ax.set(xlabel="Fisher trace of the last branch", ylabel="primary probe accuracy (fraction)")
    return rows


def _c6(ax, payload) -> list[tuple]:
    """Per seed, the accuracy of the branch the flatness rule picks and of the lowest-KL branch, joined, each marked
    with its step (one step when both rules pick the same branch)."""
    picks, seeds = payload["verdict"].get("picks", {}), _by_seed(payload["seeds"])
    # marker, colour, key in the picks, side of the step label (opposite sides: close accuracies stay legible)
    styles = {
        "flatness": ("v", "tab:blue", "chosen_step", 1),
        "lowest_kl": ("o", "tab:orange", "lowest_kl_step", -1),
    }
    rows = []
    for i, seed in enumerate(seeds):
        if seed not in picks:  # no compared branches: the rule picked nothing
            ax.text(i, 0.5, "no compared\nbranches", transform=ax.get_xaxis_transform(), ha="center", fontsize=7,
                    color="gray")  # fmt: skip
            continue
        by_step = {r["step"]: r for r in payload["seeds"][seed]}
        for rule, (marker, color, key, side) in styles.items():
            r = by_step[picks[seed][key]]
            rows.append((seed, rule, r["step"], r["probe_accuracy"], r["saturated"]))
            step, accuracy, saturated = rows[-1][2:]
            _point(ax, i, accuracy, saturated, color, marker)
            ax.annotate(f"step {step}", (i, accuracy), xytext=(7 * side, 0), textcoords="offset points", fontsize=7,
                        va="center", ha="left" if side > 0 else "right", color=color)  # fmt: skip
        ax.plot([i, i], [row[3] for row in rows[-2:]], color="gray", lw=0.8, zorder=1)  # under the markers
    ax.plot([], [], ls="none", marker="v", color="tab:blue", label="smallest trace within 0.01 nats of lowest KL")
    ax.plot([], [], ls="none", marker="o", color="tab:orange", label="lowest KL")
    ax.set_xticks(range(len(seeds)), seeds)
    ax.set_xlim(-0.8, len(seeds) - 0.2)  # room for the outer seeds' step labels
    ax.set(xlabel="seed", ylabel="primary probe accuracy of the picked branch (fraction)")
    if not rows:  # seeds, none compared: an accuracy scale around 0 would read as a measurement
        ax.set_yticks([])
    return rows


_PANELS = {"C3": _c3, "C2": _c2, "C4": _c4, "C5": _c5, "C6": _c6}
_TITLES = {
    "C3": "optimizer arms (each arm's last branch)",
    "C2": "model size (each width's last branch)",
    "C4": "saturated start vs the lookup table",
    "C5": "adversary on the read-out vs C1",
    "C6": "selection: flattest vs lowest-KL branch",
}


def _save(fig, axes, title: str, path: Path) -> None:
    """Legends, title and layout of a row of panels, written to ``path`` and closed."""
    import matplotlib.pyplot as plt

    for ax in axes:
        if ax.get_legend_handles_labels()[0]:  # a claim panel without seeds yet has nothing to list
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_claims_v2(claims_dir: Path, path: Path) -> dict[str, list[tuple]]:
    """Campaign v2's claims from the ``C*.json`` files in ``claims_dir``: a panel per claim that ran (C1, C6, C4, C3,
    C2), titled with its primary verdict; C5, which its pilot stopped, in the note. Accuracy is the primary read-out
    (the last layer's probe, mean over tasks and the ruler's splits); C1, C6, C4 and C3 draw only the records already
    read, C2 (KL against trace) every record. Filled markers are saturated records. Returns the plotted numbers
    per claim, as `plot_claims` does."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    payloads = {c: json.loads(f.read_text()) for c in _TITLES_V2 if (f := claims_dir / f"{c}.json").exists()}
    fig, grid = plt.subplots(2, 3, figsize=(18, 10))
    panels, note = list(grid.flat[:5]), grid.flat[5]
    data: dict[str, list[tuple]] = {}
    for ax, (claim, draw) in zip(panels, _PANELS_V2.items(), strict=True):
        payload = payloads.get(claim)
        ax.set_title(f"{claim} {_TITLES_V2[claim]}\n" + textwrap.fill(_verdict_v2(payload), 60), fontsize=10)
        data[claim] = draw(ax, payload) if payload else []
        if not data[claim]:
            ax.text(0.5, 0.5, "nothing read yet", ha="center", va="center", transform=ax.transAxes, color="gray")
            continue
        _tier_legend(ax)
    note.axis("off")
    note.text(
        0.0,
        0.95,
        f"C5 {_TITLES_V2['C5']}: "
        + textwrap.fill(_verdict_v2(payloads.get("C5")), 50)
        + "\n\n"
        + _TIER_NOTE
        + "Accuracy: the last layer's probe (the primary read-out), mean over\n"
        "tasks A/B/C and the ruler's fit splits, every model on the same splits.\n"
        "Fisher trace: labels drawn from the model, summed over the parameters.",
        va="top",
        fontsize=9,
    )
    _save(fig, panels, "Campaign v2 claims (one point per record; verdicts from each claim's JSON)", path)
    return data


def _verdict_v2(payload: dict[str, Any] | None) -> str:
    if payload is None:
        return "not written yet"
    verdict = payload["verdict"]
    reading = verdict.get("reading")
    return verdict["verdict"] + (f" ({reading})" if reading and reading not in verdict["verdict"] else "")


def _primary(record: dict[str, Any]) -> float | None:
    """The primary read-out of one record, the mean over the splits read; None while unread."""
    read = record.get("reads", {}).get("probe")
    return sum(read["mean"]) / len(read["mean"]) if read else None


def _as_v1(record: dict[str, Any]) -> dict[str, Any]:
    """A read v2 record in the fields `_c3` and `_c6` draw."""
    return {
        **record,
        "probe_accuracy": _primary(record),
        "saturated": in_tier(record, "saturated"),
    }


def _c1_v2(ax, payload) -> list[tuple]:
    """Per seed, the start (square) and the annealed branches in step order, in (Fisher trace, accuracy)."""
    seeds = _by_seed(payload["records"]["seeds"])
    colors, rows = _colors(seeds), []
    for seed in seeds:
        record = payload["records"]["seeds"][seed]
        path = [(0, record["start"]), *((b["step"], b) for b in sorted(record["branches"], key=lambda b: b["step"]))]
        drawn = [(step, r["fisher_trace"], _primary(r), in_tier(r, "saturated")) for step, r in path if _primary(r)]
        rows += [(seed, *row) for row in drawn]
        ax.plot([row[1] for row in drawn], [row[2] for row in drawn], color=colors[seed], lw=0.8)
        for step, trace, accuracy, saturated in drawn:
            _point(ax, trace, accuracy, saturated, colors[seed], "s" if step == 0 else "o")
        ax.plot([], [], color=colors[seed], label=f"seed {seed}")
    ax.plot([], [], ls="none", marker="s", color="k", label="start (then branches by step)")
    ax.set(xlabel="Fisher trace", ylabel="primary read-out (fraction)")
    return rows


def _c6_v2(ax, payload) -> list[tuple]:
    seeds = {
        seed: [_as_v1(b) for b in record["branches"] if _primary(b) is not None]
        for seed, record in payload["records"]["seeds"].items()
    }
    read = {seed: {b["step"] for b in branches} for seed, branches in seeds.items()}
    picks = {
        seed: pick
        for seed, pick in payload["verdict"].get("picks", {}).items()
        if {pick["chosen_step"], pick["lowest_kl_step"]} <= read[seed]
    }
    return _c6(ax, {"seeds": seeds, "verdict": {"picks": picks}})


def _c3_v2(ax, payload) -> list[tuple]:
    arms = payload["verdict"].get("arms") or payload["pilots"]["c3_arms"]
    seeds = {
        seed: {arm: _as_v1(r) for arm, r in by_arm.items() if _primary(r) is not None}
        for seed, by_arm in payload["records"]["seeds"].items()
    }
    return _c3(ax, {"arms": arms, "seeds": {seed: by_arm for seed, by_arm in seeds.items() if by_arm}})


def _c4_v2(ax, payload) -> list[tuple]:
    """Per task (and the mean over tasks), each seed's start as a point and every baseline row as a tick across the
    group: a PASS has to clear the highest tick."""
    tasks, records = ["A", "B", "C", "mean"], payload["records"]
    seeds, names = _by_seed(records["starts"]), sorted(records["baselines"])
    colors, rows = _colors(names), []  # the starts are drawn in black

    def value(record, task):
        read = record.get("reads", {}).get("probe")
        if not read:
            return None
        splits = read["mean"] if task == "mean" else read["tasks"][task]
        return sum(splits) / len(splits)

    for i, task in enumerate(tasks):
        for name in names:
            if (v := value(records["baselines"][name], task)) is not None:
                rows.append((name, task, v, None))
                ax.plot([i - 0.4, i + 0.4], [v, v], color=colors[name], lw=1.5, label=name if i == 0 else None)
        for j, seed in enumerate(seeds):
            start = records["starts"][seed]
            if (v := value(start, task)) is not None:
                rows.append((f"start seed {seed}", task, v, in_tier(start, "saturated")))
                _point(ax, i + 0.5 * (j + 0.5) / len(seeds) - 0.25, v, rows[-1][3], "k")
    ax.set_xticks(range(len(tasks)), [f"task {t}" if t != "mean" else "mean (primary)" for t in tasks])
    ax.set(xlabel="probe task (points: each seed's start; ticks: baseline rows)", ylabel="read-out (fraction)")
    return rows


def _c2_v2(ax, payload) -> list[tuple]:
    """Each width's last branch (or, for a start that missed the margin, the start) in (KL, Fisher trace): where the
    saturated tier's line falls decides which widths are compared."""
    sizes = payload["records"]["sizes"]
    widths = sorted(sizes, key=int)
    colors, rows = _colors(widths), []
    for width in widths:
        for seed in _by_seed(sizes[width]):
            r = sizes[width][seed]
            rows.append((int(width), seed, r["kl"], r["fisher_trace"], in_tier(r, "saturated")))
            _point(ax, r["kl"], r["fisher_trace"], rows[-1][4], colors[width], "X" if r.get("excluded") else "o")
        ax.plot([], [], ls="none", marker="o", color=colors[width], label=f"H{width}")
    ax.axvline(SATURATED_KL, color="k", lw=0.8, ls=":")
    ax.plot([], [], ls="none", marker="X", color="k", label="start missed the margin (left out)")
    ax.set(xlabel="KL to the exact conditionals (nats; dotted: the saturated tier's 0.010)", ylabel="Fisher trace")
    return rows


_PANELS_V2 = {"C1": _c1_v2, "C6": _c6_v2, "C4": _c4_v2, "C3": _c3_v2, "C2": _c2_v2}
_TITLES_V2 = {
    "C1": "continued training (start, then branches)",
    "C6": _TITLES["C6"],
    "C4": "saturated starts vs the strongest baseline row",
    "C3": "training algorithm (each arm's last branch)",
    "C2": "model size (each width's last branch)",
    "C5": "adversary on the read-out",
}
