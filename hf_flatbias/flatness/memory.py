"""How many contexts one ``per_sample`` batch may hold within a memory budget (``batch_size="auto"``).

A batch's working memory grows linearly with the number of contexts: the forward's saved activations (the recorded
layer outputs the graph does not save are let go after the forward), the gradients at the recorded outputs, the
norms' coefficients and the per-context Gram matrices. One real forward and
draw on the longest context, with every tensor it keeps counted once, gives the bytes per context; the model's own
weights are resident whatever the batch (under FSDP2 and ZeRO-3 one gathered module's at a time), so the budget is on
top of them; it also covers the largest tensor's gradient, which the estimator's one-context check against a plain
backward holds once (`one_context_check_bytes`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..machine import available_ram_bytes
from ..tensors import trainable_parameters
from .contexts import TraceContexts
from .distributed import differentiated_parameters
from .ghost import GhostNormRecorder
from .lm import logits_at_positions, model_device

# Margin for what the count leaves out: transient tensors inside one draw (a materialised per-sample gradient of a
# small layer, the softmax) and the allocator's rounding.
SAFETY_FACTOR = 1.25
CPU_BUDGET_FRACTION = 0.5
CUDA_BUDGET_FRACTION = 0.8
MAX_AUTO_BATCH_SIZE = 1024


def default_memory_budget(device: torch.device) -> int:
    """Bytes a measurement may use on ``device``: 80% of the free GPU memory, or half of the available RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * CUDA_BUDGET_FRACTION)
    return int(available_ram_bytes() * CPU_BUDGET_FRACTION)


def per_sample_bytes_per_context(model: nn.Module, contexts: TraceContexts, index: int) -> int:
    """Working memory one context adds to a ``per_sample`` batch, counted on one forward and draw of context
    ``index`` (use the longest: memory grows with the length). The model must be in the mode it is measured in."""
    seen: set[int] = set()
    counted = 0

    def count(tensor: torch.Tensor) -> None:
        nonlocal counted
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in _resident_storages(model) and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            counted += storage.nbytes()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        count(tensor)
        return tensor

    recorder = GhostNormRecorder(model, trainable_parameters(model))
    recorder.batch_size = 1
    batch = contexts.model_inputs([index], model)
    positions = torch.tensor([contexts.positions[index]], device=batch["input_ids"].device)
    with torch.enable_grad(), recorder, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logits = logits_at_positions(model, batch, positions)
    if recorder.calls:
        probs = torch.softmax(logits.detach()[:, 0].double(), dim=-1)
        grad_logits = (-probs).to(logits.dtype).unsqueeze(1)
        grad_logits[0, 0, int(probs.argmax())] += 1.0
        recorder.gradients_at_outputs(logits, grad_logits)
        recorder.squared_norms()
        for call in recorder.calls:
            for tensor in (call.grad_output, *call.coefficients.values()):
                if tensor is not None:
                    count(tensor)
        for gram in recorder.gram_cache.grams():
            count(gram)
    return max(1, int(counted * SAFETY_FACTOR))


def _resident_storages(model: nn.Module) -> set[int]:
    """Where the model's weights and buffers live now: under FSDP2 and ZeRO-3 a module's gathered weights, which the
    engine frees after the module (resident whatever the batch, and one module's at a time)."""
    tensors = (*differentiated_parameters(model, list(model.parameters())), *model.buffers())
    local = (t.to_local() if hasattr(t, "to_local") else t for t in tensors)
    return {t.untyped_storage().data_ptr() for t in local if t.untyped_storage().nbytes() > 0}


def one_context_check_bytes(model: nn.Module) -> int:
    """What the estimator's one-context check against a plain backward holds at once: its largest tensor's gradient,
    three times over for a matrix tied to two uses (both uses' parts and their sum exist together while autograd
    adds them). `hf_flatbias.flatness.estimators.naive`'s `streamed_squared_norm` squares each tensor's gradient in
    float64 a slice at a time and drops it as it forms, so no more of the gradient is ever whole."""
    largest = max(trainable_parameters(model), key=lambda p: p.numel(), default=None)
    return 0 if largest is None else 3 * largest.numel() * largest.element_size()


def auto_batch_size(
    model: nn.Module,
    contexts: TraceContexts,
    indices: Sequence[int],
    *,
    memory_budget: int | None = None,
    max_batch_size: int = MAX_AUTO_BATCH_SIZE,
) -> int:
    """The largest number of contexts per ``per_sample`` batch whose working memory stays under ``memory_budget``
    bytes (`default_memory_budget` of the model's device if ``None``), at most ``max_batch_size`` and the number of
    contexts.

    Raises:
        ValueError: not even one context fits the budget.
    """
    longest = max(indices, key=lambda i: len(contexts.input_ids[i]))
    device = model_device(model)
    budget = default_memory_budget(device) if memory_budget is None else int(memory_budget)
    per_context = per_sample_bytes_per_context(model, contexts, longest)
    check_bytes = one_context_check_bytes(model)
    if per_context + check_bytes > budget:
        raise ValueError(
            f"One context of {len(contexts.input_ids[longest])} tokens needs about {per_context / 2**20:.1f} MiB and "
            f"the one-context check a gradient of {check_bytes / 2**20:.1f} MiB, more than the memory budget of "
            f"{budget / 2**20:.1f} MiB: raise the budget, use shorter contexts, or pass an integer batch_size."
        )
    return max(1, min((budget - check_bytes) // per_context, max_batch_size, len(indices)))
