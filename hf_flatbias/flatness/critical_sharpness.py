"""Critical sharpness: the curvature along the optimizer's actual next update, from forward passes only.

The measure is Kalra et al.'s (arXiv 2601.16979): ``lambda_c = 2 / eta_c`` with ``eta_c`` the smallest step size
along the update the optimizer is about to apply at which the loss rises above its current value. A line search of
about a dozen forward passes finds ``eta_c``; no backward pass, no Hessian-vector product.

Two functions, neither of which knows about the Trainer:

- `proposed_update`: the update a torch optimizer WOULD apply now (``w_next - w`` per parameter), leaving the
  parameters, the optimizer's state and ``.grad`` exactly as they were.
- `estimate_critical_sharpness`: the line search along that update; a `CriticalSharpness` comes back.

Definition (what is normalised)
-------------------------------
Let ``u`` be the update (one tensor per parameter) computed at learning rate ``lr`` (the learning rate the optimizer
used to compute it; `proposed_update` reads it from the optimizer). The search direction is the update per unit of
learning rate, ``d = u / lr`` -- NOT a unit vector -- and the loss is evaluated at ``w + eta d``. So ``eta`` is on the
optimizer's own step-size scale: ``eta = lr`` is exactly the step the optimizer would take, and ``eta_c`` is the
*critical learning rate*, the learning rate above which this step (with the same gradient, moments and state)
would raise the loss. ``eta_c / lr`` (`CriticalSharpness.step_ratio`) says how far the current step is from it.

Quadratic case. For ``L(w) = 1/2 w^T H w - b^T w`` with gradient ``g``,
``L(w + eta d) - L(w) = eta g^T d + eta^2 / 2 d^T H d``, which is back to zero at ``eta = -2 g^T d / d^T H d``, so
``lambda_c = d^T H d / (-g^T d)``. For plain gradient descent (``u = -lr g``, ``d = -g``) this is
``g^T H g / g^T g``, the Rayleigh quotient of the gradient: ``lambda_c <= lambda_max``, with equality when ``g`` is
the top eigenvector, and ``eta_c = 2 / lambda_c`` is the classical stability threshold along ``g``. For a
preconditioned step (Adam: ``d = -P^{-1} g`` up to weight decay and momentum) it is the preconditioned Rayleigh
quotient ``g^T P^{-1} H P^{-1} g / g^T P^{-1} g``. A unit-norm direction would instead give
``2 / eta_c = (g^T H g / g^T g) / ||g||``, which is not a curvature, hence the ``d = u / lr`` normalisation.

Line search and its tolerance
-----------------------------
One forward pass at ``eta = 0`` gives ``L0``. Bracketing starts at ``initial_eta`` (``lr`` by default: training
runs near the threshold, so the first bracket is usually one or two passes away) and doubles ``eta`` while the loss
has not risen (halves it while it has), giving ``lo < eta_c <= hi`` with ``L(lo) <= L0 < L(hi)`` and
``hi = 2 lo``. Bisection then halves the bracket until ``(hi - lo) / (2 lo) <= rtol``; the estimate is the
midpoint, so ``rtol`` bounds the relative error of both ``eta_c`` and ``lambda_c`` (for the crossing inside the
bracket). From ``hi = 2 lo``, ``k`` bisections reach ``2^-(k+1)``: the default ``rtol=1e-3`` needs 9, i.e. 12 forward
passes in all when the first guess is within a factor of 2 of ``eta_c`` (one more per further factor of 2).
`DEFAULT_MAX_FORWARD_PASSES` caps the total. Measured every few steps, a search can start from the previous ``eta_c``
(`warm_started`): a bracket of ratio 1.5 from it and ``rtol = 1/30`` take 6 forward passes, the paper's cost for its
precision of 1/16 (Kalra et al. report 5-6). Like the paper's search, it finds the crossing of the first bracket;
a loss that dips back below ``L0`` beyond it is not looked for.

Distributed callers
-------------------
Under DDP, ZeRO or FSDP2 the forward passes must go through the engine's model and every process must compare the
same number. Pass ``loss_fn(model) -> float`` that runs the engine's forward on this process's batch and returns the
loss AVERAGED over processes (an all-reduce), identical on every rank, so that every rank takes the same branch
of the search; pass ``parameters=`` the tensors the engine updates on this rank (its local shards: FSDP2's
``DTensor`` parameters, ZeRO's partitioned ones) with ``update=`` the matching local shards of the update. The search
only adds ``eta / lr * u`` to those tensors in place and copies them back, so it gathers nothing beyond what the
engine's own forward gathers. Wiring that to each engine is left to the callers.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from .lm import evaluation_mode, measured_parameters, preserved_global_rng

DEFAULT_RTOL = 1e-3
"""Relative precision of ``eta_c`` (and ``lambda_c``) the bisection stops at: 9 bisections from a factor-2 bracket."""

DEFAULT_MAX_FORWARD_PASSES = 32
"""Cap on forward passes, the one at ``eta = 0`` included: 12 reach `DEFAULT_RTOL` when the first guess is within a
factor of 2 of ``eta_c``, and the rest leave room for a first guess up to ~2^20 away."""

WARM_BRACKET_FACTOR = 1.5
"""The bracket's ratio ``hi / lo`` of `warm_started`: an ``eta_c`` within a factor 1.5 of the previous one either way is
bracketed in two passes, and 3 bisections then reach `WARM_RTOL`."""

WARM_RTOL = 1 / 30
"""`warm_started`'s ``rtol``: ``(hi - lo) / (2 lo) <= 1/30`` is the paper's precision criterion
``|1 - lo / hi| <= 1/16`` (Kalra et al.); a bracket of ratio 1.5 meets it after 3 bisections (1/32), with room for
rounding."""

CONVERGED = "converged"
MAX_PASSES = "max_forward_passes"
NEVER_ROSE = "never_rose"
ROSE_AT_EVERY_STEP = "rose_at_every_step"
STATUSES = (CONVERGED, MAX_PASSES, NEVER_ROSE, ROSE_AT_EVERY_STEP)


@dataclass
class CriticalSharpness:
    """Critical sharpness ``lambda_c = 2 / eta_c`` along an update (see the module's docstring for the definition).

    Attributes:
        lambda_c: ``2 / eta_c``; ``nan`` unless a bracket was found (``status`` ``converged`` or
            ``max_forward_passes``).
        eta_c: the critical step size on the optimizer's learning-rate scale: the midpoint of the final bracket.
        learning_rate: the learning rate ``lr`` the update was computed at (``d = update / lr``).
        step_ratio: ``eta_c / learning_rate``: above 1 the actual step lowers the loss along the line, below 1 it
            raises it.
        bracket_low, bracket_high: ``L(w + lo d) <= L0 < L(w + hi d)``; ``0`` / ``inf`` for a missing side.
        relative_precision: ``(hi - lo) / (2 lo)``, the bound on the relative error of ``eta_c`` and ``lambda_c``
            (``inf`` without a bracket).
        n_forward_passes: forward passes made, the one at ``eta = 0`` included.
        loss_at_zero: ``L0``, the loss at the current weights.
        etas, losses: every step size tried and its loss, in order (``etas[0] = 0``).
        status: ``converged`` (``relative_precision <= rtol``); ``max_forward_passes`` (bracketed, budget spent before
            ``rtol``); ``never_rose`` (the loss stayed ``<= L0`` up to ``bracket_low``: ``lambda_c < 2 /
            bracket_low``); ``rose_at_every_step`` (the loss was above ``L0`` down to ``bracket_high``, and below it
            either the budget ended or the step stopped changing the loss at all: the update is not a descent
            direction at that resolution, e.g. momentum overshooting; ``lambda_c >= 2 / bracket_high`` if it is one).
        direction_norm: ``||update|| / lr``, the norm of the search direction ``d``.
        rtol, max_forward_passes, initial_eta: the settings.
        seconds: wall-clock time of the search.
    """

    lambda_c: float
    eta_c: float
    learning_rate: float
    step_ratio: float
    bracket_low: float
    bracket_high: float
    relative_precision: float
    n_forward_passes: int
    loss_at_zero: float
    status: str
    direction_norm: float
    rtol: float
    max_forward_passes: int
    initial_eta: float
    seconds: float
    etas: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    @property
    def converged(self) -> bool:
        return self.status == CONVERGED

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ProposedUpdate:
    """What an optimizer step would do, without doing it (`proposed_update`).

    Attributes:
        params: the parameters the step would change (those with a ``.grad``), in the optimizer's order.
        updates: ``w_next - w`` of each, in the parameter's dtype, detached.
        learning_rate: the ``lr`` of the first parameter group holding one of ``params``: the scale the critical step
            size is expressed on. With groups of different learning rates, ``eta_c / learning_rate`` is the factor by
            which all of them (a schedule) could be scaled.
    """

    params: list[torch.Tensor]
    updates: list[torch.Tensor]
    learning_rate: float


# ---------------------------------------------------------------------------------------------------------------------
# the optimizer's next update


def _unwrap_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """accelerate's ``AcceleratedOptimizer`` (what the Trainer holds) steps its ``.optimizer``: measure that one, so
    the wrapper's gradient-scaler and step bookkeeping are left alone."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def _snapshot(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return copy.deepcopy(value)


def _restore_into(container: dict, key: Any, saved: Any) -> None:
    """``container[key] = saved``, copying into the existing tensor when it fits, so that whoever holds a reference to
    it (a scheduler, a fused kernel's cache) sees the old value."""
    current = container.get(key)
    if (
        isinstance(saved, torch.Tensor)
        and isinstance(current, torch.Tensor)
        and current.shape == saved.shape
        and current.dtype == saved.dtype
        and current.device == saved.device
    ):
        with torch.no_grad():
            current.copy_(saved)
    else:
        container[key] = saved


def proposed_update(optimizer: torch.optim.Optimizer) -> ProposedUpdate:
    """The update the optimizer's next ``step()`` would apply to each parameter, leaving everything as it was.

    The step runs for real (so any torch optimizer works: SGD with momentum, AdamW, ``torch.optim.Muon``, ...) and is
    then undone bit for bit: the parameters are copied back from a snapshot, the state of every stepped parameter
    (moments, step counts, momentum buffers) is copied back into the same tensors (a state created by this first step
    is removed), and the param groups' hyper-parameters are restored. ``.grad`` is not written by torch's optimizers
    and is left alone. A later real ``step()`` therefore gives the same parameters as if this had never run.

    Cost: one optimizer step and one copy of the parameters and of their optimizer state, plus the returned updates.
    The Trainer's ``AcceleratedOptimizer`` is looked through to the optimizer it wraps. Step hooks registered on the
    optimizer do fire. DeepSpeed's ZeRO optimizer keeps fp32 master partitions that are not the model's parameters:
    `hf_flatbias.flatness.zero_update.zero_proposed_update` runs this on the torch optimizer it wraps.

    Raises:
        ValueError: no parameter of the optimizer has a ``.grad`` (run ``loss.backward()`` first).
    """
    inner = _unwrap_optimizer(optimizer)
    params = [p for group in inner.param_groups for p in group["params"] if p.grad is not None]
    if not params:
        raise ValueError(
            "No parameter of the optimizer has a .grad: the next update depends on the gradient. Call "
            "loss.backward() (and do not zero the gradients) before proposed_update(optimizer)."
        )
    learning_rate = next(
        float(group["lr"]) for group in inner.param_groups if any(p.grad is not None for p in group["params"])
    )
    saved_params = [p.detach().clone() for p in params]
    saved_states = {p: {k: _snapshot(v) for k, v in inner.state[p].items()} for p in params if p in inner.state}
    saved_groups = [{k: _snapshot(v) for k, v in group.items() if k != "params"} for group in inner.param_groups]
    try:
        inner.step()
        with torch.no_grad():
            updates = [p.detach() - w for p, w in zip(params, saved_params, strict=True)]
    finally:
        with torch.no_grad():
            for p, w in zip(params, saved_params, strict=True):
                p.copy_(w)
        for p in params:
            if p not in saved_states:
                inner.state.pop(p, None)
                continue
            state, saved = inner.state[p], saved_states[p]
            for key in [k for k in state if k not in saved]:
                del state[key]
            for key, value in saved.items():
                _restore_into(state, key, value)
        for group, saved in zip(inner.param_groups, saved_groups, strict=True):
            for key in [k for k in group if k != "params" and k not in saved]:
                del group[key]
            for key, value in saved.items():
                _restore_into(group, key, value)
    return ProposedUpdate(params=params, updates=updates, learning_rate=learning_rate)


# ---------------------------------------------------------------------------------------------------------------------
# the line search


def batch_loss(model: nn.Module, batch: Mapping[str, Any]) -> float:
    """``model(**batch).loss`` as a float: the loss a Hugging Face model computes from a batch with labels."""
    output = model(**batch)
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if loss is None:
        raise ValueError(
            f"{type(model).__name__}(**batch) returned no loss: give the batch its 'labels', or pass a "
            "loss_fn(model) -> float instead of a batch."
        )
    return float(loss.detach().double()) if isinstance(loss, torch.Tensor) else float(loss)


def _check_update(update: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(update, torch.Tensor) or not isinstance(update, Sequence):
        raise TypeError(
            f"update must be a list of tensors, one per trainable parameter (got {type(update).__name__}); pass "
            "proposed_update(optimizer) or [w_next - w for each parameter]."
        )
    if len(update) != len(params):
        raise ValueError(
            f"update has {len(update)} tensors for {len(params)} parameters: pass one tensor per trainable parameter "
            "in model.parameters() order (or parameters= the tensors it updates), e.g. proposed_update(optimizer)."
        )
    for i, (u, p) in enumerate(zip(update, params, strict=True)):
        if not isinstance(u, torch.Tensor) or u.shape != p.shape:
            shape = tuple(u.shape) if isinstance(u, torch.Tensor) else type(u).__name__
            raise ValueError(
                f"update[{i}] has shape {shape} but its parameter has {tuple(p.shape)}: pass one tensor per trainable "
                "parameter, in the same order and shapes (e.g. proposed_update(optimizer))."
            )
        if not torch.isfinite(u).all():
            raise ValueError(f"update[{i}] is not finite: fix the gradient (NaN/inf) before measuring along it.")
    return list(update)


def _check_positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0 (got {value!r}).")
    return float(value)


def warm_started(previous_eta_c: float, bracket_factor: float = WARM_BRACKET_FACTOR) -> dict[str, float]:
    """The settings of `estimate_critical_sharpness` at the paper's cost, from the previous measurement's ``eta_c``
    along the same kind of update: the first pass at it, the second a factor ``f`` above or below, so with
    `WARM_RTOL` the search takes 6 forward passes (``eta = 0``, 2 to bracket, 3 bisections) whenever ``eta_c`` moved
    by less than ``f`` either way, one more per further factor ``f``."""
    if not (math.isfinite(previous_eta_c) and previous_eta_c > 0):
        raise ValueError(
            f"warm_started needs a previous eta_c > 0 (got {previous_eta_c!r}): measure once with the defaults first."
        )
    return {"initial_eta": previous_eta_c, "bracket_factor": bracket_factor, "rtol": WARM_RTOL}


def estimate_critical_sharpness(
    model: nn.Module,
    batch_or_loss_fn: Mapping[str, Any] | Callable[[nn.Module], float | torch.Tensor],
    update: ProposedUpdate | Sequence[torch.Tensor],
    *,
    learning_rate: float | None = None,
    parameters: Sequence[torch.Tensor] | None = None,
    initial_eta: float | None = None,
    rtol: float = DEFAULT_RTOL,
    max_forward_passes: int = DEFAULT_MAX_FORWARD_PASSES,
    bracket_factor: float = 2.0,
) -> CriticalSharpness:
    """Critical sharpness ``lambda_c = 2 / eta_c`` along ``update``, by a doubling bracket and bisection on ``eta``.

    ``eta_c`` is the smallest ``eta > 0`` with ``L(w + eta * update / learning_rate) > L(w)`` (see the module's
    docstring: the step-size scale, the quadratic case, the tolerance). Forward passes only, under ``torch.no_grad``,
    with the model in eval mode (dropout off: the comparison must be deterministic) and then every module back in its
    own mode; the weights are restored bit for bit from a copy and torch's global random streams are left as they were.

    Args:
        model: the model whose parameters move.
        batch_or_loss_fn: a batch with labels (the loss is ``model(**batch).loss``), or ``loss_fn(model) -> float``:
            any scalar loss, e.g. over several batches, or one averaged across processes (a sharded caller must pass
            that; see the module's docstring).
        update: ``w_next - w`` per parameter: a `ProposedUpdate` (from `proposed_update`, which brings its parameters
            and learning rate), or a list of tensors aligned with ``parameters``.
        learning_rate: the learning rate ``update`` was computed at; required with a list, taken from the
            `ProposedUpdate` otherwise (an explicit value wins). ``eta`` multiplies ``update / learning_rate``.
        parameters: the tensors ``update`` applies to; default: the model's trainable parameters, in order.
        initial_eta: the first step size tried; default ``learning_rate`` (the actual step).
        rtol: stop when ``(hi - lo) / (2 lo) <= rtol``, the bound on the relative error of ``eta_c`` and ``lambda_c``.
        max_forward_passes: cap on forward passes, the one at ``eta = 0`` included (at least 3).
        bracket_factor: how far each bracketing pass moves ``eta`` (``eta * f`` while the loss has not risen,
            ``eta / f`` while it has), so the first bracket has ``hi = f lo``. A warm start (`warm_started`) with a
            smaller factor needs fewer bisections.

    Returns:
        A `CriticalSharpness`. Without a bracket (the loss never rose, or rose at every step tried) ``lambda_c`` is
        ``nan`` and ``status`` says which, with the bound in ``bracket_low`` / ``bracket_high``.

    Raises:
        ValueError: an update of the wrong number or shapes of tensors, a non-finite update, a non-finite loss at the
            current weights, or bad settings; each message names the fix.
    """
    start_time = time.perf_counter()
    if isinstance(update, ProposedUpdate):
        if parameters is None:
            parameters = update.params
        if learning_rate is None:
            learning_rate = update.learning_rate
        update = update.updates
    elif learning_rate is None:
        raise ValueError(
            "learning_rate is required with a list of updates: pass the learning rate the update was computed at "
            "(optimizer.param_groups[0]['lr']), or pass proposed_update(optimizer), which carries it."
        )
    lr = _check_positive("learning_rate", learning_rate)
    eta = _check_positive("initial_eta", lr if initial_eta is None else initial_eta)
    rtol = _check_positive("rtol", rtol)
    if isinstance(max_forward_passes, bool) or not isinstance(max_forward_passes, int) or max_forward_passes < 3:
        raise ValueError(f"max_forward_passes must be an int >= 3 (got {max_forward_passes!r}).")
    if not (isinstance(bracket_factor, (int, float)) and math.isfinite(bracket_factor) and bracket_factor > 1):
        raise ValueError(f"bracket_factor must be a finite number > 1, e.g. 2 (got {bracket_factor!r}).")
    params = list(measured_parameters(model) if parameters is None else parameters)
    updates = _check_update(update, params)
    if isinstance(batch_or_loss_fn, Mapping):
        batch = batch_or_loss_fn

        def loss_fn(m: nn.Module) -> float:
            return batch_loss(m, batch)
    elif callable(batch_or_loss_fn):
        loss_fn = batch_or_loss_fn
    else:
        raise TypeError(
            f"batch_or_loss_fn must be a batch (a mapping with labels) or a callable loss_fn(model) -> float, not "
            f"{type(batch_or_loss_fn).__name__}."
        )

    with torch.no_grad():
        direction_norm = math.sqrt(sum(float(u.double().square().sum()) for u in updates)) / lr
    etas: list[float] = []
    losses: list[float] = []
    with evaluation_mode(model), preserved_global_rng(), torch.no_grad():
        saved = [p.detach().clone() for p in params]
        try:

            def loss_at(step: float) -> float:
                for p, w, u in zip(params, saved, updates, strict=True):
                    p.copy_(w)
                    if step:
                        p.add_(u, alpha=step / lr)
                value = loss_fn(model)
                value = float(value.detach().double()) if isinstance(value, torch.Tensor) else float(value)
                etas.append(step)
                losses.append(value)
                return value

            loss0 = loss_at(0.0)
            if not math.isfinite(loss0):
                raise ValueError(
                    f"The loss at the current weights is {loss0}: critical sharpness compares losses to it. Fix the "
                    "model or batch (NaN/inf loss) before measuring."
                )

            def rises(step: float) -> bool:
                value = loss_at(step)
                return not value <= loss0  # NaN (diverged) counts as a rise

            lo, hi = 0.0, math.inf
            while len(etas) < max_forward_passes and (lo == 0.0 or hi == math.inf):
                if rises(eta):
                    hi = eta
                elif hi < math.inf and losses[-1] == loss0:
                    break  # halved below the loss's resolution while it rose at every larger step: no descent seen
                else:
                    lo = eta
                if hi == math.inf:
                    eta = bracket_factor * lo
                elif lo == 0.0:
                    eta = hi / bracket_factor
            if lo > 0.0 and hi < math.inf:
                while (hi - lo) / (2.0 * lo) > rtol and len(etas) < max_forward_passes:
                    mid = 0.5 * (lo + hi)
                    if rises(mid):
                        hi = mid
                    else:
                        lo = mid
        finally:
            for p, w in zip(params, saved, strict=True):
                p.copy_(w)

    if lo > 0.0 and hi < math.inf:
        precision = (hi - lo) / (2.0 * lo)
        status = CONVERGED if precision <= rtol else MAX_PASSES
        eta_c = 0.5 * (lo + hi)
        lambda_c = 2.0 / eta_c
    else:
        precision, eta_c, lambda_c = math.inf, math.nan, math.nan
        status = NEVER_ROSE if hi == math.inf else ROSE_AT_EVERY_STEP
    return CriticalSharpness(
        lambda_c=lambda_c,
        eta_c=eta_c,
        learning_rate=lr,
        step_ratio=eta_c / lr,
        bracket_low=lo,
        bracket_high=hi,
        relative_precision=precision,
        n_forward_passes=len(etas),
        loss_at_zero=loss0,
        status=status,
        direction_norm=direction_norm,
        rtol=rtol,
        max_forward_passes=max_forward_passes,
        initial_eta=lr if initial_eta is None else float(initial_eta),
        seconds=time.perf_counter() - start_time,
        etas=etas,
        losses=losses,
    )
