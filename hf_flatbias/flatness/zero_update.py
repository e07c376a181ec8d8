"""The update DeepSpeed's ZeRO optimizer (stages 1, 2 and 3) would apply next for a given gradient, computed without
applying it: the direction of critical sharpness under DeepSpeed (`hf_flatbias.flatness.beyond_trace`).

Under ZeRO the torch optimizer the engine wraps (AdamW, SGD, ...) does not hold the model's parameters. Per param
group it holds one flat fp32 *master partition*: this process's equal slice of the group's parameters flattened in
DeepSpeed's order (ZeRO-1/2: ``single_partition_of_fp32_groups``, the slice of ``bit16_groups_flat``; ZeRO-3:
``fp32_partitioned_groups_flat``, the concatenated ``ds_tensor`` partitions of a sub-group), and its state (moments,
step counts, momentum buffers) is that partition's. An engine step (1) averages the gradients over processes into
the partition's layout, (2) divides by the fp16 loss scale and clips by the global norm (``gradient_clipping``),
(3) steps the torch optimizer on the master partitions, and (4) copies them into the model's weights (all-gathered
under ZeRO-1/2, kept partitioned under ZeRO-3).

`zero_proposed_update` does (1)-(3) for a gradient it is handed and undoes (3):

- the gradient is the caller's, already summed over processes (`ParameterSpace.gradient`: the gradient of the mean
  loss over all contexts, the average DeepSpeed's reduction forms), placed into each master partition's layout and
  cast to its dtype as DeepSpeed casts its reduced gradient;
- clipping: DeepSpeed's own rule on the global norm of that gradient, ``g / max(1, (||g|| + 1e-6) / clip)`` with the
  engine's ``clip_grad``; the loss scale does not enter, the gradient was never scaled;
- the step: `proposed_update` on the wrapped torch optimizer with the master partitions listed and given that
  ``.grad``, run and undone bit for bit (the masters, the optimizer's state and hyper-parameters), the previous
  ``.grad`` objects and param-group lists put back. No DeepSpeed bookkeeping (loss scaler, step counters, gradient
  buffers) is touched: the engine's own step is never called.

The update is the masters' move ``u`` (not the rounded change of low-precision weights), laid out as the line search
moves the weights: whole parameters under ZeRO-1/2 (each group's partition updates all-gathered, as step (4) does),
this process's ``ds_tensor`` partitions under ZeRO-3 (nothing gathered), in the weights' dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .critical_sharpness import ProposedUpdate, proposed_update

DIRECTION_FIX = "or set critical_direction='gradient_descent' to search along the negative gradient"


def zero_optimizer_of(optimizer: object | None) -> object | None:
    """The ZeRO optimizer (stage 1, 2 or 3) behind ``optimizer`` (the Trainer's wrapper, ``engine.optimizer``, or
    itself), or ``None`` when there is none."""
    candidate = optimizer
    for _ in range(3):
        if candidate is None:
            return None
        if hasattr(candidate, "single_partition_of_fp32_groups") or hasattr(candidate, "fp32_partitioned_groups_flat"):
            return candidate
        candidate = getattr(candidate, "optimizer", None)
    return None


def is_deepspeed_optimizer(optimizer: object | None) -> bool:
    """Whether ``optimizer`` is (or wraps) one of DeepSpeed's own optimizers, ZeRO's or another."""
    candidate = optimizer
    for _ in range(3):
        if candidate is None:
            return False
        if type(candidate).__module__.startswith("deepspeed"):
            return True
        candidate = getattr(candidate, "optimizer", None)
    return False


def torch_optimizer_of(optimizer: object) -> object:
    """The optimizer that computes the update: the torch optimizer ZeRO wraps, or the one accelerate's wrapper holds,
    or ``optimizer`` itself."""
    zero = zero_optimizer_of(optimizer)
    if zero is not None:
        return zero.optimizer
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def check_zero_update_supported(optimizer: object | None) -> None:
    """Refuse, before any compute, the DeepSpeed set-ups whose next update `zero_proposed_update` cannot reproduce.

    Raises:
        ValueError: a DeepSpeed optimizer that is not ZeRO's (e.g. ``BF16_Optimizer`` at stage 0), an offloaded
            optimizer (its state is in DeepSpeed's CPU/NVMe buffers and CPU-Adam kernels, untested here), DeepSpeed's
            Muon (orthogonalised inside the gradient reduction), ZenFlow or a torch autocast gradient scaler.
    """
    if not is_deepspeed_optimizer(optimizer):
        return
    zero = zero_optimizer_of(optimizer)
    prefix = "critical_sharpness along DeepSpeed's optimizer update"
    if zero is None:
        inner = getattr(optimizer, "optimizer", optimizer)
        raise ValueError(
            f"{prefix} needs ZeRO stage 1, 2 or 3 (got {type(inner).__name__}): enable zero_optimization, "
            f"{DIRECTION_FIX}."
        )
    if getattr(zero, "cpu_offload", False) or getattr(zero, "offload_optimizer", False):
        raise ValueError(f"{prefix} does not support offload_optimizer: turn the offload off, {DIRECTION_FIX}.")
    muon = getattr(zero, "use_muon", False) or "muon" in type(zero.optimizer).__name__.lower()
    if muon or getattr(zero, "zenflow", False) or getattr(zero, "torch_autocast_gradscaler", None) is not None:
        raise ValueError(
            f"{prefix} does not support DeepSpeed's Muon, ZenFlow or torch autocast (they change the gradient inside "
            f"the engine's step): use a torch optimizer without them, {DIRECTION_FIX}."
        )


def zero_proposed_update(optimizer: object, space, grads: Sequence[torch.Tensor]) -> ProposedUpdate:
    """The update the ZeRO optimizer behind ``optimizer`` would apply for the gradient ``grads``, leaving the masters,
    the optimizer's state and every ``.grad`` as they were (see the module's docstring).

    Args:
        optimizer: the ZeRO optimizer, ``engine.optimizer`` or the Trainer's wrapper of it.
        space: the model's `ParameterSpace` (its ``params`` in order, and how partial sums add over processes).
        grads: the gradient summed over processes, one tensor per ``space.params`` in the space's local layout
            (whole parameters under ZeRO-1/2, ``ds_tensor`` partitions under ZeRO-3).

    Returns:
        A `ProposedUpdate` over ``space.params``: each update in the layout of ``grads`` and the weights' dtype
        (zeros for a parameter the optimizer does not hold), at the torch optimizer's learning rate.
    """
    check_zero_update_supported(optimizer)
    zero = zero_optimizer_of(optimizer)
    by_id = {id(p): g for p, g in zip(space.params, grads, strict=True)}
    stage3 = hasattr(zero, "fp32_partitioned_groups_flat")
    masters, gradients = (_stage3_gradients if stage3 else _stage12_gradients)(zero, by_id)
    _clip_as_deepspeed(zero, gradients, space, whole=not stage3)
    inner = zero.optimizer
    saved_grads = [m.grad for m in masters]
    saved_lists = [group["params"] for group in inner.param_groups]
    try:
        if stage3:  # between steps ZeRO-3 lists no parameter in the torch optimizer's groups
            for group in inner.param_groups:
                group["params"] = []
            for sub_group, master in enumerate(masters):
                inner.param_groups[zero.sub_group_to_group_id[sub_group]]["params"].append(master)
        for master, gradient in zip(masters, gradients, strict=True):
            master.grad = gradient
        proposed = proposed_update(inner)
    finally:
        for master, gradient in zip(masters, saved_grads, strict=True):
            master.grad = gradient
        for group, params in zip(inner.param_groups, saved_lists, strict=True):
            group["params"] = params
    moves = {id(m): u for m, u in zip(proposed.params, proposed.updates, strict=True)}
    moves = [moves.get(id(m), torch.zeros_like(m)) for m in masters]
    laid_out = (_stage3_updates if stage3 else _stage12_updates)(zero, moves)
    updates = [
        laid_out[id(p)].to(g.dtype) if id(p) in laid_out else torch.zeros_like(g)
        for p, g in zip(space.params, grads, strict=True)
    ]
    return ProposedUpdate(params=list(space.params), updates=updates, learning_rate=proposed.learning_rate)


def _stage12_gradients(zero, by_id: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each group's gradient flattened at DeepSpeed's offsets (its alignment padding zero) and cut to this process's
    partition."""
    masters, partitions = [], []
    for index, group in enumerate(zero.round_robin_bit16_groups):
        master = zero.single_partition_of_fp32_groups[index]
        flat = torch.zeros(zero.bit16_groups_flat[index].numel(), dtype=master.dtype, device=master.device)
        for param, meta, offset in zip(
            group, zero.round_robin_bit16_meta[index], zero.round_robin_bit16_offsets[index], strict=True
        ):
            if id(param) in by_id:
                flat[offset : offset + meta.numel()] = by_id[id(param)].reshape(-1)
        start, size = _partition_bounds(zero, index)
        masters.append(master)
        partitions.append(flat[start : start + size].clone())
    return masters, partitions


def _partition_bounds(zero, index: int) -> tuple[int, int]:
    sizes = [t.numel() for t in zero.parallel_partitioned_bit16_groups[index]]
    rank = dist.get_rank(group=zero.real_dp_process_group[index]) if len(sizes) > 1 else 0
    return sum(sizes[:rank]), sizes[rank]


def _stage12_updates(zero, moves: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Each group's partition updates all-gathered over its processes and cut into whole parameters."""
    laid_out = {}
    for index, group in enumerate(zero.round_robin_bit16_groups):
        sizes = [t.numel() for t in zero.parallel_partitioned_bit16_groups[index]]
        if len(sizes) > 1:
            pieces = [torch.empty(size, dtype=moves[index].dtype, device=moves[index].device) for size in sizes]
            dist.all_gather(pieces, moves[index].contiguous(), group=zero.real_dp_process_group[index])
            flat = torch.cat(pieces)
        else:
            flat = moves[index]
        for param, meta, offset in zip(
            group, zero.round_robin_bit16_meta[index], zero.round_robin_bit16_offsets[index], strict=True
        ):
            laid_out[id(param)] = flat[offset : offset + meta.numel()].view(meta.shape)
    return laid_out


def _stage3_gradients(zero, by_id: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each sub-group's partitions concatenated in DeepSpeed's order: the layout of its fp32 master."""
    masters, partitions = [], []
    for sub_group, params in enumerate(zero.fp16_groups):
        master = zero.fp32_partitioned_groups_flat[sub_group]
        pieces = [
            by_id[id(p)].reshape(-1) if id(p) in by_id else torch.zeros(p.partition_numel(), device=master.device)
            for p in params
        ]
        flat = torch.cat([piece.to(master.dtype) for piece in pieces])
        if flat.numel() != master.numel():
            raise ValueError(
                f"ZeRO-3 sub-group {sub_group}: the gradient's partitions hold {flat.numel()} entries, the master "
                f"{master.numel()}; pass grads in ParameterSpace's layout (param.ds_tensor's shape)."
            )
        masters.append(master)
        partitions.append(flat)
    return masters, partitions


def _stage3_updates(zero, moves: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    laid_out = {}
    for sub_group, params in enumerate(zero.fp16_groups):
        offset = 0
        for param in params:
            size = param.partition_numel()
            laid_out[id(param)] = moves[sub_group][offset : offset + size].view(param.ds_tensor.shape)
            offset += size
    return laid_out


def _clip_as_deepspeed(zero, gradients: list[torch.Tensor], space, *, whole: bool) -> None:
    """DeepSpeed's clipping (``unscale_and_clip_grads``) on the partitions, from the global norm of the gradient.

    Under ZeRO-1/2 every process's partition is a slice of one whole gradient whose norm it could take alone; the
    partitions' squares are summed over processes in both layouts, as DeepSpeed does."""
    clip_grad = float(getattr(zero, "clip_grad", 0.0) or 0.0)
    if clip_grad <= 0.0:
        return
    squares = torch.stack([g.double().square().sum() for g in gradients]).sum().reshape(1)
    if whole and space.world_size > 1:
        squares = space.sum_over_processes(squares)
    elif not whole:
        squares = space.sum_across(squares)
    clip = (math.sqrt(float(squares)) + 1e-6) / clip_grad
    if clip > 1.0:
        torch._foreach_mul_(gradients, 1.0 / clip)
