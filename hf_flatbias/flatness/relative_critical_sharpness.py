"""Relative critical sharpness (Kalra et al., arXiv 2601.16979, ``lambda_c^{1->2}``): the curvature of the
pre-training loss (1) along the update a downstream task's optimizer would take (2).

``eta_c`` is the smallest step along the downstream update ``d = u / lr`` at which the PRE-TRAINING loss rises above
its current value, and ``lambda_c = 2 / eta_c``; `estimate_critical_sharpness` does the line search, only the
direction changes. A small value says a fine-tuning step can go far before the pre-training loss notices: the
downstream direction stays inside the pre-training basin. On a quadratic pre-training loss with gradient ``g1`` and
Hessian ``H1``: ``lambda_c = d^T H1 d / (-g1^T d)`` when ``g1^T d < 0``; when ``g1^T d >= 0`` the pre-training loss
rises at once (``status`` ``rose_at_every_step``: the first fine-tuning step already leaves the basin's floor).

The downstream update is that of a FRESH optimizer's first step (the first step of fine-tuning from these weights):
for SGD ``d = -g2``, for Adam(W) ``d = -g2 / (|g2| + eps)`` elementwise (bias-corrected moments of one gradient), plus
``-weight_decay * w`` for AdamW. For a language model the downstream loss is that of a sequence classifier holding a
copy of the encoder (`hf_flatbias.flatness.forgetting.sequence_classifier_from`, its new head seeded), in ``eval()``
mode (no dropout: a deterministic direction); only the encoder's part of the update moves the LM (its own head
parts stay), as fine-tuning would leave the LM head alone.

`downstream_update` is the pure step; `estimate_relative_critical_sharpness` runs one search per batch of
pre-training contexts, each along the update of its own downstream batch, and reports the mean and standard error
over the batches that found a bracket, with the count whose pre-training loss rose at once beside.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ..constants import FORGETTING_OPTIMIZERS
from .contexts import prepare_contexts
from .critical_sharpness import (
    DEFAULT_RTOL,
    ROSE_AT_EVERY_STEP,
    ProposedUpdate,
    estimate_critical_sharpness,
    proposed_update,
)
from .lm import evaluation_mode, preserved_global_rng


def downstream_update(
    params: Sequence[torch.Tensor],
    loss: torch.Tensor,
    *,
    optimizer: str = "adamw",
    learning_rate: float,
    weight_decay: float = 0.0,
) -> ProposedUpdate:
    """The update a fresh ``optimizer`` (``"adamw"`` or ``"sgd"``, plain) would apply to ``params`` at its first step
    on ``loss``; ``params`` are left as they were (and their ``.grad``)."""
    if optimizer not in FORGETTING_OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}: choose one of {list(FORGETTING_OPTIMIZERS)}.")
    if not (isinstance(learning_rate, float | int) and math.isfinite(learning_rate) and learning_rate > 0):
        raise ValueError(f"learning_rate must be a finite number > 0 (got {learning_rate!r}).")
    params = list(params)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    saved = [p.grad for p in params]
    try:
        for p, g in zip(params, grads, strict=True):
            p.grad = torch.zeros_like(p) if g is None else g.detach()
        if optimizer == "adamw":
            fresh = torch.optim.AdamW(params, lr=learning_rate, weight_decay=weight_decay, foreach=False)
        else:
            fresh = torch.optim.SGD(params, lr=learning_rate, weight_decay=weight_decay, foreach=False)
        return proposed_update(fresh)
    finally:
        for p, g in zip(params, saved, strict=True):
            p.grad = g


@dataclass
class RelativeCriticalSharpnessEstimate:
    """``lambda_c^{pre <- downstream}`` averaged over batches (see the module's docstring).

    Attributes:
        mean, stderr: over the batches whose search found a bracket (``nan`` error with one; ``nan`` mean with none).
        n_batches, n_converged: searches run, and those that reached ``rtol``.
        n_rose_at_once: searches where the pre-training loss rose at every step tried: the downstream update goes
            uphill on the pre-training loss from the start (``lambda_c`` unbounded; left out of the mean).
        task, optimizer, learning_rate, weight_decay: the downstream task and the fresh optimizer whose first step
            is the direction.
        rtol, batch_size, downstream_batch_size, n_contexts, seed: the settings (``seed``: the new head's).
        n_forward_passes: forward passes of all searches; seconds: wall-clock time.
        per_batch, statuses: each batch's ``lambda_c`` (``nan`` without a bracket) and its search's status.
    """

    mean: float
    stderr: float
    n_batches: int
    n_converged: int
    n_rose_at_once: int
    task: str | None
    optimizer: str
    learning_rate: float
    weight_decay: float
    rtol: float
    batch_size: int
    downstream_batch_size: int
    n_contexts: int
    seed: int
    n_forward_passes: int
    seconds: float
    per_batch: list[float] = field(default_factory=list)
    statuses: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def estimate_relative_critical_sharpness(
    model: nn.Module,
    pretraining_loss: Callable[[int], Callable[[nn.Module], float]],
    downstream: nn.Module,
    downstream_loss: Callable[[int], torch.Tensor],
    n_batches: int,
    *,
    shared: Mapping[str, str] | None = None,
    optimizer: str = "adamw",
    learning_rate: float = 2e-5,
    weight_decay: float = 0.0,
    rtol: float = DEFAULT_RTOL,
) -> tuple[list[float], list[str], int]:
    """Per batch ``b < n_batches``: the fresh optimizer's update of ``downstream_loss(b)`` on ``downstream``'s
    parameters, carried to ``model``'s parameters of the same name (``shared``: model name -> downstream name; by
    default every trainable parameter of ``model`` by its own name, the two being one module), and the line search of
    ``pretraining_loss(b)`` along it. Returns each batch's ``lambda_c``, its status and the forward passes spent.
    The weights of both modules and the random streams are left as they were."""
    model_params = dict((n, p) for n, p in model.named_parameters() if p.requires_grad)
    down_params = dict((n, p) for n, p in downstream.named_parameters() if p.requires_grad)
    shared = {name: name for name in model_params} if shared is None else dict(shared)
    missing = [d for d in shared.values() if d not in down_params]
    if missing or not shared:
        raise ValueError(
            f"the downstream module has no trainable parameters named {missing[:3]}: pass shared= the model's "
            "parameter names mapped to the downstream module's."
        )
    names = list(shared)
    values, statuses, passes = [], [], 0
    with preserved_global_rng(), evaluation_mode(model), evaluation_mode(downstream):
        for batch in range(n_batches):
            with torch.enable_grad():
                proposed = downstream_update(
                    list(down_params.values()),
                    downstream_loss(batch),
                    optimizer=optimizer,
                    learning_rate=learning_rate,
                    weight_decay=weight_decay,
                )
            by_id = {id(p): u for p, u in zip(proposed.params, proposed.updates, strict=True)}
            update = [by_id[id(down_params[shared[name]])] for name in names]
            result = estimate_critical_sharpness(
                model,
                pretraining_loss(batch),
                update,
                learning_rate=proposed.learning_rate,
                parameters=[model_params[name] for name in names],
                rtol=rtol,
            )
            values.append(result.lambda_c)
            statuses.append(result.status)
            passes += result.n_forward_passes
    return values, statuses, passes


def relative_critical_sharpness(
    model: nn.Module,
    contexts,
    *,
    n_contexts: int | None,
    settings: Any,
    seed: int = 0,
    batch_size: int | str,
    causal: bool | None = None,
    optimizer: Any = None,
    task: Any = None,
) -> RelativeCriticalSharpnessEstimate:
    """The measures table's entry: batches of ``settings.critical_batch_size or batch_size`` pre-training contexts,
    each searched along the first update of a fresh ``settings.forgetting_optimizer`` (at
    ``settings.forgetting_learning_rate``) on its own batch of ``settings.forgetting_batch_size`` rows of ``task``
    (taken in the task's seeded order, from the start again when they run out), under a classification head seeded
    by ``seed``. The model is not modified; ``optimizer`` (the trainer's) is not used: the direction is the downstream
    task's, not pre-training's."""
    from .beyond_trace import fixed_batch_size, weighted_context_loss
    from .forgetting import checked_task_rows, collate_task_rows, padding_id, sequence_classifier_from

    if task is None:
        raise ValueError(
            "relative_critical_sharpness needs its downstream task loaded: pass task=load_forgetting_task("
            "settings.forgetting_task, tokenizer=...)."
        )
    start_time = time.perf_counter()
    size = settings.critical_batch_size or fixed_batch_size(batch_size)
    down_size = settings.forgetting_batch_size
    prepared, n_used = prepare_contexts(model, contexts, n_contexts, causal)
    rows = checked_task_rows(task.train_rows, "the downstream task's rows")
    classifier = sequence_classifier_from(model, task.num_labels, seed=seed)
    classifier.requires_grad_(True)
    down_names = {name for name, _ in classifier.named_parameters()}
    # the encoder's parameters; the LM's own head (and the classifier's new one) are not shared
    shared = {name: name for name, p in model.named_parameters() if p.requires_grad and name in down_names}
    pad_id = padding_id(model.config)
    device = next(model.parameters()).device

    def pretraining_loss(batch: int) -> Callable[[nn.Module], float]:
        indices = list(range(batch * size, min((batch + 1) * size, n_used)))
        return lambda m: float(
            weighted_context_loss(m, prepared, indices, len(indices), len(indices)).detach().double()
        )

    def downstream_loss(batch: int) -> torch.Tensor:
        chosen = [rows[(batch * down_size + i) % len(rows)] for i in range(down_size)]
        inputs, labels = collate_task_rows(chosen, pad_id, device)
        return torch.nn.functional.cross_entropy(classifier(**inputs).logits.float(), labels)

    values, statuses, passes = estimate_relative_critical_sharpness(
        model,
        pretraining_loss,
        classifier,
        downstream_loss,
        math.ceil(n_used / size),
        shared=shared,
        optimizer=settings.forgetting_optimizer,
        learning_rate=settings.forgetting_learning_rate,
        rtol=settings.critical_rtol,
    )
    return RelativeCriticalSharpnessEstimate(
        **summarize(values, statuses),
        task=getattr(task, "source", None),
        optimizer=settings.forgetting_optimizer,
        learning_rate=float(settings.forgetting_learning_rate),
        weight_decay=0.0,
        rtol=float(settings.critical_rtol),
        batch_size=size,
        downstream_batch_size=down_size,
        n_contexts=n_used,
        seed=int(seed),
        n_forward_passes=passes,
        seconds=time.perf_counter() - start_time,
        per_batch=values,
        statuses=statuses,
    )


def summarize(values: Sequence[float], statuses: Sequence[str]) -> dict[str, Any]:
    """Mean and standard error over the bracketed batches, and the counts beside."""
    found = torch.tensor([v for v in values if math.isfinite(v)], dtype=torch.float64)
    return {
        "mean": float(found.mean()) if found.numel() else math.nan,
        "stderr": float(found.std() / math.sqrt(found.numel())) if found.numel() > 1 else math.nan,
        "n_batches": len(values),
        "n_converged": sum(status == "converged" for status in statuses),
        "n_rose_at_once": sum(status == ROSE_AT_EVERY_STEP for status in statuses),
    }


__all__ = [
    "RelativeCriticalSharpnessEstimate",
    "downstream_update",
    "estimate_relative_critical_sharpness",
    "relative_critical_sharpness",
    "summarize",
]
