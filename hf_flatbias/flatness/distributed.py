"""Trace estimates shared across processes: each rank measures a share of the contexts, every rank gets the whole.

Each context's draws depend only on ``(seed, context index)``, so splitting the contexts over ranks and putting the
per-context values back in their original order gives the one-process estimate on the same contexts and draws
(per-context estimators; ``summed``/``hutchinson`` group contexts into batches, whose grouping then differs).

Under DeepSpeed ZeRO-3 every forward and backward gathers parameters from all ranks, so the ranks must run the same
sequence of passes: shares are then padded to equal length with a repeated context whose values are dropped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .results import TraceSamples


@dataclass
class ContextShare:
    """The contexts one rank measures: ``indices[:n_measured]`` count, the rest only keeps ranks in step."""

    indices: list[int]
    n_measured: int


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group, ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def needs_lockstep(model: nn.Module) -> bool:
    """Whether the model's parameters are partitioned across ranks (ZeRO-3), so every pass is a collective."""
    return any(hasattr(p, "ds_tensor") for p in model.parameters())


def share_of_contexts(indices: Sequence[int], rank: int, world_size: int, *, lockstep: bool) -> ContextShare:
    """Every ``world_size``-th context starting at ``rank``; padded to the longest share when ``lockstep``."""
    if not indices:
        raise ValueError("No contexts to share across processes.")
    own = list(indices[rank::world_size])
    longest = math.ceil(len(indices) / world_size)
    padding = [indices[0]] * (longest - len(own)) if lockstep else []
    if not own and not lockstep:
        return ContextShare([], 0)
    return ContextShare(own + padding, len(own))


def gather_trace_samples(local: TraceSamples | None, n_measured: int, world_size: int) -> TraceSamples:
    """Every rank's measured samples, put back in the order of the contexts before `share_of_contexts` split them.

    ``local`` holds this rank's values for its share (``None`` when it measured nothing); units beyond
    ``n_measured`` are padding and are dropped. Must be called on every rank.
    """
    payload = None
    if local is not None and n_measured > 0:
        payload = (
            local.values[:n_measured].cpu(),
            local.weights[:n_measured].cpu(),
            local.n_draws,
            local.estimator,
            local.forward_seconds,
            local.draw_seconds,
        )
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, payload)
    parts = [part for part in gathered if part is not None]
    n_total = sum(part[0].shape[0] for part in parts)
    first = parts[0]
    values = torch.empty((n_total, *first[0].shape[1:]), dtype=first[0].dtype)
    weights = torch.empty(n_total, dtype=first[1].dtype)
    for rank, part in enumerate(gathered):
        if part is not None:
            # rank r measured positions r, r + world_size, ... of the original order
            values[rank::world_size] = part[0]
            weights[rank::world_size] = part[1]
    return TraceSamples(
        values=values,
        weights=weights,
        n_draws=first[2],
        estimator=first[3],
        forward_seconds=sum(part[4] for part in parts),
        draw_seconds=sum(part[5] for part in parts),
    )
