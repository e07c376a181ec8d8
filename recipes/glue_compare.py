"""Compare checkpoints as Liu et al. (ICML 2023) do: pre-training loss, Fisher trace, and GLUE after fine-tuning.

For every checkpoint (a local folder, e.g. one saved by ``bert_bookcorpus.py``, or a Hub id with a masked-LM head
and a tokenizer) this measures the masked-LM loss and the Fisher trace on held-out text, fine-tunes it on each
task over several seeds, and writes ``glue_compare.md`` (table), ``glue_compare.csv`` and ``glue_compare.png``
(GLUE score against trace) to ``--output_dir``:

    python recipes/glue_compare.py runs/a runs/b --tasks sst2,qnli,rte --output_dir runs/compare
    accelerate launch -q --config_file recipes/configs/accelerate_1proc.yaml \\
        recipes/glue_compare.py runs/a runs/b --config recipes/configs/glue_compare.yaml
    python recipes/glue_compare.py runs/a runs/b --smoke --output_dir /tmp/compare   # SST-2 stand-in, minutes

Offline, SST-2 is replaced by Rotten Tomatoes review snippets (see ``hf_flatbias.glue.load_glue_dataset``); other
tasks need ``--data_dir``. Fine-tuning settings (learning rate, epochs, batch size, even ``--flatness_method sam``)
are the ``GlueConfig`` flags. Every checkpoint and task is checked before any training starts; bad flag values (a
flatness value out of range, a reporter that is not installed) are refused in one line before torch is imported.
``accelerate launch -q`` keeps that line the last one printed (without ``-q`` accelerate's launcher adds its own
traceback after any failed run).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

# Nothing here imports torch or transformers: check_before_loading refuses a bad flag before they are.
from hf_flatbias.cli import run_recipe
from hf_flatbias.recipe_args import check_before_loading, parse_dataclass_args

# Imported on first use (they import torch): the names this module re-exports from hf_flatbias.glue.
_LAZY = {
    "held_out_corpus": "hf_flatbias.glue.compare",
    "load_masked_lm": "hf_flatbias.glue.compare",
    "load_task_data": "hf_flatbias.glue.compare",
    "pairwise_comparisons": "hf_flatbias.glue.compare",
    "write_outputs": "hf_flatbias.glue.report",
}
__all__ = list(_LAZY)


def __getattr__(name: str):
    import importlib

    if name == "ARGUMENT_TYPES":
        return argument_types()
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def argument_types() -> tuple[type, ...]:
    """The dataclasses of the command line: the comparison, the measurements, the fine-tuning (`GlueConfig`)."""
    from hf_flatbias.glue import GlueConfig
    from hf_flatbias.glue.compare import CompareArguments, MeasurementArguments

    return (CompareArguments, MeasurementArguments, GlueConfig)


DEFAULT_OUTPUT_DIR = "runs/glue_compare"  # runs/ is git-ignored
SMOKE_SETTINGS = {
    "output_dir": "runs/glue_compare_smoke",
    "tasks": "sst2",
    "seeds": [0, 1],
    "max_length": 64,
    "max_train_samples": 800,
    "max_eval_samples": 300,
    "loss_texts": 100,
    "loss_maskings": 2,
    "max_seq_length": 64,
    "trace_contexts": 16,
    "trace_draws": 2,
    "released_trace_batches": 2,
    "released_trace_batch_size": 8,
    "max_steps": 25,
    "learning_rate": 1e-3,
    "per_device_train_batch_size": 32,
    "use_cpu": True,
    "disable_tqdm": True,
    "report_to": "none",
}


def split_positional_models(argv: list[str]) -> list[str]:
    """``MODEL [MODEL ...] --flags`` becomes ``--flags --models MODEL ...`` (HfArgumentParser has no positionals)."""
    leading = 0
    while leading < len(argv) and not argv[leading].startswith("-"):
        leading += 1
    models, rest = argv[:leading], argv[leading:]
    return rest + (["--models", *models] if models else [])


def main(argv: list[str] | None = None) -> dict[str, Path]:
    argv = split_positional_models(list(sys.argv[1:] if argv is None else argv))
    check_before_loading(argv, smoke_settings=SMOKE_SETTINGS)
    from hf_flatbias.glue import parse_glue_tasks, resolve_finetune_mode
    from hf_flatbias.glue.compare import (
        check_checkpoints,
        check_compare_arguments,
        finetune_checkpoints,
        measure_checkpoints,
        pairwise_comparisons,
        standin_tasks_of,
    )
    from hf_flatbias.glue.report import write_outputs

    args, measuring, config = parse_dataclass_args(
        argument_types(), argv, smoke_settings=SMOKE_SETTINGS, description=__doc__
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    check_compare_arguments(args, measuring)
    if config.output_dir is None:
        config.output_dir = DEFAULT_OUTPUT_DIR
    args.mode = resolve_finetune_mode(args.mode)
    tasks = [task.name for task in parse_glue_tasks(args.tasks)]
    standin_tasks = standin_tasks_of(tasks, args.data_dir, update_cards=args.update_cards)
    # Where each checkpoint's loss and trace are measured: its own pre-training held-out split, unless told.
    corpora = {model: measuring.corpus_for(model) for model in args.models}
    # Every check that can fail runs before the first training step: tokenizers, heads, vocabularies, data.
    datasets_by_task = check_checkpoints(args.models, tasks, args.data_dir, update_cards=args.update_cards)
    tasks = list(datasets_by_task)
    standin_tasks = [task for task in standin_tasks if task in tasks]

    output_dir = Path(config.output_dir)
    is_main_process = config.process_index == 0
    if is_main_process:
        print(f"glue_compare: results go to {output_dir.resolve()}", file=sys.stderr)
    # Loss and trace of every checkpoint come first, so a checkpoint that cannot be measured stops the run before
    # any fine-tuning. Measuring and writing are done once, by the main process.
    measured, losses = (
        measure_checkpoints(corpora, measuring, config) if is_main_process else (dict.fromkeys(args.models, {}), {})
    )
    rows, scores = finetune_checkpoints(args, config, datasets_by_task, measured, output_dir)
    if not is_main_process:
        return {}
    pairs = pairwise_comparisons(args.models, tasks, losses, scores, corpora)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "glue_compare.json").write_text(json.dumps({"rows": rows, "pairs": pairs}, indent=2))
    paths = write_outputs(
        rows, tasks, output_dir, standin_tasks=standin_tasks, pairs=pairs, trace_estimator=measuring.trace_estimator
    )
    print((output_dir / "glue_compare.md").read_text())
    print(f"glue_compare: wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return paths


if __name__ == "__main__":
    run_recipe(main)
