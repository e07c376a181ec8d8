"""Recipe 2: does the optimizer's implicit bias change flatness and transfer at the same loss?

Three runs from the same initialisation and data order, as in the paper's optimizer comparison:
AdamW with dropout and weight decay (the usual recipe), AdamW with neither, and neither plus SAM. Each run is
evaluated every ``--eval-every`` steps; the summary compares the final checkpoints (loss, gap to the entropy floor,
trace, probe accuracy) and the Spearman correlations across all checkpoints of all runs.

    python recipes/pcfg_optimizers.py             # defaults: 3 x 10,000 steps (SAM costs 2 passes), about 27 minutes
    python recipes/pcfg_optimizers.py --smoke     # under 2 minutes
"""

from __future__ import annotations

import argparse
import time

from hf_flatbias.cli import run_recipe
from hf_flatbias.experiments import (
    RunSpec,
    add_common_arguments,
    at_common_loss,
    config_of,
    correlations,
    default_output_dir,
    is_main_process,
    matched_loss,
    parse_recipe_arguments,
    plot_runs,
    run_spec_arguments,
    setup_language_from_args,
    train_and_evaluate,
    write_json,
)


def main(argv=None, *, default_language: str = "pcfg") -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, steps=10_000, eval_every=1000)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--sam-rho", type=float, default=0.05)
    parser.add_argument("--matched-tolerance", type=float, default=0.02)
    args = parse_recipe_arguments(parser, argv, default_language)
    output_dir = default_output_dir(args, f"{args.language}_optimizers")
    start = time.perf_counter()
    setup = setup_language_from_args(args)
    common = run_spec_arguments(args)
    specs = [
        RunSpec(label="adamw_dropout_wd", dropout=args.dropout, weight_decay=args.weight_decay, **common),
        RunSpec(label="adamw_plain", **common),
        RunSpec(label="adamw_plain_sam", flatness_method="sam", sam_rho=args.sam_rho, **common),
    ]
    runs = {
        spec.label: train_and_evaluate(
            setup, spec, output_dir, trace_contexts=args.trace_contexts, trace_draws=args.trace_draws
        )
        for spec in specs
    }
    if not is_main_process():
        return {}  # other processes of `accelerate launch` only trained
    pooled = [r for records in runs.values() for r in records if r["step"] > 0]
    finals = {label: records[-1] for label, records in runs.items()}
    payload = {
        "recipe": "optimizers",
        "language": args.language,
        "entropy_bound": setup.entropy,
        "config": config_of(args),
        "runs": runs,
        "final": finals,
        "at_common_loss": at_common_loss(runs),
        "correlations_all_checkpoints": correlations(pooled),
        "correlations_matched_loss": correlations(matched_loss(pooled, args.matched_tolerance)),
        "seconds": time.perf_counter() - start,
    }
    write_json(output_dir / "results.json", payload)
    plot_runs(
        runs,
        output_dir / "plot.png",
        f"{args.language}: optimizers (entropy floor {setup.entropy:.3f} nats)",
        matched={label: matched_loss(records, args.matched_tolerance) for label, records in runs.items()},
    )
    for label, r in finals.items():
        print(
            f"{label:>18}: loss {r['loss']:.4f} gap {r['loss_gap_to_entropy']:.4f} trace {r['hessian_trace']} "
            f"probe {r['probe_accuracy']:.3f}"
        )
    common_loss = payload["at_common_loss"]
    for label, r in common_loss["checkpoints"].items():
        print(
            f"{label:>18} at loss {common_loss['target_loss']:.4f}: step {r['step']} loss {r['loss']:.4f} "
            f"trace {r['hessian_trace']} probe {r['probe_accuracy']:.3f}"
        )
    print(f"pooled checkpoints: {payload['correlations_all_checkpoints']}")
    print(f"wrote {output_dir / 'results.json'} in {payload['seconds']:.0f} s")
    return payload


if __name__ == "__main__":
    run_recipe(main)
