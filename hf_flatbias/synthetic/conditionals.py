"""Exact masked conditionals of a whole sentence set, computed once and cached on disk.

Distillation trains on ``Pr(x_t = . | x_-t)`` at every position of every pool sentence. Both languages give every
position of a sentence from one pass (`PCFG.masked_conditionals`: one inside pass and its gradient, the outside
pass; `HMM.masked_conditionals`: one forward-backward pass), so a pool of 30k sentences costs seconds; the cache
makes a resumed or repeated campaign pay nothing. The cache key hashes the language's parameters and the sentences,
so a changed grammar or sentence set can never read stale targets.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

import numpy as np

from .hmm import HMM
from .pcfg import PCFG


def language_fingerprint(language: PCFG | HMM) -> str:
    """A hex digest of every parameter of a PCFG or HMM (its dataclass fields): equal iff the languages are."""
    digest = hashlib.sha256(type(language).__name__.encode())
    for item in dataclasses.fields(language):
        value = getattr(language, item.name)
        digest.update(item.name.encode())
        if isinstance(value, np.ndarray):
            digest.update(str(value.shape).encode() + np.ascontiguousarray(value, dtype=np.float64).tobytes())
        elif isinstance(value, list) and value and isinstance(value[0], np.ndarray):
            for part in value:
                digest.update(str(part.shape).encode() + np.ascontiguousarray(part, dtype=np.float64).tobytes())
        else:
            digest.update(repr(value).encode())  # rules: nested lists of (children, probability) tuples
    return digest.hexdigest()


def all_position_conditionals(language: PCFG | HMM, word_ids: np.ndarray, lengths: np.ndarray | None = None):
    """``(n, T, n_words)`` exact ``Pr(x_t = w | x_-t)`` at every position, one pass per sentence (float64)."""
    word_ids = np.asarray(word_ids, dtype=np.int64)
    if isinstance(language, PCFG):
        return language.masked_conditionals(word_ids, lengths)
    if isinstance(language, HMM):
        if lengths is not None and (np.asarray(lengths) != word_ids.shape[1]).any():
            raise ValueError("HMM sentences all have the sample's length: pass lengths=None or the full width.")
        return language.masked_conditionals(word_ids)
    raise TypeError(f"expected a PCFG or an HMM, got {type(language).__name__}.")


def cached_conditionals(
    language: PCFG | HMM,
    word_ids: np.ndarray,
    lengths: np.ndarray | None = None,
    *,
    cache_dir: Path | str | None = None,
) -> np.ndarray:
    """`all_position_conditionals` as float32, read from ``cache_dir`` when this language and sentence set were
    computed before (``None``: no cache).

    float32 is what the models train on; it halves the file (30k sentences of 8 words and 50 words: 48 MB).
    """
    word_ids = np.asarray(word_ids, dtype=np.int64)
    lengths_array = None if lengths is None else np.asarray(lengths, dtype=np.int64)
    if cache_dir is None:
        return all_position_conditionals(language, word_ids, lengths_array).astype(np.float32)
    digest = hashlib.sha256(language_fingerprint(language).encode())
    digest.update(str(word_ids.shape).encode() + word_ids.tobytes())
    if lengths_array is not None:
        digest.update(lengths_array.tobytes())
    path = Path(cache_dir) / f"conditionals_{digest.hexdigest()[:24]}.npy"
    if path.exists():
        return np.load(path)
    conditionals = all_position_conditionals(language, word_ids, lengths_array).astype(np.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.npy")  # concurrent processes never share one
    np.save(partial, conditionals)
    partial.replace(path)  # a killed run leaves no truncated cache behind
    return conditionals
