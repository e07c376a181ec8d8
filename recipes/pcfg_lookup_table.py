"""Recipe 3: the lookup-table model reaches the optimal loss and still transfers worse.

The paper's third argument: a model that outputs the true conditionals (a lookup table from contexts to
predictions) attains the entropy floor, the best possible pre-training loss, yet its representation is no better
for downstream tasks than the raw input. Here the lookup table is `OracleMLM`, the exact conditionals computed by
the inside algorithm (PCFG) or forward-backward (HMM). Its representations for the linear probe:

* ``lookup_onehot``: the one-hot table key (position x token) that a lookup table is indexed by;
* ``lookup_conditionals``: its own outputs, the exact conditional distribution at every position, concatenated.

They are compared with a transformer trained with AdamW for ``--steps`` steps (the same probes on its last layer).

    python recipes/pcfg_lookup_table.py           # defaults: under 2 minutes on 2 cores
    python recipes/pcfg_lookup_table.py --smoke   # under 2 minutes
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from hf_flatbias.cli import run_recipe
from hf_flatbias.experiments import (
    RunSpec,
    add_common_arguments,
    config_of,
    context_batch,
    default_output_dir,
    features_probe_scores,
    is_main_process,
    one_mask_loss,
    parse_recipe_arguments,
    run_spec_arguments,
    setup_language_from_args,
    train_and_evaluate,
    write_json,
)
from hf_flatbias.synthetic import OracleMLM
from hf_flatbias.synthetic.tokenizer import N_SPECIAL


def onehot_features(rows: list[list[int]], vocab_size: int, width: int) -> np.ndarray:
    """One-hot (position, token) of each row, padded positions all zero: a lookup table's key."""
    out = np.zeros((len(rows), width, vocab_size), dtype=np.float32)
    for i, row in enumerate(rows):
        out[i, np.arange(len(row)), row] = 1.0
    return out.reshape(len(rows), -1)


def conditional_features(language, rows: list[list[int]], width: int) -> np.ndarray:
    """The exact conditional ``Pr(x_t | x_-t)`` at every word position, concatenated (zero beyond the end)."""
    words = np.full((len(rows), width), -1, dtype=np.int64)
    for i, row in enumerate(rows):
        words[i, : len(row) - 2] = np.asarray(row[1:-1]) - N_SPECIAL
    cond = language.masked_conditionals(words)
    return cond.reshape(len(rows), -1).astype(np.float32)


def main(argv=None, *, default_language: str = "pcfg") -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, steps=1000, eval_every=1000)
    args = parse_recipe_arguments(parser, argv, default_language)
    output_dir = default_output_dir(args, f"{args.language}_lookup_table")
    start = time.perf_counter()
    setup = setup_language_from_args(args)
    batch = context_batch(setup.contexts)
    oracle_loss = one_mask_loss(OracleMLM(setup.language), batch)

    width = max(len(r) for r in setup.probe_rows + setup.probe_test_rows)
    vocab = len(setup.tokenizer)
    onehot = features_probe_scores(
        onehot_features(setup.probe_rows, vocab, width), onehot_features(setup.probe_test_rows, vocab, width), setup
    )
    conditionals = features_probe_scores(
        conditional_features(setup.language, setup.probe_rows, width - 2),
        conditional_features(setup.language, setup.probe_test_rows, width - 2),
        setup,
    )
    spec = RunSpec(label="transformer_adamw", **run_spec_arguments(args))
    records = train_and_evaluate(
        setup, spec, output_dir, trace_contexts=args.trace_contexts, trace_draws=args.trace_draws
    )

    if not is_main_process():
        return {}  # other processes of `accelerate launch` only trained

    def mean_accuracy(scores):
        return float(np.mean([s["accuracy"] for s in scores.values()]))

    payload = {
        "recipe": "lookup_table",
        "language": args.language,
        "entropy_bound": setup.entropy,
        "config": config_of(args),
        "lookup_table": {
            "loss": oracle_loss,
            "loss_gap_to_entropy": oracle_loss - setup.entropy,
            "probe_onehot": onehot,
            "probe_accuracy_onehot": mean_accuracy(onehot),
            "probe_conditionals": conditionals,
            "probe_accuracy_conditionals": mean_accuracy(conditionals),
        },
        "transformer": records,
        "seconds": time.perf_counter() - start,
    }
    write_json(output_dir / "results.json", payload)
    final = records[-1]
    print(f"entropy floor {setup.entropy:.4f}; lookup table loss {oracle_loss:.4f}")
    print(
        f"lookup table probe: one-hot {payload['lookup_table']['probe_accuracy_onehot']:.3f} "
        f"conditionals {payload['lookup_table']['probe_accuracy_conditionals']:.3f}"
    )
    print(f"transformer: loss {final['loss']:.4f} probe {final['probe_accuracy']:.3f}")
    print(f"wrote {output_dir / 'results.json'} in {payload['seconds']:.0f} s")
    return payload


if __name__ == "__main__":
    run_recipe(main)
