"""Linear probes on frozen features: how much of a downstream label a representation exposes linearly.

The paper's downstream measure for synthetic languages is the accuracy of a linear head on top of the frozen
pre-trained encoder. [`extract_features`] runs the encoder once and [`probe_accuracy`] fits a multinomial logistic
regression on one split and scores the other, with a Wilson confidence interval for the held-out accuracy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .stats import wilson_interval

POOLINGS = ("cls", "mean", "position", "concat")


@dataclass(frozen=True)
class ProbeResult:
    """Held-out accuracy of a linear probe.

    Attributes:
        accuracy: fraction of held-out rows classified correctly.
        ci_low, ci_high: Wilson score interval of the accuracy at ``confidence``.
        confidence: level of the interval.
        n_train, n_test: rows used to fit and to score.
        n_classes: distinct labels in the data.
        chance: accuracy of always predicting the most frequent training label, on the held-out rows.
    """

    accuracy: float
    ci_low: float
    ci_high: float
    confidence: float
    n_train: int
    n_test: int
    n_classes: int
    chance: float

    def to_dict(self) -> dict[str, float | int]:
        return dict(self.__dict__)


def probe_accuracy(
    features: np.ndarray | torch.Tensor,
    labels: Sequence[int] | np.ndarray,
    *,
    test_fraction: float = 0.3,
    test_features: np.ndarray | torch.Tensor | None = None,
    test_labels: Sequence[int] | np.ndarray | None = None,
    regularization: float = 1.0,
    max_iter: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> ProbeResult:
    """Fit a multinomial logistic regression on frozen features and score it on held-out rows.

    Args:
        features: ``(n, d)`` features of the training rows (or of all rows when no test set is given).
        labels: ``(n,)`` integer labels; rows with a negative label (undefined task label) are dropped.
        test_fraction: share of rows held out when ``test_features`` is not given (stratified split).
        test_features, test_labels: an explicit held-out set.
        regularization: inverse L2 strength ``C`` of scikit-learn's ``LogisticRegression``.
        max_iter: solver iterations.
        confidence: level of the Wilson interval.
        seed: seed of the split.

    Returns:
        [`ProbeResult`] with the accuracy and its interval.
    """
    from sklearn.model_selection import train_test_split

    x, y = labelled_rows(features, labels, "features")
    if test_features is None:
        if test_labels is not None:
            raise ValueError("test_labels given without test_features; pass both or neither.")
        if not 0 < test_fraction < 1:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}.")
        counts = np.bincount(y)
        stratify = y if counts[counts > 0].min() >= 2 else None
        x, x_test, y, y_test = train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=stratify)
    else:
        if test_labels is None:
            raise ValueError("test_features given without test_labels; pass both.")
        x_test, y_test = labelled_rows(test_features, test_labels, "test_features")
        if x_test.shape[1] != x.shape[1]:
            raise ValueError(f"test_features have {x_test.shape[1]} columns but features have {x.shape[1]}.")
    classes = np.unique(y)
    model = fit_probe(x, y, regularization=regularization, max_iter=max_iter)
    correct = int((model.predict(x_test) == y_test).sum())
    majority = classes[np.argmax([(y == c).sum() for c in classes])]
    low, high = wilson_interval(correct, len(y_test), confidence)
    return ProbeResult(
        accuracy=correct / len(y_test),
        ci_low=low,
        ci_high=high,
        confidence=confidence,
        n_train=len(y),
        n_test=len(y_test),
        n_classes=len(np.unique(np.concatenate([y, y_test]))),
        chance=float((y_test == majority).mean()),
    )


def fit_probe(
    features: np.ndarray,
    labels: np.ndarray,
    *,
    regularization: float = 1.0,
    max_iter: int = 1000,
    warm_start: bool = False,
):
    """The probe itself: standardised features into a multinomial logistic regression with inverse L2 strength
    ``regularization``, fitted on rows already checked by `labelled_rows`; returns the fitted scikit-learn pipeline.
    ``warm_start``: a later ``fit`` with another ``logisticregression__C`` starts from this solution (a C path)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    if len(np.unique(labels)) < 2:
        raise ValueError("a probe needs at least two distinct labels among the training rows.")
    head = LogisticRegression(C=regularization, max_iter=max_iter, warm_start=warm_start)
    return make_pipeline(StandardScaler(), head).fit(features, labels)


def labelled_rows(
    features: np.ndarray | torch.Tensor, labels: Sequence[int] | np.ndarray, name: str = "features"
) -> tuple[np.ndarray, np.ndarray]:
    """The rows a probe is fitted or scored on: ``features`` as float64 and ``labels``, without the rows whose label
    is negative (undefined for that task). Raises a ValueError naming ``name`` for a wrong shape, non-integer labels,
    non-finite features or fewer than 4 labelled rows."""
    x = features.detach().cpu().numpy() if isinstance(features, torch.Tensor) else np.asarray(features)
    y = np.asarray(labels)
    if x.ndim != 2:
        raise ValueError(f"{name} must be a 2-D (rows, dims) array, got shape {x.shape}.")
    if y.ndim != 1 or len(y) != len(x):
        raise ValueError(f"labels must be 1-D with one entry per row of {name} ({len(x)}), got shape {y.shape}.")
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError("labels must be integers (class ids).")
    if not np.isfinite(x).all():
        raise ValueError(f"{name} contain NaN or infinite values.")
    keep = y >= 0
    if keep.sum() < 4:
        raise ValueError("fewer than 4 rows have a defined (non-negative) label; a probe cannot be fitted.")
    return x[keep].astype(np.float64), y[keep]


@torch.no_grad()
def extract_features(
    model: torch.nn.Module,
    input_ids: Sequence[Sequence[int]],
    *,
    pooling: str = "cls",
    position: int = 0,
    layer: int = -1,
    batch_size: int = 256,
    pad_token_id: int = 0,
    width: int | None = None,
) -> np.ndarray:
    """Frozen features of an encoder (any model returning ``hidden_states``, e.g. ``BertForMaskedLM``).

    Args:
        model: the encoder; it runs in eval mode and its mode is restored afterwards.
        input_ids: token-id rows (unpadded lists).
        pooling: ``'cls'`` (first token), ``'mean'`` (mean over non-padding tokens), ``'position'`` (token at
            ``position``) or ``'concat'`` (all positions concatenated, padding zeroed: a flattened representation).
        position: token index used by ``'position'``.
        layer: index into ``hidden_states`` (``-1``: last layer, ``0``: embeddings).
        batch_size: rows per forward pass.
        pad_token_id: id used to pad rows to the batch's longest.
        width: with ``'concat'``, the token positions every row is padded to, so features of different calls (a
            probe's fit and test rows) have the same columns; default: the longest row of this call.

    Returns:
        ``(n, d)`` float32 array (``d * max_length`` for ``'concat'``).
    """
    if pooling not in POOLINGS:
        raise ValueError(f"pooling={pooling!r} is not supported; choose one of {list(POOLINGS)}.")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    max_length = max(len(r) for r in input_ids)
    if width is not None:
        if width < max_length:
            raise ValueError(f"width={width} but a row has {max_length} tokens; pass a width of at least the longest.")
        max_length = width
    chunks = []
    try:
        for start in range(0, len(input_ids), batch_size):
            rows = input_ids[start : start + batch_size]
            padded = max_length if pooling == "concat" else max(len(r) for r in rows)
            ids = torch.full((len(rows), padded), pad_token_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, r in enumerate(rows):
                ids[i, : len(r)] = torch.as_tensor(list(r))
                mask[i, : len(r)] = 1
            out = model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True)
            hidden = out.hidden_states[layer].float().cpu()
            if pooling == "cls":
                pooled = hidden[:, 0]
            elif pooling == "position":
                pooled = hidden[:, position]
            elif pooling == "mean":
                pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
            else:
                pooled = (hidden * mask[..., None]).reshape(len(rows), -1)
            chunks.append(pooled.numpy())
    finally:
        model.train(was_training)
    return np.concatenate(chunks)
