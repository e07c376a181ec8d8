"""The functions of `hf_flatbias.measures.MEASURE_TABLE`: each measure beyond the trace computed from a model, its
contexts and `MeasureSettings`, with one signature, so that the callback and the command line call them alike.

``critical_sharpness`` is the one measure that needs an optimizer to mean what training would do: with one (the
callback passes the trainer's), each batch's line search runs along the update the optimizer would apply to that
batch's gradient (`proposed_update`, undone bit for bit); without one (the command line) along the negative
gradient, plain gradient descent, where ``lambda_c`` is the gradient's Rayleigh quotient ``g^T H g / g^T g``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ..constants import DEFAULT_BATCH_SIZE
from ..measure_settings import MeasureSettings
from .contexts import prepare_contexts
from .critical_sharpness import estimate_critical_sharpness, proposed_update
from .distributed import share_of_contexts
from .forgetting import ForgettingResult, measure_forgetting
from .forgetting_task import ForgettingTask
from .lm import evaluation_mode, logits_at_positions, preserved_global_rng
from .parameter_space import parameter_space
from .quantization import estimate_quantization_sensitivity
from .spectrum import estimate_sam_sharpness, estimate_top_eigenvalues
from .weight_noise import estimate_weight_noise_sensitivity
from .zero_update import check_zero_update_supported, torch_optimizer_of, zero_optimizer_of, zero_proposed_update

GRADIENT_DESCENT = "gradient_descent"
"""The direction of ``critical_sharpness`` without an optimizer: ``-g``."""


def fixed_batch_size(batch_size: int | str) -> int:
    """A batch size for the measures that take no ``"auto"`` (the command line's ``--batch-size auto``)."""
    return batch_size if isinstance(batch_size, int) else DEFAULT_BATCH_SIZE


def top_eigenvalue(
    model, contexts, *, n_contexts, settings: MeasureSettings, seed, batch_size, causal=None, optimizer=None, task=None
):
    return estimate_top_eigenvalues(
        model,
        contexts,
        k=settings.top_k,
        matrix=settings.eigenvalue_matrix,
        n_contexts=n_contexts,
        seed=seed,
        batch_size=batch_size,
        causal=causal,
        product=settings.eigenvalue_product,
        finite_difference_step=settings.eigenvalue_fd_step,
        optimizer=optimizer,
    )


def sam_sharpness(
    model, contexts, *, n_contexts, settings: MeasureSettings, seed, batch_size, causal=None, optimizer=None, task=None
):
    return estimate_sam_sharpness(
        model,
        contexts,
        settings.sam_rho,
        batch_size=settings.sam_batch_size or fixed_batch_size(batch_size),
        n_contexts=n_contexts,
        causal=causal,
    )


def weight_noise(
    model, contexts, *, n_contexts, settings: MeasureSettings, seed, batch_size, causal=None, optimizer=None, task=None
):
    return estimate_weight_noise_sensitivity(
        model,
        contexts,
        settings.noise_sigmas,
        scale=settings.noise_scale,
        n_draws=settings.noise_draws,
        seed=seed,
        n_contexts=n_contexts,
        batch_size=fixed_batch_size(batch_size),
        causal=causal,
    )


def quantization(
    model, contexts, *, n_contexts, settings: MeasureSettings, seed, batch_size, causal=None, optimizer=None, task=None
):
    return estimate_quantization_sensitivity(
        model,
        contexts,
        settings.quantization_bits,
        group_size=settings.quantization_group_size,
        n_contexts=n_contexts,
        batch_size=fixed_batch_size(batch_size),
        causal=causal,
    )


def forgetting(
    model: nn.Module,
    contexts,
    *,
    n_contexts: int | None,
    settings: MeasureSettings,
    seed: int = 0,
    batch_size: int | str,
    causal: bool | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    task: ForgettingTask | None = None,
) -> ForgettingResult:
    """`measure_forgetting` on ``task`` (loaded by the caller from ``settings.forgetting_task``) with the settings'
    fine-tuning; the trace before and after at ``settings.forgetting_trace_draws`` draws when set. The model is not
    modified (a copy is fine-tuned) and the global random streams are restored; ``optimizer`` is not used."""
    if task is None:
        raise ValueError(
            "forgetting needs its downstream task loaded: pass task=load_forgetting_task(settings.forgetting_task, "
            "tokenizer=...)."
        )
    trace = None
    if settings.forgetting_trace_draws is not None:
        trace = {"n_draws": settings.forgetting_trace_draws, "seed": seed, "batch_size": fixed_batch_size(batch_size)}
    result = measure_forgetting(
        model,
        contexts,
        task.train_rows,
        eval_rows=task.eval_rows,
        num_labels=task.num_labels,
        steps=settings.forgetting_steps,
        learning_rate=settings.forgetting_learning_rate,
        batch_size=settings.forgetting_batch_size,
        optimizer=settings.forgetting_optimizer,
        seed=seed,
        trace=trace,
        n_contexts=n_contexts,
        lm_batch_size=fixed_batch_size(batch_size),
        causal=causal,
    )
    return replace(result, task=task.source, label_column=task.label_column)


@dataclass
class CriticalSharpnessEstimate:
    """Critical sharpness ``2 / eta_c`` averaged over batches of contexts, each batch's line search along its own
    next update.

    Attributes:
        mean, stderr: over the batches whose search found a bracket (``nan`` error with one).
        direction: the optimizer's class name (its next update), or ``"gradient_descent"`` (``-g``).
        learning_rate: the optimizer's learning rate (``eta_c / learning_rate`` says how far the step is from the
            edge); ``None`` for gradient descent, whose ``eta`` is on the scale of ``-g``.
        rtol, batch_size, n_contexts: the settings.
        n_batches, n_converged: batches searched, and those that found a bracket within ``rtol``.
        n_forward_passes: forward passes of all searches.
        per_batch: each batch's ``lambda_c`` (``nan`` without a bracket); statuses: each search's status.
        seconds: wall-clock time.
    """

    mean: float
    stderr: float
    direction: str
    learning_rate: float | None
    rtol: float
    batch_size: int
    n_contexts: int
    n_batches: int
    n_converged: int
    n_forward_passes: int
    seconds: float
    per_batch: list[float] = field(default_factory=list)
    statuses: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def critical_sharpness(
    model: nn.Module,
    contexts,
    *,
    n_contexts: int | None,
    settings: MeasureSettings,
    seed: int = 0,
    batch_size: int,
    causal: bool | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    task: ForgettingTask | None = None,
) -> CriticalSharpnessEstimate:
    """``lambda_c = 2 / eta_c`` per batch of ``settings.critical_batch_size or batch_size`` contexts, along the
    optimizer's next update for that batch's gradient (``optimizer``) or along ``-g``; mean and standard error over
    batches.

    The gradient is taken in ``eval()`` mode through the engine's first-gradient path (`ParameterSpace.gradient`);
    with an optimizer it is put in ``.grad`` only for `proposed_update` and the previous ``.grad`` tensors are put
    back (the same objects), the optimizer's state and hyper-parameters are restored by `proposed_update`, the
    weights by the line search, the global random streams and module modes here. Training continues as if nothing
    had run.

    With several processes (DDP, FSDP2, ZeRO), every process calls this with the same arguments: each batch's
    contexts are split over the processes, each forward's loss is summed over them (so every process compares the
    same numbers and takes the same branch of the search), and the line search moves each process's own pieces of
    the parameters (FSDP2's and ZeRO-3's shards): nothing is gathered beyond what the engine's forward gathers. Under
    DeepSpeed ZeRO-1/2/3 the update is the ZeRO optimizer's (`zero_proposed_update`: its torch optimizer stepped on
    its fp32 master partitions with the batch's gradient clipped as the engine clips, and undone).
    """
    start_time = time.perf_counter()
    size = settings.critical_batch_size or fixed_batch_size(batch_size)
    prepared, n_used = prepare_contexts(model, contexts, n_contexts, causal)
    along_optimizer = optimizer is not None and settings.critical_direction == "optimizer"
    if along_optimizer:
        check_zero_update_supported(optimizer)
    space = parameter_space(model, optimizer)
    values, statuses, passes = [], [], 0
    with evaluation_mode(model), preserved_global_rng():
        for start in range(0, n_used, size):
            batch = list(range(start, min(start + size, n_used)))
            share = share_of_contexts(batch, space.rank, space.world_size, lockstep=True)
            n_batch = len(batch)

            def share_loss(m: nn.Module, share=share, n_batch=n_batch) -> torch.Tensor:
                return weighted_context_loss(m, prepared, share.indices, share.n_measured, n_batch)

            with torch.enable_grad():
                grads = space.gradient([share_loss(model)])

            def loss_fn(m: nn.Module, share_loss=share_loss) -> float:
                space.release_gathered()  # ZeRO-3's gathered copies would hide the move of the partitions
                return float(space.sum_over_processes(share_loss(m).detach().double().reshape(1)))

            if not along_optimizer:
                update, learning_rate = [-g for g in grads], 1.0
            else:
                proposed = _optimizer_update(optimizer, space, grads, settings.critical_max_grad_norm)
                # the optimizer lists its parameters by param group (decay, no decay), the space in model order
                by_parameter = {id(p): u for p, u in zip(proposed.params, proposed.updates, strict=True)}
                ordered = [by_parameter.get(id(p), torch.zeros_like(p)) for p in space.params]
                update, learning_rate = space.local_pieces(ordered), proposed.learning_rate
            try:
                result = estimate_critical_sharpness(
                    model,
                    loss_fn,
                    update,
                    learning_rate=learning_rate,
                    parameters=space.tensors,
                    rtol=settings.critical_rtol,
                )
            finally:
                space.release_gathered()
            values.append(result.lambda_c)
            statuses.append(result.status)
            passes += result.n_forward_passes
    found = torch.tensor([v for v in values if math.isfinite(v)], dtype=torch.float64)
    mean = float(found.mean()) if found.numel() else math.nan
    stderr = float(found.std() / math.sqrt(found.numel())) if found.numel() > 1 else math.nan
    inner = torch_optimizer_of(optimizer) if optimizer is not None else None
    return CriticalSharpnessEstimate(
        mean=mean,
        stderr=stderr,
        direction=type(inner).__name__ if along_optimizer else GRADIENT_DESCENT,
        learning_rate=float(_learning_rate(inner)) if along_optimizer else None,
        rtol=float(settings.critical_rtol),
        batch_size=size,
        n_contexts=n_used,
        n_batches=len(values),
        n_converged=sum(status == "converged" for status in statuses),
        n_forward_passes=passes,
        seconds=time.perf_counter() - start_time,
        per_batch=values,
        statuses=statuses,
    )


def weighted_context_loss(
    model: nn.Module, contexts, indices: Sequence[int], n_measured: int, n_batch: int
) -> torch.Tensor:
    """This process's share of a batch's mean cross-entropy: its first ``n_measured`` contexts over ``n_batch`` (the
    rest only keep the processes' passes in step)."""
    batch = contexts.model_inputs(indices, model)
    device = batch["input_ids"].device
    positions = torch.tensor([contexts.positions[i] for i in indices], device=device)
    targets = torch.tensor([contexts.targets[i] for i in indices], device=device)
    logits = logits_at_positions(model, batch, positions)[:, 0]
    per_context = torch.nn.functional.cross_entropy(logits.float(), targets, reduction="none")
    weights = (torch.arange(len(indices), device=device) < n_measured).to(per_context.dtype)
    return (per_context * weights).sum() / n_batch


def _learning_rate(optimizer: torch.optim.Optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])


def _optimizer_update(
    optimizer: torch.optim.Optimizer, space, grads: Sequence[torch.Tensor], max_grad_norm: float | None = None
):
    """The optimizer's next update for ``grads`` (this process's pieces). A torch optimizer gets them as ``.grad``
    for `proposed_update`, clipped first to ``max_grad_norm`` as the Trainer clips before its step, then the previous
    ``.grad`` objects put back (``None`` stays ``None``); DeepSpeed's ZeRO optimizer goes through
    `zero_proposed_update`, which clips as the engine does. A group at learning rate 0 (the end of a linear
    schedule) would propose no step at all: it is measured at learning rate 1 instead, the same direction per unit of
    learning rate for SGD and Adam(W), and its 0 put back."""
    inner = torch_optimizer_of(optimizer)
    zero_groups = [group for group in inner.param_groups if not float(group["lr"]) > 0]
    for group in zero_groups:
        group["lr"] = 1.0
    try:
        if zero_optimizer_of(optimizer) is not None:
            return zero_proposed_update(optimizer, space, grads)
        if max_grad_norm:
            grads = _clipped(grads, space, max_grad_norm)
        params = space.params
        saved = [p.grad for p in params]
        try:
            for p, g in zip(params, space.as_parameter_gradients(grads), strict=True):
                p.grad = g
            return proposed_update(optimizer)
        finally:
            for p, g in zip(params, saved, strict=True):
                p.grad = g
    finally:
        for group in zero_groups:
            group["lr"] = 0.0


def _clipped(grads: Sequence[torch.Tensor], space, max_norm: float) -> list[torch.Tensor]:
    """``torch.nn.utils.clip_grad_norm_``'s rule (the Trainer's) on the whole gradient, its norm taken over the
    processes' pieces where they are shards (FSDP2); a copy, the pieces are left alone."""
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    if space.sharded and space.world_size > 1:
        total = space.sum_across(total.square().reshape(1)).sqrt()[0]
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return [g * scale.to(g.dtype) for g in grads]
