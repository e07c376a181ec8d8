"""What `hf-flatbias trace` measures: the checkpoint (or a PEFT adapter on its base model), the device it runs on and
the rows its contexts come from, each checked before anything costly loads."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..constants import DEFAULT_N_CONTEXTS, IGNORE_INDEX, MAX_N_CONTEXTS, MAX_N_DRAWS, RECOMMENDED_N_DRAWS
from ..corpus import DATA_FILE_BUILDERS, load_data_files
from ..machine import available_ram_bytes


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


TOKEN_COLUMNS = ("input_ids", "attention_mask", "token_type_ids", "labels")
"""The per-token columns of a pre-tokenized row: cut together when the row is cut."""


def model_positions(config) -> int | None:
    """How many positions the checkpoint's position embeddings hold, or ``None`` when its config does not say."""
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def token_limit(max_length: int, config) -> int:
    """The longest row a measurement reads: ``--max-length``, and never more than the model has positions for."""
    positions = model_positions(config)
    return max_length if positions is None else min(max_length, positions)


def checked_token_rows(
    rows: list[dict[str, Any]], config, max_length: int, source: str, notice: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Pre-tokenized rows with integer ids inside the model's vocabulary, cut to `token_limit` tokens as text is
    (``notice`` says how many were cut); raises `ValueError` naming the row on ids that are not whole numbers (a
    float or a string would be truncated or parsed silently) or lie outside the vocabulary (which fails deep in
    torch)."""
    checked = [_integer_ids_row(row, index, source) for index, row in enumerate(rows)]
    check_token_ids(checked, config.vocab_size, source)
    limit = token_limit(max_length, config)
    long_rows = sum(len(row["input_ids"]) > limit for row in checked)
    if long_rows:
        positions = model_positions(config)
        why = f"the model's {positions} positions" if limit == positions else f"--max-length {max_length}"
        notice(
            f"{long_rows} of {len(checked)} rows of {source} hold more than {limit} token ids ({why}); cut to {limit}."
        )
    return [{key: value[:limit] if key in TOKEN_COLUMNS else value for key, value in row.items()} for row in checked]


def _integer_ids_row(row: dict[str, Any], index: int, source: str) -> dict[str, Any]:
    return {
        key: _integer_ids(value, key, index, source) if key in TOKEN_COLUMNS else value for key, value in row.items()
    }


def _integer_ids(values: Any, column: str, index: int, source: str) -> list[int]:
    if isinstance(values, str) or not isinstance(values, Sequence):
        raise ValueError(
            f"Row {index} of {source}: {column} is {_shown(values)}, not a list of token ids; write it as a list of "
            "integers ([2, 15, 3]), or put raw text in a text column (see --text-column)."
        )
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer():
            raise ValueError(
                f"Row {index} of {source}: {column} holds {_shown(value)}, not an integer token id; write the ids "
                "as integers ([2, 15, 3]), as a tokenizer gives them."
            )
    return [int(value) for value in values]


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def check_request_size(
    n_contexts: int, n_draws: int, max_length: int, batch_size: int | str, *, available: int | None = None
) -> None:
    """Refuse, before anything loads, a request outside the sane ranges or whose draws and contexts alone need more
    than the ``available`` bytes (the RAM available now by default): it would grow until the kernel kills it."""
    for flag, value, most, hint in (
        ("--n-draws", n_draws, MAX_N_DRAWS, f"{RECOMMENDED_N_DRAWS} is recommended"),
        ("--n-contexts", n_contexts, MAX_N_CONTEXTS, f"the default is {DEFAULT_N_CONTEXTS:,}"),
    ):
        if not 1 <= value <= most:
            raise ValueError(f"{flag} {value} is outside the sane range 1..{most:,} ({hint}).")
    needed = request_bytes(n_contexts, n_draws, max_length, batch_size)
    available = available_ram_bytes() if available is None else available
    if needed > available:
        raise ValueError(
            f"--n-contexts {n_contexts} x --n-draws {n_draws} needs at least {needed / 2**30:.1f} GiB to hold the "
            f"draws and contexts, more than the {available / 2**30:.1f} GiB of memory available; lower --n-draws "
            f"({RECOMMENDED_N_DRAWS} is recommended) or --n-contexts."
        )


def request_bytes(n_contexts: int, n_draws: int, max_length: int, batch_size: int | str) -> int:
    """A lower bound on the bytes a measurement holds besides the model: every draw's value (float64), one batch's
    uniform numbers and labels (float64, int64) and the contexts' ids, mask and labels (int64)."""
    batch = min(n_contexts, batch_size) if isinstance(batch_size, int) else 1
    return 8 * (n_contexts * n_draws + 2 * batch * n_draws + 3 * n_contexts * max_length)


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
    return any(Path(folder, name).is_file() for name in TOKENIZER_FILES)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt")


def tokenizer_source_of(model: str, base_model: str | None, tokenizer: str | None = None) -> str:
    """Where the tokenizer comes from: ``--tokenizer``, else the checkpoint, else a PEFT adapter's base model."""
    if tokenizer is not None:
        return tokenizer
    return model if base_model is None or has_tokenizer_files(model) else base_model


def load_tokenizer_from(source: str, *, revision: str | None = None):
    """``AutoTokenizer`` of ``source``; a local folder without tokenizer files is refused naming ``--tokenizer``
    (transformers fails on a Llama folder with "Couldn't instantiate the backend tokenizer", and makes a
    special-tokens-only tokenizer of a BERT folder)."""
    if Path(source).is_dir() and not has_tokenizer_files(source):
        raise ValueError(
            f"{source} holds no tokenizer ({', '.join(TOKENIZER_FILES)}): pass --tokenizer with the folder or Hub id "
            "of the tokenizer the model was trained with."
        )
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source, revision=revision)


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
