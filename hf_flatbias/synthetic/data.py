"""Datasets, masked contexts and oracle predictors shared by the synthetic languages.

Rows are token ids of [`make_tokenizer`]: ``[CLS] w... [SEP]``. A *masked context* is a row with exactly one word
replaced by ``[MASK]`` and ``labels`` equal to -100 everywhere except there: the unit of the one-mask MLM loss, of
its entropy floor, and of the Hessian-trace estimators.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch
from datasets import Dataset, DatasetDict
from transformers.modeling_outputs import MaskedLMOutput

from ..constants import IGNORE_INDEX
from .dyck import Dyck
from .hmm import HMM
from .pcfg import PCFG
from .tokenizer import CLS_ID, MASK_ID, MASKED_WORD, N_SPECIAL, PAD_ID, PAD_WORD, SEP_ID


class Language(Protocol):
    """What the helpers below need from a language: its words and exact one-mask conditionals."""

    @property
    def n_words(self) -> int: ...

    def words(self) -> list[str]: ...

    def target_conditionals(self, word_ids: np.ndarray, positions: np.ndarray) -> np.ndarray: ...


def sentences_to_dataset(word_ids: np.ndarray, lengths: np.ndarray | None = None, **columns) -> Dataset:
    """Rows ``input_ids = [CLS] + words + [SEP]`` and ``attention_mask`` (unpadded), plus any label ``columns``."""
    word_ids = np.asarray(word_ids)
    if lengths is None:
        lengths = (word_ids != PAD_WORD).sum(1)
    input_ids = [[CLS_ID, *(row[:n] + N_SPECIAL).tolist(), SEP_ID] for row, n in zip(word_ids, lengths, strict=True)]
    data = {
        "input_ids": input_ids,
        "attention_mask": [[1] * len(r) for r in input_ids],
        "length": np.asarray(lengths).tolist(),
    }
    for name, values in columns.items():
        data[name] = np.asarray(values).tolist()
    return Dataset.from_dict(data)


def _split_seeds(seed: int) -> tuple[int, int]:
    train, validation = np.random.SeedSequence(seed).spawn(2)
    return int(train.generate_state(1)[0]), int(validation.generate_state(1)[0])


def build_pcfg_dataset(pcfg: PCFG, n_train: int, n_validation: int = 2000, *, seed: int = 0) -> DatasetDict:
    """Train/validation sentences of ``pcfg`` with the paper's tasks, deterministic given ``seed``.

    Columns: ``input_ids``, ``attention_mask``, ``length`` (words), ``task_a`` (sentence type), ``task_b``
    (global id of the nonterminal over the first 4 words, -1 if no node spans exactly them), ``task_c`` (the same
    over the first 2 words).
    """
    splits = {}
    for name, n, split_seed in zip(("train", "validation"), (n_train, n_validation), _split_seeds(seed), strict=True):
        sample = pcfg.sample(n, seed=split_seed, span_label_lengths=(2, 4))
        splits[name] = sentences_to_dataset(
            sample.word_ids,
            sample.lengths,
            task_a=sample.sentence_type,
            task_b=sample.span_labels[4],
            task_c=sample.span_labels[2],
        )
    return DatasetDict(splits)


def build_hmm_dataset(
    hmm: HMM, n_train: int, n_validation: int = 2000, *, length: int = 24, seed: int = 0
) -> DatasetDict:
    """Train/validation sequences of ``hmm``; column ``states`` holds the hidden states (task-k = ``states[k]``)."""
    splits = {}
    for name, n, split_seed in zip(("train", "validation"), (n_train, n_validation), _split_seeds(seed), strict=True):
        sample = hmm.sample(n, length, seed=split_seed)
        splits[name] = sentences_to_dataset(sample.word_ids, states=sample.states)
    return DatasetDict(splits)


def build_dyck_dataset(dyck: Dyck, n_train: int, n_validation: int = 2000, *, seed: int = 0) -> DatasetDict:
    """Train/validation Dyck strings; column ``depth`` is the bracket count before each position."""
    splits = {}
    for name, n, split_seed in zip(("train", "validation"), (n_train, n_validation), _split_seeds(seed), strict=True):
        words = dyck.sample(n, seed=split_seed).word_ids
        splits[name] = sentences_to_dataset(words, depth=Dyck.depth(words))
    return DatasetDict(splits)


def masked_contexts(dataset: Dataset, *, seed: int = 0, n_contexts: int | None = None) -> Dataset:
    """One masked word per row, chosen uniformly among the row's words (never ``[CLS]``/``[SEP]``).

    Returns a dataset with ``input_ids`` (the word replaced by ``[MASK]``), ``attention_mask``, ``labels``
    (-100 except the masked token), ``masked_position`` (index of the masked word among the words) and the
    original columns. This is the row format the Hessian-trace estimators take.
    """
    if n_contexts is not None:
        if not 1 <= n_contexts <= len(dataset):
            raise ValueError(f"n_contexts must be in [1, {len(dataset)}] (rows of the dataset), got {n_contexts}.")
        dataset = dataset.select(range(n_contexts))
    rng = np.random.default_rng(seed)
    word_counts = np.array([len(r) - 2 for r in dataset["input_ids"]])
    positions = (rng.random(len(word_counts)) * word_counts).astype(np.int64)
    input_ids, labels = [], []
    for row, position in zip(dataset["input_ids"], positions, strict=True):
        row = list(row)
        label = [IGNORE_INDEX] * len(row)
        label[position + 1] = row[position + 1]
        row[position + 1] = MASK_ID
        input_ids.append(row)
        labels.append(label)
    out = dataset.remove_columns(["input_ids"]).add_column("input_ids", input_ids)
    out = out.add_column("labels", labels).add_column("masked_position", positions.tolist())
    return out


def context_word_ids(contexts: Dataset) -> tuple[np.ndarray, np.ndarray]:
    """``(word_ids (n, T) padded with -1, the masked word marked -2; masked positions (n,))`` of masked contexts."""
    rows = [np.asarray(r[1:-1]) for r in contexts["input_ids"]]
    labels = [np.asarray(r[1:-1]) for r in contexts["labels"]]
    word_ids = np.full((len(rows), max(len(r) for r in rows)), PAD_WORD, dtype=np.int64)
    positions = np.empty(len(rows), dtype=np.int64)
    for i, (row, label) in enumerate(zip(rows, labels, strict=True)):
        word_ids[i, : len(row)] = np.where(row == MASK_ID, MASKED_WORD, row - N_SPECIAL)
        positions[i] = int(np.flatnonzero(label != IGNORE_INDEX)[0])
    return word_ids, positions


def target_conditionals(language: Language, contexts: Dataset) -> np.ndarray:
    """Exact ``Pr(masked word = w | rest)`` of every masked context: ``(n, n_words)``."""
    word_ids, positions = context_word_ids(contexts)
    if isinstance(language, Dyck):
        labels = np.array([r[p + 1] for r, p in zip(contexts["labels"], positions, strict=True)]) - N_SPECIAL
        word_ids[np.arange(len(word_ids)), positions] = labels  # Dyck's checker fills the position itself
    return language.target_conditionals(word_ids, positions)


def entropy_bound(language: Language, contexts: Dataset) -> float:
    """Mean ``-log Pr(x_t | x_-t)`` (nats) of the masked words: the lowest one-mask MLM loss on these contexts."""
    cond = target_conditionals(language, contexts)
    _, positions = context_word_ids(contexts)
    targets = np.array([r[p + 1] for r, p in zip(contexts["labels"], positions, strict=True)]) - N_SPECIAL
    return float(-np.log(cond[np.arange(len(cond)), targets]).mean())


class MaskedWordCollator:
    """Pads rows of a synthetic language and replaces words by ``[MASK]`` for masked-LM training.

    With ``mask_probability=0`` (the default) exactly one uniformly chosen word of each sentence is masked: the
    paper's one-mask objective, whose minimum is the entropy floor measured on masked contexts. A positive
    probability masks each word independently and still guarantees one masked word per row. Masked words always
    become ``[MASK]`` (no random or kept tokens, unlike BERT's 80/10/10 rule), because the one-mask conditionals the
    floor and the oracle are defined by only ever see ``[MASK]``; ``[CLS]``, ``[SEP]`` and padding are never masked.
    Rows that already carry ``labels`` (masked contexts) are padded as they are. With ``task_column`` the batch also
    carries ``task_labels`` from that column (adversarial pre-training reads it).
    """

    def __init__(self, mask_probability: float = 0.0, *, seed: int = 0, task_column: str | None = None) -> None:
        if not 0.0 <= mask_probability <= 1.0:
            raise ValueError(
                f"mask_probability must be in [0, 1] (0: one masked word per row), got {mask_probability}."
            )
        self.mask_probability = mask_probability
        self.generator = torch.Generator().manual_seed(seed)
        self.task_column = task_column

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        input_ids = _padded([row["input_ids"] for row in rows], PAD_ID)
        lengths = torch.as_tensor([len(row["input_ids"]) for row in rows])
        attention_mask = (torch.arange(input_ids.shape[1])[None, :] < lengths[:, None]).long()
        labels = torch.full_like(input_ids, IGNORE_INDEX)
        labelled = [i for i, row in enumerate(rows) if "labels" in row]
        if labelled:
            own = _padded([rows[i]["labels"] for i in labelled], IGNORE_INDEX)
            labels[labelled, : own.shape[1]] = own
        if not any("labels" in row for row in rows):
            is_word = (input_ids != PAD_ID) & (input_ids != CLS_ID) & (input_ids != SEP_ID)
            chosen = (torch.rand(input_ids.shape, generator=self.generator) < self.mask_probability) & is_word
            # rows where no word was drawn get one uniformly chosen word (all rows when the probability is 0)
            scores = torch.rand(input_ids.shape, generator=self.generator).masked_fill(~is_word, -1.0)
            fallback = torch.nn.functional.one_hot(scores.argmax(1), input_ids.shape[1]).bool() & ~chosen.any(
                1, keepdim=True
            )
            chosen |= fallback
            labels = torch.where(chosen, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
            input_ids = torch.where(chosen, torch.full_like(input_ids, MASK_ID), input_ids)
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        if self.task_column is not None:
            batch["task_labels"] = torch.as_tensor([row[self.task_column] for row in rows], dtype=torch.long)
        return batch


def _padded(sequences: Sequence[Sequence[int]], fill: int) -> torch.Tensor:
    """``(len(sequences), longest)`` long tensor of the sequences, right-padded with ``fill``.

    One C-level transpose instead of a tensor per row: at batch 1024 a per-row loop took 30 ms, longer than a GPU step.
    """
    # Contiguous: a transposed view would make every *_like tensor (labels) transposed too, and models .view() them.
    columns = np.array(list(itertools.zip_longest(*sequences, fillvalue=fill)), dtype=np.int64)
    return torch.from_numpy(np.ascontiguousarray(columns.T))


class OracleMLM(torch.nn.Module):
    """The "lookup table" of the paper: a masked LM whose output at each ``[MASK]`` is the true conditional.

    Its one-mask loss is the entropy floor. It has no parameters to learn and no representation beyond its input,
    which is what the paper contrasts with trained transformers: optimal loss, no useful features.
    ``forward`` accepts the Trainer's batch and returns a [`MaskedLMOutput`] with ``logits`` of shape
    ``(batch, length, 5 + n_words)`` (log-probabilities at masked positions, zeros elsewhere).
    """

    def __init__(self, language: Language, *, floor: float = 1e-30) -> None:
        super().__init__()
        self.language = language
        self.floor = floor

    def forward(self, input_ids: torch.Tensor, attention_mask=None, labels=None, **_) -> MaskedLMOutput:
        ids = input_ids.detach().cpu().numpy()
        batch, length = ids.shape
        logits = torch.zeros(batch, length, N_SPECIAL + self.language.n_words, dtype=torch.float32)
        rows, cols = np.nonzero(ids == MASK_ID)
        if len(rows):
            sentence_rows = sorted(set(rows.tolist()))
            words = []
            for r in sentence_rows:
                row = ids[r]
                row = row[(row != PAD_ID) & (row != CLS_ID) & (row != SEP_ID)]
                words.append(np.where(row == MASK_ID, MASKED_WORD, row - N_SPECIAL))
            word_ids = np.full((len(words), max(len(w) for w in words)), PAD_WORD, dtype=np.int64)
            for i, w in enumerate(words):
                word_ids[i, : len(w)] = w
            index_of = {r: i for i, r in enumerate(sentence_rows)}
            sentence_index = np.array([index_of[r] for r in rows])
            # column of the masked word among the words: every row starts with [CLS]
            if isinstance(self.language, Dyck):
                cond = np.stack(
                    [
                        _dyck_mask_conditional(self.language, word_ids[i], c - 1)
                        for i, c in zip(sentence_index, cols, strict=True)
                    ]
                )
            elif isinstance(self.language, PCFG):
                cond = self.language.masked_conditionals(word_ids)[sentence_index, cols - 1]
            else:
                cond = self.language.masked_conditionals(word_ids)[sentence_index, cols - 1]
            logits[:, :, :N_SPECIAL] = float(np.log(self.floor))
            logits[rows, cols, N_SPECIAL:] = torch.as_tensor(np.log(np.maximum(cond, self.floor)), dtype=torch.float32)
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).cpu(), ignore_index=IGNORE_INDEX
            )
        return MaskedLMOutput(loss=loss, logits=logits)


def _dyck_mask_conditional(dyck: Dyck, word_ids: np.ndarray, position: int) -> np.ndarray:
    if (word_ids == MASKED_WORD).sum() != 1:
        raise ValueError("OracleMLM on Dyck strings supports exactly one [MASK] per row.")
    return dyck.masked_conditionals(word_ids[None], np.array([position]))[0]
