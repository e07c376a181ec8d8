"""``hf-flatbias trace MODEL --data FILE|DATASET``: measure the Hessian trace of any local or Hub checkpoint."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..constants import DEFAULT_BATCH_SIZE, ESTIMATORS, IGNORE_INDEX, RECOMMENDED_N_DRAWS
from .paths import local_path_or_hub_id

DATA_FILE_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".txt": "text", ".parquet": "parquet"}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "trace",
        help="Estimate the trace of the Hessian of the pre-training loss (the paper's flatness measure).",
        description="Estimate Tr(H) = E_x E_{y~f(x)} ||grad log f(x)_y||^2 on masked (or causal) LM contexts, print "
        "it and write it as JSON.",
    )
    parser.add_argument("model", help="A local checkpoint folder or a Hub model id (masked or causal LM).")
    parser.add_argument(
        "--data",
        required=True,
        help="A .json/.jsonl/.csv/.txt/.parquet file, a folder written by datasets' save_to_disk, or a Hub dataset "
        "name. Rows hold text (see --text-column) or input_ids; rows with labels (-100 except at predicted "
        "positions) are used as they are.",
    )
    parser.add_argument("--split", default=None, help="Dataset split (default: validation if present, else train).")
    parser.add_argument("--config-name", default=None, help="Hub dataset configuration (e.g. wikitext-2-raw-v1).")
    parser.add_argument("--text-column", default="text", help="Column holding raw text (default: text).")
    parser.add_argument("--max-length", type=int, default=128, help="Truncate tokenized text to this many tokens.")
    parser.add_argument("--n-contexts", type=int, default=1000, help="Contexts to average over (the paper: 10,000).")
    parser.add_argument(
        "--n-draws",
        type=int,
        default=RECOMMENDED_N_DRAWS,
        help="Draws of y per context (default: %(default)s, which reached the same error several times faster than "
        "the paper's 50 with the per_sample estimator).",
    )
    parser.add_argument("--estimator", default="per_sample", choices=list(ESTIMATORS), help="Estimator to use.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the masked positions and the draws.")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE, help="Contexts per forward.")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu).")
    parser.add_argument("--causal", action="store_true", help="Treat the model as a causal LM (default: detect).")
    parser.add_argument("--output", default="hessian_trace.json", help="JSON file to write (default: %(default)s).")
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Show a progress bar with the time left on stderr (default: shown).",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    args.model = local_path_or_hub_id(args.model, "MODEL")
    args.data = local_path_or_hub_id(args.data, "--data", file_suffixes=tuple(DATA_FILE_FORMATS))
    result = measure(args)
    estimate = result["estimate"]
    print(
        f"Hessian trace of {args.model}: {estimate['mean']:.6g} +- {estimate['stderr']:.3g} (standard error; "
        f"{estimate['estimator']}, {estimate['n_contexts']} contexts x {estimate['n_draws']} draws, "
        f"{estimate['seconds']:.1f} s)"
    )
    if estimate.get("suggested_n_draws"):
        print(f"Draws per context with the least error per second on this model: {estimate['suggested_n_draws']}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(f"Wrote {args.output}")
    return 0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Load the checkpoint and the data, build the contexts and estimate; raises `ValueError` on bad input."""
    from ..utils import quiet_deepspeed_without_accelerator

    quiet_deepspeed_without_accelerator()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    from ..flatness.api import estimate_hessian_trace
    from ..flatness.contexts import build_masked_contexts
    from ..flatness.lm import check_tokenizer_fits_model, is_causal_lm, output_vocab_size

    if args.n_draws < 1:
        raise ValueError(f"--n-draws must be >= 1 (got {args.n_draws}).")
    if args.n_contexts < 1:
        raise ValueError(f"--n-contexts must be >= 1 (got {args.n_contexts}).")
    rows = _load_rows(args)  # before the model: a bad data file is reported at once
    if not rows:
        raise ValueError(f"{args.data} holds no rows.")
    config = AutoConfig.from_pretrained(args.model)
    architectures = list(getattr(config, "architectures", None) or [])
    causal_names, masked_names = (
        set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()),
        set(MODEL_FOR_MASKED_LM_MAPPING_NAMES.values()),
    )
    if architectures and not any(a in causal_names or a in masked_names for a in architectures):
        raise ValueError(
            f"{args.model} is a {architectures} checkpoint without a language-model head; loading it as an LM would "
            "initialise a random head. Measure the pre-trained checkpoint (e.g. ...ForMaskedLM / ...ForCausalLM)."
        )
    causal = args.causal or is_causal_lm(config)
    model_class = AutoModelForCausalLM if causal else AutoModelForMaskedLM
    model = model_class.from_pretrained(args.model)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    vocab_size = output_vocab_size(model)

    tokenizer = None
    if "input_ids" not in rows[0]:
        if args.text_column not in rows[0]:
            raise ValueError(
                f"Rows of {args.data} have neither input_ids nor a {args.text_column!r} column (columns: "
                f"{sorted(rows[0])}); name the text column with --text-column."
            )
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        texts = [row[args.text_column] for row in rows if row[args.text_column] and row[args.text_column].strip()]
        if not texts:
            raise ValueError(f"The {args.text_column!r} column of {args.data} holds no text.")
        encoded = tokenizer(texts, truncation=True, max_length=args.max_length)
        check_tokenizer_fits_model(
            tokenizer, vocab_size, source=args.model, input_ids=encoded["input_ids"], text_source=args.data
        )
        rows = [
            {"input_ids": ids, "attention_mask": mask}
            for ids, mask in zip(encoded["input_ids"], encoded["attention_mask"], strict=True)
        ]
    if "labels" in rows[0]:
        # ready-made contexts: each labelled position is one
        contexts = rows
        n_contexts = min(args.n_contexts, _count_labelled(rows))
    else:
        if tokenizer is None and not causal:
            tokenizer = AutoTokenizer.from_pretrained(args.model)
            check_tokenizer_fits_model(tokenizer, vocab_size, source=args.model)
        if not causal and tokenizer.mask_token_id is None:
            raise ValueError(f"The tokenizer of {args.model} has no mask token; is this a masked LM?")
        contexts = build_masked_contexts(
            rows,
            mask_token_id=None if causal else tokenizer.mask_token_id,
            causal=causal,
            n_contexts=args.n_contexts,
            seed=args.seed,
            special_token_ids=list(getattr(tokenizer, "all_special_ids", []) or []),
        )
        n_contexts = None
    estimate = estimate_hessian_trace(
        model,
        contexts,
        n_contexts=n_contexts,
        n_draws=args.n_draws,
        estimator=args.estimator,
        seed=args.seed,
        batch_size=args.batch_size,
        causal=causal,
        progress=args.progress,
    )
    return {
        "model": args.model,
        "data": args.data,
        "split": args.split,
        "seed": args.seed,
        "device": device,
        "estimate": estimate.to_dict(),
    }


def _count_labelled(rows: list[dict[str, Any]]) -> int:
    return sum(sum(1 for label in row["labels"] if label != IGNORE_INDEX) for row in rows)


def _load_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    import datasets

    path = Path(args.data)
    if path.is_dir():
        loaded = datasets.load_from_disk(str(path))
    elif path.is_file():
        file_format = DATA_FILE_FORMATS.get(path.suffix.lower())
        if file_format is None:
            raise ValueError(f"--data {args.data}: unknown file type; use one of {sorted(DATA_FILE_FORMATS)}.")
        if not path.read_bytes().strip():
            raise ValueError(f"--data {args.data} is empty; give a file with one text (or row) per line.")
        try:
            loaded = datasets.load_dataset(file_format, data_files=str(path))
        except datasets.exceptions.DatasetGenerationError as error:
            cause = error.__cause__ or error
            raise ValueError(
                f"--data {args.data} could not be read as {file_format} ({type(cause).__name__}: {cause}); check "
                "the file's format against its extension."
            ) from error
    else:
        loaded = datasets.load_dataset(args.data, args.config_name)
    if isinstance(loaded, datasets.DatasetDict):
        split = args.split or ("validation" if "validation" in loaded else "train" if "train" in loaded else None)
        if split not in loaded:
            raise ValueError(f"--data {args.data} has splits {list(loaded)}; choose one with --split.")
        loaded = loaded[split]
    # rows are reused with other positions when there are fewer than contexts, so more are never needed
    return [dict(row) for row in loaded.select(range(min(len(loaded), args.n_contexts)))]
