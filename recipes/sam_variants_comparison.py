"""AdamW vs SAM vs Functional-SAM vs preconditioned Functional-SAM vs sub-batch SAM on a tiny BERT and a tiny Llama.

Both models are pre-trained from scratch on one small PCFG (`hf_flatbias.synthetic`), whose exact probabilities give
a held-out measure of how far each model is from the language:

- BERT (masked LM, 15% masking): KL(exact one-mask conditional || model) over every position of held-out sentences,
  each masked in turn (`measure_saturation`);
- Llama (causal LM over ``[CLS] words [SEP]``): the held-out sequence KL per predicted token,
  ``mean_s (log p(s) - log q(s)) / mean_s (len(s) + 1)`` with ``p(s)`` the PCFG's exact sentence probability. By the
  chain rule it is the mean next-token KL under the language, so no next-token conditional is tabulated.

Every run also reports the Fisher trace of the pre-training loss on held-out contexts. ``adamw_2x`` (AdamW at twice
the steps, its own cosine schedule) is the equal-compute baseline of the two-pass methods. The pass/fail rule is in
``RULE`` and is written to the results file before the first run. Runs are appended to the JSON as they finish; a
rerun skips those already there (resumable).

    OMP_NUM_THREADS=1 PYTHONPATH=. python recipes/sam_variants_comparison.py --output runs/sam_variants.json
    OMP_NUM_THREADS=1 PYTHONPATH=. python recipes/sam_variants_comparison.py --smoke --output /tmp/smoke.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from research.sam_variants import METHODS, MODELS, RULE, Setting, run_one, summarize

from hf_flatbias.results import write_json


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("runs/sam_variants_comparison.json"))
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--n-train", type=int, default=20_000)
    parser.add_argument("--n-eval", type=int, default=300, help="held-out sentences for the KL")
    # the research Setting's trace_contexts, n_contexts of the trace (see CompareArguments.trace_contexts for why)
    parser.add_argument("--trace-contexts", type=int, default=128)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--smoke", action="store_true", help="a few steps, 1 seed: checks the whole pipeline")
    return parser


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.smoke:
        args.steps, args.seeds, args.n_train, args.n_eval, args.trace_contexts = 4, 1, 256, 16, 8
    methods = [m for m in args.methods.split(",") if m]
    models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS)) + sorted(set(models) - set(MODELS))
    if unknown:
        raise ValueError(f"unknown methods/models {unknown}; choose from {list(METHODS)} and {list(MODELS)}.")
    torch.set_num_threads(1)
    settings = {k: v for k, v in vars(args).items() if k not in ("output",)}
    payload = {"rule": RULE, "settings": settings, "runs": []}
    if args.output.exists():
        previous = json.loads(args.output.read_text())
        if previous.get("settings") != settings:
            raise ValueError(
                f"{args.output} holds runs of other settings {previous.get('settings')}; pass another --output."
            )
        payload = previous
    write_json(args.output, payload)  # the rule is on disk before any run
    setting = Setting(n_train=args.n_train, n_eval=args.n_eval, trace_contexts=args.trace_contexts)
    done = {(r["model"], r["method"], r["seed"]) for r in payload["runs"]}
    for seed in range(args.seeds):
        for kind in models:
            for method in methods:
                if (kind, method, seed) in done:
                    continue
                record = run_one(
                    setting,
                    kind,
                    method,
                    seed,
                    steps=args.steps,
                    batch_size=args.batch_size,
                    learning_rate=args.learning_rate,
                    hidden=args.hidden,
                )
                payload["runs"].append(record)
                payload["summary"] = summarize(payload["runs"])
                write_json(args.output, payload)
                print(json.dumps(record), flush=True)
    return payload


if __name__ == "__main__":
    main()
