"""The ruler's read-outs of campaign v2's claims (issue 33): checkpoints and baseline rows read on the gate's splits.

Every compared checkpoint and every C4 baseline row is read by `ruler`'s probe (C fixed at `rules.RULER_C`) on the
gate's pool, test set and ``R`` fit splits exactly (`ruler_rows`: the same `ruler.ruler_pool` draw, cached on disk),
so differences are paired split by split. A record's read-outs live in one resumable JSON (`ReadStore`, rewritten
after every split): ``"probe"`` (the primary, last layer, every split), ``"layerK"`` (the other layers) and
``"finetune"`` (full fine-tuning of the encoder), both on the first `rules.SECONDARY_SPLITS` splits.
`compact_read` turns a finished read-out into what the claims' JSON and verdicts read.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hf_flatbias.results import write_json
from hf_flatbias.synthetic import PCFG

from . import rules_v2 as rules
from .paper_language import TASKS, SentenceSet
from .paper_probes import onehot_position_word
from .ruler import (
    RowLayout,
    finetune_accuracy,
    layer_features,
    primary_accuracy,
    probe_test_accuracy,
    ruler_pool,
    split_rows,
    subset,
    task_class_counts,
)
from .units import file_lock, rewrite_lock

PRIMARY = "probe"
FINETUNE = "finetune"


@dataclass(frozen=True)
class RulerSizes:
    """The ruler of the claims: the rules' values by default (the gate's); `RULER_SMOKE` shrinks them for tests."""

    n_test: int = rules.RULER_N_TEST
    n_fit: int = rules.RULER_N_FIT
    n_splits: int = rules.RULER_SPLITS
    n_cv: int = rules.RULER_N_CV
    secondary_splits: int = rules.SECONDARY_SPLITS
    regularization: float = rules.RULER_C
    max_iter: int = rules.RULER_MAX_ITER
    finetune_epochs: int = rules.FINETUNE_EPOCHS
    finetune_lr: float = rules.FINETUNE_LR
    finetune_batch: int = rules.FINETUNE_BATCH
    finetune_seed: int = rules.FINETUNE_SEED

    def splits_of(self, readout: str) -> int:
        """Fit splits a read-out covers: all for the primary, the secondary ones for the others."""
        return self.n_splits if readout == PRIMARY else min(self.secondary_splits, self.n_splits)


RULER_SMOKE = RulerSizes(n_test=40, n_fit=60, n_splits=2, n_cv=0, secondary_splits=1, max_iter=200, finetune_epochs=1)


@dataclass
class RulerRows:
    """The ruler's sentences: the pool and its parts (``"test"``, ``"fit0"`` ..), and the grammar they come from."""

    grammar: PCFG
    sentences: SentenceSet
    parts: dict[str, np.ndarray]

    def part(self, name: str) -> SentenceSet:
        return subset(self.sentences, self.parts[name])

    @property
    def width(self) -> int:
        return self.grammar.max_length


def ruler_rows(grammar: PCFG, grammar_seed: int, sizes: RulerSizes, cache_dir: Path) -> RulerRows:
    """The gate's pool for ``sizes`` (the same draw as ``recipes/ruler_gate.py``'s: its size fixes the chunks), read
    from ``cache_dir`` after the first time (labels take the inside algorithm over every sentence)."""
    layout = RowLayout(sizes.n_test, sizes.n_fit, sizes.n_splits, sizes.n_cv)
    cache = cache_dir / f"ruler_pool_g{grammar_seed}_{layout.total}.npz"
    if cache.exists():
        data = np.load(cache)
        sentences = SentenceSet(data["word_ids"], data["lengths"], {task: data[f"label_{task}"] for task in TASKS})
    else:
        sentences = ruler_pool(grammar, layout.total, grammar_seed)
        cache.parent.mkdir(parents=True, exist_ok=True)
        labels = {f"label_{task}": y for task, y in sentences.labels.items()}
        np.savez(cache, word_ids=sentences.word_ids, lengths=sentences.lengths, **labels)
    return RulerRows(grammar, sentences, split_rows(layout))


def baseline_features(grammar: PCFG, sentences: SentenceSet, name: str) -> np.ndarray:
    """The C4 rows' features (`rules.C4_BASELINES`), every position up to the grammar's width:
    ``lexical`` one-hot word; ``lookup`` the exact masked conditionals ``Pr(x_t | x_-t)`` (v1's row); ``lookup_lexical``
    both; ``unmasked_lookup`` the lookup read on the unmasked sentence (the word's one-hot scaled by its exact
    conditional) beside ``lookup_lexical``."""
    if name not in rules.C4_BASELINES:
        raise ValueError(f"baseline {name!r} is not one of {rules.C4_BASELINES}.")
    width, n_words = grammar.max_length, grammar.n_words
    lexical = onehot_position_word(sentences.word_ids, sentences.lengths, width, n_words)
    if name == "lexical":
        return lexical
    conditionals = np.zeros((len(sentences), width, n_words), dtype=np.float32)
    exact = grammar.masked_conditionals(sentences.word_ids, sentences.lengths)
    conditionals[:, : exact.shape[1]] = exact
    lookup = conditionals.reshape(len(sentences), -1)
    if name == "lookup":
        return lookup
    if name == "lookup_lexical":
        return np.concatenate([lookup, lexical], axis=1)
    return np.concatenate([lookup, lexical, lexical * lookup], axis=1)


class ReadStore:
    """The read-outs of every record, in one JSON rewritten (atomically) after every split; a rerun skips what it
    holds. Written with other ruler sizes, it refuses to be resumed. Several processes may share one file: each
    `save` merges this process's splits into what is on disk under the file's lock, and picks up the others'."""

    def __init__(self, path: Path, sizes: RulerSizes):
        self.path = path
        self.settings = dataclasses.asdict(sizes)
        self.reads: dict[str, dict[str, Any]] = self._on_disk()
        self._unsaved_cpu: dict[str, float] = {}

    def _on_disk(self) -> dict[str, dict[str, Any]]:
        if not self.path.exists():
            return {}
        state = json.loads(self.path.read_text())
        if state["ruler"] != self.settings:
            raise SystemExit(
                f"{self.path} holds read-outs of another ruler {state['ruler']}: pass another --results-dir."
            )
        return state["reads"]

    def entry(self, key: str, source: str) -> dict[str, Any]:
        return self.reads.setdefault(key, {"source": source, "readouts": {}, "cpu_seconds": 0.0})

    def spend(self, key: str, cpu_seconds: float) -> None:
        """Count ``cpu_seconds`` of reading toward ``key``'s entry."""
        self.reads[key]["cpu_seconds"] += cpu_seconds
        self._unsaved_cpu[key] = self._unsaved_cpu.get(key, 0.0) + cpu_seconds

    def save(self) -> None:
        """Merge this process's splits into the file (a split already there is kept) and take up the others', in
        place: the entries a caller holds stay the store's."""
        with file_lock(rewrite_lock(self.path)):
            disk = self._on_disk()
            _take_splits(disk, self.reads)
            for key, seconds in self._unsaved_cpu.items():
                disk[key]["cpu_seconds"] += seconds
            write_json(self.path, {"ruler": self.settings, "rules": "RULES.md and RULES_v2.md", "reads": disk})
        _take_splits(self.reads, disk)
        for key, entry in disk.items():
            self.reads[key]["cpu_seconds"] = entry["cpu_seconds"]
        self._unsaved_cpu = {}


def _take_splits(into: dict[str, dict[str, Any]], source: dict[str, dict[str, Any]]) -> None:
    """Add to ``into`` every record's split that only ``source`` holds (where both hold one, ``into``'s stays)."""
    for key, entry in source.items():
        held = into.setdefault(key, {**entry, "readouts": {}, "cpu_seconds": 0.0})
        for readout, splits in entry["readouts"].items():
            mine = held["readouts"].setdefault(readout, {})
            for split, row in splits.items():
                mine.setdefault(split, row)


def compact_read(entry: dict[str, Any] | None, readout: str, sizes: RulerSizes) -> dict[str, Any] | None:
    """``{"mean": [...], "tasks": {"A": [...], ...}}`` over the read-out's splits, or None until all are read."""
    if entry is None:
        return None
    splits = entry["readouts"].get(readout, {})
    if any(str(r) not in splits for r in range(sizes.splits_of(readout))):
        return None
    rows = [splits[str(r)] for r in range(sizes.splits_of(readout))]
    return {"mean": [row["mean"] for row in rows], "tasks": {task: [row[task] for row in rows] for task in TASKS}}


def _per_task(accuracy) -> dict[str, float]:
    per_task = {task: accuracy(task) for task in TASKS}
    return {**per_task, "mean": primary_accuracy(per_task)}


def read_record(
    store: ReadStore,
    key: str,
    rows: RulerRows,
    sizes: RulerSizes,
    readouts: list[str],
    *,
    model: torch.nn.Module | None = None,
    baseline: str | None = None,
    source: str = "",
) -> dict[str, Any]:
    """Read ``key`` (a masked LM ``model``, or the C4 row ``baseline``) on every split each of ``readouts`` covers
    that the store does not hold yet; the store is saved after every split. Returns the record's entry."""
    if (model is None) == (baseline is None):
        raise ValueError("read_record reads either a model or a baseline row.")
    entry = store.entry(key, source or (f"baseline {baseline}" if baseline else "model"))
    if model is not None:
        last = model.config.num_hidden_layers
        layer_of = {PRIMARY: last, **{f"layer{k}": k for k in range(last)}}
    test = rows.part("test")
    classes = task_class_counts(rows.grammar)
    test_features: dict[str, np.ndarray] = {}

    def features(sentences: SentenceSet, readout: str) -> np.ndarray:
        if baseline is not None:
            return baseline_features(rows.grammar, sentences, baseline)
        return layer_features(model, sentences, [layer_of[readout]], rows.width)[layer_of[readout]]

    for readout in readouts:
        done = entry["readouts"].setdefault(readout, {})
        for r in range(sizes.splits_of(readout)):
            if str(r) in done:
                continue
            began = time.process_time()
            fit = rows.part(f"fit{r}")
            if readout == FINETUNE:
                done[str(r)] = _per_task(
                    lambda task, fit=fit, r=r: finetune_accuracy(
                        model,
                        fit,
                        test,
                        task,
                        n_classes=classes[task],
                        width=rows.width,
                        epochs=sizes.finetune_epochs,
                        learning_rate=sizes.finetune_lr,
                        batch_size=sizes.finetune_batch,
                        seed=sizes.finetune_seed + r,
                    )
                )
            else:
                if readout not in test_features:
                    test_features[readout] = features(test, readout)
                fit_x = features(fit, readout)
                done[str(r)] = _per_task(
                    lambda task, fit=fit, fit_x=fit_x, readout=readout: probe_test_accuracy(
                        fit_x,
                        fit.labels[task],
                        test_features[readout],
                        test.labels[task],
                        regularization=sizes.regularization,
                        max_iter=sizes.max_iter,
                    )
                )
            store.spend(key, time.process_time() - began)
            store.save()
            print(f"[ruler] {key} {readout} split {r}: {done[str(r)]['mean']:.4f}", flush=True)
    return entry
