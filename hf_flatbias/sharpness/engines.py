"""How a flatness step reaches parameters and gradients under the engines accelerate can hand us.

The first SAM gradient must bypass the engine: DDP and DeepSpeed hooks fire on ``.grad`` accumulation and
DeepSpeed's backward also steps the optimizer. Gradients are therefore taken with ``torch.autograd.grad`` on the
unwrapped module, and anything the engine would normally do for them (averaging over ranks) happens here.

FSDP2 (``fully_shard``) is the exception: its forward runs on all-gathered copies that ``torch.autograd.grad``
cannot reach from the sharded parameters, so there the first gradient comes through FSDP's own backward (see
`FullyShardedParameters`); ``sam_perturbation="per_rank"`` works on FSDP's all-gathered copies instead
(`hf_flatbias.sharpness.fsdp_per_rank`); `hf_flatbias.sharpness.layouts` picks the layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..tensors import Perturbation, SquaredNormReducer, perturb_weights


def gradients_of(loss: torch.Tensor, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``d loss / d params`` without touching ``.grad`` or any hook; unused parameters get zeros.

    Zeros, not ``None``, so that every rank holds the same list of tensors for collective averaging.
    """
    grads = torch.autograd.grad(loss, list(params), allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]


def first_gradient(
    losses: torch.Tensor | Iterable[torch.Tensor],
    params: Sequence[torch.Tensor],
    *,
    scaler: torch.amp.GradScaler | None = None,
    average_over_processes: bool = False,
) -> list[torch.Tensor]:
    """``d sum(losses) / d params`` off the engine's hooks, unscaled, optionally averaged over processes.

    Args:
        losses: one loss, or an iterable of them (a generator keeps one micro-batch graph alive at a time).
        params: the tensors to differentiate against (`perturbable_parameters(...).params`).
        scaler: the fp16 gradient scaler, if any. Each loss is multiplied by its scale so that small gradients do
            not underflow, and the sum is unscaled on our own copy: the optimizer's scaler never sees these
            gradients, so nothing is unscaled twice.
        average_over_processes: average the result over all processes (``sam_perturbation="global"``).

    Returns:
        One gradient per parameter (zeros for a parameter the losses do not reach).
    """
    grads: list[torch.Tensor] | None = None
    for loss in [losses] if isinstance(losses, torch.Tensor) else losses:
        loss_grads = gradients_of(scaler.scale(loss) if scaler is not None else loss, params)
        if grads is None:
            grads = loss_grads
        else:
            torch._foreach_add_(grads, loss_grads)
    if grads is None:
        raise ValueError("first_gradient needs at least one loss.")
    if scaler is not None:
        torch._foreach_div_(grads, scaler.get_scale())
    if average_over_processes:
        average_across_processes(grads)
    return grads


def average_across_processes(tensors: list[torch.Tensor]) -> None:
    """In-place mean over all processes, flattened into one buffer so there is one collective per step."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1 or not tensors:
        return
    flat = _flatten_dense_tensors(tensors)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat.div_(dist.get_world_size())
    for tensor, averaged in zip(tensors, _unflatten_dense_tensors(flat, tensors), strict=True):
        tensor.copy_(averaged)


def deepspeed_zero_stage(engine: object | None) -> int | None:
    """The ZeRO stage of a DeepSpeed engine (0 when ZeRO is off), or ``None`` when ``engine`` is not one."""
    stage_of = getattr(engine, "zero_optimization_stage", None)
    return int(stage_of()) if callable(stage_of) else None


def _sum_over_group(group: dist.ProcessGroup | None) -> SquaredNormReducer:
    def reduce(value: torch.Tensor) -> torch.Tensor:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
        return value

    return reduce


class PerturbableParameters:
    """The tensors a flatness step moves to ``w + e``, in the layout the engine keeps them.

    With plain PyTorch, DDP and DeepSpeed ZeRO 0-2 every rank holds whole parameters and the module's own
    tensors are edited: ZeRO 1/2 keep separate fp32 master partitions in the optimizer, which a flatness step never
    touches, so the optimizer steps from the restored ``w`` whatever happens to the module's copy. ZeRO-3 overrides
    this to edit each rank's partition instead (see `ZeroStage3Parameters`).
    """

    #: Whether the engine keeps gathered copies of the edited tensors that must be dropped around every edit.
    has_gathered_copies: bool = False

    def __init__(self, params: Sequence[torch.nn.Parameter]):
        self.params = list(params)

    @property
    def tensors(self) -> list[torch.Tensor]:
        """What ``perturb_weights`` edits, one tensor per parameter."""
        return self.params

    @property
    def sq_norm_reducer(self) -> SquaredNormReducer | None:
        """How a squared norm over ``tensors`` becomes the squared norm over the whole model."""
        return None

    @property
    def differentiable_tensors(self) -> list[torch.Tensor]:
        """``tensors`` as a loss term may use them, so that its gradient reaches the parameters (`linear_term`)."""
        return self.params

    def first_gradient(
        self,
        losses: torch.Tensor | Iterable[torch.Tensor],
        *,
        scaler: torch.amp.GradScaler | None = None,
        average_over_processes: bool = False,
    ) -> list[torch.Tensor]:
        """``d sum(losses) / d params`` (see `first_gradient`), off the engine's hooks and ``.grad``."""
        return first_gradient(losses, self.params, scaler=scaler, average_over_processes=average_over_processes)

    def local_gradients(self, full_gradients: list[torch.Tensor]) -> list[torch.Tensor]:
        """Gradients of the whole parameters, cut to the layout of ``tensors`` (may reuse the buffers)."""
        return full_gradients

    def release_gathered(self) -> None:
        """Drop any gathered copy that would hide an edit of ``tensors`` from the next forward."""

    def perturb(
        self,
        full_gradients: list[torch.Tensor],
        rho: float,
        *,
        adaptive: bool = False,
        eta: float = 0.01,
        preconditioner: list[torch.Tensor] | None = None,
        preconditioned_ball: bool = False,
    ) -> Perturbation | None:
        """Move the parameters to ``w + e`` along ``full_gradients``; see `perturb_weights` (``preconditioner`` is
        per whole parameter, so only for engines that keep whole parameters)."""
        if preconditioner is not None and self.has_gathered_copies:
            raise ValueError("A preconditioned perturbation needs whole parameters; ZeRO-3 keeps partitions.")
        self.release_gathered()
        perturbation = perturb_weights(
            self.tensors,
            self.local_gradients(full_gradients),
            rho,
            adaptive=adaptive,
            eta=eta,
            sq_norm_reducer=self.sq_norm_reducer,
            preconditioner=preconditioner,
            preconditioned_ball=preconditioned_ball,
        )
        if perturbation is None or not self.has_gathered_copies:
            return perturbation
        return _ReleasingPerturbation(
            perturbation.params,
            perturbation.saved_weights,
            grad_norm=perturbation.grad_norm,
            norm=perturbation.norm,
            release_gathered=self.release_gathered,
        )


class ZeroStage3Parameters(PerturbableParameters):
    """ZeRO-3: each rank edits its own partition ``param.ds_tensor`` of every parameter.

    The module's parameters are empty between forwards and are gathered from the partitions on use, so an edit of
    the partitions reaches the next forward once every gathered copy is dropped; that includes the small parameters
    ZeRO-3 keeps gathered ("persistent") across forwards. The squared norm is summed over the partition group.
    """

    has_gathered_copies = True

    def __init__(self, params: Sequence[torch.nn.Parameter], optimizer: object, *, rank: int | None = None):
        """``optimizer`` is the engine's ZeRO-3 optimizer; ``rank`` this process's index in the partition group."""
        super().__init__(params)
        missing = [i for i, p in enumerate(self.params) if getattr(p, "ds_tensor", None) is None]
        if missing:
            raise ValueError(
                f"{len(missing)} trainable parameters are not partitioned by ZeRO-3 (no ds_tensor); pass the "
                "model through deepspeed.initialize (or the Trainer) before building a ZeRO-3 flatness step."
            )
        self._optimizer = optimizer
        self._group = getattr(self.params[0], "ds_process_group", None) if self.params else None
        if rank is None:
            rank = dist.get_rank(group=self._group) if dist.is_available() and dist.is_initialized() else 0
        self.rank = rank

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [p.ds_tensor for p in self.params]

    @property
    def sq_norm_reducer(self) -> SquaredNormReducer | None:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group=self._group) == 1:
            return None
        return _sum_over_group(self._group)

    def local_gradients(self, full_gradients: list[torch.Tensor]) -> list[torch.Tensor]:
        shards = []
        for param, grad in zip(self.params, full_gradients, strict=True):
            partition = param.ds_tensor
            size = partition.numel()
            flat = grad.reshape(-1)
            start = min(self.rank * size, flat.numel())
            stop = min(start + size, flat.numel())
            # Padding at the end of the last partition gets a zero gradient: it takes no part in norms or steps.
            shard = torch.zeros(size, dtype=partition.dtype, device=partition.device)
            shard[: stop - start].copy_(flat[start:stop])
            shards.append(shard.view_as(partition))
        return shards

    def release_gathered(self) -> None:
        # The optimizer's method, not the engine's: the engine's also runs gc.collect() on every call (5x slower
        # steps on a small model).
        self._optimizer.empty_partition_cache()


class FullyShardedParameters(PerturbableParameters):
    """FSDP2 (``fully_shard``): each rank edits its local shard of every parameter, ``param.to_local()``.

    The forward all-gathers the shards into unsharded copies and frees them again, so an edit of the shards reaches
    the next forward, and ``torch.autograd.grad`` against the sharded parameters finds them unused. The first
    gradient therefore takes FSDP's own backward, which reduce-scatters the gradient, averaged over ranks, into each
    parameter's sharded ``.grad``: exactly the global first gradient, in the layout of the shards. The gradient the
    update has accumulated so far is moved aside for that backward and put back after it, untouched; the new shards
    become the buffers `perturb_weights` keeps ``w`` in, so the step holds one extra copy of this rank's shard, not
    of the model. The squared norm is summed over ranks.

    Every backward of a flatness step must reduce-scatter (see `sync_gradients_every_backward`): FSDP keeps the
    gradient of a backward that does not in its unsharded buffers, where the first gradient would add to it.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter]):
        from torch.distributed.tensor import DTensor

        super().__init__(params)
        unsharded = [i for i, p in enumerate(self.params) if not isinstance(p, DTensor)]
        if unsharded:
            raise ValueError(
                f"{len(unsharded)} trainable parameters are not sharded by FSDP2 (not DTensors): pass the model "
                "through accelerate's prepare (or the Trainer) with fsdp_version 2 before building a flatness step."
            )

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [p.to_local() for p in self.params]

    @property
    def differentiable_tensors(self) -> list[torch.Tensor]:
        # to_local() is differentiable: the term's gradient lands in this rank's shard of the sharded .grad, which
        # is what an average over ranks of the same term gives.
        return [p.to_local() for p in self.params]

    @property
    def sq_norm_reducer(self) -> SquaredNormReducer | None:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        return _sum_over_group(None)

    def first_gradient(
        self,
        losses: torch.Tensor | Iterable[torch.Tensor],
        *,
        scaler: torch.amp.GradScaler | None = None,
        average_over_processes: bool = True,
    ) -> list[torch.Tensor]:
        """The rank-averaged first gradient, one local shard per parameter, through FSDP's backward.

        ``average_over_processes=False`` is `PerRankFullyShardedParameters`'s: FSDP's reduce-scatter always averages.
        """
        if not average_over_processes:
            raise ValueError(
                "FullyShardedParameters' first gradient is the average over ranks (reduce-scatter); build the "
                "parameters with perturbable_parameters(..., per_rank=True) for sam_perturbation='per_rank'."
            )
        accumulated = [p.grad for p in self.params]
        for param in self.params:
            param.grad = None
        try:
            n_losses = 0
            for loss in [losses] if isinstance(losses, torch.Tensor) else losses:
                (scaler.scale(loss) if scaler is not None else loss).backward()
                n_losses += 1
            if n_losses == 0:
                raise ValueError("first_gradient needs at least one loss.")
            grads = [torch.zeros_like(p.to_local()) if p.grad is None else p.grad.to_local() for p in self.params]
        finally:
            for param, grad in zip(self.params, accumulated, strict=True):
                param.grad = grad
        if scaler is not None:
            torch._foreach_div_(grads, scaler.get_scale())
        return grads


def sync_gradients_every_backward(model: torch.nn.Module) -> None:
    """Make FSDP2 reduce-scatter on the next backward even inside accelerate's ``no_sync`` (accumulation).

    A flatness step takes the first gradient by a backward of its own; were the update's earlier gradients kept
    unsharded (what ``no_sync`` does), that backward would add to them. Reduce-scattering every micro-batch keeps
    the update's gradient in the sharded ``.grad``, summed over micro-batches as before, at the cost of one
    reduce-scatter per micro-batch instead of one per update. accelerate turns the sync back on after the step.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(True, recurse=False)


@dataclass
class _ReleasingPerturbation(Perturbation):
    release_gathered: Callable[[], None] = lambda: None

    @torch.no_grad()
    def restore(self) -> None:
        self.release_gathered()
        super().restore()


def deepspeed_backward(engine: object, loss: torch.Tensor, *, is_boundary: bool) -> None:
    """Backward through a DeepSpeed engine without its optimizer step.

    accelerate's DeepSpeed backward also steps on the last micro-batch, which under SAM would happen at ``w + e``.
    The loss is already divided by the accumulation steps (the Trainer does it), hence ``scale_wrt_gas=False``.
    Call ``engine.step()`` yourself on the boundary, after restoring ``w``.
    """
    engine.set_gradient_accumulation_boundary(is_boundary=is_boundary)
    engine.backward(loss, scale_wrt_gas=False)
