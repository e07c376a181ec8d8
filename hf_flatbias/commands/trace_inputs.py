"""What `hf-flatbias trace` measures: the checkpoint (or a PEFT adapter on its base model), the device it runs on and
the rows its contexts come from, each checked before anything costly loads."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..constants import IGNORE_INDEX
from ..corpus import DATA_FILE_BUILDERS, load_data_files


def checked_device(name: str | None, torch) -> str:
    """``--device``, or cuda when available else cpu; a device this torch cannot use is refused before loading."""
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        torch.empty(0, device=name)
    except (RuntimeError, AssertionError) as error:  # AssertionError: "Torch not compiled with CUDA enabled"
        raise ValueError(
            f"--device {name}: this torch cannot use it ({error}); drop --device to use what is available."
        ) from None
    return name


def check_token_ids(rows: list[dict[str, Any]], vocab_size: int, source: str) -> None:
    for index, row in enumerate(rows):
        ids = [int(token) for token in row["input_ids"]]
        labels = [int(label) for label in row.get("labels", []) if label != IGNORE_INDEX]
        bad = [token for token in ids + labels if not 0 <= token < vocab_size]
        if bad:
            raise ValueError(
                f"Row {index} of {source} holds the token id {bad[0]}, outside the model's vocabulary of {vocab_size} "
                f"(ids 0..{vocab_size - 1}): the data was tokenized for another model."
            )


def peft_base_model(model: str) -> str | None:
    """The base model a local PEFT adapter folder (``adapter_config.json``) adapts, else ``None``."""
    adapter_config = Path(model, "adapter_config.json")
    if not adapter_config.is_file():
        return None
    base = json.loads(adapter_config.read_text()).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{adapter_config} names no base_model_name_or_path: the adapter's base model is unknown.")
    return base


def has_tokenizer_files(folder: str) -> bool:
    return any(Path(folder, name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"))


def load_language_model(model: str, base_model: str | None, causal: bool, *, revision: str | None = None):
    """The checkpoint with its LM head (at ``revision`` of a Hub repo); a PEFT adapter on its base model, the
    adapter's parameters trainable (the trace is taken over trainable parameters, as for a LoRA run in the
    trainer)."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    model_class = AutoModelForCausalLM if causal else AutoModelForMaskedLM
    if base_model is None:
        return model_class.from_pretrained(model, revision=revision)
    from peft import PeftModel

    return PeftModel.from_pretrained(model_class.from_pretrained(base_model), model, is_trainable=True)


def count_labelled(rows: list[dict[str, Any]]) -> int:
    return sum(sum(1 for label in row["labels"] if label != IGNORE_INDEX) for row in rows)


def load_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    import datasets

    path = Path(args.data)
    if path.is_dir():
        loaded = datasets.load_from_disk(str(path))
    elif path.is_file():
        file_format = DATA_FILE_BUILDERS.get(path.suffix.lower())
        if file_format is None:
            raise ValueError(f"--data {args.data}: unknown file type; use one of {sorted(DATA_FILE_BUILDERS)}.")
        if not path.read_bytes().strip():
            raise ValueError(f"--data {args.data} is empty; give a file with one text (or row) per line.")
        try:
            loaded = load_data_files(str(path))
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
