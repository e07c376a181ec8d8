"""``sam_perturbation="per_rank"`` under FSDP2 (``fully_shard``): each rank perturbs the whole model along its own
first gradient, as under DDP.

Per rank means what it means under DDP: rank r's first gradient ``g_r`` is the gradient of its own micro-batches'
loss (no average over ranks), its perturbation is ``e_r = rho * g_r / ||g_r||`` with the norm over the whole of
``g_r`` (every parameter, not this rank's shard), and the second pass's gradient at ``w + e_r`` is averaged over ranks
as any FSDP gradient is.

FSDP2 stands in the way twice. Its backward reduce-scatters, so the sharded ``.grad`` only ever holds the rank
average; and every forward all-gathers each parameter from all ranks' shards, so perturbing the shards would mix the
ranks' perturbations. Both are avoided on the all-gathered ("unsharded") copies the forward actually runs on:

- the first gradient is ``torch.autograd.grad`` with respect to those copies, which FSDP neither reduces nor stores
  (its post-backward reduce-scatters ``.grad`` only, which stays empty);
- the second pass runs on copies overwritten with ``w + e_r`` right after every all-gather (forward, and backward's
  re-gather when the forward resharded), while the shards keep ``w``. The overwrite is a copy, not an addition, so a
  copy gathered once and used twice (the root's, a recomputed forward) is not perturbed twice. Collectives are the
  same on every rank whether or not its own gradient gave a direction.

Each rank holds two whole copies of the trainable parameters during the step (``w`` and ``w + e_r``, as a DDP rank
holds the model and its saved ``w``) instead of one shard: per-rank SAM needs a whole perturbation per rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..tensors import Perturbation, SquaredNormReducer, perturb_weights
from .engines import FullyShardedParameters, gradients_of


def _fsdp_params(model: nn.Module, params: Sequence[nn.Parameter]) -> list[tuple[object, object]]:
    """``(FSDPParamGroup, FSDPParam)`` of each sharded parameter in ``params``, in order.

    FSDP2 exposes no public map from a sharded parameter to its unsharded copy; its parameter groups are the one
    place that holds both (read from torch 2.13's ``_fully_shard``; checked by the 2-process tests).
    """
    from torch.distributed.fsdp import FSDPModule

    owner = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for fsdp_param in group.fsdp_params:
                    owner[id(fsdp_param.sharded_param)] = (group, fsdp_param)
    missing = [i for i, p in enumerate(params) if id(p) not in owner]
    if missing:
        raise ValueError(
            f"{len(missing)} perturbed parameters belong to no FSDP2 parameter group; prepare the model with "
            "accelerate (fsdp_version 2) before building the flatness step."
        )
    return [owner[id(p)] for p in params]


class PerRankFullyShardedParameters(FullyShardedParameters):
    """FSDP2 with ``sam_perturbation="per_rank"``: see the module's docstring."""

    def __init__(self, model: nn.Module, params: Sequence[nn.Parameter]):
        super().__init__(params)
        self._owners = _fsdp_params(model, self.params)

    @property
    def sq_norm_reducer(self) -> SquaredNormReducer | None:
        return None  # each rank normalises its own whole gradient

    def first_gradient(
        self,
        losses: torch.Tensor | Iterable[torch.Tensor],
        *,
        scaler: torch.amp.GradScaler | None = None,
        average_over_processes: bool = False,
    ) -> list[torch.Tensor]:
        """This rank's own first gradient, whole parameters, with respect to the unsharded copies its forward used."""
        if average_over_processes:
            raise ValueError(
                "PerRankFullyShardedParameters takes each rank's own gradient (sam_perturbation='per_rank')."
            )
        grads: list[torch.Tensor] | None = None
        for loss in [losses] if isinstance(losses, torch.Tensor) else losses:
            # The unsharded copies exist from the first all-gather on (this loss's forward) and are reused after it.
            unsharded = [fsdp_param.unsharded_param for _, fsdp_param in self._owners]
            loss_grads = gradients_of(scaler.scale(loss) if scaler is not None else loss, unsharded)
            if grads is None:
                grads = loss_grads
            else:
                torch._foreach_add_(grads, loss_grads)
        if grads is None:
            raise ValueError("first_gradient needs at least one loss.")
        if scaler is not None:
            torch._foreach_div_(grads, scaler.get_scale())
        return grads

    @torch.no_grad()
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
        """``w + e_r`` for the whole parameters, written into the unsharded copies at every all-gather until
        ``restore``; the shards are never edited."""
        # A collective: every rank gathers, whether or not its gradient gives a direction.
        weights = [param.full_tensor() for param in self.params]
        perturbation = perturb_weights(
            weights,
            full_gradients,
            rho,
            adaptive=adaptive,
            eta=eta,
            preconditioner=preconditioner,
            preconditioned_ball=preconditioned_ball,
        )
        if perturbation is None:
            return None
        return UnshardedCopiesPerturbation(
            weights,
            perturbation.saved_weights,
            grad_norm=perturbation.grad_norm,
            norm=perturbation.norm,
            owners=self._owners,
        )


@dataclass
class UnshardedCopiesPerturbation(Perturbation):
    """``params`` hold ``w + e`` and ``saved_weights`` ``w``, both whole; FSDP's unsharded copies get ``w + e`` after
    every all-gather while this perturbation is active (``restore`` ends it)."""

    owners: list[tuple[object, object]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._groups = {id(group): group for group, _ in self.owners}
        for group in self._groups.values():
            gather = group.wait_for_unshard  # FSDP calls it after every all-gather, in forward and in backward

            def wait_then_perturb(group=group, gather=gather) -> None:
                gather()
                self._write(group, self.params)

            group.wait_for_unshard = wait_then_perturb
            self._write(group, self.params)

    @torch.no_grad()
    def _write(self, group: object, values: list[torch.Tensor]) -> None:
        if not group.is_unsharded:
            return
        for (owner, fsdp_param), value in zip(self.owners, values, strict=True):
            if owner is group:
                copy = fsdp_param.unsharded_param
                # As FSDP's own all-gather copy-out: the copy is a leaf the autograd graph may have saved.
                with torch.autograd._unsafe_preserve_version_counter(copy):
                    copy.copy_(value)

    @torch.no_grad()
    def restore(self) -> None:
        for group in self._groups.values():
            vars(group).pop("wait_for_unshard", None)  # the class's method again (a second restore changes nothing)
            # A copy still gathered (a pass that failed half-way) gets w back, locally: resharding here would make
            # this rank skip an all-gather the others run.
            self._write(group, self.saved_weights)
