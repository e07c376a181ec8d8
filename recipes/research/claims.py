"""The saturated-start campaign's result files: one JSON per claim under the results folder, each holding its rule
(on disk before its first run), the design, per-seed records and the verdict recomputed from those records alone;
the C1 plot; the markdown the docs quote. Reads only what `campaign`'s phases left on disk.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

from hf_flatbias.results import write_json

from .campaign import RATE_RULE, ROUTE, SHAPES, continue_spec, finished_from_disk
from .paper_probes import mcnemar, without_predictions
from .plots import plot_branches, plot_claims
from .protocol import reference_rows
from .verdicts import (
    C1_RULE,
    C2_RULE,
    C2_SIZES,
    C3_ARMS,
    C3_RULE,
    C4_RULE,
    C5_RULE,
    C6_RULE,
    CLAIM_FILES,
    c2_verdict,
    c3_verdict,
    c4_verdict,
    c5_verdict,
    c6_verdict,
    saturated_start_c1,
)


def write_c3(args) -> dict[str, Any]:
    """``optimizer.json``: the rule, every finished arm of every seed, the verdict (in progress until all are in)."""
    seeds: dict[str, dict[str, Any]] = {}
    for seed in args.seeds:
        for arm in C3_ARMS:
            done = args.work_dir / f"seed{seed}" / "c3" / arm / "result.json"
            if done.exists():
                seeds.setdefault(str(seed), {})[arm] = json.loads(done.read_text())["record"]
    payload = {
        "claim": "C3 training algorithm (from a saturated start)", "rule": C3_RULE, "rule_fixed_before_runs": True,
        "arms": {arm: dict(zip(("dropout", "weight_decay", "sam"), v, strict=True)) for arm, v in C3_ARMS.items()},
        **design(args), "planned_seeds": args.seeds, "verdict": c3_verdict(seeds, len(args.seeds)), "seeds": seeds,
    }  # fmt: skip
    write_json(args.results_dir / "optimizer.json", payload)
    return payload


def design(args) -> dict[str, Any]:
    skip = {"stop_after", "merge", "use_cpu", "figures_dir"}  # where figures go is no part of the design
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in skip}
    return {"route": ROUTE, "shape": SHAPES[config["shape"]], "config": config}


def paired_comparisons(records: list[dict[str, Any]], start: dict[str, Any]) -> dict[str, Any]:
    """McNemar of the primary probe, every pair of branches (and the start against each), per task."""
    named = {"start": start, **{f"step{r['step']}": r for r in records}}
    return {
        f"{a}_vs_{b}": {
            task: mcnemar(named[a]["probe"][task]["correct"], named[b]["probe"][task]["correct"])
            for task in named[b]["probe"]
        }
        for a, b in itertools.combinations(named, 2)
    }


def write_results(args, language, results: dict[int, dict], starts: dict[int, dict], rate, references) -> dict:
    """``continued_training.json`` and its plot from every finished seed (and the rule, before any has)."""
    seeds = {str(s): r["records"] for s, r in results.items()}
    payload = {
        "claim": "C1 continued training (from a saturated start)",
        "rule": C1_RULE,
        "rule_fixed_before_runs": True,
        "rate_rule": RATE_RULE,
        **design(args),
        "planned_seeds": args.seeds,
        "finished_seeds": sorted(results),
        "continued_training_rate": rate,
        "references": references,
        "verdict": saturated_start_c1(seeds, len(args.seeds)),
        "seeds": {
            str(s): {
                "start": {**starts[s]["distillation"], "measured": starts[s]["measured"]},
                "branches": r["records"],
                "mcnemar": paired_comparisons(r["records"], starts[s]["measured"]),
            }
            for s, r in results.items()
        },
        "cost_seconds": {
            str(s): {"distillation": starts[s]["distillation"]["seconds"], "continued": r.get("seconds_this_run")}
            for s, r in results.items()
        },
    }
    write_json(args.results_dir / "continued_training.json", payload)
    if results:
        plot_branches(
            {s: [{**starts[int(s)]["measured"], "step": 0}, *records] for s, records in seeds.items()},
            args.figures_dir / "continued_training.png",
            "C1 from a saturated start (distilled; step 0 = the start, later points = annealed branches)",
            references=references,
        )
    return payload


def markdown_summary(args) -> str:
    """The C1 results as docs/reproduction/synthetic.md shows them: verdict line, rate pilot, references, per seed a
    table of the start and its branches and the seed's rule statistics."""
    payload = json.loads((args.results_dir / "continued_training.json").read_text())
    verdict, lines = payload["verdict"], []
    lines += [
        f"C1 (saturated start): **{verdict['verdict']}** (regime of the compared branches: {verdict['regime']})",
        "",
    ]
    pilot_path = args.work_dir / "rate_pilot.json"
    if pilot_path.exists():
        pilot = json.loads(pilot_path.read_text())
        pilots = "; ".join(
            f"{p['learning_rate']:g}: KL {p['kl']:.4f} [{p['saturation']['ci_low']:.4f}, "
            f"{p['saturation']['ci_high']:.4f}]"
            for p in pilot["pilots"]
        )
        lines += [
            f"**Rate pilot** (seed 0, one branch interval then the anneal): {pilots}; chosen **{pilot['chosen']:g}**.",
            "",
        ]

    def tasks(row):
        return " / ".join(f"{t['accuracy']:.3f}" for t in row["probe"].values())

    references = payload.get("references") or {}
    lines += [
        "**Reference rows** (the fixed test set; A / B / C, mean): "
        + "; ".join(
            f"{name.replace('_', ' ')} {tasks(r)} ({r['probe_accuracy']:.3f})" for name, r in references.items()
        )
        + ".",
        "",
    ]
    header = (
        "| point | KL [95% CI] | saturated | Fisher trace (output layer + rest) | Hutchinson, data-label loss "
        "| primary probe A / B / C (mean) | layers 0 / 1 / 2 (mean) |"
    )
    for seed, row in payload["seeds"].items():
        start = row["start"]
        lines += [
            f"**Seed {seed}**: distilled in {start['steps']:,} steps ({start['seconds']:.0f} s wall), stop-set KL "
            f"{start['stop_kl']['kl']:.4f} (upper {start['stop_kl']['ci_high']:.4f}).",
            "",
            header,
            "|---|---|---|---|---|---|---|",
        ]
        for name, r in [("start", start["measured"])] + [(f"branch {b['step']}", b) for b in row["branches"]]:
            layers = " / ".join(f"{x['probe_accuracy']:.3f}" for x in r.get("probe_by_layer", {}).values())
            lines.append(
                f"| {name} | {r['kl']:.4f} [{r['saturation']['ci_low']:.4f}, {r['saturation']['ci_high']:.4f}] "
                f"| {'yes' if r['saturated'] else 'no'} | {r['fisher_trace']:.1f} ± {r['fisher_trace_stderr']:.1f} "
                f"({r['fisher_trace_output_layer']:.1f} + {r['fisher_trace_rest']:.1f}) "
                f"| {r['hutchinson_trace_data_loss']:.1f} ± {r['hutchinson_trace_data_loss_stderr']:.1f} "
                f"| {tasks(r)} ({r['probe_accuracy']:.3f}) | {layers} |"
            )
        per_seed = verdict["per_seed"][seed]
        first, last = row["branches"][0]["step"], row["branches"][-1]["step"]
        paired = row["mcnemar"][f"step{first}_vs_step{last}"]
        rho, gain = per_seed.get("spearman_step_trace"), per_seed.get("accuracy_gain")
        lines += [
            "",
            f"Seed {seed}: compared branches {per_seed['regime']} ({verdict['branches_saturated'][seed]} saturated); "
            f"Spearman(step, Fisher trace) {'n/a' if rho is None else f'{rho:+.2f}'}; last-minus-first primary "
            f"accuracy {'n/a' if gain is None else f'{gain:+.4f}'}; McNemar last vs first branch: "
            + ", ".join(f"{t} {x['difference']:+.3f} (p {x['p_value']:.2f})" for t, x in paired.items())
            + ".",
            "",
        ]
    return "\n".join(lines)


def _last_records(args, claim: str) -> dict[str, dict[str, Any]]:
    """``{seed: last branch record}`` of every finished seed of a one-branch claim (``c5``) or of C1."""
    out = {}
    for seed in args.seeds:
        done = args.work_dir / f"seed{seed}" / claim / "result.json"
        if done.exists():
            payload = json.loads(done.read_text())
            out[str(seed)] = payload["records"][-1] if claim == "c1" else payload["record"]
    return out


def write_c4(args, references: dict[str, Any]) -> dict[str, Any]:
    """``lookup_table.json``: C4 from the seeds' starts, their last C1 branches and the lookup-table row."""
    every_start = {}
    for seed in args.seeds:
        path = args.work_dir / f"seed{seed}" / "start" / "start.json"
        if path.exists():
            every_start[str(seed)] = json.loads(path.read_text())["measured"]
    last = _last_records(args, "c1")
    payload = {
        "claim": "C4 lookup table vs saturated models (from a saturated start)", "rule": C4_RULE,
        "rule_fixed_before_runs": "before the comparison; C1's measurements were already on disk",
        **design(args), "planned_seeds": args.seeds, "references": references,
        "verdict": c4_verdict(every_start, last, references["exact_conditionals"], len(args.seeds)),
        "seeds": {s: {"start": without_predictions(r), "last_c1_branch": without_predictions(last[s]) if s in last
                      else None} for s, r in every_start.items()},
    }  # fmt: skip
    write_json(args.results_dir / "lookup_table.json", payload)
    return payload


#: what C6's file keeps of each C1 branch: all that its rule reads
SELECTION_KEYS = ("step", "kl", "saturated", "saturation", "fisher_trace", "probe_accuracy")


def write_c6(args) -> dict[str, Any]:
    """``selection.json``: C6 from every finished seed's C1 branches."""
    results, _, _ = finished_from_disk(args)
    seeds = {str(s): r["records"] for s, r in results.items()}
    payload = {
        "claim": "C6 flatness-based selection vs the lowest KL (from a saturated start)", "rule": C6_RULE,
        "rule_fixed_before_runs": "before the selection; C1's measurements were already on disk",
        **design(args), "planned_seeds": args.seeds, "verdict": c6_verdict(seeds, len(args.seeds)),
        "seeds": {s: [{k: r[k] for k in SELECTION_KEYS} for r in rows] for s, rows in seeds.items()},
    }  # fmt: skip
    write_json(args.results_dir / "selection.json", payload)
    return payload


def write_c5(args) -> dict[str, Any]:
    """``adversarial.json``: C5 from every finished adversarial seed against its last C1 branch."""
    adversarial, plain = _last_records(args, "c5"), _last_records(args, "c1")
    payload = {
        "claim": "C5 adversary on the evaluated read-out (from a saturated start)", "rule": C5_RULE,
        "rule_fixed_before_runs": True, "adversary_weight": args.adversary_weight, **design(args),
        "planned_seeds": args.seeds, "verdict": c5_verdict(adversarial, plain, len(args.seeds)),
        "seeds": {s: {"adversarial": without_predictions(r), "c1_last_branch": without_predictions(plain[s])
                      if s in plain else None} for s, r in adversarial.items()},
    }  # fmt: skip
    write_json(args.results_dir / "adversarial.json", payload)
    return payload


def write_c2(args) -> dict[str, Any]:
    """``model_size.json``: C2 from every finished width of every seed."""
    sizes: dict[int, dict[str, dict[str, Any]]] = {hidden: {} for hidden in C2_SIZES}
    starts: dict[int, dict[str, dict[str, Any]]] = {hidden: {} for hidden in C2_SIZES}
    for seed, hidden in itertools.product(args.seeds, C2_SIZES):
        done = args.work_dir / f"seed{seed}" / "c2" / f"h{hidden}" / "result.json"
        if done.exists():
            payload = json.loads(done.read_text())
            sizes[hidden][str(seed)] = without_predictions(payload["record"])
            starts[hidden][str(seed)] = {k: v for k, v in payload["start"].items() if k != "measured"}
    payload = {
        "claim": "C2 model size (from saturated starts)", "rule": C2_RULE, "rule_fixed_before_runs": True,
        **design(args), "planned_seeds": args.seeds, "sizes": list(C2_SIZES),
        "verdict": c2_verdict(sizes, len(args.seeds)),
        "seeds": {str(h): rows for h, rows in sizes.items()}, "distillation": {str(h): s for h, s in starts.items()},
    }  # fmt: skip
    write_json(args.results_dir / "model_size.json", payload)
    return payload


def verdict_table(results_dir: Path) -> str:
    """One markdown row per claim file on disk: the claim, its verdict and regime, its file."""
    lines = ["| claim | verdict | file |", "|---|---|---|"]
    for claim, name in CLAIM_FILES.items():
        path = results_dir / name
        if path.exists():
            verdict = json.loads(path.read_text())["verdict"]
            regime = verdict.get("regime")
            shown = verdict["verdict"] + (f" (compared branches: {regime})" if regime else "")
            lines.append(f"| {claim} | {shown} | `{name}` |")
    return "\n".join(lines)


def _interval(row: dict[str, Any] | None) -> str:
    if not row or not row.get("difference"):
        return "n/a"
    low, high = row["difference"]["ci"]
    return f"{row['difference']['mean']:+.4f} [{low:+.4f}, {high:+.4f}]"


def claims_markdown(results_dir: Path) -> str:
    """Tables of C3-C6 (those with a file on disk) as docs/reproduction/synthetic.md shows them."""
    lines: list[str] = []

    def load(name):
        path = results_dir / name
        return json.loads(path.read_text()) if path.exists() else None

    if c4 := load(CLAIM_FILES["C4"]):
        v = c4["verdict"]
        tasks = list(c4["references"]["exact_conditionals"]["probe"])
        lookup = c4["references"]["exact_conditionals"]["probe"]
        lines += [
            f"C4 (lookup table): **{v['verdict']}**",
            "",
            "| seed | start KL | start A / B / C | minus lookup A / B / C |",
            "|---|---|---|---|",
        ]
        for seed, row in c4["seeds"].items():
            start = row["start"]
            accuracy = [start["probe"][t]["accuracy"] for t in tasks]
            lines.append(
                f"| {seed} | {start['kl']:.4f} | " + " / ".join(f"{a:.3f}" for a in accuracy) + " | "
                + " / ".join(f"{a - lookup[t]['accuracy']:+.3f}" for a, t in zip(accuracy, tasks, strict=True)) + " |"
            )  # fmt: skip
        lines += [
            "| lookup | - | " + " / ".join(f"{lookup[t]['accuracy']:.3f}" for t in tasks) + " | - |",
            "",
            "Seed-level 95% intervals of model minus lookup: "
            + "; ".join(f"{t} {_interval(v['per_task'][t])}" for t in tasks)
            + f"; mean over tasks {_interval(v['mean_over_tasks'])}.",
            "",
        ]
    if c6 := load(CLAIM_FILES["C6"]):
        v = c6["verdict"]
        lines += [
            f"C6 (selection by flatness): **{v['verdict']}** (compared branches: {v['regime']})",
            "",
            "| seed | regime | chosen (smallest trace within 0.01 nats) | lowest KL | accuracy, chosen minus lowest |",
            "|---|---|---|---|---|",
        ]
        for seed, pick in v["picks"].items():
            rows = {r["step"]: r for r in c6["seeds"][seed]}
            chosen, low = rows[pick["chosen_step"]], rows[pick["lowest_kl_step"]]
            lines.append(
                f"| {seed} | {pick['regime']} | step {chosen['step']}: trace {chosen['fisher_trace']:.1f}, KL "
                f"{chosen['kl']:.4f}, acc {chosen['probe_accuracy']:.3f} | step {low['step']}: trace "
                f"{low['fisher_trace']:.1f}, KL {low['kl']:.4f}, acc {low['probe_accuracy']:.3f} | "
                f"{v['per_seed_difference'][seed]:+.4f} |"
            )
        lines += ["", f"Seed-level 95% interval of the difference: {_interval(v)}.", ""]
    if (c3 := load(CLAIM_FILES["C3"])) and c3["seeds"]:
        lines += [f"C3 (optimizer arms): **{c3['verdict']['verdict']}**", "", "| seed | " + " | ".join(C3_ARMS) + " |"]
        lines.append("|---|" + "---|" * len(C3_ARMS))
        for seed, arms in c3["seeds"].items():
            cells = [
                f"KL {arms[a]['kl']:.4f}, trace {arms[a]['fisher_trace']:.1f}, acc {arms[a]['probe_accuracy']:.3f}"
                if a in arms else "-"
                for a in C3_ARMS
            ]  # fmt: skip
            lines.append(f"| {seed} | " + " | ".join(cells) + " |")
        lines.append("")
    if (c5 := load(CLAIM_FILES["C5"])) and c5["seeds"]:
        v = c5["verdict"]
        lines += [
            f"C5 (adversary on the read-out): **{v['verdict']}**",
            "",
            "| seed | adversarial: KL, trace, acc | C1 last branch: KL, trace, acc |",
            "|---|---|---|",
        ]
        for seed, row in c5["seeds"].items():
            cells = [
                f"{r['kl']:.4f}, {r['fisher_trace']:.1f}, {r['probe_accuracy']:.3f}" if r else "-"
                for r in (row["adversarial"], row["c1_last_branch"])
            ]
            lines.append(f"| {seed} | {cells[0]} | {cells[1]} |")
        lines += [
            "",
            f"Adversarial minus C1, seed-level 95% intervals: accuracy {_interval(v['accuracy_difference'])}; "
            f"Fisher trace {_interval(v['fisher_trace_difference'])}.",
            "",
        ]
    if (c2 := load(CLAIM_FILES["C2"])) and any(c2["seeds"].values()):
        lines += [
            f"C2 (model size): **{c2['verdict']['verdict']}**",
            "",
            "| width | seed | KL | trace (own / H128 space) | acc |",
        ]
        lines.append("|---|---|---|---|---|")
        for width, rows in c2["seeds"].items():
            for seed, r in rows.items():
                lines.append(
                    f"| {width} | {seed} | {r['kl']:.4f} | {r['fisher_trace']:.1f} / {r['fisher_trace_enlarged']:.1f} "
                    f"| {r['probe_accuracy']:.3f} |"
                )
        lines.append("")
    return "\n".join(lines)


def references_of(args, language) -> dict[str, Any]:
    """The probe rows without pre-training (lexical, untrained encoder, lookup table), measured once per work folder."""
    path = args.work_dir / "references.json"
    if path.exists():
        return json.loads(path.read_text())
    rows = reference_rows(language, continue_spec(args, args.seeds[0], 0.0, args.branch_every))
    references = {name: without_predictions(row) for name, row in rows.items()}
    write_json(path, references)
    return references


def write_rules(args) -> None:
    """Each requested claim's file with its rule (and no seeds) unless it exists: the rule is on disk first."""
    writers = {"c1": lambda: write_results(args, None, {}, {}, None, None), "c3": lambda: write_c3(args),
               "c5": lambda: write_c5(args), "c2": lambda: write_c2(args)}  # fmt: skip
    for claim in ["c1", *args.claims]:
        if not (args.results_dir / CLAIM_FILES[claim.upper()]).exists():
            writers[claim]()


def write_claims(args, references: dict[str, Any]) -> dict[str, Any]:
    """Every claim's JSON from what is on disk and, once any of C2-C6 has a seed, their figure ``claims.png``;
    returns C1's."""
    later = [write_c3(args), write_c5(args), write_c2(args), write_c4(args, references), write_c6(args)]
    results, starts, rate = finished_from_disk(args)
    payload = write_results(args, None, results, starts, rate, references)
    # C2's seeds sit under each width: `any` of the values, not of the keys
    if any(any(claim["seeds"].values()) for claim in later):
        plot_claims(args.results_dir, args.figures_dir / "claims.png")
    return payload
