"""Weight-noise sensitivity of the pre-training loss: how much the loss rises when Gaussian noise is added to the
weights, ``E_eps[L(w + sigma eps)] - L(w)``, over a grid of ``sigma``.

``L`` is the mean data-label cross-entropy over the contexts (rows with one or more labelled positions, as for
`hf_flatbias.flatness.estimate_hessian_trace`): the loss whose Hessian `exact_hessian_trace` takes the trace of. For
small ``sigma`` the expected increase is ``sigma^2 / 2 * Tr(H)`` (absolute noise), or ``sigma^2 / 2 * sum_p rms(w_p)^2
Tr(H_pp)`` with noise relative to each tensor's root-mean-square (``scale="rms"``).

- Antithetic pairs: each draw measures ``(L(w + s eps) + L(w - s eps)) / 2 - L(w)``, which cancels the first-order
  term ``s g.eps`` exactly; a single-sided draw is dominated by it at small ``s``.
- Common random numbers: the noise of a parameter depends only on ``(seed, draw index, parameter name)`` (drawn on
  the CPU in float32), so two checkpoints of the same architecture get the same noise and their difference is not
  blurred by it. The same draws serve every ``sigma`` of the grid.
- The weights are restored bit for bit (copied back from a saved copy, never subtracted), and the measurement runs in
  ``eval()`` mode with module modes, ``.grad`` and the global random streams left as they were. It holds two extra
  copies of the trainable parameters meanwhile (the saved weights and the draw's scaled noise).
- Precision: the loss is read in float64, but a float32 model rounds the forward to ~1e-7 relative, so at
  ``sigma ~ 1e-3`` the increase (``~ sigma^2 Tr(H)``) can drown in rounding on a small model; measure such a limit
  in float64 (``model.double()``). Larger ``sigma`` (the 1e-2 to 1e-1 relative noise the robustness studies use)
  is well above it.

Nothing here knows about the Trainer.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ..constants import DEFAULT_BATCH_SIZE, NOISE_SCALES
from .contexts import TraceContexts, prepare_contexts
from .lm import (
    evaluation_mode,
    logits_at_positions,
    measured_parameters,
    preserved_global_rng,
)

DEFAULT_SIGMAS = (1e-3, 3e-3, 1e-2, 3e-2)


# ---------------------------------------------------------------------------------------------------------------------
# shared with quantization and forgetting: the data-label loss of each context


@torch.no_grad()
def per_context_losses(model: nn.Module, contexts: TraceContexts, n_used: int, batch_size: int) -> torch.Tensor:
    """The data-label cross-entropy ``-log p(target_c)`` of each of the first ``n_used`` contexts, in float64 (the
    logits are read in float64, so a float64 model keeps its precision). The caller sets the mode (eval)."""
    losses = torch.empty(n_used, dtype=torch.float64)
    for start in range(0, n_used, batch_size):
        indices = list(range(start, min(start + batch_size, n_used)))
        batch = contexts.model_inputs(indices, model)
        positions = torch.tensor([contexts.positions[i] for i in indices], device=batch["input_ids"].device)
        targets = torch.tensor([contexts.targets[i] for i in indices], device=positions.device)
        logits = logits_at_positions(model, batch, positions)[:, 0].double()
        losses[start : start + len(indices)] = torch.nn.functional.cross_entropy(
            logits, targets, reduction="none"
        ).cpu()
    return losses


def check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1 (got {value!r}).")


def mean_and_stderr(values: torch.Tensor) -> tuple[float, float]:
    """Mean and ``std / sqrt(n)`` (``nan`` for a single value) of a 1-d float64 tensor."""
    if values.numel() < 2:
        return float(values.mean()), float("nan")
    return float(values.mean()), float(values.std() / math.sqrt(values.numel()))


# ---------------------------------------------------------------------------------------------------------------------
# results


@dataclass
class WeightNoisePoint:
    """The loss increase at one noise level.

    Attributes:
        sigma: the noise level (absolute, or relative to each tensor's RMS; see `WeightNoiseSensitivity.scale`).
        mean: the estimate of ``E[L(w + sigma eps)] - L(w)``.
        stderr: its standard error over the draws (``nan`` with one draw).
        per_draw: each draw's value (the antithetic pair's mean minus ``L(w)``, or the single-sided increase).
    """

    sigma: float
    mean: float
    stderr: float
    per_draw: list[float] = field(default_factory=list)


@dataclass
class WeightNoiseSensitivity:
    """Weight-noise sensitivity of the pre-training loss over a grid of noise levels.

    Attributes:
        points: one `WeightNoisePoint` per ``sigma``, in the order asked.
        base_loss: ``L(w)``, the mean data-label cross-entropy of the unperturbed model.
        scale: ``"absolute"`` or ``"rms"`` (noise ``sigma * rms(w_p) * eps`` on tensor ``p``; see `NOISE_SCALES`).
        antithetic: whether each draw was an antithetic pair.
        n_draws: draws (pairs when antithetic) per ``sigma``.
        seed: the noise depends only on ``(seed, draw, parameter name)``.
        n_contexts: contexts the loss averages over.
        n_parameters: the perturbed (trainable) parameters.
        seconds: wall-clock time.
    """

    points: list[WeightNoisePoint]
    base_loss: float
    scale: str
    antithetic: bool
    n_draws: int
    seed: int
    n_contexts: int
    n_parameters: int
    seconds: float

    @property
    def sigmas(self) -> list[float]:
        return [p.sigma for p in self.points]

    @property
    def means(self) -> list[float]:
        return [p.mean for p in self.points]

    def to_dict(self, *, per_draw: bool = False) -> dict[str, Any]:
        """Plain floats and settings; the per-draw values only with ``per_draw=True``."""
        values = asdict(self)
        if not per_draw:
            for point in values["points"]:
                point.pop("per_draw")
        return values


# ---------------------------------------------------------------------------------------------------------------------
# the noise


def noise_generator(seed: int, draw: int, name: str) -> torch.Generator:
    """A CPU generator that depends only on ``(seed, draw, name)`` (a stable hash: not Python's salted ``hash``)."""
    digest = hashlib.blake2b(f"{int(seed)}\x00{int(draw)}\x00{name}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") % (2**63 - 1))


def weight_noise(
    model: nn.Module, *, seed: int, draw: int, names: Sequence[str] | None = None
) -> dict[str, torch.Tensor]:
    """The standard-normal noise ``eps`` of draw ``draw`` for the model's trainable parameters (or ``names``), by
    parameter name: float32 CPU tensors of the parameters' shapes, each from `noise_generator(seed, draw, name)`."""
    shapes = {name: p.shape for name, p in model.named_parameters() if p.requires_grad}
    chosen = list(shapes) if names is None else list(names)
    return {
        name: torch.randn(shapes[name], generator=noise_generator(seed, draw, name), dtype=torch.float32)
        for name in chosen
    }


def _named_trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    measured_parameters(model)  # raises when nothing is trainable
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


# ---------------------------------------------------------------------------------------------------------------------
# the estimate


def estimate_weight_noise_sensitivity(
    model: nn.Module,
    dataset: Iterable[Mapping[str, Any]],
    sigmas: Sequence[float] = DEFAULT_SIGMAS,
    *,
    scale: str = "rms",
    n_draws: int = 16,
    antithetic: bool = True,
    seed: int = 0,
    n_contexts: int | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    causal: bool | None = None,
) -> WeightNoiseSensitivity:
    """``E_eps[L(w + sigma eps)] - L(w)`` of the pre-training loss for each ``sigma``, with its standard error.

    Args:
        model: a masked or causal LM; the noise goes on its trainable parameters (tied weights once).
        dataset: rows with ``input_ids``, ``attention_mask`` and ``labels`` (-100 except the predicted positions),
            as for `estimate_hessian_trace`.
        sigmas: the noise levels.
        scale: ``"rms"`` (default): tensor ``p`` gets ``sigma * rms(w_p) * eps``, comparable across layers and
            checkpoints of different weight norms; ``"absolute"``: ``sigma * eps``, whose small-``sigma`` limit is
            ``sigma^2 / 2 * Tr(H)``.
        n_draws: noise draws per ``sigma`` (antithetic pairs: each costs two forwards over the contexts).
        antithetic: measure ``(L(w + s eps) + L(w - s eps)) / 2 - L(w)`` per draw (default); ``False`` measures
            ``L(w + s eps) - L(w)``, one forward, its first-order term left in.
        seed: draw ``k`` of parameter ``name`` depends only on ``(seed, k, name)`` (`weight_noise`): the same noise
            for every checkpoint of the architecture and every ``sigma``.
        n_contexts: use the first ``n_contexts`` contexts; all by default.
        batch_size: contexts per forward.
        causal: whether the model is a causal LM; detected from the model class by default.

    Returns:
        A `WeightNoiseSensitivity`.

    Raises:
        ValueError: an empty or non-positive ``sigmas``, an unknown ``scale``, ``n_draws`` or ``batch_size`` below 1,
            a model without an LM head or trainable parameters, rows without a labelled position.
    """
    start_time = time.perf_counter()
    sigmas = [float(s) for s in sigmas]
    if not sigmas or not all(math.isfinite(s) and s > 0 for s in sigmas):
        raise ValueError(f"sigmas must be a non-empty list of finite numbers > 0 (got {sigmas!r}).")
    if scale not in NOISE_SCALES:
        raise ValueError(f"scale={scale!r} is not supported; choose one of {list(NOISE_SCALES)}.")
    check_positive_int("n_draws", n_draws)
    check_positive_int("batch_size", batch_size)
    contexts, n_used = prepare_contexts(model, dataset, n_contexts, causal)
    named = _named_trainable(model)
    params = [p for _, p in named]
    values = torch.empty(len(sigmas), n_draws, dtype=torch.float64)
    with evaluation_mode(model), preserved_global_rng(), torch.no_grad():
        base = per_context_losses(model, contexts, n_used, batch_size).mean()
        saved = [p.detach().clone() for p in params]
        if scale == "rms":
            tensor_scales = [float(w.double().square().mean().sqrt()) for w in saved]
        else:
            tensor_scales = [1.0] * len(params)
        try:
            for draw in range(n_draws):
                noise = weight_noise(model, seed=seed, draw=draw, names=[name for name, _ in named])
                directions = [
                    noise[name].to(device=p.device, dtype=p.dtype) * s
                    for (name, p), s in zip(named, tensor_scales, strict=True)
                ]
                del noise
                for index, sigma in enumerate(sigmas):
                    signs = (1.0, -1.0) if antithetic else (1.0,)
                    losses = []
                    for sign in signs:
                        for param, weight, direction in zip(params, saved, directions, strict=True):
                            torch.add(weight, direction, alpha=sign * sigma, out=param.data)
                        losses.append(per_context_losses(model, contexts, n_used, batch_size).mean())
                    values[index, draw] = torch.stack(losses).mean() - base
        finally:
            torch._foreach_copy_(params, saved)
    points = []
    for index, sigma in enumerate(sigmas):
        mean, stderr = mean_and_stderr(values[index])
        points.append(WeightNoisePoint(sigma=sigma, mean=mean, stderr=stderr, per_draw=values[index].tolist()))
    return WeightNoiseSensitivity(
        points=points,
        base_loss=float(base),
        scale=scale,
        antithetic=antithetic,
        n_draws=n_draws,
        seed=int(seed),
        n_contexts=n_used,
        n_parameters=sum(p.numel() for p in params),
        seconds=time.perf_counter() - start_time,
    )
