"""Tensor and parameter helpers that both the trace (`hf_flatbias.flatness`) and the flatness steps
(`hf_flatbias.sharpness`) build on: which parameters take part, squared norms, and the move to ``w + e`` and back.

SAM (Foret et al., 2021) steps with the gradient taken at ``w + e`` where ``e = rho * g / ||g||``.
ASAM (Kwon et al., 2021) measures the neighbourhood relative to the weights: with ``T = |w| + eta``,
``e = rho * T^2 g / ||T g||``. A preconditioned perturbation (Singh et al., ICML 2025) takes the step in the base
optimizer's geometry: ``e = rho * (g / P) / ||g / P||`` with ``P`` Adam's denominator ``sqrt(v_hat) + eps``.
The step lives here rather than in `sharpness` because the trace's SAM-sharpness estimate (`flatness.spectrum`)
must take the very step the trainer takes.

The functions take parallel lists of parameters and gradients so that callers decide which tensors take part
(trainable parameters only, a ZeRO shard, ...). ``sq_norm_reducer`` lets a caller whose parameters are sharded
across processes sum the squared norm over the shards before it is used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

SquaredNormReducer = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Perturbation:
    """The weights ``w`` saved while the parameters hold ``w + e``; ``restore`` puts ``w`` back bit for bit."""

    params: list[torch.Tensor]
    saved_weights: list[torch.Tensor]
    grad_norm: float
    norm: float

    @torch.no_grad()
    def restore(self) -> None:
        torch._foreach_copy_(self.params, self.saved_weights)


def squared_norm(tensors: Sequence[torch.Tensor | None], *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Sum of squared entries of all tensors, accumulated in ``dtype``.

    Args:
        tensors: the tensors; ``None`` entries (the unused parameters of ``torch.autograd.grad(...,
            allow_unused=True)``) count as zeros.
        dtype: the accumulation dtype. By default float32 or wider: half-precision squares overflow, and float64
            inputs stay float64 (which ``_foreach_norm`` cannot narrow). The trace estimators ask for float64.

    Returns:
        A 0-dim tensor of ``dtype`` on the tensors' device (a zero on the CPU when there are none).
    """
    present = [t for t in tensors if t is not None]
    if dtype is None:
        dtype = torch.float64 if any(t.dtype == torch.float64 for t in present) else torch.float32
    if not present:
        return torch.zeros((), dtype=dtype)
    return torch.stack(torch._foreach_norm(present, 2, dtype=dtype)).square().sum()


def asam_scale(param: torch.Tensor, eta: float) -> torch.Tensor:
    """ASAM's elementwise operator ``T_w = |w| + eta``."""
    return param.detach().abs().add_(eta)


def scaled_grad_norm(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    *,
    adaptive: bool = False,
    eta: float = 0.01,
    sq_norm_reducer: SquaredNormReducer | None = None,
) -> torch.Tensor:
    """``||g||`` for SAM or ``||T_w g||`` for ASAM, reduced over shards when ``sq_norm_reducer`` is given."""
    if adaptive:
        sq = sum(
            (squared_norm([asam_scale(p, eta).mul_(g)]) for p, g in zip(params, grads, strict=True)),
            torch.zeros(()),
        )
    else:
        sq = squared_norm(grads)
    if sq_norm_reducer is not None:
        sq = sq_norm_reducer(sq)
    return sq.sqrt()


@torch.no_grad()
def perturb_weights(
    params: Sequence[torch.Tensor],
    grads: list[torch.Tensor],
    rho: float,
    *,
    adaptive: bool = False,
    eta: float = 0.01,
    sq_norm_reducer: SquaredNormReducer | None = None,
    preconditioner: Sequence[torch.Tensor] | None = None,
    preconditioned_ball: bool = False,
) -> Perturbation | None:
    """Move ``params`` in place to ``w + e`` and return what is needed to restore them.

    ``grads`` is consumed: its buffers are reused to hold the saved weights, so the whole step needs at most one
    extra copy of the parameters. Returns ``None``, leaving the parameters untouched, when the gradient norm is zero
    or not finite (an fp16 overflow, a diverged batch): a perturbation along such a direction is meaningless.
    ``preconditioner`` (one positive tensor per parameter, e.g. `adam_preconditioner`) divides the gradient before
    it is normalised; ``grad_norm`` then reports ``||g / P||``. It excludes ``adaptive``. ``preconditioned_ball``
    takes the ball in ``P``'s norm instead, ``e^T P e <= rho^2``: the same direction ``g / P``, normalised by
    ``sqrt(g^T P^-1 g)`` (then ``grad_norm``), so that ``||e||_P = rho``.
    """
    params = list(params)
    if preconditioned_ball and preconditioner is None:
        raise ValueError("perturb_weights: preconditioned_ball needs a preconditioner.")
    if preconditioner is not None:
        if adaptive:
            raise ValueError("perturb_weights takes either adaptive=True or a preconditioner, not both.")
        torch._foreach_div_(grads, list(preconditioner))
    if preconditioned_ball:
        # ||g / P||_P^2 = sum (g / P)^2 * P
        weighted = [grad * scale.sqrt() for grad, scale in zip(grads, preconditioner, strict=True)]
        norm = scaled_grad_norm(params, weighted, sq_norm_reducer=sq_norm_reducer)
        del weighted
    else:
        norm = scaled_grad_norm(params, grads, adaptive=adaptive, eta=eta, sq_norm_reducer=sq_norm_reducer)
    norm_value = float(norm)
    if not torch.isfinite(norm) or norm_value == 0.0:
        return None
    scale = rho / norm_value
    perturbation_sq = torch.zeros(())
    for param, grad in zip(params, grads, strict=True):
        step = grad.mul(scale)
        if adaptive:
            step.mul_(asam_scale(param, eta).square_())
        perturbation_sq += squared_norm([step])
        grad.copy_(param)
        param.add_(step)
    if sq_norm_reducer is not None:
        perturbation_sq = sq_norm_reducer(perturbation_sq)
    return Perturbation(params, grads, grad_norm=norm_value, norm=float(perturbation_sq.sqrt()))


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters a flatness step perturbs and the trace is taken over: those with ``requires_grad=True`` (the
    adapters only under PEFT). Empty for a frozen model; a caller that needs some raises its own error."""
    return [p for p in model.parameters() if p.requires_grad]


def is_fully_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 (``fully_shard``) shards the model or one of its submodules."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(module, FSDPModule) for module in model.modules())
