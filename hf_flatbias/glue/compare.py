"""Checkpoints side by side as Liu et al. (ICML 2023) compare them: the pre-training loss on held-out text with
paired standard errors, the trace (the paper's Fisher form Tr(F) and the released code's Hutchinson Tr(H)), and
paired GLUE differences over the same seeds. ``recipes/glue_compare.py`` is its command line."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..constants import DEFAULT_ESTIMATOR, DEFAULT_N_CONTEXTS, RECOMMENDED_N_DRAWS
from ..corpus import DEFAULT_VALIDATION_TEXTS, CorpusSpec
from ..stats import paired_difference
from .data import load_glue_dataset
from .finetune import GlueArguments, finetune_glue
from .models import load_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class CompareArguments(GlueArguments):
    """Which checkpoints are compared on which tasks (and the fine-tuning of [`GlueArguments`])."""

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


def check_compare_arguments(args: CompareArguments, measuring: MeasurementArguments) -> None:
    """Every check of the arguments alone, before any model loads; raises `ValueError` naming the flag."""
    if not args.models:
        raise ValueError("Name at least one checkpoint: glue_compare.py MODEL [MODEL ...] --tasks sst2,qnli,rte.")
    if measuring.trace_contexts < 1 or measuring.trace_draws < 1 or not args.seeds or measuring.loss_maskings < 1:
        raise ValueError("--trace_contexts, --trace_draws, --loss_maskings and --seeds must be non-empty / at least 1.")
    if measuring.released_trace_batches < 0 or measuring.released_trace_batch_size < 1:
        raise ValueError("--released_trace_batches must be >= 0 (0 skips it) and --released_trace_batch_size >= 1.")


def standin_tasks_of(tasks: Sequence[str], data_dir: str | None, *, update_cards: bool) -> list[str]:
    """The tasks that would run on an offline stand-in (SST-2: Rotten Tomatoes), labelled so in the outputs; never
    recorded as GLUE in a model card, so ``update_cards`` with one is refused."""
    from . import data  # looked up at call time: tests take the Hub away through it

    standin = ["sst2"] if "sst2" in tasks and data_dir is None and not data.hub_is_reachable() else []
    if standin and update_cards:
        raise ValueError(
            "--update_cards would record Rotten Tomatoes stand-in scores as GLUE SST-2: run with the Hub reachable "
            "or --data_dir holding the real SST-2 files."
        )
    return standin


@dataclass
class MeasurementArguments:
    """How each checkpoint's pre-training loss and trace are measured on held-out text."""

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
            "help": "Independent 15%% maskings of every held-out block (10: each token scored 1.5 times on average); "
            "more maskings lower the loss's standard error towards that of scoring every token once."
        },
    )
    max_seq_length: int = field(default=128, metadata={"help": "Tokens per block of held-out text."})
    # The trace's settings are grouped as trace_* because the recipes' flags share one namespace with the training
    # arguments (trace_estimator beside the model's own settings); trace_contexts and trace_draws are the n_contexts
    # and n_draws of estimate_hessian_trace, HessianTraceCallback and `hf-flatbias trace`. Not renamed: the research
    # code and its committed result files (about 100, some recomputed by tests) spell it trace_contexts, so a rename
    # would leave two spellings instead of one.
    trace_contexts: int = field(
        default=DEFAULT_N_CONTEXTS, metadata={"help": "Masked contexts for the trace (paper: 10,000)."}
    )
    trace_draws: int = field(default=RECOMMENDED_N_DRAWS, metadata={"help": "Labels drawn per context (paper: 50)."})
    trace_estimator: str = field(default=DEFAULT_ESTIMATOR, metadata={"help": "Estimator of estimate_hessian_trace."})
    released_trace_batches: int = field(
        default=50,
        metadata={
            "help": "Batches for the released code's trace (Gaussian Hutchinson, data-label loss, 15%%-masked "
            "blocks; the released script runs 50,000 of 128); 0 skips it."
        },
    )
    released_trace_batch_size: int = field(default=32, metadata={"help": "Blocks per released-code trace batch."})

    def corpus_for(self, model_name_or_path: str) -> CorpusSpec:
        """Where a checkpoint is measured: ``--text_dataset`` if given, else its own recorded held-out split."""
        if self.text_dataset:
            return CorpusSpec(
                self.text_dataset, self.text_column, validation_texts=self.loss_texts or DEFAULT_VALIDATION_TEXTS
            )
        corpus = held_out_corpus(model_name_or_path)
        if corpus is None:
            raise ValueError(
                f"{model_name_or_path!r} does not record its pre-training corpus (no pretraining_corpus in its "
                "card): pass --text_dataset (e.g. bbc_news or bookcorpus) to measure every checkpoint's loss and "
                "trace on it."
            )
        return corpus


def load_masked_lm(model_name_or_path: str):
    """The checkpoint's masked-LM model and tokenizer; errors if either is missing or they disagree."""
    from transformers import AutoModelForMaskedLM

    from ..flatness.lm import check_tokenizer_fits_model

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


def held_out_corpus(model_name_or_path: str) -> CorpusSpec | None:
    """The pre-training corpus and held-out split recorded in a local checkpoint's card (or summary), else None."""
    folder = Path(model_name_or_path)
    if not folder.is_dir():
        return None
    if (folder / "README.md").is_file():
        from ..modelcard import load_flatness_card

        try:
            corpus = load_flatness_card(folder).pretraining_corpus
        except ValueError:  # a README that is not a flatness card
            corpus = None
        if corpus is not None:
            return corpus
    summary = folder / "pretraining_summary.json"
    record = json.loads(summary.read_text()).get("pretraining_corpus") if summary.is_file() else None
    return CorpusSpec.from_record(record) if record else None


def held_out_losses(model, blocks, tokenizer, *, maskings: int, seed: int):
    """Per block, the summed masked-LM loss and masked-token count over ``maskings`` independent BERT maskings."""
    from ..text_data import mask_blocks_once, masked_lm_row_losses

    sums, counts = 0, 0
    for masking in range(maskings):
        block_sums, block_counts = masked_lm_row_losses(model, mask_blocks_once(blocks, tokenizer, seed=seed + masking))
        sums, counts = sums + block_sums, counts + block_counts
    return sums, counts


def released_code_batches(blocks, tokenizer, *, n_batches: int, batch_size: int, seed: int):
    """Batches of held-out blocks with BERT's 15% masking and their data labels, as the released trace script uses."""
    import torch

    from ..text_data import mask_blocks_once

    rows = mask_blocks_once(blocks.select(range(min(len(blocks), n_batches * batch_size))), tokenizer, seed=seed)
    return [
        {key: torch.tensor(rows[start : start + batch_size][key]) for key in ("input_ids", "attention_mask", "labels")}
        for start in range(0, len(rows), batch_size)
    ]


def pretraining_measurements(model_name_or_path: str, raw_text, args: MeasurementArguments, *, seed: int, device: str):
    """Loss on held-out text (per-block sums, for paired errors), the paper's Fisher trace and the released code's
    trace of one checkpoint. Returns ``(row fields, per-block loss sums, per-block counts)``."""
    from ..flatness import build_masked_contexts, estimate_hessian_trace
    from ..flatness.lm import check_tokenizer_fits_model
    from ..flatness.released_code import released_code_trace
    from ..text_data import ratio_mean_stderr, tokenize_into_blocks

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
    corpora: dict[str, object],
) -> list[dict]:
    """Every pair of checkpoints: the held-out loss difference with its paired standard error ("same loss" when
    within 2 s.e.; only for checkpoints measured on the same text) and each task's paired score difference with its
    95% interval over seeds."""
    from ..text_data import ratio_mean_stderr

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


def load_task_data(tasks: Sequence[str], data_dir: str | None) -> dict:
    """Each task's data; offline, a task without data is skipped with one line (SST-2 has an offline stand-in)."""
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


def check_checkpoints(models: Sequence[str], tasks: Sequence[str], data_dir: str | None, *, update_cards: bool) -> dict:
    """Every check that can fail, run before the first training step: tokenizers, heads, cards, one vocabulary for
    all, and each task's data read by that vocabulary. Returns each task's data (tasks without data left out)."""
    from ..modelcard import load_flatness_card
    from .data import check_task_text_fits_tokenizer
    from .models import load_classifier
    from .tasks import get_glue_task

    tokenizers = {}
    for model in models:
        tokenizers[model] = load_masked_lm(model)[1]
        if update_cards:
            if not Path(model).is_dir():
                raise ValueError(f"--update_cards edits local checkpoint folders; {model!r} is not one.")
            load_flatness_card(model)  # fails now, not after fine-tuning, if the folder has no card
        for task in tasks:
            load_classifier(model, get_glue_task(task))
    vocabularies = {model: tokenizer.get_vocab() for model, tokenizer in tokenizers.items()}
    differing = [m for m in models if vocabularies[m] != vocabularies[models[0]]]
    if differing:
        raise ValueError(
            f"{differing} use another vocabulary than {models[0]!r}: their losses are per token of different "
            "vocabularies and cannot be compared. Compare checkpoints pre-trained with one tokenizer."
        )
    datasets_by_task = load_task_data(tasks, data_dir)
    tasks = [task for task in tasks if task in datasets_by_task]
    for task in tasks:  # the one rule `hf-flatbias trace` applies: text the vocabulary reads as [UNK] is refused
        check_task_text_fits_tokenizer(
            tokenizers[models[0]], get_glue_task(task), datasets_by_task[task]["train"], source=models[0]
        )
    return {task: datasets_by_task[task] for task in tasks}


def measure_checkpoints(corpora: dict[str, CorpusSpec], measuring: MeasurementArguments, config) -> tuple[dict, dict]:
    """Loss and trace of every checkpoint on its held-out text (each corpus read once): ``(row fields by model,
    (per-block loss sums, counts) by model)``."""
    measured, losses, texts = {}, {}, {}
    for model, corpus in corpora.items():
        if corpus not in texts:
            texts[corpus] = corpus.held_out(max_texts=measuring.loss_texts)
        fields, sums, counts = pretraining_measurements(
            model, texts[corpus], measuring, seed=config.seed, device=config.device
        )
        measured[model] = {**fields, "corpus": corpus.label}
        losses[model] = (sums, counts)
        logger.info("%s: %s", model, measured[model])
    return measured, losses


def finetune_checkpoints(
    args: CompareArguments, config, datasets_by_task: dict, measured: dict, output_dir: Path
) -> tuple[list[dict], dict[tuple[str, str], list[float]]]:
    """Fine-tune every checkpoint on every task over the seeds: one row per checkpoint and task (with its
    ``measured`` loss and trace) and the scores per seed. Collective under ``accelerate launch``: every process runs
    it; only the main one edits cards (``update_cards``)."""
    rows: list[dict] = []
    scores: dict[tuple[str, str], list[float]] = {}
    for model in args.models:
        for task, dataset in datasets_by_task.items():
            result = finetune_glue(
                model, task, args, config, dataset=dataset, output_dir=output_dir / "runs" / Path(model).name
            )
            rows.append({**result.to_dict(), **measured[model]})
            scores[(model, task)] = result.scores
            logger.info("%s %s: %.4f, 95%% interval %s", model, task, result.mean, result.interval)
            if args.update_cards and config.process_index == 0:
                from ..modelcard import add_glue_results

                means = {name: sum(m[name] for m in result.metrics) / len(result.metrics) for name in result.metrics[0]}
                add_glue_results(model, {task: means})
    return rows, scores
