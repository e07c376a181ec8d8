"""Campaign v2 (issue 33): starts distilled to the margin, KL/trace-only pilots, then the claims read by the ruler.

Rules: `research.rules_v2` (prose: recipes/research/results/campaign_v2/RULES_v2.md), committed before any run.
Phase ``starts``: H64 seeds 0-4, then H128, then H48; v1's committed start reused where it meets the margin (stop-set
KL <= 0.007, upper <= 0.010), else up to 3 further 4,000-step decays; each start measured on v1's KL set (KL, Fisher
trace). Phase ``pilots``: C1's dose, C2's rate per width, C3's dropout, C5's adversary weight, from seed 0's starts.
No probe is read in either phase. Phase ``claims`` (``--claims C1,C4,...``, default all, in the rules' order C1, C4,
C6, C5, C2, C3): each claim's runs from the starts at the pilots' dose/rates/dropout/weight (refused while a pilot it
needs is unfinished), then the ruler's read-outs (primary: the last layer's probe on the gate's 5 x 20k splits; then
every other layer and the fine-tuning), each claim's JSON under ``claims/`` rewritten as work finishes.

Resumable: a unit whose row in the phase's JSON says ``done`` is skipped; a finished decay, branch or ladder rung is
read back; a stopped decay or trunk resumes from its checkpoint. The work folder goes with a session, so each snapshot
runs ``--carry-out`` with the runs paused and commits ``carry/`` (`research.carry`); every phase copies it back in as
it starts. One process, one thread:

    mkdir -p outputs/campaign_v2; OMP_NUM_THREADS=1 PYTHONPATH=$PWD:$PWD/recipes nohup nice -n 10 sh -c \\
      'python recipes/pcfg_campaign_v2.py --phase starts && python recipes/pcfg_campaign_v2.py --phase pilots' \\
      >> outputs/campaign_v2/campaign.log 2>&1 &
    OMP_NUM_THREADS=1 PYTHONPATH=$PWD:$PWD/recipes nohup nice -n 10 python recipes/pcfg_campaign_v2.py \\
      --phase claims >> outputs/campaign_v2/claims.log 2>&1 &
"""

from __future__ import annotations

import argparse
import os
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
from research.carry import carry_in, carry_out
from research.claims_v2 import ClaimsRun, parse_claims, pilot_decisions, run_claims
from research.claims_v2_report import claims_markdown
from research.docs_blocks import replace_generated
from research.plots import plot_claims_v2
from research.ruler_reads import RULER_SMOKE, RulerSizes
from research.rules_v2 import CLAIMS, SEEDS
from research.units import read_units

DOCS = Path(__file__).resolve().parents[1] / "docs" / "reproduction" / "campaign_v2.md"
FIGURE = DOCS.parents[1] / "plots" / "campaign_v2" / "claims.png"


def generated_tables(results_dir: Path) -> dict[str, str]:
    """The page's generated blocks by marker name: the starts' and pilots' tables, the claims' rows."""
    phases = [
        starts_markdown(read_units(results_dir / "starts.json")),
        pilots_markdown(read_units(results_dir / "pilots.json")),
    ]
    return {"tables": "\n\n".join(filter(None, phases)), "claims": claims_markdown(results_dir / "claims")}


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", choices=["starts", "pilots", "claims"], default=None, help="the phase to run")
    parser.add_argument(
        "--claims", type=parse_claims, default=list(CLAIMS), help="claims of --phase claims, e.g. C1,C4 (default all)"
    )
    parser.add_argument(
        "--only-seeds", type=int, nargs="+", default=list(SEEDS), help="run only these model seeds' claim units"
    )
    parser.add_argument("--markdown", action="store_true", help="only print the docs' tables from the JSON")
    parser.add_argument(
        "--update-docs",
        action="store_true",
        help=f"only rewrite the generated tables of {DOCS.relative_to(DOCS.parents[2])} and draw "
        f"{FIGURE.relative_to(DOCS.parents[2])} from the JSON",
    )
    parser.add_argument(
        "--carry-out",
        action="store_true",
        help="only copy what a later session needs of --work-dir into the results' carry/ folder (runs paused)",
    )
    parser.add_argument("--work-dir", type=Path, default=Path("outputs") / "campaign_v2", help="checkpoints, caches")
    parser.add_argument("--results-dir", type=Path, default=RESULTS, help="starts.json, pilots.json, claims/")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds (tests)")
    args = parser.parse_args(argv)
    if not set(args.only_seeds) <= set(SEEDS):
        parser.error(f"--only-seeds {args.only_seeds} must be among the rules' seeds {list(SEEDS)}.")
    return args


def main(argv=None) -> dict:
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    args = parse_arguments(argv)
    starts, pilots = args.results_dir / "starts.json", args.results_dir / "pilots.json"
    claims_dir = args.results_dir / "claims"
    if args.markdown:
        print(*filter(None, generated_tables(args.results_dir).values()), sep="\n\n")
        return {}
    if args.update_docs:
        text = DOCS.read_text()
        for name, table in generated_tables(args.results_dir).items():
            text = replace_generated(text, f"campaign_v2 {name}", table, DOCS)
        DOCS.write_text(text)
        plot_claims_v2(claims_dir, FIGURE)
        print(f"rewrote the tables of {DOCS} and drew {FIGURE}")
        return {}
    if args.carry_out:
        if not args.work_dir.is_dir():
            raise SystemExit(
                f"--carry-out: no work folder {args.work_dir}; run from the checkout's root or pass --work-dir."
            )
        changed = carry_out(args.work_dir, args.results_dir / "carry")
        print(f"carried {len(changed)} changes into {args.results_dir / 'carry'}", *changed, sep="\n")
        return {}
    if args.phase is None:
        raise SystemExit("--phase starts|pilots|claims (or --markdown, --update-docs, --carry-out) is required.")
    sizes = SMOKE if args.smoke else Sizes()
    if args.phase == "claims":
        decisions = pilot_decisions(pilots, args.claims)  # a missing pilot stops here, before any compute
        carry_in(args.results_dir, args.work_dir)  # a fresh checkout: the starts' weights, the last session's state
        run = ClaimsRun(
            material=load_material(args.work_dir, sizes),
            sizes=sizes,
            ruler=RULER_SMOKE if args.smoke else RulerSizes(),
            starts=starts,
            pilots=decisions,
            work_dir=args.work_dir,
            claims_dir=claims_dir,
        )
        return run_claims(run, args.claims, args.only_seeds)
    carry_in(args.results_dir, args.work_dir)
    material = load_material(args.work_dir, sizes)
    if args.phase == "starts":
        return run_starts(material, args.work_dir, starts, sizes)
    return run_pilots(material, starts, pilots, args.work_dir, sizes)


if __name__ == "__main__":
    main()
