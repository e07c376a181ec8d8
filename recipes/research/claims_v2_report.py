"""Campaign v2's claim files (issue 33): each claim's JSON built from what the claims phase left on disk, its verdicts
recomputed from that JSON alone, and the markdown table the docs quote.

A claim's JSON (``claims/C1.json`` ..) holds the rule (the claim's paragraph of RULES_v2.md, read from the file),
the rules' constants, the pilots' decisions it used, the ruler's sizes, the ``records`` its rule reads (KL, Fisher
trace and the ruler's read-outs of every compared start or branch) and the verdicts computed from those records by
`claim_verdicts`: the primary (saturated tier, last-layer probe), the matched-tier sensitivity row, and one row per
secondary read-out (every other layer's probe, the fine-tuning). Tests recompute them with the same function.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import rules_v2 as rules
from . import verdicts_v2 as v
from .campaign_v2 import rules_header, start_key
from .paper_language import TASKS
from .ruler_reads import FINETUNE, PRIMARY, ReadStore, RulerSizes, compact_read

RULES_FILE = Path(__file__).parent / "results" / "campaign_v2" / "RULES_v2.md"
CLAIM_NAMES = {
    "C1": "continued training",
    "C2": "model size",
    "C3": "training algorithm",
    "C4": "lookup table (diagnostic)",
    "C5": "adversary on the read-out",
    "C6": "selection by flatness",
}
NO_ADVERSARY = "undecided (no adversary weight stays saturated: C5 not run)"


def secondary_readouts(layers: int = rules.LAYERS) -> list[str]:
    """The read-outs beside the primary: the other layers' probes (``hidden_states`` 0 .. L-1), the fine-tuning."""
    return [f"layer{k}" for k in range(layers)] + [FINETUNE]


def rule_text(claim: str, path: Path = RULES_FILE) -> str:
    """The claim's paragraph of RULES_v2.md's claims section (the bullet starting ``- **C1 ``), on one line."""
    lines = path.read_text().splitlines()
    begin = next(i for i, line in enumerate(lines) if line.startswith(f"- **{claim} "))
    end = next((i for i in range(begin + 1, len(lines)) if not lines[i].startswith("  ")), len(lines))
    return " ".join(line.strip() for line in lines[begin:end])


def start_record(starts: Mapping[str, dict], width: int, seed: int) -> dict[str, Any] | None:
    """A finished start of starts.json as a record (``excluded`` when it missed the margin), else None."""
    row = starts.get(start_key(width, seed))
    if row is None or row.get("status") != "done":
        return None
    measured = row["measured"]
    record = {
        "key": f"start/h{width}/seed{seed}",
        "kl": measured["kl"],
        "ci_high": measured["saturation"]["ci_high"],
        "fisher_trace": measured["fisher_trace"],
        "checkpoint": row["checkpoint"],
    }
    if not row["margin_met"]:
        record["excluded"] = "start missed the margin"
    return record


def with_reads(record: dict[str, Any], store: ReadStore, sizes: RulerSizes) -> dict[str, Any]:
    """``record`` with ``reads``: each of its read-outs the store holds on every split it covers."""
    entry = store.reads.get(record["key"])
    held = entry["readouts"] if entry else {}
    reads = {r: compact_read(entry, r, sizes) for r in held}
    return {**record, "reads": {r: read for r, read in reads.items() if read is not None}}


def claim_records(
    claim: str,
    runs: Mapping[str, dict],
    starts: Mapping[str, dict],
    store,
    sizes,
    *,
    widths: Sequence[int] = rules.WIDTHS,
    base_width: int = rules.V1_WIDTH,
) -> dict[str, Any]:
    """What ``claim``'s rule reads, from the finished units of runs.json and starts.json and the read-outs (C2:
    ``widths``; C4: the starts of ``base_width``)."""

    def read(record):
        return with_reads(record, store, sizes)

    def done(key):
        row = runs.get(key)
        return row if row is not None and row.get("status") == "done" else None

    seeds = [str(s) for s in rules.SEEDS]
    c1 = {}
    for s in seeds:
        if row := done(f"c1/seed{s}"):
            c1[s] = {"start": read(row["start"]), "branches": [read(b) for b in row["branches"]]}
    if claim in ("C1", "C6"):
        return {"seeds": c1}
    if claim == "C4":
        base_starts = {s: start_record(starts, base_width, int(s)) for s in seeds}
        baselines = {name: read({"key": f"baseline/{name}"}) for name in rules.C4_BASELINES}
        return {
            "starts": {s: read(r) for s, r in base_starts.items() if r is not None},
            "baselines": baselines,
            "c1_last_branch": {s: r["branches"][-1] for s, r in c1.items() if r["branches"]},
        }
    if claim == "C5":
        adversarial = {s: read(row["branch"]) for s in seeds if (row := done(f"c5/seed{s}"))}
        return {"adversarial": adversarial, "plain": {s: r["branches"][-1] for s, r in c1.items() if r["branches"]}}
    if claim == "C2":
        sizes_rows: dict[str, dict[str, Any]] = {}
        for width in widths:
            for s in seeds:
                if row := done(f"c2/h{width}/seed{s}"):
                    sizes_rows.setdefault(str(width), {})[s] = read(row["branch"])
        return {"sizes": sizes_rows}
    if claim == "C3":
        arms: dict[str, dict[str, Any]] = {}
        for key, row in runs.items():
            if key.startswith("c3/") and row.get("status") == "done":
                arms.setdefault(str(row["seed"]), {})[row["arm"]] = read(row["branch"])
        return {"seeds": arms}
    raise ValueError(f"unknown claim {claim!r}; expected one of {list(CLAIM_NAMES)}.")


def claim_verdict(claim: str, records: Mapping[str, Any], pilots: Mapping[str, Any], tier: str, readout: str) -> dict:
    """One verdict row of ``claim`` from its JSON's ``records`` and ``pilots`` (C3's arms, C5's weight)."""
    planned = len(rules.SEEDS)
    if claim == "C1":
        return {**v.c1_verdict(records["seeds"], planned, tier, readout), "dose": pilots.get("dose")}
    if claim == "C6":
        return v.c6_verdict(records["seeds"], planned, tier, readout)
    if claim == "C4":
        return v.c4_verdict(records["starts"], records["baselines"], planned, tier, readout)
    if claim == "C5":
        if pilots.get("adversary_weight") is None:
            return {"verdict": NO_ADVERSARY, "tier": tier, "readout": readout, "reads_pending": []}
        return v.c5_verdict(records["adversarial"], records["plain"], planned, tier, readout)
    if claim == "C2":
        return v.c2_verdict(records["sizes"], planned, tier, readout)
    if claim == "C3":
        return v.c3_verdict(records["seeds"], pilots["c3_arms"], planned, tier, readout)
    raise ValueError(f"unknown claim {claim!r}; expected one of {list(CLAIM_NAMES)}.")


def claim_verdicts(claim: str, records: Mapping[str, Any], pilots: Mapping[str, Any], layers: int) -> dict[str, Any]:
    """Every verdict row of a claim: ``verdict`` (saturated tier, primary probe), ``sensitivity_matched`` (matched
    tier, primary) and ``secondary`` (saturated tier, each other read-out of models of ``layers`` layers)."""
    return {
        "verdict": claim_verdict(claim, records, pilots, "saturated", PRIMARY),
        "sensitivity_matched": claim_verdict(claim, records, pilots, "matched", PRIMARY),
        "secondary": {r: claim_verdict(claim, records, pilots, "saturated", r) for r in secondary_readouts(layers)},
    }


def claim_payload(
    claim: str, records: dict[str, Any], pilots: dict[str, Any], sizes: RulerSizes, layers: int
) -> dict[str, Any]:
    """A claim's JSON: rule, constants, pilots' decisions, ruler, records and verdicts (models of ``layers``)."""
    return {
        "claim": f"{claim} {CLAIM_NAMES[claim]} (campaign v2)",
        "rule": rule_text(claim),
        **rules_header("claims"),
        "pilots": pilots,
        "ruler": {**sizes.__dict__, "pool": "ruler.ruler_pool, SeedSequence([0, 33]): the gate's rows and splits"},
        "layers": layers,
        "records": records,
        **claim_verdicts(claim, records, pilots, layers),
    }


# ---------------------------------------------------------------- the docs' rows


def contrast_row(claim: str, verdict: Mapping[str, Any]) -> Mapping[str, Any]:
    """The row of the claim's main contrast (`verdicts_v2.decide`'s: ``difference``, ``reading``), {} if none yet."""
    key = {"C2": "accuracy_difference", "C3": "flattest_minus_sharpest", "C4": "mean_over_tasks"}.get(claim)
    return (verdict.get(key) or {}) if key else verdict


def headline(claim: str, verdict: Mapping[str, Any]) -> dict[str, Any] | None:
    """The claim's main contrast: estimate and two-way interval, or None where there is none yet."""
    return contrast_row(claim, verdict).get("difference")


def _interval(interval: Mapping[str, Any] | None) -> str:
    if not interval:
        return "–"
    low, high = interval["ci"]
    return f"{interval['mean']:+.4f} [{low:+.4f}, {high:+.4f}]"


def _verdict_cell(claim: str, verdict: Mapping[str, Any]) -> str:
    reading = contrast_row(claim, verdict).get("reading")
    return f"**{verdict['verdict']}**" + (f" ({reading})" if reading and verdict["verdict"] in ("PASS", "FAIL") else "")


def claims_markdown(claims_dir: Path) -> str:
    """The claims' table of docs/reproduction/campaign_v2.md from the claim files on disk ('' when there is none)."""
    lines = []
    for claim in rules.CLAIMS:
        path = claims_dir / f"{claim}.json"
        if not path.exists():
            continue
        payload = json.loads(path.read_text())
        primary, matched, secondary = payload["verdict"], payload["sensitivity_matched"], payload["secondary"]
        layers = " / ".join(_interval(headline(claim, secondary[f"layer{k}"])) for k in range(payload["layers"]))
        lines.append(
            f"| {claim} {CLAIM_NAMES[claim]} | {_verdict_cell(claim, primary)} "
            f"| {len(primary.get('seeds_compared', []))} | {_interval(headline(claim, primary))} "
            f"| {matched['verdict']}: {_interval(headline(claim, matched))} "
            f"| {_interval(headline(claim, secondary[FINETUNE]))} | {layers} |"
        )
    if not lines:
        return ""
    header = [
        "| claim | verdict (saturated tier, ruler) | seeds compared | contrast, two-way 95% | matched tier "
        "(sensitivity) | fine-tuning | layers 0 / 1 / 2 |",
        "|---|---|---|---|---|---|---|",
    ]
    return "\n".join(header + lines + _c4_rows(claims_dir))


def _c4_rows(claims_dir: Path) -> list[str]:
    """C4's rows: each baseline's and the starts' mean read-out per task over the splits."""
    path = claims_dir / "C4.json"
    if not path.exists():
        return []
    records = json.loads(path.read_text())["records"]
    rows = [(f"baseline {name}", r) for name, r in records["baselines"].items()]
    rows += [(f"H64 start seed {s}", r) for s, r in records["starts"].items()]
    lines = ["", "| C4 row | " + " | ".join(TASKS) + " | mean |", "|---|" + "---|" * (len(TASKS) + 1)]
    for name, record in rows:
        read = record.get("reads", {}).get(PRIMARY)
        values = [] if read is None else [*(read["tasks"][t] for t in TASKS), read["mean"]]
        cells = [f"{np.mean(x):.4f}" for x in values] or ["–"] * (len(TASKS) + 1)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines
