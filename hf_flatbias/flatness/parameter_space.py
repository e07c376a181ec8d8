"""The trainable parameters as this process holds them, for measurements that move the weights and take gradients
without gathering the model: its local pieces (whole parameters, or FSDP2's and ZeRO-3's shards), vectors over those
pieces, and the gradient of a loss split over processes, reduced into the same pieces.

Under FSDP2 and ZeRO-3 a vector over the parameters lives in the shard space: each process holds its shard of every
parameter's entries, dot products and norms are partial sums added over processes (`ParameterSpace.sum_across`), and
a move of the weights along a vector edits the local shards only (the engine's next forward gathers them). Under DDP
and ZeRO 0-2 every process holds whole parameters and whole vectors. In every layout the contexts are split over the
processes, each process's loss is its share of the mean over all contexts, and the gradient comes from the engine's
own first-gradient path (`hf_flatbias.sharpness.engines`), summed over processes; under ZeRO-3 each parameter's
gradient is reduce-scattered into this process's partition as the backward forms it
(`zero3_partitioned_gradient`), so no process holds a whole gradient.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from ..sharpness.engines import (
    FullyShardedParameters,
    PerturbableParameters,
    ZeroStage3Parameters,
)
from ..tensors import is_fully_sharded
from .distributed import is_zero3_partitioned, world
from .lm import measured_parameters


@dataclass
class ParameterSpace:
    """Vectors and gradients over a model's trainable parameters in the layout this process holds them.

    Attributes:
        model: the module whose forward the engine hooks.
        params: the trainable parameters (the module's own tensors, sharded or not).
        layout: the engine's view of them (`PerturbableParameters`): what to edit, how to take a gradient.
        shapes: each parameter's whole shape.
        sharded: whether each process holds a shard of every parameter (FSDP2, ZeRO-3).
        rank, world_size: of the default process group.
    """

    model: nn.Module
    params: list[nn.Parameter]
    layout: PerturbableParameters
    shapes: list[torch.Size]
    sharded: bool
    rank: int
    world_size: int

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The local pieces a move of the weights edits, one per parameter."""
        return self.layout.tensors

    @property
    def dimension(self) -> int:
        """The number of trainable parameters (of the whole model, summed over shards)."""
        return sum(math.prod(shape) for shape in self.shapes)

    @property
    def local_dimension(self) -> int:
        return sum(t.numel() for t in self.tensors)

    @property
    def lockstep(self) -> bool:
        """Whether every process must run the same passes: each forward gathers (FSDP2, ZeRO-3), or each gradient is
        reduced over processes."""
        return self.world_size > 1

    def sum_across(self, partial: torch.Tensor) -> torch.Tensor:
        """Partial sums over this process's entries added over processes (a copy; the input is left alone)."""
        if not self.sharded or self.world_size == 1:
            return partial
        total = partial.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total

    def sum_over_processes(self, value: torch.Tensor) -> torch.Tensor:
        """A per-process partial (a loss over this process's share of the contexts) summed over processes."""
        if self.world_size == 1:
            return value
        total = value.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total

    def as_parameter_gradients(self, pieces: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """This process's pieces as ``.grad`` values of the parameters (FSDP2: sharded DTensors like the parameters),
        for an optimizer to step on. Not for ZeRO-3, whose optimizer is DeepSpeed's."""
        if not self.sharded:
            return [piece.clone() for piece in pieces]
        if isinstance(self.layout, ZeroStage3Parameters):
            raise ValueError("ZeRO-3's optimizer is DeepSpeed's: its update cannot be proposed from .grad.")
        from torch.distributed.tensor import DTensor

        return [
            DTensor.from_local(piece.clone(), p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            for piece, p in zip(pieces, self.params, strict=True)
        ]

    def local_pieces(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Tensors laid out as the parameters (FSDP2's DTensors) as this process's pieces."""
        return [t.to_local() if hasattr(t, "to_local") else t for t in tensors]

    def flatten(self, pieces: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([piece.reshape(-1).to(dtype) for piece in pieces])

    def unflatten(self, vector: torch.Tensor) -> list[torch.Tensor]:
        """A flat local vector as one piece per local tensor, each in its tensor's shape and dtype."""
        pieces, offset = [], 0
        for tensor in self.tensors:
            pieces.append(vector[offset : offset + tensor.numel()].reshape(tensor.shape).to(tensor.dtype))
            offset += tensor.numel()
        return pieces

    def local_piece(self, index: int, whole: torch.Tensor) -> torch.Tensor:
        """This process's entries of a tensor the shape of parameter ``index`` (its slice of the flattened entries,
        with ZeRO-3's padding as zeros), flat."""
        flat = whole.reshape(-1)
        tensor = self.tensors[index]
        if not self.sharded:
            return flat
        if isinstance(self.layout, ZeroStage3Parameters):
            size = tensor.numel()
            start = min(self.layout.rank * size, flat.numel())
            piece = torch.zeros(size, dtype=flat.dtype, device=flat.device)
            piece[: min(size, flat.numel() - start)] = flat[start : start + size]
            return piece
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        param = self.params[index]
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        row = math.prod(param.shape[1:])
        return flat[offset[0] * row : offset[0] * row + math.prod(shape)]

    def random_vector(self, seed: int, dtype: torch.dtype) -> torch.Tensor:
        """A standard Gaussian vector over the whole parameters, drawn parameter by parameter from one generator (so
        any layout holds its slice of the same vector), and this process's entries of it."""
        generator = torch.Generator().manual_seed(seed)
        device = self.tensors[0].device
        pieces = []
        for index, shape in enumerate(self.shapes):
            whole = torch.randn(math.prod(shape), generator=generator, dtype=torch.float64)
            pieces.append(self.local_piece(index, whole).to(device=device, dtype=dtype))
        return torch.cat(pieces)

    def gradient(self, losses: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """``d sum(losses) / d params`` summed over processes, as this process's pieces (`tensors`' layout).

        Each process passes its own losses; with the contexts split over processes, each loss the process's share
        of the mean over all contexts, the result is the gradient of that mean. ``.grad`` is left as it was.
        """
        if isinstance(self.layout, ZeroStage3Parameters):
            return zero3_partitioned_gradient(losses, self.params)
        several = self.world_size > 1
        grads = self.layout.first_gradient(losses, average_over_processes=several or self.sharded)
        grads = self.layout.local_gradients(grads)
        if several:
            torch._foreach_mul_(grads, float(self.world_size))  # the engines average over processes; we want the sum
        return grads

    def release_gathered(self) -> None:
        """Drop gathered copies an edit of the local pieces would not reach: ZeRO-3's persistent parameters, and
        FSDP2's root, which stays unsharded after a forward without a backward (a line search's, a Fisher
        product's), so that the next forward would run on the weights before the edit."""
        if isinstance(self.layout, FullyShardedParameters):
            _reshard(self.model)
        self.layout.release_gathered()


def parameter_space(model: nn.Module, optimizer: object | None = None) -> ParameterSpace:
    """The `ParameterSpace` of ``model``'s trainable parameters in the layout of the engine that holds it.

    FSDP2 is recognised from the module. ZeRO-3 from its partitioned parameters; its gathered copies are released
    through the engine's optimizer (``optimizer``: DeepSpeed's, or the Trainer's wrapper of it), which is then
    required. Anything else holds whole parameters (one process, DDP, ZeRO 0-2).
    """
    fully_sharded = is_fully_sharded(model)
    if fully_sharded:
        _reshard(model)  # the parameters are the shards (DTensors) again
    params = measured_parameters(model)
    rank, world_size = world()
    if fully_sharded:
        layout: PerturbableParameters = FullyShardedParameters(params)
        shapes = [p.shape for p in params]
        sharded = True
    elif is_zero3_partitioned(model):
        zero_optimizer = _zero3_optimizer(optimizer)
        layout = ZeroStage3Parameters(params, zero_optimizer)
        shapes = [p.ds_shape for p in params]
        sharded = True
    else:
        layout = PerturbableParameters(params)
        shapes = [p.shape for p in params]
        sharded = False
    return ParameterSpace(
        model=model,
        params=params,
        layout=layout,
        shapes=list(shapes),
        sharded=sharded,
        rank=rank,
        world_size=world_size,
    )


def zero3_partitioned_gradient(losses: Iterable[torch.Tensor], params: Sequence[nn.Parameter]) -> list[torch.Tensor]:
    """``d sum(losses) / d params`` summed over ZeRO-3's partition group, as this process's partitions (the layout of
    ``param.ds_tensor``, the padding zero).

    The engine's own gradient path would reduce into its optimizer's buffers, and ``torch.autograd.grad`` alone hands
    back every parameter's whole gradient at once. Here a hook takes each parameter's gradient as the backward forms
    it (while ZeRO-3 holds the module gathered), reduce-scatters it into the partitions at once and gives autograd a
    stride-0 zero: a process holds its partitions, and one parameter's gradient (twice, padded for the collective)
    at a time. Every process runs the same backward, so the hooks, and their collectives, fire in the same order on
    every rank. The cost is one collective per parameter per loss, where a whole gradient took one per product.
    """
    group = getattr(params[0], "ds_process_group", None) if params else None
    world_size = dist.get_world_size(group=group) if dist.is_available() and dist.is_initialized() else 1
    partitions = [torch.zeros_like(p.ds_tensor).reshape(-1) for p in params]

    def reduce_into(index: int, grad: torch.Tensor) -> torch.Tensor:
        partition = partitions[index]
        flat = grad.reshape(-1)
        if world_size == 1:
            partition[: flat.numel()].add_(flat)
        else:
            padding = partition.numel() * world_size - flat.numel()
            whole = torch.cat([flat, flat.new_zeros(padding)]) if padding else flat.contiguous()
            piece = torch.empty_like(partition)
            dist.reduce_scatter_tensor(piece, whole, op=dist.ReduceOp.SUM, group=group)
            partition.add_(piece)
        return grad.new_zeros(()).expand_as(grad)

    handles = [p.register_hook(partial(reduce_into, i)) for i, p in enumerate(params) if p.requires_grad]
    try:
        for loss in losses:
            torch.autograd.grad(loss, list(params), allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    return [partition.view_as(p.ds_tensor) for partition, p in zip(partitions, params, strict=True)]


def _reshard(model: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()  # local: frees the gathered copy, no collective


def _zero3_optimizer(optimizer: object | None) -> object:
    for candidate in (optimizer, getattr(optimizer, "optimizer", None)):
        if candidate is not None and hasattr(candidate, "empty_partition_cache"):
            return candidate
    raise ValueError(
        "The model is partitioned by DeepSpeed ZeRO-3: pass optimizer= the engine's optimizer (trainer.optimizer or "
        "engine.optimizer), through which its gathered parameters are released after each move of the weights."
    )
