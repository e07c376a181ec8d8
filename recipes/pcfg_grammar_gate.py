"""The grammar gate: which paper-shaped grammar can a CPU model saturate while its probes keep headroom?

Hard probes and saturation pull against each other on a CPU (issue 15), so the grammar is chosen by measurement, not
taste. For each candidate ``GRAMMAR_SEED:CONCENTRATION`` (`PCFG.paper_shaped`) this measures the *lexical baseline*
(a linear probe on one-hot (position, word) features: tasks A/B/C, regularisation chosen on a validation split, the
fixed test set) and trains a short annealed pilot (AdamW, beta2 0.98, warm-up then linear decay to 0 over
``--steps``), then measures its KL(exact conditional || model) over every position of ``--n-kl`` held-out sentences.

RULE (fixed before any run): keep the candidate with the lowest mean lexical-baseline accuracy (over A/B/C) among
those whose pilot KL is <= ``--max-kl`` (0.04 nats) after ``--steps`` (8,000); none passing: no grammar is gated.

Resumable: each candidate's ``candidate_SEED_cCONC.json`` is written when it finishes and a rerun skips it (a
candidate stopped midway starts again); the table and the choice are (re)written to ``gate.json`` after every
candidate, from every candidate file in the output folder.

    python recipes/pcfg_grammar_gate.py --candidates 0:1 1:1        # run some candidates (in parallel processes)
    python recipes/pcfg_grammar_gate.py --merge                     # the table and the choice from what is done
    python recipes/pcfg_grammar_gate.py --smoke
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
    add_paper_protocol_arguments,
    apply_paper_smoke,
    lexical_features,
    measure_saturation,
    paper_run_spec,
    probe_all_tasks,
    setup_paper_language,
    train_annealed,
    trains_on_cpu,
    without_predictions,
    write_json,
)

DEFAULT_CANDIDATES = ("0:1", "1:1", "2:1", "0:0.5")


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--candidates", nargs="+", default=list(DEFAULT_CANDIDATES), help="grammars as GRAMMAR_SEED:CONCENTRATION"
    )
    parser.add_argument("--steps", type=int, default=8000, help="steps of each annealed pilot")
    parser.add_argument("--max-kl", type=float, default=0.04, help="largest pilot KL (nats) a grammar may keep")
    parser.add_argument("--model-seed", type=int, default=0)
    parser.add_argument("--merge", action="store_true", help="only write gate.json from the finished candidates")
    add_paper_protocol_arguments(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        apply_paper_smoke(args)
        args.steps = 20
        if "--candidates" not in (sys.argv[1:] if argv is None else argv):  # run as a script, argv is None
            args.candidates = ["0:1", "1:1"]
    try:
        args.grammars = [(int(s), float(c)) for s, c in (c.split(":") for c in args.candidates)]
    except ValueError:
        parser.error(f"--candidates must look like 0:1 1:0.5 (GRAMMAR_SEED:CONCENTRATION), got {args.candidates}.")
    trains_on_cpu(args.device)  # --device cuda without one fails here, before any compute
    if args.output_dir is None:
        args.output_dir = Path("outputs") / "pcfg_grammar_gate"
    return args


def candidate_path(args: argparse.Namespace, grammar_seed: int, concentration: float) -> Path:
    return args.output_dir / f"candidate_{grammar_seed}_c{concentration:g}.json"


def run_candidate(args: argparse.Namespace, grammar_seed: int, concentration: float) -> dict:
    path = candidate_path(args, grammar_seed, concentration)
    if path.exists():
        print(f"grammar {grammar_seed}:{concentration:g}: measured earlier ({path})", flush=True)
        return json.loads(path.read_text())
    start = time.perf_counter()
    language = setup_paper_language(
        grammar_seed,
        n_train=args.n_train,
        n_kl=args.n_kl,
        n_trace=1,
        n_probe=args.n_probe,
        shape={"concentration": concentration},
    )
    lexical = without_predictions(probe_all_tasks(lexical_features(language), language))
    print(f"grammar {grammar_seed}:{concentration:g}: lexical baseline {lexical['probe_accuracy']:.3f}", flush=True)
    spec = paper_run_spec(
        args,
        label=f"gate_{grammar_seed}_c{concentration:g}",
        seed=args.model_seed,
        eval_every=args.steps,
        lr_scheduler_type="linear",
    )
    model = train_annealed(language, spec, args.output_dir / spec.label)
    kl = measure_saturation(
        model, language.kl_sentences.word_ids, language.kl_conditionals, language.kl_sentences.lengths
    )
    payload = {
        "grammar_seed": grammar_seed,
        "concentration": concentration,
        "lexical_baseline": lexical,
        "pilot_kl": kl.kl,
        "pilot_saturation": kl.to_dict(),
        "mean_length": float(language.kl_sentences.lengths.mean()),
        "seconds": time.perf_counter() - start,
    }
    write_json(path, payload)
    print(f"grammar {grammar_seed}:{concentration:g}: pilot KL {kl.kl:.4f} ({payload['seconds']:.0f} s)", flush=True)
    return payload


def gate(candidates: list[dict], max_kl: float) -> dict:
    """The rule of this recipe's docstring over measured candidates: the table and the chosen grammar (or None)."""
    table = sorted(
        (
            {
                "grammar_seed": c["grammar_seed"],
                "concentration": c["concentration"],
                "lexical_baseline": c["lexical_baseline"]["probe_accuracy"],
                **{f"lexical_{t}": r["accuracy"] for t, r in c["lexical_baseline"]["probe"].items()},
                "pilot_kl": c["pilot_kl"],
                "passes": c["pilot_kl"] <= max_kl,
            }
            for c in candidates
        ),
        key=lambda row: row["lexical_baseline"],
    )
    passing = [row for row in table if row["passes"]]
    return {"max_kl": max_kl, "table": table, "chosen": passing[0] if passing else None}


def merge(args: argparse.Namespace) -> dict:
    candidates = [json.loads(p.read_text()) for p in sorted(args.output_dir.glob("candidate_*.json"))]
    result = {"recipe": "pcfg_grammar_gate", "steps": args.steps, **gate(candidates, args.max_kl)}
    write_json(args.output_dir / "gate.json", result)
    chosen = result["chosen"]
    print(
        "gate: no candidate reached the KL limit"
        if chosen is None
        else f"gate: grammar {chosen['grammar_seed']}:{chosen['concentration']:g} "
        f"(--grammar-seed {chosen['grammar_seed']} --concentration {chosen['concentration']:g})",
        flush=True,
    )
    return result


def main(argv=None) -> dict:
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # tiny models run many times slower with two threads on a shared machine
    args = parse_arguments(argv)
    if not args.merge:
        for grammar_seed, concentration in args.grammars:
            run_candidate(args, grammar_seed, concentration)
            merge(args)
    return merge(args)


if __name__ == "__main__":
    run_recipe(main)
