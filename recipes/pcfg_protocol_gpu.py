"""Campaign v2 (issue 33) at a GPU's shape on one GPU, in commands of at most ~10 minutes that resume each other.

The design is ``recipes/pcfg_campaign_v2.py``'s, run through the same functions (rules `research.rules_v2`, prose
RULES_v2.md; `campaign_v2.run_starts`, `campaign_v2.run_pilots`, `claims_v2.run_claims`; the same JSON, rows and
resumption): (1) starts, every width and seed distilled to the margin (stop-set KL <= 0.007, upper <= 0.010) by up to
three 4,000-step extension decays; (2) the KL/trace-only pilots: C1's dose, C2's rate per width, C3's dropout, C5's
adversary weight; (3) the claims C1, C4, C6, C5, C2, C3 (``--claims``) from those starts at the pilots' choices,
read by the ruler. Only the shape differs from the CPU campaign, `GPU_SIZES`: the released grammar
(`PCFG.paper_shaped` defaults: 4 levels of 10 symbols, 200 words); BERT-L4 at H256 (C1, C3, C5, the pilots), H512
and H192 (C2: the rules' H64 / H128 / H48 times four); batch 1024; no v1 start exists at this shape, so every start
is fresh and first runs v1's GPU distillation to its end (8,000 steps, peak 1e-3, warm-up 200) before the rules'
extensions. Ladders, doses, step counts, tiers and verdicts are the rules' own. The ruler is cut to the budget by
default (``--ruler-splits 3 --ruler-fit 5000 --ruler-test 5000``, no CV rows; the gated ruler is 5 x 20,000 on 10,000)
and its C = 0.3 was cross-validated on the 3-level grammar, not this one.

Each command runs the phases in one child process (one model at a time on the GPU; the probes fit on the CPU) and
kills it at ``--budget-minutes``: every finished unit (a start, a pilot, a claim's run, a read split) is already in
its JSON, written whole as it finishes, and the next command skips it; a killed decay resumes from its last 500-step
checkpoint, a killed trunk from its last branch (the Trainer writes a trunk's checkpoint in place: a kill inside that
write, under a second per branch interval, leaves a partial ``trunk/checkpoint-N`` the resume stops on; deleting that
folder resumes from the previous one). Each command appends its wall time and where the phases stand to
``RESULTS/gpu_calls.json``. Results: ``--results-dir`` (default ``recipes/research/results/campaign_v2_gpu``, never the
CPU campaign's); checkpoints and caches: ``--output-dir`` (a fresh machine needs that folder back to resume: the
starts' and branches' weights, about 13 MB per H256 model).

BUDGET (assumed, not measured on a GPU): ~15 ms per step of H256-L4 at batch 1024 (H512 ~2x), ~30 s per branch or
start measurement. Measured on the CPU here (one thread): the exact conditionals of the 30,000-sentence pool at this
grammar ~85 s (500 in 1.4 s), once (then cached: 384 MB in the output folder); C5's task labels of 200,000 sentences
~150 s (2,000 in 1.5 s), in every command that runs a C5 unit.
Starts: 15 x (8,000 + 4,000-12,000) steps, about 1-1.5 GPU-hours (8-10 commands); pilots: C1's dose up to 40,000
steps (~10 min), C2's rates up to 4 x dose per width, C3 up to 3, C5 up to 4 branches of the dose, about 1-3 hours
at a 20-40k dose; claims: about 4.5 x 5 dose-length runs (C3's SAM arms 2x) plus ~60 ruler reads (each 3 probe splits
on the CPU at 18 x 256 = 4,608 feature columns, minutes each), several hours. Measured wall times land in
gpu_calls.json; replace these lines with them.

    python recipes/pcfg_protocol_gpu.py                       # on the GPU machine; rerun until every phase is done
    python recipes/pcfg_protocol_gpu.py --claims C1,C4,C6     # the claims phase restricted, as the CPU driver's
    python recipes/pcfg_protocol_gpu.py --markdown            # the tables, from the results folder
    python recipes/pcfg_protocol_gpu.py --dry-run             # the smoke sizes on whatever device is here (tests)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch
from research.campaign_v2 import (
    RESULTS,
    SMOKE,
    Sizes,
    load_material,
    pilots_markdown,
    run_pilots,
    run_starts,
    starts_markdown,
)
from research.claims_v2 import ClaimsRun, parse_claims, pilot_decisions, run_claims
from research.claims_v2_report import claims_markdown
from research.deadline import run_concurrently
from research.ruler_reads import RULER_SMOKE, RulerSizes
from research.rules_v2 import CLAIMS, SEEDS
from research.units import read_units

from hf_flatbias.results import write_json

RECIPES = Path(__file__).resolve().parent
PHASES = ("starts", "pilots", "claims")
#: the GPU's shape (module docstring); every schedule length, ladder and threshold stays the rules'
GPU_SIZES = dataclasses.replace(
    Sizes(),
    shape="paper",
    widths=(256, 512, 192),
    base_width=256,
    layers=4,
    batch_size=1024,
    first_decay=(8000, 1e-3, 200),
    v1_starts=None,
)
#: the dry run: the CPU campaign's smoke sizes at the released grammar, three small widths, no v1 start
DRY_RUN_SIZES = dataclasses.replace(SMOKE, shape="paper", widths=(32, 64, 16), base_width=32, v1_starts=None)


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--phases", type=lambda text: text.split(","), default=list(PHASES), help="starts,pilots,claims (in order)"
    )
    parser.add_argument(
        "--claims", type=parse_claims, default=list(CLAIMS), help="claims of the claims phase, e.g. C1,C4 (default all)"
    )
    parser.add_argument(
        "--only-seeds", type=int, nargs="+", default=list(SEEDS), help="run only these model seeds' claim units"
    )
    parser.add_argument("--budget-minutes", type=float, default=9.0, help="the child running the phases is killed then")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    parser.add_argument("--output-dir", type=Path, default=Path("outputs") / "campaign_v2_gpu", help="weights, caches")
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=None,
        help="starts.json, pilots.json, claims/ (default recipes/research/results/campaign_v2_gpu; --dry-run: "
        "OUTPUT-DIR/results)",
    )
    parser.add_argument("--ruler-fit", type=int, default=5000, help="ruler: sentences per fit split (gated: 20,000)")
    parser.add_argument("--ruler-splits", type=int, default=3, help="ruler: disjoint fit splits (gated: 5)")
    parser.add_argument("--ruler-test", type=int, default=5000, help="ruler: common test sentences (gated: 10,000)")
    parser.add_argument("--markdown", action="store_true", help="only print the tables from the results folder")
    parser.add_argument("--dry-run", action="store_true", help="the smoke sizes (DRY_RUN_SIZES, RULER_SMOKE), seconds")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # the child that runs the phases
    args = parser.parse_args(argv)
    unknown = [p for p in args.phases if p not in PHASES]
    if unknown or not args.phases:
        parser.error(f"--phases takes names among {','.join(PHASES)}, got {','.join(args.phases)}.")
    if not set(args.only_seeds) <= set(SEEDS):
        parser.error(f"--only-seeds {args.only_seeds} must be among the rules' seeds {list(SEEDS)}.")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible here; pass --device auto.")
    if args.budget_minutes <= 0:
        parser.error("--budget-minutes must be > 0.")
    if args.results_dir is None:
        results = RECIPES / "research" / "results" / "campaign_v2_gpu"
        args.results_dir = args.output_dir / "results" if args.dry_run else results
    if args.results_dir.resolve() == RESULTS.resolve():
        parser.error(f"--results-dir {args.results_dir} is the CPU campaign's: pass a folder of this driver's own.")
    args.phases = [p for p in PHASES if p in args.phases]
    return args


def campaign_sizes(args: argparse.Namespace) -> Sizes:
    """The run's sizes on its device: the GPU's shape, or the dry run's."""
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    return dataclasses.replace(DRY_RUN_SIZES if args.dry_run else GPU_SIZES, device=device)


def ruler_sizes(args: argparse.Namespace) -> RulerSizes:
    """The ruler of the claims: the flags' cut of the gated ruler (C and the fine-tuning as gated), or the smoke's."""
    if args.dry_run:
        return RULER_SMOKE
    return RulerSizes(n_test=args.ruler_test, n_fit=args.ruler_fit, n_splits=args.ruler_splits, n_cv=0)


def run_phases(args: argparse.Namespace) -> None:
    """The child: the requested phases in order, each resuming from the JSON on disk (the CPU driver's functions)."""
    sizes, work = campaign_sizes(args), args.output_dir
    starts, pilots = args.results_dir / "starts.json", args.results_dir / "pilots.json"
    decisions = None
    if "claims" in args.phases and "pilots" not in args.phases:
        decisions = pilot_decisions(pilots, args.claims, sizes.widths)  # a missing pilot stops here, before compute
    print(f"campaign v2 on {sizes.device}: phases {', '.join(args.phases)}", flush=True)
    material = load_material(work, sizes)
    if "starts" in args.phases:
        run_starts(material, work, starts, sizes)
    if "pilots" in args.phases:
        run_pilots(material, starts, pilots, work, sizes)
    if "claims" in args.phases:
        run = ClaimsRun(
            material=material,
            sizes=sizes,
            ruler=ruler_sizes(args),
            starts=starts,
            pilots=decisions or pilot_decisions(pilots, args.claims, sizes.widths),
            work_dir=work,
            claims_dir=args.results_dir / "claims",
        )
        run_claims(run, args.claims, args.only_seeds)


def standing(results_dir: Path, widths) -> dict:
    """Where the phases stand, from the results folder: starts done / meeting the margin, each pilot's status and
    choice, each claim's primary verdict."""
    starts = read_units(results_dir / "starts.json")
    pilots = read_units(results_dir / "pilots.json")
    done = [row for row in starts.values() if row.get("status") == "done"]
    claims = {}
    for path in sorted((results_dir / "claims").glob("C*.json")):
        claims[path.stem] = json.loads(path.read_text())["verdict"]["verdict"]
    return {
        "starts_planned": len(widths) * len(SEEDS),
        "starts_done": len(done),
        "starts_meeting_margin": sum(bool(row.get("margin_met")) for row in done),
        "pilots": {key: {"status": row["status"], **(row.get("choice") or {})} for key, row in pilots.items()},
        "claims": claims,
    }


def main(argv=None) -> dict:
    given = sys.argv[1:] if argv is None else list(argv)
    args = parse_arguments(given)
    sizes = campaign_sizes(args)
    if args.worker:
        run_phases(args)
        return {}
    if args.markdown:
        tables = [
            starts_markdown(read_units(args.results_dir / "starts.json"), sizes.widths),
            pilots_markdown(read_units(args.results_dir / "pilots.json")),
            claims_markdown(args.results_dir / "claims"),
        ]
        print(*filter(None, tables), sep="\n\n")
        return {}
    calls_path = args.results_dir / "gpu_calls.json"
    state = json.loads(calls_path.read_text()) if calls_path.exists() else {"calls": []}
    # the device is each call's own (below): a run may move between machines, never between shapes
    shape = {k: str(v) for k, v in dataclasses.asdict(sizes).items() if k != "device"}
    settings = {"sizes": shape, "ruler": dataclasses.asdict(ruler_sizes(args))}
    if state["calls"] and {k: state[k] for k in settings} != settings:
        raise SystemExit(f"{args.results_dir} holds a run of other sizes or ruler: pass another --results-dir.")
    began = time.monotonic()
    device = torch.cuda.get_device_name(0) if sizes.device == "cuda" else "cpu"
    print(f"campaign v2 at the {'dry run' if args.dry_run else 'GPU'}'s shape on {device}", flush=True)
    pythonpath = os.pathsep.join(filter(None, [str(RECIPES.parent), str(RECIPES), os.environ.get("PYTHONPATH")]))
    outcome = run_concurrently(
        {"campaign": [sys.executable, str(Path(__file__).resolve()), *given, "--worker"]},
        began + 60 * args.budget_minutes,
        None,  # the child's output is this command's
        pythonpath,
    )["campaign"]
    call = {
        "device": device,
        "phases": args.phases,
        "claims": args.claims,
        "budget_minutes": args.budget_minutes,
        **outcome,
        "standing": standing(args.results_dir, sizes.widths),
    }
    write_json(calls_path, {**settings, "calls": [*state["calls"], call]})
    print(json.dumps(call["standing"], indent=1), flush=True)
    ended = "killed at the deadline" if outcome["killed"] else f"exit {outcome['returncode']}"
    print(f"{ended} after {outcome['seconds']:.0f} s; the same command resumes", flush=True)
    return call


if __name__ == "__main__":
    ran = main()
    # a child killed at the deadline is the budget's normal end; one that failed is this command's failure
    if ran and not ran["killed"] and ran["returncode"]:
        raise SystemExit(ran["returncode"])
