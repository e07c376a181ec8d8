"""The optimizer's coming update, read from its state, as Momentum-SAM perturbs along it (Becker, Altrock, Risse,
arXiv 2401.12033).

Momentum-SAM takes the gradient at ``w + e`` with ``e = -rho * d / ||d||``, where the optimizer's next update is
``w <- w - lr * d`` as far as its state already says: no extra gradient is computed, ``e`` points where the optimizer
is about to move. ``d`` per parameter, from the state the optimizer holds *before* the coming gradient:

* torch's ``AdamW`` and ``Adam`` (``amsgrad=False``): ``d = m_hat / (sqrt(v_hat) + eps)`` with
  ``m_hat = exp_avg / (1 - beta1^t)``, ``v_hat = exp_avg_sq / (1 - beta2^t)`` and ``t`` the parameter's own ``step``:
  the elementwise form of torch's update (``denom = sqrt(exp_avg_sq) / sqrt(1 - beta2^t) + eps``), weight decay left
  out (decay does not depend on the data);
* torch's ``SGD`` with ``momentum > 0``: ``d = momentum_buffer`` (the update is ``w <- w - lr * buf`` without Nesterov;
  with Nesterov the buffer is still the part of the update the state knows).

A parameter without state yet (no gradient so far) contributes ``d = 0``; ``||d||`` is taken over every parameter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..tensors import squared_norm

METHOD = "momentum_sam"


def _unwrapped(optimizer: object) -> object:
    # accelerate's AcceleratedOptimizer holds the torch optimizer (and its state) as `.optimizer`
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def why_coming_update_unreadable(optimizer: object) -> str | None:
    """Why `coming_update_direction` cannot read ``optimizer`` (an instance, or a class given to the Trainer), as a
    one-line error that names the fix; ``None`` when it can."""
    optimizer = _unwrapped(optimizer)
    kind = optimizer if isinstance(optimizer, type) else type(optimizer)
    groups = [] if isinstance(optimizer, type) else list(getattr(optimizer, "param_groups", []))
    fix = "use optim='adamw_torch' (or torch.optim.AdamW/Adam), or optim='sgd' with optim_args='momentum=0.9'"
    if issubclass(kind, (torch.optim.Adam, torch.optim.AdamW)):
        if any(group.get("amsgrad") for group in groups):
            return (
                f"flatness_method={METHOD!r} reads Adam's update m_hat / (sqrt(v_hat) + eps), but amsgrad=True "
                "divides by the running maximum of v; set amsgrad=False."
            )
        if any(group.get("maximize") for group in groups):
            return f"flatness_method={METHOD!r} assumes the optimizer minimises; set maximize=False."
        return None
    if issubclass(kind, torch.optim.SGD):
        if any(not group.get("momentum") for group in groups):
            return (
                f"flatness_method={METHOD!r} perturbs along SGD's momentum buffer, but momentum=0 keeps none; "
                "set optim_args='momentum=0.9' (or SGD(momentum=0.9)), or use optim='adamw_torch'."
            )
        if any(group.get("maximize") for group in groups):
            return f"flatness_method={METHOD!r} assumes the optimizer minimises; set maximize=False."
        return None
    return (
        f"flatness_method={METHOD!r} reads the coming update from the optimizer's state, which it can for torch's "
        f"AdamW, Adam and SGD with momentum, not {kind.__name__}; {fix}."
    )


@torch.no_grad()
def coming_update_direction(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]
) -> list[torch.Tensor | None]:
    """``d`` of each of ``params`` (the module docstring's form), new tensors, ``None`` where the optimizer holds no
    state yet.

    Raises:
        ValueError: when ``optimizer`` is not one `why_coming_update_unreadable` accepts.
    """
    optimizer = _unwrapped(optimizer)
    why = why_coming_update_unreadable(optimizer)
    if why is not None:
        raise ValueError(why)
    states = [optimizer.state.get(param) or {} for param in params]
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return [None if state.get("momentum_buffer") is None else state["momentum_buffer"].clone() for state in states]
    with_state = [i for i, state in enumerate(states) if "exp_avg" in state]
    if not with_state:
        return [None] * len(params)
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    first_moments, second_moments, first_corrections, second_corrections, epsilons = [], [], [], [], []
    for i in with_state:
        state, group = states[i], group_of[id(params[i])]
        beta1, beta2 = group["betas"]
        step = float(state["step"])  # a parameter's own count: it skipped the updates where it had no gradient
        first_moments.append(state["exp_avg"])
        second_moments.append(state["exp_avg_sq"])
        first_corrections.append(1 - beta1**step)
        second_corrections.append(math.sqrt(1 - beta2**step))
        epsilons.append(group["eps"])
    # one pass per operation over all parameters (torch's foreach kernels), as torch's AdamW takes its own step
    denominators = torch._foreach_sqrt(second_moments)
    torch._foreach_div_(denominators, second_corrections)
    torch._foreach_add_(denominators, epsilons)
    present = torch._foreach_div(first_moments, denominators)
    torch._foreach_div_(present, first_corrections)
    directions: list[torch.Tensor | None] = [None] * len(params)
    for i, direction in zip(with_state, present, strict=True):
        directions[i] = direction
    return directions


def momentum_sam_offsets(directions: Sequence[torch.Tensor | None], rho: float) -> list[torch.Tensor | None] | None:
    """``e = -rho * d / ||d||`` (in place in ``directions``), ``||d||`` over every direction; ``None`` when there is
    no direction to follow (no state yet, or ``||d||`` zero or not finite)."""
    present = [d for d in directions if d is not None]
    if not present:
        return None
    norm = float(squared_norm(present).sqrt())
    if not math.isfinite(norm) or norm == 0.0:
        return None
    torch._foreach_mul_(present, -rho / norm)
    return list(directions)
