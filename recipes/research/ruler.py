"""The ruler of campaign v2 (issue 33): a pre-registered probe read-out whose own noise is measured before any claim.

A checkpoint is read by linear probes on its frozen features for the campaign's three tasks (A/B/C, the released
code's labels: `PCFG.task_labels`), one multinomial logistic regression per task, with the regularisation ``C`` fixed
beforehand by k-fold cross-validation on a model that is not compared (`cross_validated_regularization`). Every
checkpoint is read on ``R`` disjoint fit splits of ``n_fit`` sentences (`split_rows`), the same splits for every
compared model, and one fixed common test set; its read-out is the mean over splits. The primary read-out is the last
layer's probe averaged over A/B/C; every layer's probe is reported beside it, and full fine-tuning of the encoder per
task (`finetune_accuracy`) is a secondary read-out on the same rows.

The gate (`gate_summary`): on one model pair, the s.d. over splits of the paired difference of the primary read-out
must not exceed a threshold. Everything here is a small function of arrays; the recipe ``recipes/ruler_gate.py``
strings them together, writes JSON as it goes and resumes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hf_flatbias.probe import extract_features, fit_probe, labelled_rows
from hf_flatbias.stats import mean_interval
from hf_flatbias.synthetic import PCFG

from .paper_language import MIN_PROBE_WORDS, TASKS, SentenceSet
from .paper_probes import token_rows

#: the pool's seed tag: ``SeedSequence([grammar_seed, POOL_TAG])``, disjoint from v1's streams (15: protocol, 23: pool)
POOL_TAG = 33
#: the gate's threshold on the s.d. over splits of the pair's primary difference (a third of C1's powered effect)
GATE_SD = 0.002
#: inverse L2 strengths the cross-validation chooses from (half-decades)
CV_GRID = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0)


@dataclass(frozen=True)
class RowLayout:
    """Where each part of the ruler's pool lies: rows ``[0, n_test)`` are the common test set, then ``n_splits``
    consecutive fit splits of ``n_fit`` rows, then ``n_cv`` rows for the cross-validation of ``C``."""

    n_test: int
    n_fit: int
    n_splits: int
    n_cv: int = 0

    @property
    def total(self) -> int:
        return self.n_test + self.n_fit * self.n_splits + self.n_cv


def split_rows(layout: RowLayout) -> dict[str, np.ndarray]:
    """Row indices of the pool per part: ``"test"``, ``"fit0"`` .. ``"fit{R-1}"``, ``"cv"``; pairwise disjoint."""
    if min(layout.n_test, layout.n_fit, layout.n_splits) < 1 or layout.n_cv < 0:
        raise ValueError(f"test, fit and split counts must be >= 1 and n_cv >= 0, got {layout}.")
    parts = {"test": np.arange(layout.n_test)}
    start = layout.n_test
    for r in range(layout.n_splits):
        parts[f"fit{r}"] = np.arange(start, start + layout.n_fit)
        start += layout.n_fit
    parts["cv"] = np.arange(start, start + layout.n_cv)
    return parts


def ruler_pool(grammar: PCFG, n_rows: int, grammar_seed: int) -> SentenceSet:
    """``n_rows`` fresh probe sentences (>= ``MIN_PROBE_WORDS`` words, as the released generator keeps) with their
    task labels, drawn from ``grammar`` by seeds derived from ``grammar_seed`` and `POOL_TAG` alone (so the same for
    every model and every rerun); drawn in chunks until enough survive the length filter."""
    words, lengths, have = [], [], 0
    seeds = np.random.SeedSequence([grammar_seed, POOL_TAG])
    while have < n_rows:
        seed = int(seeds.spawn(1)[0].generate_state(1)[0])
        sample = grammar.sample(int(1.25 * (n_rows - have)) + 100, seed=seed)
        keep = sample.lengths >= MIN_PROBE_WORDS
        words.append(sample.word_ids[keep])
        lengths.append(sample.lengths[keep])
        have += int(keep.sum())
    width = max(w.shape[1] for w in words)
    word_ids = np.concatenate([np.pad(w, ((0, 0), (0, width - w.shape[1])), constant_values=-1) for w in words])
    word_ids, lengths_all = word_ids[:n_rows], np.concatenate(lengths)[:n_rows]
    labels = grammar.task_labels(word_ids, lengths_all)
    return SentenceSet(word_ids, lengths_all, {task: labels[column] for task, column in TASKS.items()})


def subset(sentences: SentenceSet, rows: np.ndarray) -> SentenceSet:
    """The rows ``rows`` of ``sentences`` with their labels."""
    return SentenceSet(
        sentences.word_ids[rows], sentences.lengths[rows], {t: y[rows] for t, y in sentences.labels.items()}
    )


def layer_features(
    model: torch.nn.Module, sentences: SentenceSet, layers: Sequence[int], width: int
) -> dict[int, np.ndarray]:
    """Per ``hidden_states`` index in ``layers``: every token position of ``[CLS] words [SEP]`` concatenated up to the
    fixed ``width`` words (+2 tokens), padding zeroed (v1's primary read-out, `paper_probes.encoder_features`)."""
    rows = token_rows(sentences)
    return {layer: extract_features(model, rows, pooling="concat", width=width + 2, layer=layer) for layer in layers}


def probe_test_accuracy(
    fit_x: np.ndarray,
    fit_y: np.ndarray,
    test_x: np.ndarray,
    test_y: np.ndarray,
    *,
    regularization: float,
    max_iter: int = 1000,
) -> float:
    """Test accuracy of one probe (`hf_flatbias.probe.fit_probe`: standardised features, multinomial logistic
    regression with inverse L2 strength ``regularization``) fitted on the fit rows."""
    x, y = labelled_rows(fit_x, fit_y, "fit features")
    tx, ty = labelled_rows(test_x, test_y, "test features")
    probe = fit_probe(x, y, regularization=regularization, max_iter=max_iter)
    return float((probe.predict(tx) == ty).mean())


def cross_validated_regularization(
    features: np.ndarray,
    labels: Mapping[str, np.ndarray],
    *,
    grid: Sequence[float] = CV_GRID,
    folds: int = 3,
    max_iter: int = 1000,
) -> dict:
    """``C`` by ``folds``-fold cross-validation (contiguous folds: the rows are i.i.d. draws), one value for every
    task: the grid value with the best accuracy averaged over folds and tasks; a tie keeps the smaller ``C`` (the
    stronger regularisation). Returns ``chosen`` and the ``scores`` per C (mean, then per task)."""
    if folds < 2:
        raise ValueError(f"cross-validation needs >= 2 folds, got {folds}.")
    fold_of = np.arange(len(features)) * folds // len(features)
    grid = sorted(grid)
    accuracy = {c: {task: [] for task in labels} for c in grid}
    for task, y in labels.items():
        for k in range(folds):
            x, fit_y = labelled_rows(features[fold_of != k], y[fold_of != k], "fit features")
            test_x, test_y = labelled_rows(features[fold_of == k], y[fold_of == k], "held-out features")
            # one warm-started path along ascending C (the same optima as cold fits, several times faster)
            probe = fit_probe(x, fit_y, regularization=grid[0], max_iter=max_iter, warm_start=True)
            for c in grid:
                probe.set_params(logisticregression__C=c).fit(x, fit_y)
                accuracy[c][task].append(float((probe.predict(test_x) == test_y).mean()))
    scores: dict[str, dict[str, float]] = {}
    for c in grid:
        per_task = {task: float(np.mean(values)) for task, values in accuracy[c].items()}
        scores[f"{c:g}"] = {"mean": float(np.mean(list(per_task.values()))), **per_task}
    best = max(scores.values(), key=lambda s: s["mean"])["mean"]
    chosen = min(float(c) for c, s in scores.items() if s["mean"] == best)
    return {"chosen": chosen, "folds": folds, "grid": grid, "rows": len(features), "scores": scores}


def primary_accuracy(per_task: Mapping[str, float]) -> float:
    """The primary read-out of one checkpoint on one split: the mean of the tasks' accuracies."""
    return float(np.mean([per_task[t] for t in TASKS]))


def gate_summary(
    baseline: Sequence[float], compared: Sequence[float], *, threshold: float = GATE_SD, confidence: float = 0.95
) -> dict:
    """The gate on paired per-split read-outs of two checkpoints (``compared - baseline`` per split): the
    differences, their mean with a Student-t interval, their s.d. (``ddof=1``) and ``verdict`` PASS when that s.d.
    is at most ``threshold``, FAIL otherwise. Needs >= 2 splits."""
    a, b = np.asarray(baseline, dtype=np.float64), np.asarray(compared, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size < 2:
        raise ValueError(f"the gate needs >= 2 paired splits of equal count, got {a.shape} and {b.shape}.")
    differences = b - a
    interval = mean_interval(differences, confidence)
    sd = float(differences.std(ddof=1))
    return {
        "differences": differences.tolist(),
        "mean_difference": interval.estimate,
        "ci_low": interval.low,
        "ci_high": interval.high,
        "confidence": confidence,
        "sd_difference": sd,
        "threshold": threshold,
        "verdict": "PASS" if sd <= threshold else "FAIL",
        "baseline_mean": float(a.mean()),
        "compared_mean": float(b.mean()),
    }


class _ConcatClassifier(torch.nn.Module):
    """The encoder under fine-tuning and one linear layer on its last layer's positions concatenated (padding
    zeroed): the primary probe's read-out, trained end to end."""

    def __init__(self, encoder: torch.nn.Module, tokens: int, hidden: int, n_classes: int):
        super().__init__()
        self.encoder = encoder
        self.head = torch.nn.Linear(tokens * hidden, n_classes)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        states = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state * mask[..., None]
        return self.head(states.flatten(1))


def padded_tokens(sentences: SentenceSet, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[CLS] words [SEP]`` ids padded with 0 to ``width + 2`` tokens, and their attention mask."""
    rows = token_rows(sentences)
    ids = torch.zeros((len(rows), width + 2), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.as_tensor(row)
    return ids, (ids != 0).long()


def finetune_classifier(
    masked_lm: torch.nn.Module,
    fit: SentenceSet,
    task: str,
    *,
    n_classes: int,
    width: int,
    epochs: int,
    learning_rate: float,
    batch_size: int,
    seed: int,
) -> torch.nn.Module:
    """Full fine-tuning of a copy of ``masked_lm``'s encoder with a linear head on the concatenated last layer
    (`_ConcatClassifier`) on the fit rows of ``task``: AdamW (weight decay 0.01) at a constant ``learning_rate``,
    ``epochs`` shuffled passes; ``seed`` fixes the head and the order (the same for every compared model). Trains on
    ``masked_lm``'s device and returns the classifier in eval mode; ``masked_lm`` is not modified."""
    import copy

    encoder = copy.deepcopy(masked_lm.base_model).train()
    torch.manual_seed(seed)
    tokens = width + 2
    device = next(masked_lm.parameters()).device
    # the head is drawn on the CPU whatever the device, so every device starts fine-tuning from the same head
    model = _ConcatClassifier(encoder, tokens, masked_lm.config.hidden_size, n_classes).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.01)
    ids, mask = (tensor.to(device) for tensor in padded_tokens(fit, width))
    labels = torch.as_tensor(fit.labels[task]).to(device)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(len(labels), generator=generator)
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size].to(device)
            loss = torch.nn.functional.cross_entropy(model(ids[batch], mask[batch]), labels[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return model.eval()


def classifier_accuracy(model: torch.nn.Module, sentences: SentenceSet, task: str, width: int) -> float:
    """Accuracy of a `finetune_classifier` model on ``sentences``' labels of ``task``."""
    device = next(model.parameters()).device
    ids, mask = (tensor.to(device) for tensor in padded_tokens(sentences, width))
    with torch.no_grad():
        predictions = torch.cat(
            [model(ids[s : s + 1024], mask[s : s + 1024]).argmax(-1) for s in range(0, len(ids), 1024)]
        )
    return float((predictions.cpu().numpy() == sentences.labels[task]).mean())


def finetune_accuracy(
    masked_lm: torch.nn.Module,
    fit: SentenceSet,
    test: SentenceSet,
    task: str,
    *,
    n_classes: int,
    width: int,
    epochs: int,
    learning_rate: float,
    batch_size: int,
    seed: int,
) -> float:
    """`finetune_classifier` on ``fit``, scored on ``test`` (`classifier_accuracy`); ``masked_lm`` is not modified."""
    model = finetune_classifier(
        masked_lm,
        fit,
        task,
        n_classes=n_classes,
        width=width,
        epochs=epochs,
        learning_rate=learning_rate,
        batch_size=batch_size,
        seed=seed,
    )
    return classifier_accuracy(model, test, task, width)


def task_class_counts(grammar: PCFG) -> dict[str, int]:
    """Classes per task: the sentence types (A), every nonterminal (B, C; `paper_language.task_classes`)."""
    return {"A": grammar.n_sentence_types, "B": grammar.n_symbols, "C": grammar.n_symbols}
