"""The robustness study (issue 37): SAM, a late SAM window and AdamW continued from the saturated H64 starts, judged
by weight noise, quantization and forgetting beside the Fisher trace. Rules: `research.robustness_rules` (committed
before any real run; prose in docs/reproduction/robustness.md).

Resumable: a (seed, arm) unit whose row in the JSON says ``done`` is skipped; a unit stopped midway starts again.
One process, one thread (from the repository root):

    mkdir -p outputs/robustness; OMP_NUM_THREADS=1 PYTHONPATH=$PWD:$PWD/recipes nohup nice -n 10 \\
      python recipes/robustness_study.py >> outputs/robustness/study.log 2>&1 &
    PYTHONPATH=$PWD:$PWD/recipes python recipes/robustness_study.py --markdown   # tables and figure from the JSON
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from research.robustness import (
    RESULTS,
    SMOKE,
    StudySizes,
    load_language,
    plot_study,
    read_units,
    run_study,
    study_markdown,
    study_work,
)
from research.robustness_rules import ARMS, REFERENCE, SEEDS


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="only print the docs' tables and draw the figure")
    parser.add_argument(
        "--out", type=Path, default=RESULTS / "study.json", help="the study's JSON (rewritten per unit)"
    )
    parser.add_argument("--work-dir", type=Path, default=Path("outputs") / "robustness", help="trained arms' weights")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS), help="model seeds (default: the rules')")
    parser.add_argument(
        "--arms", nargs="+", default=[REFERENCE, *ARMS], choices=[REFERENCE, *ARMS], help="arms (default: all)"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds (tests and timing)")
    parser.add_argument("--steps", type=int, default=None, help="override the rules' steps (timing smoke runs only)")
    args = parser.parse_args(argv)
    if args.steps is not None and args.out.resolve() == (RESULTS / "study.json").resolve():
        parser.error("--steps changes the pre-registered schedule: give another --out than the study's JSON.")
    if args.smoke and args.out.resolve() == (RESULTS / "study.json").resolve():
        parser.error("--smoke writes tiny rows: give another --out than the study's JSON.")
    return args


def main(argv=None) -> dict:
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    args = parse_arguments(argv)
    if args.markdown:
        units = read_units(args.out)
        print(study_markdown(units))
        plot_study(units, args.out.with_suffix(".png"))
        return units
    sizes = SMOKE if args.smoke else StudySizes()
    if args.steps is not None:
        sizes = StudySizes(**{**sizes.__dict__, "steps": args.steps})
    language = load_language(sizes)
    return run_study(args.out, study_work(language, sizes, args.work_dir), seeds=args.seeds, arms=args.arms)


if __name__ == "__main__":
    main()
