"""Do the explicit flatness regularizers lower the measured trace at matched pre-training loss? (synthetic language)

Small BERT masked LMs are pre-trained on a synthetic language (`hf_flatbias.synthetic`, the PCFG by default) with plain
AdamW and with each flatness method of ``METHODS``. The plain run fixes the target: its one-mask validation loss at the
end. Every other method trains up to ``--extra`` times as many steps, is evaluated every ``--eval-every`` steps and
stops at the first checkpoint whose loss is at or below the target (flagged when none gets there within the budget:
then its last checkpoint is compared). At that checkpoint the recipe reports what every synthetic recipe reports
(`hf_flatbias.experiments.evaluate_checkpoint`): the paper's Fisher trace, and linear-probe accuracy on the language's
tasks on concatenated and on mean-pooled frozen features.

    OMP_NUM_THREADS=1 PYTHONPATH=. python recipes/pcfg_regularizers.py --output-dir runs/pcfg_regularizers
    OMP_NUM_THREADS=1 PYTHONPATH=. python recipes/pcfg_regularizers.py --quick   # a few minutes
    OMP_NUM_THREADS=1 PYTHONPATH=. python recipes/pcfg_regularizers.py --methods sam,fisher_penalty --target 2.05

Prints a markdown table and writes ``results.json`` to ``--output-dir``.
"""

from __future__ import annotations

import argparse
import time

from hf_flatbias.cli import run_recipe
from hf_flatbias.experiments import (
    RunSpec,
    add_common_arguments,
    default_output_dir,
    final_row,
    is_main_process,
    parse_recipe_arguments,
    run_spec_arguments,
    setup_language_from_args,
    train_and_evaluate,
    write_results,
)

# name -> FlatBiasConfig overrides; every run shares the rest of the arguments.
METHODS: dict[str, dict] = {
    "adamw": {"flatness_method": "none"},
    "sam": {"flatness_method": "sam", "sam_rho": 0.1},
    "sam_every_4": {"flatness_method": "sam", "sam_rho": 0.1, "sam_every_k": 4},
    "looksam_every_4": {"flatness_method": "looksam", "sam_rho": 0.1, "sam_every_k": 4},
    "fisher_penalty": {"flatness_method": "fisher_penalty", "penalty_lambda": 0.001, "penalty_fd_step": 0.01},
    "grad_norm_penalty": {"flatness_method": "grad_norm_penalty", "penalty_lambda": 0.08, "penalty_fd_step": 0.1},
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, steps=1500, eval_every=100)
    # this recipe's own sizes: a 64 x 2 BERT trained with 15% masking; unset sizes follow --quick
    parser.set_defaults(
        steps=None, eval_every=None, n_contexts=None, trace_contexts=None, hidden=64, layers=2, batch_size=32
    )
    parser.set_defaults(learning_rate=2e-3, n_train=20_000, mask_probability=0.15)
    parser.add_argument("--quick", action="store_true", help="few steps and contexts, a run of a few minutes")
    parser.add_argument("--extra", type=float, default=2.0, help="step budget of the other methods, x --steps")
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ",".join(METHODS))
    parser.add_argument(
        "--target", type=float, default=None, help="target loss from an earlier AdamW run (then 'adamw' is not rerun)"
    )
    return parser


def resolve_sizes(args) -> None:
    """Fill the sizes left unset: ``--quick`` (200 steps, 200 contexts) or the full run (1500 steps, 1000)."""
    args.steps = args.steps or (200 if args.quick else 1500)
    args.eval_every = args.eval_every or max(10, args.steps // 15)
    args.n_contexts = args.n_contexts or (200 if args.quick else 1000)
    args.trace_contexts = args.n_contexts if args.trace_contexts is None else args.trace_contexts


def main(argv=None, *, default_language: str = "pcfg") -> dict:
    args = parse_recipe_arguments(build_parser(), argv, default_language)  # --smoke sizes win over --quick
    resolve_sizes(args)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or ("adamw" not in methods and args.target is None):
        raise ValueError(
            f"--methods must be among {list(METHODS)} (got unknown {unknown}) and include 'adamw' unless --target "
            "gives the AdamW loss to match."
        )
    output_dir = default_output_dir(args, f"{args.language}_regularizers", root="runs")
    started = time.perf_counter()
    setup = setup_language_from_args(args)
    common = {**run_spec_arguments(args), "weight_decay": args.weight_decay, "trace_final_only": True}
    results, target = [], args.target
    for method in sorted(methods, key=lambda m: m != "adamw"):
        method_start = time.perf_counter()
        budget = args.steps if method == "adamw" else int(round(args.steps * args.extra))
        spec = RunSpec(
            label=method,
            flatness_overrides=METHODS[method],
            target_loss=None if method == "adamw" else target,
            **{**common, "steps": budget},
        )
        print(f"{method}: up to {budget} steps", flush=True)
        records = train_and_evaluate(
            setup, spec, output_dir, trace_contexts=args.trace_contexts, trace_draws=args.trace_draws
        )
        if not records:
            return {}  # not the main process of `accelerate launch`
        if method == "adamw":
            target = records[-1]["loss"]
        row = final_row(records, target_loss=target, train_seconds=time.perf_counter() - method_start, method=method)
        row.update(overrides=METHODS[method], loss_curve=[(r["step"], round(r["loss"], 4)) for r in records])
        results.append(row)
    if not is_main_process():
        return {}
    print(
        f"\nentropy floor of the validation contexts: {setup.entropy:.4f} nats; target loss (AdamW, {args.steps} "
        f"steps): {target:.4f}"
    )
    columns = ["method", "steps", "loss", "matched", "hessian_trace", "hessian_trace_stderr", "probe_accuracy"]
    columns += ["probe_accuracy_mean_pooled"] + [f"probe_{task}" for task in setup.probe_tasks]
    return write_results(
        output_dir,
        "regularizers",
        args,
        setup,
        started,
        table=[{**r, "matched": "yes" if r["reached_target"] else "NO"} for r in results],
        columns=columns,
        target_loss=target,
        plain_steps=args.steps,
        results=results,
    )


if __name__ == "__main__":
    run_recipe(main)
