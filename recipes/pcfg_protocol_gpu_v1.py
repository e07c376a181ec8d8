"""Campaign v1's saturated-start protocol (issue 23) at a GPU's shape on one GPU, in one command of at most ~10 min.

CAMPAIGN V1, kept as run by v1's docs (docs/reproduction/synthetic.md); campaign v2's design at the GPU's shape is
``recipes/pcfg_protocol_gpu.py``.

Runs `pcfg_saturated_start.py` in phases, each phase's model seeds as concurrent processes on the one GPU (the models
are far too small to fill it: a step is bound by kernel launches and data, and processes overlap on its idle time;
each gets an equal share of the CPU threads, since the probes fit on the CPU): (1) every seed distils its start on
the exact conditionals until the stop set is saturated; (2) seed 0's rate pilot picks the continued-training rate by
the stated KL-only rule; (3) every seed continues with the paper's objective from its start, annealed branches
measured; (4) ``--later-claims`` (C3, C5, C2) as further phases while the budget lasts; (5) a merge writes every
claim's JSON with its verdict (undecided while seeds are missing).
Shape: the released grammar's (`PCFG.paper_shaped` defaults: 4 levels of 10 symbols, 200 words), BERT H256-L4
(3.3M parameters), batch 1024, AdamW beta2 0.98, weight decay 0.01, fp32 (the annealed branches train without
autocast, so bf16 would treat trunk and branches differently). The route is ours, not the paper's training.

CAMPAIGN V2 (issue 33, ``docs/reproduction/campaign_v2.md``): after the merge, C1 is also read with v2's ruler
(`research.ruler_reads`, C fixed at the gate's 0.3, ``--ruler-splits`` disjoint fit splits of ``--ruler-fit`` fresh
sentences and one common test set, the same splits for every model): each finished seed's start and its first and
last compared C1 branches (v2's saturated tier; v1's matched tier as the sensitivity row), C1's v2 verdict with the
two-way seed x split interval (`research.verdicts_v2.c1_verdict`) into ``ruler_c1.json``. The ruler's default size
here is cut to the GPU budget (3 x 5,000 rows: the probes run on the CPU, at the released grammar's 18 x 256 = 4,608
feature columns): it is not the gated 5 x 20,000 ruler, and C = 0.3 was cross-validated on the 3-level grammar. Not
yet carried over to the GPU shape: v2's margins (starts to stop-set KL <= 0.007), its dose/rate/dropout/weight
pilots and claims C2-C6 under v2's rules; those run on the CPU (``recipes/pcfg_campaign_v2.py``).

BUDGET (assumed, not measured on a GPU): ~15 ms per step of H256-L4 at batch 1024 including the batch's assembly,
~30 s per branch measurement, ~25 s of language setup per process. Distillation: 8,000 steps (~2 minutes);
continued training: 4,000 trunk steps, a branch every 1,000 annealed over 500 (4 branches, ~3 minutes per seed,
seeds concurrent). The script stops starting work once ``--budget-minutes`` are spent, kills what still runs at the
deadline (a finished start, pilot or seed is already on disk and a rerun resumes from it), and merges whatever
finished; each phase's wall time is printed and written to ``protocol_gpu.json`` so the next session can resize.

    python recipes/pcfg_protocol_gpu_v1.py                # on the GPU machine: <= 9 minutes, outputs/pcfg_protocol_gpu
    python recipes/pcfg_protocol_gpu_v1.py --dry-run      # tiny sizes on whatever device is here (tests)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from research import verdicts_v2
from research.campaign import SHAPES
from research.deadline import run_concurrently, threads_each
from research.ruler_reads import PRIMARY, RULER_SMOKE, ReadStore, RulerSizes, compact_read, read_record, ruler_rows
from research.verdicts import CLAIM_FILES
from transformers import BertForMaskedLM

from hf_flatbias.cli import run_recipe
from hf_flatbias.results import write_json
from hf_flatbias.synthetic import PCFG

RECIPES = Path(__file__).resolve().parent
#: seconds kept back from the budget for the final merge (reference rows: three probes and the exact conditionals)
MERGE_RESERVE_SECONDS = 60


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grammar-seed", type=int, default=0, help="seed of PCFG.paper_shaped")
    parser.add_argument("--shape", default="paper", help="pcfg_saturated_start.py's --shape (paper: released shape)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="model seeds (concurrent)")
    parser.add_argument("--budget-minutes", type=float, default=9.0, help="no new work starts after this; all stops")
    parser.add_argument("--start-share", type=float, default=0.35, help="largest fraction of the budget for starts")
    parser.add_argument("--hidden", type=int, default=256, help="BERT hidden size (256 x 4 layers: 3.3M parameters)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--distil-steps", type=int, default=8000)
    parser.add_argument("--distil-lr", type=float, default=1e-3, help="peak rate of the distillation's decay")
    parser.add_argument("--continue-steps", type=int, default=4000, help="trunk steps from the saturated start")
    parser.add_argument("--branch-every", type=int, default=1000)
    parser.add_argument("--anneal-steps", type=int, default=500)
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--output-dir", type=Path, default=Path("outputs") / "pcfg_protocol_gpu")
    parser.add_argument(
        "--later-claims",
        nargs="*",
        choices=["c3", "c5", "c2"],
        default=[],
        help="claims run after C1 while the budget lasts, each a phase of concurrent seeds (C4 and C6 need no run)",
    )
    parser.add_argument("--ruler-fit", type=int, default=5000, help="v2 ruler: sentences per fit split")
    parser.add_argument("--ruler-splits", type=int, default=3, help="v2 ruler: disjoint fit splits (the gate's: 5)")
    parser.add_argument("--ruler-test", type=int, default=5000, help="v2 ruler: common test sentences")
    parser.add_argument("--no-ruler", action="store_true", help="skip the v2 ruler read-out of C1")
    parser.add_argument("--dry-run", action="store_true", help="the recipe's --smoke sizes, 2 seeds, seconds")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible here; pass --device auto.")
    if args.budget_minutes <= 0 or not 0 < args.start_share < 1:
        parser.error("--budget-minutes must be > 0 and --start-share in (0, 1).")
    if args.dry_run and "--seeds" not in (argv or sys.argv[1:]):
        args.seeds = [0, 1]
    return args


def recipe_command(args: argparse.Namespace, *extra: str) -> list[str]:
    """``python recipes/pcfg_saturated_start.py`` with this run's shape (or ``--smoke``), folders and ``extra``."""
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    out = args.output_dir
    command = [
        sys.executable, str(RECIPES / "pcfg_saturated_start.py"), "--device", device,
        "--grammar-seed", str(args.grammar_seed), "--shape", args.shape,
        "--work-dir", str(out / "work"), "--results-dir", str(out / "results"),
        "--figures-dir", str(out / "results"),
    ]  # fmt: skip
    if args.dry_run:
        return [*command, "--smoke", *extra]
    shape = {
        "--hidden": args.hidden, "--layers": args.layers, "--batch-size": args.batch_size,
        "--distil-steps": args.distil_steps, "--distil-lr": args.distil_lr, "--continue-steps": args.continue_steps,
        "--branch-every": args.branch_every, "--anneal-steps": args.anneal_steps,
    }  # fmt: skip
    return [*command, *(str(x) for pair in shape.items() for x in pair), *extra]


def merge_environment() -> dict[str, str]:
    """A merge's environment: this checkout first on the path, the threads of a process running alone."""
    path = os.pathsep.join(filter(None, [str(RECIPES.parent), os.environ.get("PYTHONPATH")]))
    threads = str(threads_each(1))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}


def c1_records(work: Path, seed: int) -> dict | None:
    """A finished v1 C1 seed of the work folder as v2's records (`verdicts_v2.c1_verdict`), weights' folders beside."""
    result, start = work / f"seed{seed}" / "c1" / "result.json", work / f"seed{seed}" / "start"
    if not result.exists():
        return None
    measured = json.loads((start / "start.json").read_text())["measured"]

    def record(key, row, checkpoint):
        kl = {"kl": row["kl"], "ci_high": row["saturation"]["ci_high"], "fisher_trace": row["fisher_trace"]}
        return {"key": key, **kl, "checkpoint": str(checkpoint)}

    branches = [
        {
            **record(f"c1/seed{seed}/step-{r['step']}", r, result.parent / "branches" / f"step-{r['step']}"),
            "step": r["step"],
        }
        for r in json.loads(result.read_text())["records"]
    ]
    return {"start": record(f"start/seed{seed}", measured, start), "branches": branches}


def ruler_c1(args: argparse.Namespace, out: Path) -> dict:
    """C1 read by v2's ruler: every record its v2 rule compares (saturated tier, then the matched sensitivity row)
    read on the same splits, then `verdicts_v2.c1_verdict` of each tier; ``ruler_c1.json`` holds both."""
    sizes = RULER_SMOKE if args.dry_run else RulerSizes(n_test=args.ruler_test, n_fit=args.ruler_fit,
                                                         n_splits=args.ruler_splits, n_cv=0)  # fmt: skip
    grammar = PCFG.paper_shaped(args.grammar_seed, **SHAPES[args.shape])
    rows = ruler_rows(grammar, args.grammar_seed, sizes, out / "cache")
    store = ReadStore(out / "ruler_reads.json", sizes)
    seeds = {str(s): r for s in args.seeds if (r := c1_records(out / "work", s)) is not None}

    def verdicts():
        for record in seeds.values():
            for row in [record["start"], *record["branches"]]:
                read = compact_read(store.reads.get(row["key"]), PRIMARY, sizes)
                row["reads"] = {PRIMARY: read} if read else {}
        return {tier: verdicts_v2.c1_verdict(seeds, len(args.seeds), tier) for tier in verdicts_v2.TIERS}

    paths = {row["key"]: row["checkpoint"] for r in seeds.values() for row in [r["start"], *r["branches"]]}
    for key in sorted({k for row in verdicts().values() for k in row["reads_pending"]}):
        model = BertForMaskedLM.from_pretrained(paths[key]).eval()  # features on the GPU when there is one
        model.to("cuda" if torch.cuda.is_available() else "cpu")
        read_record(store, key, rows, sizes, [PRIMARY], model=model, source=paths[key])
    payload = {"ruler": store.settings, "seeds": seeds, "verdicts": verdicts()}
    write_json(out / "ruler_c1.json", payload)
    return payload["verdicts"]


def main(argv=None) -> dict:
    args = parse_arguments(argv)
    start = time.monotonic()
    deadline = start + 60 * args.budget_minutes
    out = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"recipe": "pcfg_protocol_gpu", "config": {k: str(v) for k, v in vars(args).items()}}
    summary["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"

    def save():
        (out / "protocol_gpu.json").write_text(json.dumps(summary, indent=2) + "\n")

    def phase(name: str, commands: dict[str, list[str]], until: float) -> None:
        began = time.monotonic()
        print(f"{name}: {len(commands)} process(es) on {summary['device']}", flush=True)
        summary[f"{name}_runs"] = run_concurrently(commands, until, out / "logs", merge_environment()["PYTHONPATH"])
        summary[f"{name}_seconds"] = time.monotonic() - began
        save()

    seeds = [str(s) for s in args.seeds]
    phase(
        "starts",
        {f"start_seed{s}": recipe_command(args, "--seeds", s, "--stop-after", "start") for s in seeds},
        min(deadline, start + 60 * args.budget_minutes * args.start_share),
    )
    phase("rate", {"rate_pilot": recipe_command(args, "--seeds", seeds[0], "--stop-after", "rate")}, deadline)
    work = out / "work"
    if (work / "rate_pilot.json").exists():
        phase(
            "c1",
            {f"c1_seed{s}": recipe_command(args, "--seeds", s, "--claims", "c1") for s in seeds},
            deadline - MERGE_RESERVE_SECONDS * (not args.dry_run),
        )
    else:
        print("rate pilot not finished within the budget: C1 not started", flush=True)
    summary["c1_finished_seeds"] = [s for s in args.seeds if (work / f"seed{s}" / "c1" / "result.json").exists()]
    for claim in args.later_claims if summary["c1_finished_seeds"] else []:
        phase(
            claim,
            {f"{claim}_seed{s}": recipe_command(args, "--seeds", s, "--claims", claim) for s in seeds},
            deadline - MERGE_RESERVE_SECONDS * (not args.dry_run),
        )
    subprocess.run(
        recipe_command(args, "--seeds", *seeds, "--claims", "c1", "--merge"), check=True, env=merge_environment(),
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    results = json.loads((out / "results" / "continued_training.json").read_text())
    summary["c1_verdict"] = results["verdict"]
    for claim, name in CLAIM_FILES.items():
        if (out / "results" / name).exists():
            summary[f"{claim.lower()}_verdict"] = json.loads((out / "results" / name).read_text())["verdict"]
    summary["continued_training_rate"] = results["continued_training_rate"]
    if not args.no_ruler and summary["c1_finished_seeds"]:
        began = time.monotonic()
        summary["ruler_c1"] = {tier: row["verdict"] for tier, row in ruler_c1(args, out).items()}
        summary["ruler_seconds"] = time.monotonic() - began
        print(f"C1 read by v2's ruler: {summary['ruler_c1']}", flush=True)
    summary["seconds"] = time.monotonic() - start
    save()
    verdict = results["verdict"]
    print(f"C1 ({len(results['seeds'])} seeds finished): {verdict['verdict']} ({verdict['regime']})", flush=True)
    for seed, row in results["seeds"].items():
        begin = row["start"]["measured"]
        line = ", ".join(f"{r['step']}: KL {r['kl']:.4f} tr {r['fisher_trace']:.1f} acc {r['probe_accuracy']:.3f}"
                         for r in row["branches"])  # fmt: skip
        print(f"  seed {seed}: start KL {begin['kl']:.4f} acc {begin['probe_accuracy']:.3f}; {line}", flush=True)
    print(f"total {summary['seconds']:.0f} s; JSON in {out}", flush=True)
    return summary


if __name__ == "__main__":
    run_recipe(main)
