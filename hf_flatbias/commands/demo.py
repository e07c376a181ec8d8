"""``hf-flatbias demo``: pre-train a tiny BERT with SAM on a generated language, log the trace, write the card.

Everything is generated locally (a random PCFG in the shape of the paper's, a word-level tokenizer, a BERT built
from a config), so the demo runs offline on a CPU in a few minutes and shows the whole loop: SAM steps,
``flatness/hessian_trace`` logged during training, and a flatness model card saved beside the weights.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="pre-train a tiny BERT with SAM on a generated PCFG language, log the Hessian trace, write a model card",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--output-dir", default="flatbias-demo", help="where the model and its card are written")
    parser.add_argument("--method", default="sam", choices=["none", "sam", "asam"], help="flatness method")
    parser.add_argument("--rho", type=float, default=0.05, help="SAM/ASAM neighbourhood radius")
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps")
    parser.add_argument("--n-train", type=int, default=20000, help="generated training sentences")
    parser.add_argument("--trace-contexts", type=int, default=256, help="masked contexts per trace measurement")
    parser.add_argument("--seed", type=int, default=0, help="seed of the grammar, the data and the model")
    parser.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    for name in ("steps", "n_train", "trace_contexts"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    import torch
    from transformers import BertConfig, BertForMaskedLM, DataCollatorForLanguageModeling

    from ..callbacks import HessianTraceCallback
    from ..config import FlatBiasConfig
    from ..modelcard import load_flatness_card
    from ..synthetic import PCFG, build_pcfg_dataset, make_tokenizer
    from ..trainer import FlatBiasTrainer

    torch.manual_seed(args.seed)
    pcfg = PCFG.from_seed(args.seed)
    data = build_pcfg_dataset(pcfg, n_train=args.n_train, n_validation=512, seed=args.seed)
    tokenizer = make_tokenizer(pcfg.words())
    model = BertForMaskedLM(
        BertConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=256,
            max_position_embeddings=tokenizer.model_max_length,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    train = data["train"].select_columns(["input_ids", "attention_mask"])
    validation = data["validation"].select_columns(["input_ids", "attention_mask"])
    config = FlatBiasConfig(
        output_dir=args.output_dir,
        flatness_method=args.method,
        sam_rho=args.rho,
        max_steps=args.steps,
        per_device_train_batch_size=64,
        per_device_eval_batch_size=128,
        learning_rate=2e-3,
        warmup_steps=min(50, args.steps // 10),
        weight_decay=0.01,
        eval_strategy="steps",
        eval_steps=max(1, args.steps // 3),
        logging_steps=max(1, args.steps // 12),
        save_strategy="no",
        report_to="none",
        seed=args.seed,
    )
    trace = HessianTraceCallback(n_contexts=args.trace_contexts, n_draws=2, seed=args.seed)
    trainer = FlatBiasTrainer(
        model=model,
        args=config,
        train_dataset=train,
        eval_dataset=validation,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15),
        processing_class=tokenizer,
        callbacks=[trace],
    )
    trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model()

    card = load_flatness_card(args.output_dir)
    summary = {
        "output_dir": str(Path(args.output_dir).resolve()),
        "flatness_method": args.method,
        "eval_loss": metrics["eval_loss"],
        "hessian_trace": card.hessian_trace,
        "hessian_trace_stderr": card.hessian_trace_stderr,
        "model_card": str(Path(args.output_dir, "README.md").resolve()),
    }
    print(json.dumps(summary, indent=2))
    return 0
