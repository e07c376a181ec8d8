"""Claim C1, continued training, on the gated paper-shaped grammar: five model seeds, annealed branches, a stated rule.

Each model seed trains a constant-rate trunk (AdamW, beta2 0.98, weight decay 0.01, linear warm-up); every
``--branch-every`` steps a branch copied from the trunk (weights and Adam state) is annealed linearly to lr 0 over
``--anneal-steps`` steps and measured: KL(exact conditional || model) over every position of ``--n-kl`` held-out
sentences with a bootstrap interval, the Fisher trace (``per_sample``), the Hutchinson trace of the data-label loss
(the released code's quantity) and linear probes of tasks A/B/C at a fixed feature width, regularisation chosen on a
validation split, one test set for every model. The grammar, the KL sentences, the probe sets and the reference rows
(lexical baseline, untrained encoder, exact conditionals) depend on ``--grammar-seed`` only.

PASS RULE (fixed before any run; `hf_flatbias.experiments.verdicts`): pass if Spearman(training step, Fisher trace) < 0
among saturated branches (KL <= 0.010, bootstrap upper end <= 0.015) in >= 4 of 5 seeds AND the last-minus-first
compared branch probe accuracy has a 95% seed-level t interval above 0. A seed with fewer than 3 saturated branches
compares its branches with KL <= 0.020 within 0.003 nats of its lowest ("matched, not saturated"); with fewer than 4
seeds having 3 such branches the verdict is "undecided (not saturated)". Reported beside the verdict: pooled
Spearman(trace, accuracy) and Spearman(KL, accuracy) over the compared branches.

Resumable: ``SEED/branches.json`` is written after every branch and the trunk checkpointed right after it; a rerun
skips finished seeds (``SEED/result.json``) and resumes unfinished ones from their last branch. ``--merge`` (after
every seed is done) measures the reference rows, the McNemar comparisons and the verdict into ``c1_results.json``.

    python recipes/pcfg_c1_continued_training.py --grammar-seed G --seeds 0        # one seed (run seeds in parallel)
    python recipes/pcfg_c1_continued_training.py --grammar-seed G --merge          # verdict from the finished seeds
    python recipes/pcfg_c1_continued_training.py --smoke                           # seconds
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from hf_flatbias.cli import run_recipe
from hf_flatbias.experiments import (
    RunSpec,
    add_paper_protocol_arguments,
    apply_paper_smoke,
    c1_verdict,
    mcnemar,
    paper_run_spec,
    reference_rows,
    setup_paper_language,
    train_with_branches,
    trains_on_cpu,
    without_predictions,
    write_json,
)


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grammar-seed", type=int, default=0, help="seed of PCFG.paper_shaped (the gate's choice)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="model seeds to train")
    parser.add_argument("--steps", type=int, default=16_000, help="trunk steps")
    parser.add_argument("--branch-every", type=int, default=2000, help="trunk steps between annealed branches")
    parser.add_argument("--anneal-steps", type=int, default=2000, help="steps of each branch's linear anneal to 0")
    parser.add_argument("--n-trace", type=int, default=1000, help="one-mask contexts of the trace estimates")
    parser.add_argument("--trace-draws", type=int, default=2, help="labels drawn per context (Fisher, per_sample)")
    parser.add_argument("--hutchinson-draws", type=int, default=4, help="Rademacher probes per batch (data-label loss)")
    parser.add_argument("--merge", action="store_true", help="only merge the finished seeds into c1_results.json")
    add_paper_protocol_arguments(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        apply_paper_smoke(args)
        given = sys.argv[1:] if argv is None else argv  # run as a script, argv is None
        args.seeds = args.seeds if "--seeds" in given else [0, 1]
        args.steps, args.branch_every, args.anneal_steps = 40, 20, 10
        args.n_trace, args.trace_draws, args.hutchinson_draws = 16, 1, 1
    trains_on_cpu(args.device)  # --device cuda without one fails here, before any compute
    if args.output_dir is None:
        args.output_dir = Path("outputs") / "pcfg_c1" / f"grammar{args.grammar_seed}_c{args.concentration:g}"
    return args


def run_spec(args: argparse.Namespace, seed: int) -> RunSpec:
    return paper_run_spec(
        args, label=f"seed{seed}", seed=seed, eval_every=args.branch_every, lr_scheduler_type="constant_with_warmup"
    )


def language_of(args: argparse.Namespace, *, training: bool):
    return setup_paper_language(
        args.grammar_seed,
        n_train=args.n_train if training else 1,
        n_kl=args.n_kl,
        n_trace=args.n_trace,
        n_probe=args.n_probe,
        shape={"concentration": args.concentration},
        with_conditionals=training,
    )


def run_seed(args: argparse.Namespace, language, seed: int) -> dict:
    seed_dir = args.output_dir / f"seed{seed}"
    done = seed_dir / "result.json"
    if done.exists():
        print(f"seed {seed}: finished earlier ({done})", flush=True)
        return json.loads(done.read_text())
    start = time.perf_counter()
    records = train_with_branches(
        language,
        run_spec(args, seed),
        seed_dir,
        branch_every=args.branch_every,
        anneal_steps=args.anneal_steps,
        measure_kwargs=dict(
            trace_contexts=args.n_trace, trace_draws=args.trace_draws, hutchinson_draws=args.hutchinson_draws
        ),
    )
    payload = {"seed": seed, "config": _config(args), "records": records, "seconds": time.perf_counter() - start}
    write_json(done, payload)
    print(f"seed {seed}: {len(records)} branches in {payload['seconds']:.0f} s -> {done}", flush=True)
    return payload


def merge(args: argparse.Namespace) -> dict:
    """References, paired comparisons and the verdict from every finished seed of ``args.seeds``."""
    results = {}
    for seed in args.seeds:
        path = args.output_dir / f"seed{seed}" / "result.json"
        if not path.exists():
            raise SystemExit(
                f"seed {seed} is not finished ({path} missing): run it first, or pass --seeds of those done."
            )
        results[seed] = json.loads(path.read_text())
    language = language_of(args, training=False)
    references = reference_rows(language, run_spec(args, args.seeds[0]))
    paired = {}
    for seed, result in results.items():
        first, last = result["records"][0], result["records"][-1]
        paired[str(seed)] = {
            f"{name}_{task}": mcnemar(a["probe"][task]["correct"], b["probe"][task]["correct"])
            for name, (a, b) in {
                "last_vs_first_branch": (first, last),
                "last_branch_vs_lexical": (references["lexical_baseline"], last),
            }.items()
            for task in last["probe"]
        }
    verdict = c1_verdict({str(seed): result["records"] for seed, result in results.items()})
    payload = {
        "recipe": "pcfg_c1_continued_training",
        "config": _config(args),
        "verdict": verdict,
        "references": {name: without_predictions(row) for name, row in references.items()},
        "mcnemar": paired,
        "seeds": {str(seed): [without_predictions(r) for r in result["records"]] for seed, result in results.items()},
    }
    write_json(args.output_dir / "c1_results.json", payload)
    print(f"C1: {verdict['verdict']} ({verdict['regime']}); wrote {args.output_dir / 'c1_results.json'}", flush=True)
    return payload


def _config(args: argparse.Namespace) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in ("merge", "seeds")}


def main(argv=None) -> dict:
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # tiny models run many times slower with two threads on a shared machine
    args = parse_arguments(argv)
    if not args.merge:
        language = language_of(args, training=True)
        for seed in args.seeds:
            run_seed(args, language, seed)
        seeds = " ".join(str(s) for s in args.seeds)
        print(
            f"merge once every seed is done: {Path(__file__).name} --grammar-seed {args.grammar_seed} "
            f"--concentration {args.concentration:g} --seeds ... --merge (this run: --seeds {seeds})",
            flush=True,
        )
        return {}
    return merge(args)


if __name__ == "__main__":
    run_recipe(main)
