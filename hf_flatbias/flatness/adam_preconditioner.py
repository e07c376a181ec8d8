"""The Hessian as Adam sees it (``matrix="adam_preconditioned"``): ``P^-1/2 H P^-1/2``, ``P = diag(sqrt(v_hat) + eps)``.

Adam moves by ``-lr m_hat / P``, so near a point its linearised dynamics are those of gradient descent (with momentum)
on ``P^-1 H``; its stability threshold bounds the top eigenvalue of ``P^-1 H`` by ``(2 + 2 beta1) / ((1 - beta1) lr)``,
38/lr for beta1 = 0.9, where full-batch Adam settles (Cohen et al., arXiv 2207.14484, "adaptive edge of stability").
``P^-1 H = P^-1/2 (P^-1/2 H P^-1/2) P^1/2`` is similar to the symmetric ``P^-1/2 H P^-1/2``: the same eigenvalues,
and Lanczos needs a symmetric operator, so the Hessian product is wrapped between two diagonal scalings.

``v_hat = exp_avg_sq / (1 - beta2^t)`` per parameter with its own ``t`` (``state["step"]``), and ``eps`` the group's:
the denominator torch's Adam and AdamW divide by (as `hf_flatbias.sharpness.coming_update` reads it), weight decay
apart.
P is taken as the optimizer holds it, before the next gradient: the matrix of the step just taken.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..constants import ADAM_PRECONDITIONED

NO_OPTIMIZER_FIX = (
    "pass optimizer= a torch Adam or AdamW that has taken a step (HessianTraceCallback passes the Trainer's), "
    "or choose matrix='hessian'"
)


def _unwrapped(optimizer: object) -> object:
    # accelerate's AcceleratedOptimizer holds the torch optimizer (and its state) as `.optimizer`
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def why_optimizer_unreadable(optimizer: object) -> str | None:
    """Why ``optimizer`` (an instance, or the class given to a Trainer) cannot precondition, as a one-line error that
    names the fix; ``None`` when it can. Its state is checked by `inverse_sqrt_preconditioner`."""
    if optimizer is None:
        return f"matrix={ADAM_PRECONDITIONED!r} reads Adam's second moments from the optimizer; {NO_OPTIMIZER_FIX}."
    optimizer = _unwrapped(optimizer)
    kind = optimizer if isinstance(optimizer, type) else type(optimizer)
    if not issubclass(kind, (torch.optim.Adam, torch.optim.AdamW)):
        return (
            f"matrix={ADAM_PRECONDITIONED!r} reads Adam's second moments, which {kind.__name__} does not keep; train "
            "with torch's AdamW or Adam (optim='adamw_torch'), or choose matrix='hessian'."
        )
    groups = [] if isinstance(optimizer, type) else optimizer.param_groups
    if any(group.get("amsgrad") for group in groups):
        return (
            f"matrix={ADAM_PRECONDITIONED!r} preconditions by sqrt(v_hat) + eps, but amsgrad=True divides by the "
            "running maximum of v; set amsgrad=False or choose matrix='hessian'."
        )
    return None


def adam_denominator(exp_avg_sq: torch.Tensor, step: float, beta2: float, eps: float) -> torch.Tensor:
    """``sqrt(exp_avg_sq / (1 - beta2^step)) + eps`` in float64."""
    return exp_avg_sq.detach().double().div(1 - beta2**step).sqrt_().add_(eps)


def inverse_sqrt_preconditioner(
    optimizer: object, params: Sequence[torch.Tensor], names: Sequence[str], *, dtype: torch.dtype
) -> torch.Tensor:
    """``P^-1/2`` over ``params`` as one flat vector (in ``params``' order, the curvature operator's), on their device.

    Raises, before any pass:
        ValueError: `why_optimizer_unreadable`'s reasons, or a parameter the optimizer does not update or holds no
            state for yet (before its first step, or one frozen while the optimizer ran), naming the first.
    """
    why = why_optimizer_unreadable(optimizer)
    if why is not None:
        raise ValueError(why)
    optimizer = _unwrapped(optimizer)
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    outside = [name for name, p in zip(names, params, strict=True) if id(p) not in group_of]
    if outside:
        raise ValueError(
            f"matrix={ADAM_PRECONDITIONED!r}: {len(outside)} trainable parameters ({outside[0]} first) are not in the "
            "optimizer's param groups; pass the optimizer that trains them, or set requires_grad=False on them."
        )
    stateless = [name for name, p in zip(names, params, strict=True) if "exp_avg_sq" not in optimizer.state.get(p, {})]
    if stateless:
        raise ValueError(
            f"matrix={ADAM_PRECONDITIONED!r}: {len(stateless)} trainable parameters ({stateless[0]} first) have no "
            "Adam state yet; measure after the optimizer's first step, or set requires_grad=False on parameters "
            "it does not update."
        )
    pieces = []
    for p in params:
        state, group = optimizer.state[p], group_of[id(p)]
        denominator = adam_denominator(state["exp_avg_sq"], float(state["step"]), group["betas"][1], group["eps"])
        pieces.append(denominator.rsqrt_().reshape(-1))
    return torch.cat(pieces).to(dtype=dtype)


class PreconditionedOperator:
    """``v -> S A S v`` with ``S = diag(scale)``: with ``scale = P^-1/2`` and ``A`` the Hessian product, the
    product of ``P^-1/2 H P^-1/2``. Exposes what Lanczos reads of the operator it wraps."""

    def __init__(self, operator: Callable[[torch.Tensor], torch.Tensor], scale: torch.Tensor) -> None:
        self.operator = operator
        self.scale = scale
        self.dtype = operator.dtype
        self.device = operator.device
        self.dimension = operator.dimension
        # the scaling adds one rounding per entry on each side, far below the products' own
        self.rounding = operator.rounding

    @property
    def n_matvecs(self) -> int:
        return self.operator.n_matvecs

    def __call__(self, vector: torch.Tensor) -> torch.Tensor:
        return self.operator(vector * self.scale).mul_(self.scale)
