"""How a flatness step reaches parameters and gradients under the engines accelerate can hand us.

The first SAM gradient must bypass the engine: DDP and DeepSpeed hooks fire on ``.grad`` accumulation and
DeepSpeed's backward also steps the optimizer. Gradients are therefore taken with ``torch.autograd.grad`` on the
unwrapped module, and anything the engine would normally do for them (averaging over ranks) happens here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Parameters a flatness step may perturb: the trainable ones (LoRA adapters only under PEFT)."""
    return [p for p in model.parameters() if p.requires_grad]


def gradients_of(loss: torch.Tensor, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``d loss / d params`` without touching ``.grad`` or any hook; unused parameters get zeros.

    Zeros, not ``None``, so that every rank holds the same list of tensors for collective averaging.
    """
    grads = torch.autograd.grad(loss, list(params), allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]


def average_across_processes(tensors: list[torch.Tensor]) -> None:
    """In-place mean over all processes, flattened into one buffer so there is one collective per step."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1 or not tensors:
        return
    flat = _flatten_dense_tensors(tensors)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat.div_(dist.get_world_size())
    for tensor, averaged in zip(tensors, _unflatten_dense_tensors(flat, tensors), strict=True):
        tensor.copy_(averaged)
