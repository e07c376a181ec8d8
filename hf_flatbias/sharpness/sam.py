"""SAM / ASAM perturbations as pure tensor functions.

SAM (Foret et al., 2021) steps with the gradient taken at ``w + e`` where ``e = rho * g / ||g||``.
ASAM (Kwon et al., 2021) measures the neighbourhood relative to the weights: with ``T = |w| + eta``,
``e = rho * T^2 g / ||T g||``. A preconditioned perturbation (Singh et al., ICML 2025) takes the step in the base
optimizer's geometry: ``e = rho * (g / P) / ||g / P||`` with ``P`` Adam's denominator ``sqrt(v_hat) + eps``.

The functions take parallel lists of parameters and gradients so that callers decide which tensors take part
(trainable parameters only, a ZeRO shard, ...). ``sq_norm_reducer`` lets a caller whose parameters are sharded
across processes sum the squared norm over the shards before it is used.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

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
) -> Perturbation | None:
    """Move ``params`` in place to ``w + e`` and return what is needed to restore them.

    ``grads`` is consumed: its buffers are reused to hold the saved weights, so the whole step needs at most one
    extra copy of the parameters. Returns ``None``, leaving the parameters untouched, when the gradient norm is zero
    or not finite (an fp16 overflow, a diverged batch): a perturbation along such a direction is meaningless.
    ``preconditioner`` (one positive tensor per parameter, e.g. `adam_preconditioner`) divides the gradient before
    it is normalised; ``grad_norm`` then reports ``||g / P||``. It excludes ``adaptive``.
    """
    params = list(params)
    if preconditioner is not None:
        if adaptive:
            raise ValueError("perturb_weights takes either adaptive=True or a preconditioner, not both.")
        torch._foreach_div_(grads, list(preconditioner))
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


def adam_preconditioner(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Adam's per-coordinate denominator for this step's gradient ``g``, ``P = sqrt(v_hat) + eps``, with
    ``v = beta2 * v_prev + (1 - beta2) * g^2`` and ``v_hat = v / (1 - beta2^(t + 1))``: the second moment torch's
    Adam/AdamW would hold after taking ``g`` at its step ``t + 1``, from ``v_prev``, ``t``, ``betas`` and ``eps`` in
    ``optimizer``'s state and param groups.

    Including ``g`` defines the first step (no state: ``v_prev = 0``, ``t = 0``, so ``P = |g| + eps``) and keeps
    ``|g| / P <= sqrt((1 - beta2^(t+1)) / (1 - beta2))``: with ``v_prev`` alone a coordinate that never had a
    gradient before (the embedding row of a token not yet seen) gets ``P = eps`` and takes the whole perturbation.

    Raises:
        ValueError: when a parameter's state exists but holds no ``exp_avg_sq`` (not an Adam-family optimizer).
    """
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    denominators = []
    for param, grad in zip(params, grads, strict=True):
        state = optimizer.state.get(param) or {}
        if state and "exp_avg_sq" not in state:
            raise ValueError(
                f"sam_preconditioner='adam' needs Adam's second moment, but {type(optimizer).__name__}'s state holds "
                f"{sorted(state)}; use an AdamW optimizer or sam_preconditioner='none'."
            )
        group = group_of.get(id(param))
        if group is None:
            raise ValueError("sam_preconditioner='adam': a perturbed parameter is not in the optimizer's param groups.")
        beta2, eps = group["betas"][1], group["eps"]
        step = float(state["step"]) if state else 0.0
        second_moment = grad.detach().square().mul_(1 - beta2)
        if state:
            second_moment.add_(state["exp_avg_sq"], alpha=beta2)
        bias_correction = math.sqrt(1 - beta2 ** (step + 1))
        denominators.append(second_moment.sqrt_().div_(bias_correction).add_(eps))
    return denominators


def scheduled_rho(
    rho: float, step: int, *, start: int = 0, end: int = -1, schedule: str = "constant", warmup_steps: int = 0
) -> float | None:
    """The SAM radius at optimizer update ``step``, or ``None`` outside the window ``[start, end)`` (``end=-1``: no
    end). ``"linear_warmup"`` grows it as ``rho * min(1, (step - start + 1) / warmup_steps)``."""
    if step < start or (end != -1 and step >= end):
        return None
    if schedule == "linear_warmup":
        return rho * min(1.0, (step - start + 1) / warmup_steps)
    if schedule != "constant":
        raise ValueError(f"Unknown rho schedule {schedule!r}; use 'constant' or 'linear_warmup'.")
    return rho


def select_parameters(
    named_parameters: Sequence[tuple[str, torch.nn.Parameter]],
    spec: str,
    *,
    output_layer: Sequence[torch.nn.Parameter] = (),
) -> list[torch.nn.Parameter]:
    """The parameters a SAM step perturbs: ``"all"`` of ``named_parameters``, those among them that belong to
    ``output_layer`` (``"output_layer"``), or those whose name matches one of the comma-separated fnmatch patterns.

    Raises:
        ValueError: when the selection is empty (the message lists a few names to match against).
    """
    spec = spec.strip()
    if spec == "all":
        return [p for _, p in named_parameters]
    if spec == "output_layer":
        wanted = {id(p) for p in output_layer}
        selected = [p for _, p in named_parameters if id(p) in wanted]
        what = "the output layer (model.get_output_embeddings())"
    else:
        patterns = [pattern.strip() for pattern in spec.split(",") if pattern.strip()]
        selected = [p for name, p in named_parameters if any(fnmatch.fnmatchcase(name, pat) for pat in patterns)]
        what = f"the patterns {patterns}"
    if not selected:
        names = [name for name, _ in named_parameters][:6]
        raise ValueError(
            f"sam_parameters={spec!r} selects no trainable parameter: {what} matched none of them (names look like "
            f"{names}); use 'all', 'output_layer' or fnmatch patterns of these names."
        )
    return selected


def ascent_rows(inputs: dict, fraction: float) -> dict:
    """The first ``ceil(fraction * rows)`` rows of a batch (every tensor whose first dimension is the batch's),
    the rows whose gradient defines a sub-batch SAM perturbation (Bahri et al., ACL 2022)."""
    sizes = {value.shape[0] for value in inputs.values() if isinstance(value, torch.Tensor) and value.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(
            f"sam_ascent_fraction < 1 needs every batch tensor to share its first (row) dimension; got sizes {sizes}."
        )
    (rows,) = sizes
    keep = max(1, math.ceil(fraction * rows))
    return {
        name: value[:keep] if isinstance(value, torch.Tensor) and value.dim() > 0 else value
        for name, value in inputs.items()
    }
