"""Trace estimates shared across processes: each rank measures a share of the contexts, every rank gets the whole.

Each context's draws depend only on ``(seed, context index)``, so splitting the contexts over ranks and putting the
per-context values back in their original order gives the one-process estimate on the same contexts and draws
(per-context estimators; ``summed``/``hutchinson`` group contexts into batches, whose grouping then differs).

Under DeepSpeed ZeRO-3 and FSDP2 every forward and backward gathers parameters from all ranks, so the ranks must
run the same sequence of passes: shares are then padded to equal length with a repeated context whose values are
dropped. The trace is measured through the engines' own per-module gather and free (`differentiated_parameters`,
`Zero3BackwardHooks`, `release_zero3_leftovers`); `gathered_parameters` and `unsharded_parameters` hold the whole
model on every rank instead, for a measure that needs it (see their docstrings for the memory this costs).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..tensors import is_fully_sharded
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


def is_zero3_partitioned(model: nn.Module) -> bool:
    """Whether DeepSpeed ZeRO-3 partitions the model's parameters."""
    return any(hasattr(p, "ds_tensor") for p in model.parameters())


def needs_lockstep(model: nn.Module) -> bool:
    """Whether the model's parameters are partitioned across ranks (ZeRO-3, FSDP2), so every pass is a collective."""
    return is_zero3_partitioned(model) or is_fully_sharded(model)


@contextlib.contextmanager
def gathered_parameters(model: nn.Module) -> Iterator[None]:
    """Every parameter of a ZeRO-3 model whole on every rank until the block ends, then partitioned again.

    ``per_sample`` differentiates down to the recorded layer outputs only, a backward during which ZeRO-3's per-module
    hooks would release or miss parameters; with the whole model resident they have nothing to fetch. The cost is
    the unpartitioned parameters on every rank for the measurement (what ZeRO 0-2 hold all the time: 4 bytes per
    parameter in fp32, 440 MB for BERT-base), on top of one batch of activations. A model that does not fit whole on
    one device is measured with ``estimator='naive'``, whose stock forward and backward ZeRO-3 gathers per module.
    The gather is one collective; every rank enters together (the ranks are in step under ZeRO-3 anyway).
    """
    import deepspeed

    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        # ZeRO-3's post-forward hooks partition a parameter no module holds active: mark each one held by the
        # measurement, so that it stays whole through every forward and backward of it.
        for param in params:
            param.ds_active_sub_modules.add(_MEASUREMENT_HOLDER)
        try:
            yield
        finally:
            for param in params:
                param.ds_active_sub_modules.discard(_MEASUREMENT_HOLDER)


@contextlib.contextmanager
def unsharded_parameters(model: nn.Module) -> Iterator[None]:
    """Every parameter of an FSDP2 model whole on every rank until the block ends, then sharded again.

    The estimators differentiate against the parameters the module holds, which under FSDP2 are the shards between
    forwards (a backward to them finds them unused). Each FSDP module is all-gathered once (one collective per
    module, every rank entering together) and told not to reshard after forward or backward, so the module holds
    its unsharded parameters through every pass of the measurement and FSDP's hooks have nothing to gather, free or
    reduce (the estimators write no ``.grad``). The cost is the whole fp32 model on every rank while it measures, as
    DDP holds it all the time. The resharding settings are FSDP's own (torch 2.13 keeps them on each parameter
    group) and are put back as they were.
    """
    from torch.distributed.fsdp import FSDPModule

    modules = [module for module in model.modules() if isinstance(module, FSDPModule)]
    saved = []
    for module in modules:
        state = module._get_fsdp_state()
        groups = [
            (group, group.post_forward_mesh_info, group.reshard_after_backward) for group in state._fsdp_param_groups
        ]
        saved.append((state, state._auto_reshard_after_forward, groups))
        module.set_reshard_after_forward(False, recurse=False)
        module.set_reshard_after_backward(False, recurse=False)
    try:
        for module in modules:
            module.unshard()
        yield
    finally:
        for module in modules:
            module.reshard()
        for state, auto_reshard, groups in saved:
            state._auto_reshard_after_forward = auto_reshard
            for group, post_forward_mesh_info, reshard_after_backward in groups:
                group.post_forward_mesh_info = post_forward_mesh_info
                group.reshard_after_backward = reshard_after_backward


def differentiated_parameters(model: nn.Module, params: Sequence[nn.Parameter]) -> list[torch.Tensor]:
    """The tensors a forward of ``model`` differentiates in place of ``params``: FSDP2's unsharded parameter for each
    sharded one (the engine all-gathers into it per FSDP unit and frees its storage after), ``params`` themselves
    otherwise (ZeRO-3 swaps the whole parameter into the same object). Call it after a forward: FSDP2 creates the
    unsharded parameters at the first all-gather."""
    if not is_fully_sharded(model):
        return list(params)
    from torch.distributed.fsdp import FSDPModule

    unsharded = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    if hasattr(fsdp_param, "_unsharded_param"):
                        unsharded[id(fsdp_param.sharded_param)] = fsdp_param._unsharded_param
    return [unsharded.get(id(p), p) for p in params]


class Zero3BackwardHooks:
    """Re-arms ZeRO-3's per-module backward hooks for another backward through the same forward's graph.

    ZeRO-3 fetches a module's partitioned parameters before its backward and releases them after by counters the
    forward sets (``applied_pre_backward_ref_cnt``, ``ds_grads_remaining``), one backward per forward: a second
    backward through a retained graph (a draw of ``per_sample``) would find the parameters released and not fetch
    them. `snapshot` records the counts the forward left; `rearm` puts them back before each further backward, so the
    engine gathers and frees each module's parameters per backward as it does in training. A no-op off ZeRO-3.
    """

    _COUNTERS = ("applied_pre_backward_ref_cnt", "ds_grads_remaining")

    def __init__(self, model: nn.Module) -> None:
        self._modules = list(model.modules()) if is_zero3_partitioned(model) else []
        self._counts: list[tuple[nn.Module, str, int]] = []

    def snapshot(self) -> None:
        self._counts = [
            (module, name, module.__dict__[name])
            for module in self._modules
            for name in self._COUNTERS
            if name in module.__dict__
        ]

    def rearm(self) -> None:
        for module, name, count in self._counts:
            setattr(module, name, count)


def release_zero3_leftovers(model: nn.Module) -> None:
    """Partition again every ZeRO-3 parameter a measurement left gathered, as DeepSpeed's own reset does at a step.

    A module whose inputs need no gradient (the token embedding) gets no post-backward hook, so ZeRO-3 still counts
    it active and whole after the backward; it frees it only at the optimizer step, which a measurement never
    reaches. Called between passes, when no module is running; persistent parameters stay whole."""
    for param in model.parameters():
        status = getattr(param, "ds_status", None)
        if status is not None and status.name == "AVAILABLE" and not param.ds_persist:
            param.ds_active_sub_modules.clear()
            param.partition()


def lockstep_minimum(value: int, model: nn.Module) -> int:
    """``value``'s minimum over the ranks when every pass of ``model`` is a collective (the ranks must then run as
    many batches), ``value`` itself otherwise."""
    if not needs_lockstep(model) or world()[1] == 1:
        return value
    reduced = torch.tensor([value], dtype=torch.long, device=next(model.parameters()).device)
    dist.all_reduce(reduced, op=dist.ReduceOp.MIN)
    return int(reduced)


_MEASUREMENT_HOLDER = -1
"""The id `gathered_parameters` registers as an active user of every parameter (DeepSpeed's module ids are >= 0)."""


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
            None if local.group_values is None else local.group_values[:n_measured].cpu(),
            local.group_names,
        )
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, payload)
    parts = [part for part in gathered if part is not None]
    n_total = sum(part[0].shape[0] for part in parts)
    first = parts[0]
    values = torch.empty((n_total, *first[0].shape[1:]), dtype=first[0].dtype)
    weights = torch.empty(n_total, dtype=first[1].dtype)
    group_values = None if first[6] is None else torch.empty((n_total, *first[6].shape[1:]), dtype=first[6].dtype)
    for rank, part in enumerate(gathered):
        if part is not None:
            # rank r measured positions r, r + world_size, ... of the original order
            values[rank::world_size] = part[0]
            weights[rank::world_size] = part[1]
            if group_values is not None:
                group_values[rank::world_size] = part[6]
    return TraceSamples(
        values=values,
        weights=weights,
        n_draws=first[2],
        estimator=first[3],
        forward_seconds=sum(part[4] for part in parts),
        draw_seconds=sum(part[5] for part in parts),
        group_values=group_values,
        group_names=first[7],
    )
