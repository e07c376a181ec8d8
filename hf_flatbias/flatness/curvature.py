"""Exact products with the Hessian or the Fisher of the mean pre-training loss over contexts, on flat vectors.

``matrix="hessian"`` takes a backward through the gradient (double backward); ``matrix="fisher"`` (Gauss-Newton) a
forward-mode ``J v`` and one backward ``J^T (M J v)``, no double backward. See `hf_flatbias.flatness.spectrum`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..constants import CURVATURE_MATRICES, SPECTRUM_MATRICES
from .contexts import TraceContexts
from .lm import logits_at_positions


def check_matrix(matrix: str, choices: tuple[str, ...] = SPECTRUM_MATRICES) -> None:
    if matrix not in choices:
        raise ValueError(f"matrix={matrix!r} is not supported; choose one of {list(choices)}.")


class _LogitsAtPositions(nn.Module):
    """The model's logits at the predicted positions as a module, so `torch.func` can call it on other parameters."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: Mapping[str, torch.Tensor], positions: torch.Tensor) -> torch.Tensor:
        return logits_at_positions(self.model, batch, positions)[:, 0]


class CurvatureOperator:
    """``v -> A v`` for the Hessian or Fisher of the mean pre-training loss over the first ``n_contexts`` contexts, on
    flat vectors over ``params``.

    With the contexts in one batch its graph is built once and kept between products; with several, each product
    builds and frees one batch's graph at a time (one more forward per batch and product): memory stays that of one
    batch, whatever the number of contexts.
    """

    def __init__(
        self,
        model: nn.Module,
        contexts: TraceContexts,
        n_contexts: int,
        params: Sequence[nn.Parameter],
        *,
        matrix: str,
        batch_size: int,
        vector_dtype: torch.dtype = torch.float64,
    ) -> None:
        check_matrix(matrix, CURVATURE_MATRICES)  # adam_preconditioned wraps the Hessian's products
        self.matrix = matrix
        self.params = list(params)
        self.dtype = vector_dtype
        # the products are only as exact as the parameters' dtype, whatever the vectors' dtype
        self.rounding = max(torch.finfo(p.dtype).eps for p in self.params)
        self.device = self.params[0].device
        self.dimension = sum(p.numel() for p in self.params)
        self.n_matvecs = 0
        self._n = n_contexts
        names = {id(p): name for name, p in model.named_parameters()}
        self._names = [f"model.{names[id(p)]}" for p in self.params]
        self._function = _LogitsAtPositions(model)
        self._inputs = []
        for start in range(0, n_contexts, batch_size):
            indices = list(range(start, min(start + batch_size, n_contexts)))
            batch = contexts.model_inputs(indices, model)
            positions = torch.tensor([contexts.positions[i] for i in indices], device=batch["input_ids"].device)
            targets = torch.tensor([contexts.targets[i] for i in indices], device=positions.device)
            self._inputs.append({"batch": batch, "positions": positions, "targets": targets})
        self._kept = self._graph(self._inputs[0]) if len(self._inputs) == 1 else None

    def _graph(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """What the products of one batch differentiate: the loss gradients with their graph (Hessian), or the
        logits with theirs and the softmax (Fisher)."""
        # the fused attention kernels have neither a double backward nor forward-mode derivatives
        with torch.enable_grad(), sdpa_kernel(SDPBackend.MATH):
            logits = self._function(inputs["batch"], inputs["positions"])
            if self.matrix == "hessian":
                # at least float32, and float64 for a float64 model: its products are then exact to float64
                wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
                loss = torch.nn.functional.cross_entropy(wide, inputs["targets"], reduction="sum") / self._n
                grads = torch.autograd.grad(loss, self.params, create_graph=True, allow_unused=True)
                used = _used(grads)
                return {"grads": [grads[i] for i in used], "used": used}
            probs = torch.softmax(logits.detach().double(), dim=-1)
            return {**inputs, "logits": logits, "probs": probs}

    def _unflatten(self, vector: torch.Tensor) -> list[torch.Tensor]:
        pieces, offset = [], 0
        for p in self.params:
            pieces.append(vector[offset : offset + p.numel()].reshape(p.shape).to(p.dtype))
            offset += p.numel()
        return pieces

    def __call__(self, vector: torch.Tensor) -> torch.Tensor:
        self.n_matvecs += 1
        tangents = self._unflatten(vector)
        total = torch.zeros(self.dimension, dtype=self.dtype, device=self.device)
        for inputs in self._inputs:
            keep = self._kept is not None
            part = self._kept if keep else self._graph(inputs)
            if self.matrix == "hessian":
                outputs, grad_outputs = part["grads"], [tangents[i] for i in part["used"]]
            else:
                outputs, grad_outputs = self._fisher_pullback(part, tangents)
            del part
            if outputs:
                self._backward_into(total, outputs, grad_outputs, keep)
            del outputs, grad_outputs
        return total

    def _backward_into(
        self, total: torch.Tensor, outputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor], keep: bool
    ) -> None:
        """``total += d(outputs)/d(params)^T grad_outputs``, each parameter's piece added as soon as the backward
        reaches it and then freed: `torch.autograd.grad` would hold all of them at once, one more full vector in the
        parameters' dtype (measured in `benchmarks/lanczos_memory.py`)."""
        saved = [p.grad for p in self.params]
        handles = []

        def add_and_free(param: torch.Tensor, piece: torch.Tensor) -> None:
            piece.add_(param.grad.reshape(-1))
            param.grad = None

        offset = 0
        for p in self.params:
            p.grad = None
            piece = total[offset : offset + p.numel()]
            handles.append(p.register_post_accumulate_grad_hook(lambda param, piece=piece: add_and_free(param, piece)))
            offset += p.numel()
        try:
            torch.autograd.backward(
                list(outputs), grad_tensors=list(grad_outputs), retain_graph=keep, inputs=self.params
            )
        finally:
            for handle in handles:
                handle.remove()
            for p, grad in zip(self.params, saved, strict=True):
                p.grad = grad

    def _fisher_pullback(
        self, part: dict[str, Any], tangents: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The logits and what to pull back through them for ``F v``: ``(diag(p) - p p^T) J v / n``."""
        primals = {name: p.detach() for name, p in zip(self._names, self.params, strict=True)}
        directions = dict(zip(self._names, tangents, strict=True))

        def logits_of(values: dict[str, torch.Tensor]) -> torch.Tensor:
            return torch.func.functional_call(self._function, values, (part["batch"], part["positions"]))

        with sdpa_kernel(SDPBackend.MATH):
            _, jv = torch.func.jvp(logits_of, (primals,), (directions,))
        probs = part["probs"]
        jv = jv.double()
        weighted = (probs * jv - probs * (probs * jv).sum(dim=-1, keepdim=True)) / self._n
        logits = part["logits"]
        return [logits], [weighted.to(logits.dtype)]


def _used(grads: Sequence[torch.Tensor | None]) -> list[int]:
    # a gradient that does not depend on the parameters (or is absent) has no second derivative to take
    return [i for i, g in enumerate(grads) if g is not None and g.requires_grad]
