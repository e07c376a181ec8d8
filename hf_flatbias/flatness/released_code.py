"""The trace the paper's released code measures (github Liuhong99/implicitbiasmlmcode, ``calculate_hessian.py``).

That script is not the paper's Fisher trace (`hf_flatbias.flatness.estimators`, ``per_sample``): it draws one
Gaussian probe ``v`` per batch and averages ``v^T H v``, where ``H`` is the Hessian of the *data-label* masked-LM loss
of a batch of multi-mask sequences (BERT's 15% masking), over every parameter except the pooler and the output
layer's bias. Its expectation is the trace of that Hessian, which equals the Fisher trace only when the model's
conditionals are the true ones; off the optimum it can even be negative.

Kept apart from the paper's estimators so that a comparison can report both numbers side by side.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..constants import IGNORE_INDEX
from .contexts import context_generator
from .lm import evaluation_mode, preserved_global_rng
from .results import TraceEstimate

RELEASED_CODE_ESTIMATOR = "released_code_hutchinson"


def released_code_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The trainable parameters the released code differentiates: all but the pooler and the output layer's bias.

    The output bias is found as the bias of ``model.get_output_embeddings()`` (BERT's ``cls.predictions.bias``,
    RoBERTa's ``lm_head.bias``), so the rule holds whatever name the architecture gives it.
    """
    output_layer = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    output_bias = getattr(output_layer, "bias", None)
    excluded = {id(output_bias)} if output_bias is not None else set()
    selected = [
        (name, param)
        for name, param in model.named_parameters()
        if param.requires_grad and id(param) not in excluded and ".pooler." not in f".{name}"
    ]
    if not selected:
        raise ValueError("The model has no trainable parameter outside the pooler and the output bias.")
    return selected


def released_code_trace(
    model: nn.Module,
    batches: Iterable[Mapping[str, torch.Tensor]],
    *,
    probes_per_batch: int = 1,
    seed: int = 0,
) -> TraceEstimate:
    """Gaussian-probe Hutchinson estimate of the trace of the Hessian of the data-label masked-LM loss.

    Args:
        model: a masked LM returning ``.loss`` when given ``labels``.
        batches: dicts of tensors (``input_ids``, ``attention_mask``, ``labels`` with -100 off the masked
            positions, optionally ``token_type_ids``), e.g. held-out blocks masked with BERT's 15% rule. The loss of a
            batch is the mean cross-entropy over its masked tokens, as the released code uses it.
        probes_per_batch: Gaussian probes per batch (the released code: 1, over 50,000 batches of 128).
        seed: the probes of batch ``b`` depend only on ``(seed, b)``.

    Returns:
        A `TraceEstimate` over batches: ``mean`` of the per-batch averages of ``v^T H v``, ``stderr`` from their
        spread (``nan`` for one batch), ``n_contexts`` the number of batches, ``n_draws`` the probes per batch.
        Measured in ``eval()`` mode (no dropout); modes, ``.grad`` and global random streams are left as they were.
    """
    if probes_per_batch < 1:
        raise ValueError(f"probes_per_batch must be at least 1, got {probes_per_batch}.")
    start = time.perf_counter()
    params = [param for _, param in released_code_parameters(model)]
    device = next(model.parameters()).device
    per_batch: list[float] = []
    # The fused attention kernels have no second derivative; the math kernel does.
    with evaluation_mode(model), preserved_global_rng(), torch.enable_grad(), sdpa_kernel(SDPBackend.MATH):
        for batch_index, batch in enumerate(batches):
            inputs = {key: torch.as_tensor(value).to(device) for key, value in batch.items()}
            if "labels" not in inputs or not (inputs["labels"] != IGNORE_INDEX).any():
                raise ValueError(f"Batch {batch_index} has no masked (labelled) token.")
            loss = model(**inputs).loss
            grads = torch.autograd.grad(loss, params, create_graph=True)
            total = 0.0
            generator = context_generator(seed, batch_index)  # reruns and subsets of batches draw the same probes
            for _ in range(probes_per_batch):
                probe = [torch.randn(p.shape, generator=generator, dtype=p.dtype).to(p.device) for p in params]
                directional = sum((g * v).sum() for g, v in zip(grads, probe, strict=True))
                hessian_probe = torch.autograd.grad(directional, params, retain_graph=True)
                total += float(sum((h.double() * v.double()).sum() for h, v in zip(hessian_probe, probe, strict=True)))
            per_batch.append(total / probes_per_batch)
    if not per_batch:
        raise ValueError("released_code_trace needs at least one batch.")
    values = torch.tensor(per_batch, dtype=torch.float64)
    stderr = float(values.std(unbiased=True) / len(values) ** 0.5) if len(values) > 1 else float("nan")
    return TraceEstimate(
        mean=float(values.mean()),
        stderr=stderr,
        n_contexts=len(values),
        n_draws=probes_per_batch,
        estimator=RELEASED_CODE_ESTIMATOR,
        seconds=time.perf_counter() - start,
    )
