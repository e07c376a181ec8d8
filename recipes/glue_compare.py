"""Compare checkpoints as Liu et al. (ICML 2023) do: pre-training loss, Hessian trace, and GLUE after fine-tuning.

For every checkpoint (a local folder, e.g. one saved by ``bert_bookcorpus.py``, or a Hub id with a masked-LM head
and a tokenizer) this measures the masked-LM loss and the Hessian trace on held-out text, fine-tunes it on each
task over several seeds, and writes ``glue_compare.md`` (table), ``glue_compare.csv`` and ``glue_compare.png``
(GLUE score against trace) to ``--output_dir``:

    python recipes/glue_compare.py runs/a runs/b --tasks sst2,qnli,rte --output_dir runs/compare
    accelerate launch --config_file recipes/configs/accelerate_1proc.yaml \\
        recipes/glue_compare.py runs/a runs/b --config recipes/configs/glue_compare.yaml
    python recipes/glue_compare.py runs/a runs/b --smoke --output_dir /tmp/compare   # SST-2 stand-in, minutes

Offline, SST-2 is replaced by Rotten Tomatoes review snippets (see ``hf_flatbias.glue.load_glue_dataset``); other
tasks need ``--data_dir``. Fine-tuning settings (learning rate, epochs, batch size, even ``--flatness_method sam``)
are the ``GlueConfig`` flags. Every checkpoint and task is checked before any training starts.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hf_flatbias.cli import run_recipe
from hf_flatbias.glue import GlueArguments, GlueConfig
from hf_flatbias.glue.compare import (
    MeasurementArguments,
    check_checkpoints,
    held_out_corpus,
    load_masked_lm,
    load_task_data,
    measure_checkpoints,
    pairwise_comparisons,
)
from hf_flatbias.glue.report import write_outputs
from hf_flatbias.recipe_args import parse_dataclass_args

__all__ = ["held_out_corpus", "load_masked_lm", "load_task_data", "pairwise_comparisons", "write_outputs"]

logger = logging.getLogger("glue_compare")


@dataclass
class CompareArguments(GlueArguments):
    models: list[str] = field(
        default_factory=list,
        metadata={"help": "Checkpoints to compare (folders or Hub ids); may also be given as leading positionals."},
    )
    tasks: str = field(
        default="sst2,qnli,rte",
        metadata={"help": "Comma-separated GLUE tasks; offline, a task without data is skipped with one line."},
    )
    seeds: list[int] = field(
        default_factory=lambda: [0, 1, 2, 3, 4],
        metadata={"help": "One fine-tuning run per seed; a seed gives every checkpoint the same data order and head."},
    )
    data_dir: str | None = field(default=None, metadata={"help": "Local GLUE files (see load_glue_dataset)."})
    update_cards: bool = field(
        default=False,
        metadata={"help": "Merge each local checkpoint's GLUE means into its flatness card (README.md)."},
    )
    smoke: bool = field(default=False, metadata={"help": "Tiny run: SST-2 (stand-in offline), 2 seeds, few steps."})


ARGUMENT_TYPES = (CompareArguments, MeasurementArguments, GlueConfig)
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
    args, measuring, config = parse_dataclass_args(
        ARGUMENT_TYPES, argv, smoke_settings=SMOKE_SETTINGS, description=__doc__
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from hf_flatbias.glue import (
        finetune_glue,
        hub_is_reachable,
        parse_glue_tasks,
        resolve_finetune_mode,
    )

    if not args.models:
        raise ValueError("Name at least one checkpoint: glue_compare.py MODEL [MODEL ...] --tasks sst2,qnli,rte.")
    if config.output_dir is None:
        config.output_dir = DEFAULT_OUTPUT_DIR
    if measuring.trace_contexts < 1 or measuring.trace_draws < 1 or not args.seeds or measuring.loss_maskings < 1:
        raise ValueError("--trace_contexts, --trace_draws, --loss_maskings and --seeds must be non-empty / at least 1.")
    if measuring.released_trace_batches < 0 or measuring.released_trace_batch_size < 1:
        raise ValueError("--released_trace_batches must be >= 0 (0 skips it) and --released_trace_batch_size >= 1.")
    args.mode = resolve_finetune_mode(args.mode)
    tasks = [task.name for task in parse_glue_tasks(args.tasks)]

    # Offline, SST-2 is the Rotten Tomatoes stand-in: label it so, and never record it as GLUE in a model card.
    standin_tasks = ["sst2"] if "sst2" in tasks and args.data_dir is None and not hub_is_reachable() else []
    if standin_tasks and args.update_cards:
        raise ValueError(
            "--update_cards would record Rotten Tomatoes stand-in scores as GLUE SST-2: run with the Hub reachable "
            "or --data_dir holding the real SST-2 files."
        )
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

    rows: list[dict] = []
    scores: dict[tuple[str, str], list[float]] = {}
    for model in args.models:
        for task in tasks:
            # Fine-tuning is collective under accelerate launch: every process runs it.
            result = finetune_glue(
                model,
                task,
                args,
                config,
                dataset=datasets_by_task[task],
                output_dir=output_dir / "runs" / Path(model).name,
            )
            rows.append({**result.to_dict(), **measured[model]})
            scores[(model, task)] = result.scores
            logger.info("%s %s: %.4f, 95%% interval %s", model, task, result.mean, result.interval)
            if args.update_cards and is_main_process:
                from hf_flatbias.modelcard import add_glue_results

                means = {name: sum(m[name] for m in result.metrics) / len(result.metrics) for name in result.metrics[0]}
                add_glue_results(model, {task: means})
    if not is_main_process:
        return {}
    pairs = pairwise_comparisons(args.models, tasks, losses, scores, corpora)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "glue_compare.json").write_text(json.dumps({"rows": rows, "pairs": pairs}, indent=2))
    paths = write_outputs(rows, tasks, output_dir, standin_tasks=standin_tasks, pairs=pairs)
    print((output_dir / "glue_compare.md").read_text())
    print(f"glue_compare: wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return paths


if __name__ == "__main__":
    run_recipe(main)
