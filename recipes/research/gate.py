"""Issue 23's language gate: which synthetic language this CPU can distil to the saturated tier, at what cost, and
how much probe headroom its distilled start leaves above the lookup table (the exact conditionals as features).

Every candidate is distilled exactly as the campaign distils its starts (`campaign.distilled_start`, seed 0, the
campaign's width and schedule), so the rows compare languages, not recipes. A candidate equal to the campaign's own
language is read from the campaign's work folder, not distilled again. The HMM has no task of the released code, so
its row has the cost and the KL but no probe rows.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from hf_flatbias.results import write_json
from hf_flatbias.synthetic import build_model
from hf_flatbias.synthetic.conditionals import cached_conditionals
from hf_flatbias.synthetic.hmm import HMM
from hf_flatbias.synthetic.tokenizer import N_SPECIAL

from .campaign import SHAPES, distil_kwargs, distilled_start, material
from .claims import references_of
from .distillation import ConditionalPool, distil_to_saturation

EXTEND_BELOW = 0.030
GATE_RULE = (
    "Per candidate language, model seed 0 is distilled with the campaign's width and schedule (an 8,000-step decay "
    "from 2e-3, then decays of 4,000 steps from 5e-4 and 2.5e-4 while the stop set is not saturated; the extensions "
    f"only if the first decay ended at a stop-set KL <= {EXTEND_BELOW}, three times the tier). A candidate is "
    "eligible if its stop set reaches the saturated tier (KL <= 0.010, bootstrap upper end <= 0.015). Headroom = the "
    "distilled start's primary probe accuracy (mean over the released tasks A/B/C) minus the lookup-table row's; "
    "only PCFG candidates carry those tasks. Kept: the eligible candidate with the largest headroom; none eligible: "
    "none kept. Fixed before the gate's runs; the campaign's language had been chosen before, from the pilots."
)
CANDIDATES: dict[str, dict[str, Any]] = {
    "pcfg_three_level_g0": {"kind": "pcfg", "shape": "three_level", "grammar_seed": 0},
    "pcfg_three_level_g1": {"kind": "pcfg", "shape": "three_level", "grammar_seed": 1},
    "pcfg_paper_g0": {"kind": "pcfg", "shape": "paper", "grammar_seed": 0},
    "hmm_20_states_40_words": {"kind": "hmm", "seed": 0, "n_states": 20, "n_words": 40, "length": 12},
}
GATE_SEED = 0
REFERENCE_ROWS = ("lexical_baseline", "untrained_encoder", "exact_conditionals")


def gate_choice(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """`GATE_RULE`'s answer from the candidates' rows (``eligible`` and, for PCFG candidates, ``headroom``)."""
    eligible = {name: row for name, row in rows.items() if row["eligible"] and row.get("headroom") is not None}
    kept = max(eligible, key=lambda name: eligible[name]["headroom"]) if eligible else None
    return {"eligible": sorted(eligible), "kept": kept}


def pcfg_row(args: argparse.Namespace, name: str, candidate: dict[str, Any]) -> dict[str, Any]:
    """A PCFG candidate's row: its seed-0 start distilled (or read from the campaign's folder) and measured, and the
    reference probe rows of its language."""
    own = (candidate["shape"], candidate["grammar_seed"]) == (args.shape, args.grammar_seed)
    work_dir = args.work_dir if own else args.work_dir / "gate" / name
    # n_train 1: the gate distils from the pool and never continues, so no training sentences need drawing
    changes = {
        "shape": candidate["shape"],
        "grammar_seed": candidate["grammar_seed"],
        "work_dir": work_dir,
        "n_train": 1,
    }
    language_args = argparse.Namespace(**{**vars(args), **changes})
    language, pool, stop_set = material(language_args)
    _, start = distilled_start(language_args, language, pool, stop_set, GATE_SEED)
    references = references_of(language_args, language)
    measured, distillation = start["measured"], start["distillation"]
    lookup = references["exact_conditionals"]["probe_accuracy"]
    return {
        **candidate,
        "shape_arguments": SHAPES[candidate["shape"]],
        "read_from_campaign": own,
        "n_words": len(language.grammar.words()),
        "max_length": language.width,
        "mean_length": float(language.kl_sentences.lengths.mean()),
        "distillation": distillation,
        "measured": {key: measured[key] for key in ("kl", "saturated", "saturation", "fisher_trace", "probe")},
        "eligible": bool(distillation["saturated"]),
        "probe_rows": {
            **{row: value["probe_accuracy"] for row, value in references.items()},
            "distilled_start": measured["probe_accuracy"],
        },
        "headroom": measured["probe_accuracy"] - lookup,
    }


def hmm_row(args: argparse.Namespace, name: str, candidate: dict[str, Any]) -> dict[str, Any]:
    """An HMM candidate's row: the same distillation on its exact conditionals (one forward-backward pass per
    sentence), the stop set's KL; no probe rows (no released task)."""
    hmm = HMM.from_seed(candidate["seed"], n_states=candidate["n_states"], n_words=candidate["n_words"])
    pools = []
    for offset, n in enumerate((args.n_pool, args.n_stop)):
        sample = hmm.sample(n, candidate["length"], seed=1000 * (candidate["seed"] + 1) + offset)
        lengths = np.full(n, candidate["length"])
        conditionals = cached_conditionals(hmm, sample.word_ids, cache_dir=args.work_dir / "gate" / "cache")
        pools.append(ConditionalPool(sample.word_ids, lengths, conditionals))
    model = build_model(N_SPECIAL + hmm.n_words, hidden=args.hidden, layers=args.layers, seed=GATE_SEED)
    print(f"[{name}] distilling ({sum(p.numel() for p in model.parameters()):,} parameters)", flush=True)
    checkpoint = args.work_dir / "gate" / name / "distillation.pt"
    distillation = distil_to_saturation(model, *pools, seed=GATE_SEED, checkpoint=checkpoint, **distil_kwargs(args))
    return {
        **candidate,
        "n_words": hmm.n_words,
        "max_length": candidate["length"],
        "mean_length": float(candidate["length"]),
        "distillation": distillation,
        "eligible": bool(distillation["saturated"]),
        "probe_rows": None,
        "headroom": None,
    }


def run_gate(args: argparse.Namespace, names: list[str], path: Path) -> dict[str, Any]:
    """Each named candidate's row (computed once, then read from ``WORK/gate/NAME/row.json``) and the rule's answer,
    rewritten to ``path`` after every candidate."""
    payload: dict[str, Any] = {"rule": GATE_RULE, "extend_below": EXTEND_BELOW, "seed": GATE_SEED, "candidates": {}}
    args = argparse.Namespace(**{**vars(args), "extend_below": EXTEND_BELOW})
    for name in names:
        row_path = args.work_dir / "gate" / name / "row.json"
        if row_path.exists():
            row = json.loads(row_path.read_text())
        else:
            began = time.perf_counter()
            candidate = CANDIDATES[name]
            row = (pcfg_row if candidate["kind"] == "pcfg" else hmm_row)(args, name, candidate)
            row["seconds_this_run"] = time.perf_counter() - began
            write_json(row_path, row)
            (row_path.parent / "distillation.pt").unlink(missing_ok=True)
        payload["candidates"][name] = row
        payload["choice"] = gate_choice(payload["candidates"])
        write_json(path, payload)
        print(f"[gate] {name}: stop-set KL {row['distillation']['stop_kl']['kl']:.4f} after "
              f"{row['distillation']['steps']} steps, headroom {row['headroom']}", flush=True)  # fmt: skip
    return payload


def gate_markdown(path: Path) -> str:
    """The gate's table as docs/reproduction/synthetic.md shows it (empty when the gate has not run)."""
    if not path.exists():
        return ""
    gate = json.loads(path.read_text())
    lines = [
        f"Language gate (`{path.name}`): eligible {', '.join(gate['choice']['eligible']) or 'none'}; "
        f"kept **{gate['choice']['kept'] or 'none'}**",
        "",
        "| candidate | words | mean length | steps | CPU min | stop-set KL [95%] | eligible | lexical / untrained / "
        "lookup / start | headroom |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in gate["candidates"].items():
        distillation, kl = row["distillation"], row["distillation"]["stop_kl"]
        # the campaign's own start predates cpu_seconds: its wall seconds under load are shown, marked
        cpu = f"{distillation['cpu_seconds'] / 60:.1f}" if "cpu_seconds" in distillation else (
            f"{distillation['seconds'] / 60:.1f} (wall)"
        )  # fmt: skip
        rows = row["probe_rows"]
        probes = " / ".join(f"{rows[k]:.3f}" for k in (*REFERENCE_ROWS, "distilled_start")) if rows else "no tasks"
        headroom = "n/a" if row["headroom"] is None else f"{row['headroom']:+.3f}"
        lines.append(
            f"| {name} | {row['n_words']} | {row['mean_length']:.1f} | {distillation['steps']:,} | {cpu} | "
            f"{kl['kl']:.4f} [{kl['ci_low']:.4f}, {kl['ci_high']:.4f}] | {'yes' if row['eligible'] else 'no'} | "
            f"{probes} | {headroom} |"
        )
    return "\n".join(lines)
