"""Gradient alignment across data sources: the mean pairwise cosine between the mean gradients of the pre-training
loss on each source's contexts (Nexus, arXiv 2604.09258: at equal loss, models whose sources' gradients agree do
better downstream).

With ``G_s`` the mean over source ``s``'s contexts of the gradient of the data-label cross-entropy at the predicted
position, the measure is ``A = mean over pairs s < t of cos(G_s, G_t)``: 1 when every source pulls the weights the
same way, near 0 when their pulls are unrelated, negative when they conflict.

Its standard error is a stratified delete-one-block jackknife: each source's contexts (in their seeded order) are
split into ``n_blocks`` contiguous blocks, and each replicate drops one block of one source and recomputes ``A``;
``var = sum over sources (m_s - 1) / m_s sum over its blocks (A_(s,b) - mean_b A_(s,b))^2``. The contexts are the
random draw (a new draw gives other contexts of the same sources), the sources are fixed by the data (not a sample of
sources), so the resampling stays within sources. Blocks keep it cheap: only one summed gradient per block is held,
and every replicate comes from the Gram matrix of those block gradients.

`alignment_from_gram` is the pure arithmetic; `estimate_gradient_alignment` takes the gradients.
"""

from __future__ import annotations

import math
import time
from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ..constants import DEFAULT_BATCH_SIZE, IGNORE_INDEX
from .contexts import prepare_contexts
from .lm import evaluation_mode, logits_at_positions, measured_parameters, preserved_global_rng


def _mean_pairwise_cosine(gram: torch.Tensor, membership: torch.Tensor, counts: torch.Tensor) -> float:
    """``A`` from the Gram matrix of block sums: ``membership[s, j] = 1`` when block ``j`` is source ``s``'s,
    ``counts[s]`` its contexts (dropped blocks already zeroed in ``membership``)."""
    means = membership / counts[:, None]  # each source's mean gradient as a combination of blocks
    inner = means @ gram @ means.T
    norms = inner.diagonal().clamp_min(0).sqrt()
    cosines = inner / (norms[:, None] * norms[None, :])
    upper = torch.triu_indices(len(counts), len(counts), offset=1)
    return float(cosines[upper[0], upper[1]].mean())


def alignment_from_gram(
    gram: torch.Tensor, block_sources: Sequence[int], block_sizes: Sequence[int]
) -> tuple[float, float, list[float]]:
    """``(A, its jackknife standard error, each source pair's cosine)`` from the Gram matrix ``gram[i, j] =
    b_i . b_j`` of block-summed gradients ``b_i``, block ``i`` holding ``block_sizes[i]`` contexts of source
    ``block_sources[i]`` (0..S-1). The error is ``nan`` when a source has a single block."""
    gram = torch.as_tensor(gram, dtype=torch.float64)
    sources = torch.as_tensor(list(block_sources), dtype=torch.long)
    sizes = torch.as_tensor(list(block_sizes), dtype=torch.float64)
    n_sources = int(sources.max()) + 1
    if n_sources < 2:
        raise ValueError("gradient alignment needs at least two sources; name a column with two or more values.")
    membership = torch.zeros(n_sources, len(sources), dtype=torch.float64)
    membership[sources, torch.arange(len(sources))] = 1.0
    counts = membership @ sizes
    value = _mean_pairwise_cosine(gram, membership, counts)
    means = membership / counts[:, None]
    inner = means @ gram @ means.T
    norms = inner.diagonal().sqrt()
    upper = torch.triu_indices(n_sources, n_sources, offset=1)
    pairs = (inner / (norms[:, None] * norms[None, :]))[upper[0], upper[1]].tolist()
    variance = 0.0
    for s in range(n_sources):
        blocks = (sources == s).nonzero().reshape(-1).tolist()
        if len(blocks) < 2:
            return value, math.nan, pairs
        replicates = []
        for j in blocks:
            kept = membership.clone()
            kept[s, j] = 0.0
            left = counts - torch.where(torch.arange(n_sources) == s, sizes[j], 0.0)
            replicates.append(_mean_pairwise_cosine(gram, kept, left))
        replicates_t = torch.tensor(replicates, dtype=torch.float64)
        m = len(blocks)
        variance += (m - 1) / m * float((replicates_t - replicates_t.mean()).square().sum())
    return value, math.sqrt(variance), pairs


@dataclass
class GradientAlignment:
    """The mean pairwise cosine of per-source mean gradients (see the module's docstring).

    Attributes:
        mean: ``A``; stderr: its stratified jackknife error over blocks of contexts within sources.
        sources: the sources' names (as text), in the order of ``contexts_per_source``; pair_cosines: ``cos(G_s,
            G_t)`` for each pair ``s < t`` in that order (row by row).
        column: the column the sources came from; n_blocks: blocks per source (fewer when a source has fewer
            contexts); n_contexts, batch_size, seconds: the settings and the wall-clock time.
    """

    mean: float
    stderr: float
    column: str | None
    sources: list[str]
    contexts_per_source: list[int]
    pair_cosines: list[float]
    n_blocks: int
    n_contexts: int
    batch_size: int
    seconds: float
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _blocks(sources: Sequence[Hashable], n_blocks: int) -> tuple[list[str], list[list[int]], list[int]]:
    """The sources (sorted by their text), and per block its context indices and its source's index."""
    names = sorted({str(s) for s in sources})
    index = {name: i for i, name in enumerate(names)}
    members: list[list[int]] = [[] for _ in names]
    for i, source in enumerate(sources):
        members[index[str(source)]].append(i)
    blocks, owners = [], []
    for s, contexts in enumerate(members):
        for part in torch.tensor_split(torch.tensor(contexts), min(n_blocks, len(contexts))):
            blocks.append(part.tolist())
            owners.append(s)
    return names, blocks, owners


def estimate_gradient_alignment(
    model: nn.Module,
    contexts,
    sources: Sequence[Hashable],
    *,
    n_blocks: int = 8,
    n_contexts: int | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    causal: bool | None = None,
    column: str | None = None,
) -> GradientAlignment:
    """``A`` and its error over the first ``n_contexts`` contexts (all by default), context ``i`` belonging to source
    ``sources[i]``. One backward per batch of at most ``batch_size`` contexts of one block; ``S x n_blocks`` flat
    gradients of the trainable parameters are held (float64, on the model's device). The model is measured in
    ``eval()`` mode; no ``.grad`` is written, and modes and random streams are restored."""
    start_time = time.perf_counter()
    if isinstance(n_blocks, bool) or not isinstance(n_blocks, int) or n_blocks < 2:
        raise ValueError(f"n_blocks must be a whole number >= 2 (got {n_blocks!r}): the error drops one block of two.")
    prepared, n_used = prepare_contexts(model, contexts, n_contexts, causal)
    params = measured_parameters(model)
    sources = list(sources)[:n_used]
    if len(sources) < n_used:
        raise ValueError(f"{len(sources)} sources for {n_used} contexts: pass one source per context.")
    names, blocks, owners = _blocks(sources, n_blocks)
    if len(names) < 2:
        raise ValueError(
            f"all {n_used} contexts come from one source ({names[0]!r}): gradient alignment compares sources; name "
            "a column with two or more values (the sentence type, task_a, for the synthetic languages)."
        )
    device = params[0].device
    sums = torch.zeros(len(blocks), sum(p.numel() for p in params), dtype=torch.float64, device=device)
    with evaluation_mode(model), preserved_global_rng(), torch.enable_grad():
        for row, block in enumerate(blocks):
            for start in range(0, len(block), batch_size):
                indices = block[start : start + batch_size]
                batch = prepared.model_inputs(indices, model)
                positions = torch.tensor([prepared.positions[i] for i in indices], device=device)
                targets = torch.tensor([prepared.targets[i] for i in indices], device=device)
                logits = logits_at_positions(model, batch, positions)[:, 0]
                loss = torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum")
                grads = torch.autograd.grad(loss, params, allow_unused=True)
                for g, piece in zip(grads, sums[row].split([p.numel() for p in params]), strict=True):
                    if g is not None:  # a parameter the loss does not reach (BERT's pooler) adds nothing
                        piece += g.reshape(-1).double()
    gram = (sums @ sums.T).cpu()
    value, stderr, pairs = alignment_from_gram(gram, owners, [len(b) for b in blocks])
    counts = [sum(len(b) for b, o in zip(blocks, owners, strict=True) if o == s) for s in range(len(names))]
    notes = []
    if min(counts) < 2 * n_blocks:
        notes.append(f"a source has {min(counts)} contexts: fewer than 2 per block; the error is rough")
    return GradientAlignment(
        mean=value,
        stderr=stderr,
        column=column,
        sources=names,
        contexts_per_source=counts,
        pair_cosines=pairs,
        n_blocks=n_blocks,
        n_contexts=n_used,
        batch_size=batch_size,
        seconds=time.perf_counter() - start_time,
        notes=notes,
    )


def gradient_alignment(
    model: nn.Module,
    contexts,
    *,
    n_contexts: int | None,
    settings: Any,
    seed: int = 0,
    batch_size: int | str,
    causal: bool | None = None,
    optimizer: Any = None,
    task: Any = None,
) -> GradientAlignment:
    """The measures table's entry: the sources are each context's ``settings.alignment_column`` (carried from its
    row by `build_masked_contexts(keep_columns=...)`, which the callback and the command line do)."""
    from .beyond_trace import fixed_batch_size

    column = settings.alignment_column
    rows = list(contexts)
    used = rows if n_contexts is None else rows[:n_contexts]
    several = next((i for i, row in enumerate(used) if sum(int(t) != IGNORE_INDEX for t in row["labels"]) != 1), None)
    if several is not None:
        raise ValueError(
            f"context {several} labels other than one position: gradient_alignment reads each context's source from "
            "its row, so it needs one labelled position per row (build_masked_contexts(keep_columns=...) writes such)."
        )
    missing = next((i for i, row in enumerate(used) if column not in row), None)
    if missing is not None:
        raise ValueError(
            f"context {missing} has no {column!r} column: gradient_alignment needs each context's source; give the "
            f"rows a {column!r} column (or name another with alignment_column)."
        )
    return estimate_gradient_alignment(
        model,
        rows,
        [row[column] for row in used],
        n_blocks=settings.alignment_blocks,
        n_contexts=n_contexts,
        batch_size=fixed_batch_size(batch_size),
        causal=causal,
        column=column,
    )


__all__ = ["GradientAlignment", "alignment_from_gram", "estimate_gradient_alignment", "gradient_alignment"]
