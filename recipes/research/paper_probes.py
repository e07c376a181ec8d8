"""Linear probes of the paper-shaped protocol: fixed feature width, regularisation chosen on a validation split,
one fixed test set, paired (McNemar) comparisons and the reference rows every model is read against.

Features always have the grammar's longest sentence as their width (``[CLS]``, the words, ``[SEP]``, then zeros), for
fit, validation and test alike, so a column means the same position in every split whatever the lengths drawn. The
reference rows: the *lexical baseline* (one-hot word at each position, no model), the *untrained encoder* (the same
architecture at initialisation) and the *exact conditionals* (the lookup table: ``Pr(x_t | x_-t)`` at each position).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hf_flatbias.probe import extract_features, fit_probe, labelled_rows, wilson_interval
from hf_flatbias.synthetic.tokenizer import CLS_ID, N_SPECIAL, SEP_ID

from .paper_language import PROBE_SPLITS, PaperLanguage, SentenceSet

#: inverse L2 strengths tried on the validation split (the lexical baseline's optimum was 1e-3 to 1e-2)
REGULARIZATION_GRID = (1e-4, 1e-3, 1e-2, 1e-1, 1.0)


def token_rows(sentences: SentenceSet) -> list[list[int]]:
    """``[CLS] words [SEP]`` token rows of word-id sentences."""
    return [
        [CLS_ID, *(row[:n] + N_SPECIAL).tolist(), SEP_ID]
        for row, n in zip(sentences.word_ids, sentences.lengths, strict=True)
    ]


def onehot_position_word(word_ids: np.ndarray, lengths: np.ndarray, width: int, n_words: int) -> np.ndarray:
    """``(n, width * n_words)`` one-hot of the word at each position; positions past the end stay zero."""
    out = np.zeros((len(lengths), width, n_words), dtype=np.float32)
    rows, cols = np.nonzero(np.arange(width)[None, :] < lengths[:, None])
    out[rows, cols, word_ids[rows, cols]] = 1.0
    return out.reshape(len(lengths), -1)


def encoder_features(model, language: PaperLanguage, layer: int = -1) -> dict[str, np.ndarray]:
    """States of every token position up to the fixed width, concatenated, for each probe split.

    ``layer`` indexes ``hidden_states`` (``-1``: the last layer, the released code's read-out; ``0``: embeddings).
    """
    return {
        split: extract_features(
            model, token_rows(language.probes[split]), pooling="concat", width=language.width + 2, layer=layer
        )
        for split in PROBE_SPLITS
    }


def lexical_features(language: PaperLanguage) -> dict[str, np.ndarray]:
    """The lexical baseline's features (`onehot_position_word`) for each probe split."""
    n_words = language.grammar.n_words
    return {
        split: onehot_position_word(s.word_ids, s.lengths, language.width, n_words)
        for split, s in language.probes.items()
    }


def exact_conditional_features(language: PaperLanguage) -> dict[str, np.ndarray]:
    """The lookup table's features: the exact ``Pr(x_t = . | x_-t)`` at every position, padded to the fixed width."""
    out = {}
    for split, s in language.probes.items():
        conditionals = language.grammar.masked_conditionals(s.word_ids, s.lengths)
        padded = np.zeros((len(s), language.width, conditionals.shape[-1]), dtype=np.float32)
        padded[:, : conditionals.shape[1]] = conditionals
        out[split] = padded.reshape(len(s), -1)
    return out


def selected_probe(
    features: dict[str, np.ndarray],
    labels: dict[str, np.ndarray],
    *,
    grid: Sequence[float] = REGULARIZATION_GRID,
    confidence: float = 0.95,
    max_iter: int = 1000,
) -> dict[str, Any]:
    """Fit one probe per regularisation on "fit", keep the best on "validation", score it once on "test".

    Args:
        features: ``{"fit", "validation", "test"}`` feature arrays of equal width.
        labels: the same splits' labels of one task.
        grid: inverse L2 strengths to choose from.

    Returns:
        ``accuracy`` on test with its Wilson interval, the chosen ``regularization``, ``validation_accuracy``, and
        ``correct``: a string of 0/1 over the test rows (compact in JSON), for paired comparisons (`mcnemar`).
    """
    widths = {split: f.shape[1] for split, f in features.items()}
    if len(set(widths.values())) != 1:
        raise ValueError(f"probe splits must have one feature width, got {widths}: pad them to a fixed width.")
    if not grid:
        raise ValueError("grid must hold at least one regularisation value.")
    fit_x, fit_y = labelled_rows(features["fit"], labels["fit"], "fit features")
    val_x, val_y = labelled_rows(features["validation"], labels["validation"], "validation features")
    test_x, test_y = labelled_rows(features["test"], labels["test"], "test features")
    best_score, chosen, best_predictions = -1.0, None, None
    # one warm-started path along ascending C: each fit starts from the previous, several times faster than cold fits
    grid = sorted(grid)
    probe = fit_probe(fit_x, fit_y, regularization=grid[0], max_iter=max_iter, warm_start=True)
    for c in grid:
        probe.set_params(logisticregression__C=c).fit(fit_x, fit_y)
        score = float((probe.predict(val_x) == val_y).mean())
        if score > best_score:  # ties keep the stronger regularisation
            best_score, chosen, best_predictions = score, c, probe.predict(test_x)
    correct = best_predictions == test_y
    low, high = wilson_interval(int(correct.sum()), len(test_y), confidence)
    return {
        "accuracy": float(correct.mean()),
        "ci_low": low,
        "ci_high": high,
        "regularization": chosen,
        "validation_accuracy": best_score,
        "n_fit": len(fit_y),
        "n_test": len(test_y),
        "correct": "".join("1" if c else "0" for c in correct),
    }


def probe_all_tasks(features: dict[str, np.ndarray], language: PaperLanguage, **kwargs) -> dict[str, Any]:
    """`selected_probe` for every task of the language, and their mean test accuracy as ``probe_accuracy``."""
    tasks = {
        task: selected_probe(features, {split: s.labels[task] for split, s in language.probes.items()}, **kwargs)
        for task in language.probes["test"].labels
    }
    return {"probe_accuracy": float(np.mean([t["accuracy"] for t in tasks.values()])), "probe": tasks}


def _as_bool(correct: str | Sequence[int]) -> np.ndarray:
    if isinstance(correct, str):
        return np.frombuffer(correct.encode(), dtype=np.uint8) == ord("1")
    return np.asarray(correct, dtype=bool)


def mcnemar(correct_a: str | Sequence[int], correct_b: str | Sequence[int]) -> dict[str, Any]:
    """Exact McNemar test of two classifiers scored on the same test rows (``correct`` strings or 0/1 sequences).

    Returns the rows only ``a`` / only ``b`` gets right, ``b``'s accuracy minus ``a``'s, and the two-sided exact
    binomial p-value of the discordant rows (1.0 when there are none).
    """
    from scipy.stats import binomtest

    a, b = _as_bool(correct_a), _as_bool(correct_b)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired comparisons need the same test rows, got {a.shape} and {b.shape}.")
    only_a, only_b = int((a & ~b).sum()), int((b & ~a).sum())
    p_value = 1.0 if only_a + only_b == 0 else float(binomtest(only_a, only_a + only_b, 0.5).pvalue)
    return {"only_a": only_a, "only_b": only_b, "difference": float(b.mean() - a.mean()), "p_value": p_value}


def without_predictions(probes: dict[str, Any]) -> dict[str, Any]:
    """A `probe_all_tasks` result without the per-row ``correct`` lists (for compact JSON)."""
    return {
        **probes,
        "probe": {t: {k: v for k, v in r.items() if k != "correct"} for t, r in probes["probe"].items()},
    }
