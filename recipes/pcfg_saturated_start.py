"""The paper's claims from a saturated start (issue 23): distil the exact conditionals to the optimum, then continue
with the paper's objective and measure annealed branches. One resumable campaign on one CPU core.

ROUTE (ours, not the paper's training): per model seed, a BERT (H64-L3 by default) is distilled on the exact
conditionals of `PCFG.paper_shaped(G, n_levels=3, symbols_per_level=5, n_words=50, binary_rules_per_symbol=10)`
(soft cross-entropy, one [MASK] per row, a pool of 30k sentences with every position's conditional, AdamW beta2
0.98, weight decay 0.01, clip 1, lr 2e-3, warm-up 200, linear decay to 0 over 8,000 steps, extended by further
decays while not saturated) until a held-out stop set is saturated (KL <= 0.010, bootstrap upper end <= 0.015).
From that start the trunk continues with the paper's objective (a sampled data token at one [MASK] per row) under
AdamW (beta2 0.98, weight decay 0.01) at a constant rate after a 100-step warm-up; every ``--branch-every`` steps a
branch (weights and Adam state) is annealed linearly to lr 0 over ``--anneal-steps`` and measured on material fixed
by the grammar seed: KL over every position of ``--n-kl`` held-out sentences with a bootstrap interval, the Fisher
trace with its output-layer term and the rest, the Hutchinson trace of the data-label loss, and linear probes of
tasks A/B/C (primary: the released code's read-out, last layer, fixed positions concatenated; layers 0..L-1 beside).

RATE (rule fixed before the runs): the constant rate is the largest of ``--continue-lrs`` whose one pilot branch
(seed 0, ``--branch-every`` steps, annealed, KL only) is saturated; none saturated: the smallest. Only the KL decides.

C1 RULE (fixed before the runs, `hf_flatbias.experiments.verdicts.C1_RULE`): PASS if Spearman(step, Fisher trace) < 0
among the saturated branches in >= 4 of 5 seeds AND last-minus-first primary probe accuracy has a 95% seed-level t
interval above 0; a verdict is "undecided (runs in progress: k of 5 seeds)" until every seed has finished.

C3 RULE (fixed before its runs, `hf_flatbias.experiments.verdicts.C3_RULE`): after C1's seeds, four arms per seed from
the same start (AdamW with dropout 0.1 and weight decay 0.01, with neither, each with SAM), one branch at the C1
length; the sharpest arm must transfer worst, with a seed-level interval; ``RESULTS/optimizer.json``.

Resumable: a finished distillation (``WORK/seedS/start``), rate pilot, seed (``WORK/seedS/c1/result.json``) or branch
(the trunk's checkpoint) is never recomputed; ``RESULTS/continued_training.json`` is rewritten after every seed.

    OMP_NUM_THREADS=1 nohup python recipes/pcfg_saturated_start.py > outputs/saturated_start/campaign.log 2>&1 &
    python recipes/pcfg_saturated_start.py --smoke --work-dir /tmp/w --results-dir /tmp/r     # seconds (tests)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import BertForMaskedLM

from hf_flatbias.experiments import (
    C1_RULE,
    RunSpec,
    build_model,
    mcnemar,
    measure_branch,
    reference_rows,
    saturated_start_c1,
    setup_paper_language,
    train_with_branches,
    trains_on_cpu,
    without_predictions,
    write_json,
)
from hf_flatbias.experiments.distillation import ConditionalPool, distil_to_saturation
from hf_flatbias.experiments.plots import plot_branches
from hf_flatbias.experiments.verdicts import C3_ARMS, C3_RULE, c3_verdict
from hf_flatbias.synthetic.conditionals import cached_conditionals

#: grammars by name: the one the CPU distillation pilot saturated (NOTES.md, "Distillation pilot, final"), and the
#: released grammar's shape (`PCFG.paper_shaped`'s defaults) for a GPU
SHAPES = {
    "three_level": {"n_levels": 3, "symbols_per_level": 5, "n_words": 50, "binary_rules_per_symbol": 10},
    "paper": {},
}
ROUTE = (
    "Saturated start reached by distilling the exact conditionals (soft targets; our route, not the paper's "
    "training), then continued training with the paper's objective (sampled data token, one [MASK] per row); every "
    "compared point is a branch annealed to lr 0, measured on exact conditionals."
)
RATE_RULE = (
    "The constant continued-training rate is the largest of the candidates whose one pilot branch (seed 0, one "
    "branch interval at that rate, annealed) is saturated (KL <= 0.010, upper <= 0.015); the smallest if none is. "
    "Chosen on the KL alone, before any trace or probe of the campaign is seen."
)


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--grammar-seed", type=int, default=0, help="seed of PCFG.paper_shaped")
    add("--shape", choices=sorted(SHAPES), default="three_level", help="PCFG.paper_shaped arguments (see SHAPES)")
    add("--device", choices=["cpu", "cuda", "auto"], default="cpu", help="where models train (probes fit on CPU)")
    add(
        "--stop-after",
        choices=["start", "rate"],
        default=None,
        help="stop once the seeds' starts (or also the rate pilot) are on disk: phases of a concurrent GPU run",
    )
    add("--merge", action="store_true", help="only write the results of the seeds finished on disk")
    add("--markdown", action="store_true", help="only print the committed C1 results as the docs' tables")
    add(
        "--claims",
        nargs="+",
        choices=["c1", "c3"],
        default=["c1", "c3"],
        help="claims in order: C1 for every seed first, then C3's arms for every seed",
    )
    add("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="model seeds, run in this order")
    add("--hidden", type=int, default=64, help="BERT hidden size")
    add("--layers", type=int, default=3, help="BERT layers")
    add("--batch-size", type=int, default=128, help="rows per step (distillation and continued training)")
    add("--n-pool", type=int, default=30_000, help="distillation pool sentences (every position's conditional)")
    add("--n-stop", type=int, default=1000, help="held-out sentences the distillation stops on (not the KL set)")
    add("--distil-steps", type=int, default=8000, help="steps of the first distillation decay")
    add("--distil-lr", type=float, default=2e-3, help="peak rate of the first distillation decay")
    add("--distil-warmup", type=int, default=200, help="warm-up steps of the first distillation decay")
    add(
        "--extensions",
        type=str,
        nargs="*",
        default=["4000:5e-4", "4000:2.5e-4"],
        help="further decays STEPS:PEAK, each used only while the stop set is not saturated",
    )
    add(
        "--continue-lrs",
        type=float,
        nargs="+",
        default=[4e-4, 2e-4, 1e-4],
        help="candidate constant rates of the continued training (see RATE)",
    )
    add("--continue-steps", type=int, default=5000, help="trunk steps of the continued training")
    add("--branch-every", type=int, default=1000, help="trunk steps between annealed branches")
    add("--anneal-steps", type=int, default=500, help="steps of each branch's linear anneal to lr 0")
    add("--continue-warmup", type=int, default=100, help="warm-up of the continued training's fresh AdamW")
    add("--n-train", type=int, default=200_000, help="sentences the continued training samples rows from")
    add("--n-kl", type=int, default=1000, help="held-out sentences of the KL (every position)")
    add("--n-trace", type=int, default=1000, help="one-mask contexts of the trace estimates")
    add("--trace-draws", type=int, default=2, help="labels drawn per context (Fisher, per_sample)")
    add("--hutchinson-draws", type=int, default=8, help="Rademacher probes per batch (data-label loss)")
    add("--n-probe", type=int, default=2000, help="probe fit and test sentences each (>= 5 words)")
    add("--work-dir", type=Path, default=Path("outputs") / "saturated_start", help="checkpoints and caches")
    add("--results-dir", type=Path, default=Path("docs") / "reproduction" / "saturated_start", help="JSON, plots")
    add("--smoke", action="store_true", help="tiny sizes, seconds (tests)")
    args = parser.parse_args(argv)
    if args.smoke:
        given = sys.argv[1:] if argv is None else argv
        args.seeds = args.seeds if "--seeds" in given else [0, 1]
        args.hidden, args.layers, args.batch_size = 32, 1, 16
        args.n_pool, args.n_stop, args.n_kl, args.n_trace, args.n_probe, args.n_train = 300, 40, 30, 16, 60, 400
        args.distil_steps, args.distil_warmup, args.extensions = 40, 5, ["10:5e-4"]
        args.continue_lrs = args.continue_lrs if "--continue-lrs" in given else [2e-4]
        args.continue_steps, args.branch_every, args.anneal_steps, args.continue_warmup = 40, 20, 10, 5
        args.trace_draws, args.hutchinson_draws = 1, 1
    try:
        args.extensions = [(int(s), float(p)) for s, p in (e.split(":") for e in args.extensions)]
    except ValueError:
        parser.error(f"--extensions takes STEPS:PEAK pairs, e.g. 4000:5e-4; got {args.extensions}.")
    if args.continue_steps < args.branch_every or args.branch_every < 1:
        parser.error("need 1 <= --branch-every <= --continue-steps.")
    args.use_cpu = trains_on_cpu(args.device)  # --device cuda without one fails here, before any compute
    return args


def _seeds(grammar_seed: int) -> tuple[int, int]:
    # the pool and the stop set: draws of their own, disjoint from the protocol's train/KL/trace/probe streams
    pool, stop = np.random.SeedSequence([grammar_seed, 23]).spawn(2)
    return int(pool.generate_state(1)[0]), int(stop.generate_state(1)[0])


def material(args: argparse.Namespace):
    """The language's fixed material (`setup_paper_language`), the distillation pool and the stop set."""
    language = setup_paper_language(
        args.grammar_seed,
        n_train=args.n_train,
        n_kl=args.n_kl,
        n_trace=args.n_trace,
        n_probe=args.n_probe,
        shape=SHAPES[args.shape],
    )
    pools = []
    for n, seed in zip((args.n_pool, args.n_stop), _seeds(args.grammar_seed), strict=True):
        sample = language.grammar.sample(n, seed=seed)
        start = time.perf_counter()
        conditionals = cached_conditionals(
            language.grammar, sample.word_ids, sample.lengths, cache_dir=args.work_dir / "cache"
        )
        print(f"exact conditionals of {n} sentences: {time.perf_counter() - start:.1f} s", flush=True)
        pools.append(ConditionalPool(sample.word_ids, sample.lengths, conditionals))
    return language, pools[0], pools[1]


def measure_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        trace_contexts=args.n_trace,
        trace_draws=args.trace_draws,
        hutchinson_draws=args.hutchinson_draws,
        probe_layers=tuple(range(args.layers)),  # hidden_states 0 (embeddings) .. L-1; L is the primary
    )


def distilled_start(args, language, pool, stop_set, seed: int) -> tuple[BertForMaskedLM, dict[str, Any]]:
    """Seed ``seed``'s saturated start (distilled once, then read from disk) and its record."""
    start_dir = args.work_dir / f"seed{seed}" / "start"
    record_path = start_dir / "start.json"
    if record_path.exists():
        model = BertForMaskedLM.from_pretrained(start_dir).to("cpu" if args.use_cpu else "cuda")
        return model.eval(), json.loads(record_path.read_text())
    model = build_model(len(language.tokenizer), hidden=args.hidden, layers=args.layers, seed=seed)
    model.to("cpu" if args.use_cpu else "cuda")
    print(f"[seed {seed}] distilling ({sum(p.numel() for p in model.parameters()):,} parameters)", flush=True)
    distillation = distil_to_saturation(
        model,
        pool,
        stop_set,
        steps=args.distil_steps,
        learning_rate=args.distil_lr,
        warmup_steps=args.distil_warmup,
        batch_size=args.batch_size,
        extensions=args.extensions,
        seed=seed,
    )
    start = time.perf_counter()
    measured = measure_branch(model, language, seed=0, **measure_kwargs(args))
    record = {"distillation": distillation, "measured": measured, "measure_seconds": time.perf_counter() - start}
    print(
        f"[seed {seed}] start: {distillation['steps']} steps in {distillation['seconds']:.0f} s, KL "
        f"{measured['kl']:.4f} [{measured['saturation']['ci_low']:.4f}, {measured['saturation']['ci_high']:.4f}] "
        f"saturated={measured['saturated']} Fisher {measured['fisher_trace']:.1f} "
        f"probe {measured['probe_accuracy']:.3f}",
        flush=True,
    )
    model.save_pretrained(start_dir)
    write_json(record_path, record)  # written last: its presence means the start is complete
    return model, record


def continue_spec(
    args,
    seed: int,
    learning_rate: float,
    steps: int,
    *,
    dropout: float = 0.0,
    weight_decay: float = 0.01,
    sam: bool = False,
) -> RunSpec:
    """The continued training: AdamW (beta2 0.98, weight decay 0.01), constant rate after a short warm-up; C3's arms
    change dropout, weight decay and SAM (rho 0.05 every step; the branches anneal with plain AdamW steps)."""
    return RunSpec(
        label=f"seed{seed}",
        steps=steps,
        eval_every=args.branch_every,
        batch_size=args.batch_size,
        learning_rate=learning_rate,
        warmup_steps=args.continue_warmup,
        lr_scheduler_type="constant_with_warmup",
        adam_beta2=0.98,
        weight_decay=weight_decay,
        dropout=dropout,
        flatness_method="sam" if sam else "none",
        sam_rho=0.05,
        hidden=args.hidden,
        layers=args.layers,
        seed=seed,
        use_cpu=args.use_cpu,
    )


def choose_rate(args, language, start: BertForMaskedLM) -> dict[str, Any]:
    """`RATE_RULE` on seed 0's start: pilots from the largest candidate down, stopping at the first saturated."""
    path = args.work_dir / "rate_pilot.json"
    if path.exists():
        return json.loads(path.read_text())
    pilots = []
    candidates = sorted(args.continue_lrs, reverse=True)
    chosen = candidates[-1]
    for rate in candidates:
        records = train_with_branches(
            language,
            continue_spec(args, args.seeds[0], rate, args.branch_every),
            args.work_dir / "rate_pilot" / f"lr{rate:g}",
            branch_every=args.branch_every,
            anneal_steps=args.anneal_steps,
            start_model=start,
            measure_kwargs=dict(trace_contexts=0, trace_draws=1, hutchinson_draws=1),
        )
        pilots.append({"learning_rate": rate, "kl": records[0]["kl"], "saturation": records[0]["saturation"]})
        if records[0]["saturated"]:
            chosen = rate
            break
    payload = {"rule": RATE_RULE, "candidates": candidates, "pilots": pilots, "chosen": chosen}
    write_json(path, payload)
    print(f"continued-training rate: {chosen:g} (pilots {[(p['learning_rate'], round(p['kl'], 4)) for p in pilots]})")
    return payload


def run_c1_seed(args, language, start: BertForMaskedLM, seed: int, rate: float) -> dict[str, Any]:
    """Continued training of one seed from its saturated start; finished seeds are read back."""
    seed_dir = args.work_dir / f"seed{seed}" / "c1"
    done = seed_dir / "result.json"
    if done.exists():
        return json.loads(done.read_text())
    began = time.perf_counter()
    records = train_with_branches(
        language,
        continue_spec(args, seed, rate, args.continue_steps),
        seed_dir,
        branch_every=args.branch_every,
        anneal_steps=args.anneal_steps,
        measure_kwargs=measure_kwargs(args),
        start_model=start,
        keep_branches=True,
    )
    payload = {"seed": seed, "records": records, "seconds_this_run": time.perf_counter() - began}
    write_json(done, payload)
    return payload


def run_c3_arm(args, language, start: BertForMaskedLM, seed: int, rate: float, arm: str) -> dict[str, Any]:
    """One C3 arm of one seed from its saturated start: the C1 length, one branch at the end; read back if done."""
    arm_dir = args.work_dir / f"seed{seed}" / "c3" / arm
    done = arm_dir / "result.json"
    if done.exists():
        return json.loads(done.read_text())
    dropout, weight_decay, sam = C3_ARMS[arm]
    spec = continue_spec(args, seed, rate, args.continue_steps, dropout=dropout, weight_decay=weight_decay, sam=sam)
    began = time.perf_counter()
    records = train_with_branches(
        language,
        spec,
        arm_dir,
        branch_every=args.continue_steps,
        anneal_steps=args.anneal_steps,
        measure_kwargs=measure_kwargs(args),
        start_model=start,
    )
    payload = {"seed": seed, "arm": arm, "record": records[-1], "seconds_this_run": time.perf_counter() - began}
    write_json(done, payload)
    return payload


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
    skip = {"stop_after", "merge", "use_cpu"}
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
            args.results_dir / "continued_training.png",
            "C1 from a saturated start (distilled; step 0 = the start, later points = annealed branches)",
            references=references,
        )
    return payload


def commit_checkpoints(args, language, seed: int, result: dict[str, Any]) -> None:
    """The saturated start and the last branch of ``seed`` (weights, config, tokenizer) under RESULTS/checkpoints."""
    last = result["records"][-1]["step"]
    for name, source in {
        "start": args.work_dir / f"seed{seed}" / "start",
        "last_branch": args.work_dir / f"seed{seed}" / "c1" / "branches" / f"step-{last}",
    }.items():
        target = args.results_dir / "checkpoints" / f"seed{seed}_{name}"
        if not source.exists() and (target / "model.safetensors").exists():
            continue  # a resumed campaign: the committed state keeps this copy, not the branch folder it came from
        target.mkdir(parents=True, exist_ok=True)
        for file in ("config.json", "model.safetensors"):
            shutil.copy2(source / file, target / file)
        language.tokenizer.save_pretrained(target)


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


def finished_from_disk(args) -> tuple[dict[int, dict], dict[int, dict], float | None]:
    """Every planned seed whose start and continued training are on disk (also those of other processes)."""
    results, starts = {}, {}
    for seed in args.seeds:
        done = args.work_dir / f"seed{seed}" / "c1" / "result.json"
        start = args.work_dir / f"seed{seed}" / "start" / "start.json"
        if done.exists() and start.exists():
            results[seed], starts[seed] = json.loads(done.read_text()), json.loads(start.read_text())
    pilot = args.work_dir / "rate_pilot.json"
    return results, starts, json.loads(pilot.read_text())["chosen"] if pilot.exists() else None


def main(argv=None) -> dict:
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    args = parse_arguments(argv)
    if args.markdown:
        print(markdown_summary(args))
        return {}
    if not (args.results_dir / "continued_training.json").exists():
        write_results(args, None, {}, {}, None, None)  # the rule on disk before any run
    language, pool, stop_set = material(args)
    references_path = args.work_dir / "references.json"
    if references_path.exists():
        references = json.loads(references_path.read_text())
    else:
        rows = reference_rows(language, continue_spec(args, args.seeds[0], 0.0, args.branch_every))
        references = {name: without_predictions(row) for name, row in rows.items()}
        write_json(references_path, references)
    if "c3" in args.claims and not (args.results_dir / "optimizer.json").exists():
        write_c3(args)  # C3's rule on disk before any of its runs
    if not args.merge:
        rate = None
        for seed in args.seeds if "c1" in args.claims or args.stop_after else []:
            start, _ = distilled_start(args, language, pool, stop_set, seed)
            if args.stop_after == "start":
                continue
            if rate is None:
                rate = choose_rate(args, language, start)["chosen"]
            if args.stop_after == "rate":
                break
            result = run_c1_seed(args, language, start, seed, rate)
            if seed == 0:
                commit_checkpoints(args, language, seed, result)
            results, starts, _ = finished_from_disk(args)
            payload = write_results(args, language, results, starts, rate, references)
            print(f"[seed {seed}] done; C1: {payload['verdict']['verdict']}", flush=True)
        if args.stop_after is not None:
            return {}
        for seed in args.seeds if "c3" in args.claims else []:
            start, _ = distilled_start(args, language, pool, stop_set, seed)
            rate = rate or choose_rate(args, language, start)["chosen"]
            for arm in C3_ARMS:
                run_c3_arm(args, language, start, seed, rate, arm)
                print(f"[seed {seed}] C3 {arm} done; C3: {write_c3(args)['verdict']['verdict']}", flush=True)
    if "c3" in args.claims:
        write_c3(args)
    results, starts, rate = finished_from_disk(args)
    payload = write_results(args, language, results, starts, rate, references)
    print(f"C1 ({len(results)} of {len(args.seeds)} seeds): {payload['verdict']['verdict']}", flush=True)
    return payload


if __name__ == "__main__":
    main()
