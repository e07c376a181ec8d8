"""Recipe 1: keep training after the pre-training loss has converged.

The paper's first finding (Sec. 3-4): once the MLM loss saturates, further training leaves the loss unchanged but
keeps lowering the trace of the Hessian, and downstream (probe) accuracy keeps rising. This recipe trains one
model at a constant learning rate well past convergence, evaluates checkpoints and reports Spearman correlations of
trace and of loss with probe accuracy, over all checkpoints and over those at matched loss.

    python recipes/pcfg_continue_training.py           # defaults: 0.11M BERT, 30,000 steps, 21 min on 2 shared cores
    python recipes/pcfg_continue_training.py --smoke   # under 2 minutes
    accelerate launch --config_file recipes/configs/accelerate_1proc.yaml \\
        recipes/pcfg_continue_training.py --language hmm
"""

from __future__ import annotations

import argparse
import time

from hf_flatbias.cli import run_recipe
from hf_flatbias.experiments import (
    RunSpec,
    add_common_arguments,
    config_of,
    correlations,
    default_output_dir,
    flatness_selection,
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
    add_common_arguments(parser, steps=30_000, eval_every=1000)
    parser.add_argument(
        "--matched-tolerance", type=float, default=0.02, help="nats above the best loss that count as 'same loss'"
    )
    args = parse_recipe_arguments(parser, argv, default_language)
    output_dir = default_output_dir(args, f"{args.language}_continue_training")
    start = time.perf_counter()
    setup = setup_language_from_args(args)
    spec = RunSpec(label="adamw_constant_lr", **run_spec_arguments(args))
    records = train_and_evaluate(
        setup, spec, output_dir, trace_contexts=args.trace_contexts, trace_draws=args.trace_draws
    )
    if not is_main_process():
        return {}  # other processes of `accelerate launch` only trained
    matched = matched_loss(records, args.matched_tolerance)
    payload = {
        "recipe": "continue_training",
        "language": args.language,
        "entropy_bound": setup.entropy,
        "config": config_of(args),
        "records": records,
        "correlations_all_checkpoints": correlations(records),
        "correlations_matched_loss": correlations(matched),
        "matched_steps": [r["step"] for r in matched],
        "flatness_selection": flatness_selection(records, args.matched_tolerance),
        "seconds": time.perf_counter() - start,
    }
    write_json(output_dir / "results.json", payload)
    plot_runs(
        {spec.label: records},
        output_dir / "plot.png",
        f"{args.language}: continued training (entropy floor {setup.entropy:.3f} nats)",
        matched={spec.label: matched},
    )
    print(f"all checkpoints: {payload['correlations_all_checkpoints']}")
    print(f"matched loss ({len(matched)} checkpoints): {payload['correlations_matched_loss']}")
    print(f"checkpoint selection: {payload['flatness_selection']}")
    print(f"wrote {output_dir / 'results.json'} in {payload['seconds']:.0f} s")
    return payload


if __name__ == "__main__":
    run_recipe(main)
