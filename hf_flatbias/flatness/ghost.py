"""Per-sample squared gradient norms from one batched backward ("ghost norms").

For a layer whose weight gradient is a sum of outer products over positions, ``dW = sum_t l_t r_t^T``, the squared
norm of one sample's gradient is ``sum_{t,s} (l_t . l_s)(r_t . r_s)``: it needs the layer's input and the gradient
at its output, never the per-sample weight gradient itself. Tied weights (a word embedding reused as the decoder)
add the cross terms ``2 <dW_u, dW_v>`` between their uses, which have the same form. Norm layers' gradients are
per-sample vectors and are formed directly.

``GhostNormRecorder`` hooks the supported modules of a model, records what each call saw during a forward, and turns
the gradients at the recorded outputs (one ``torch.autograd.grad`` for the whole batch) into per-sample squared
norms over the chosen parameters. Nothing here knows about the Trainer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

SUPPORTED_MODULE_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, Conv1D, nn.Embedding, nn.LayerNorm)


@dataclass
class _LayerCall:
    """What one call of a hooked module saw: its input (ids for embeddings) and its output tensor."""

    module: nn.Module
    inputs: torch.Tensor
    output: torch.Tensor
    grad_output: torch.Tensor | None = None


@dataclass
class _OuterFactors:
    """Per-sample gradient ``sum_t left_t right_t^T``; ``left_ids`` stands for one-hot rows (embedding lookups)."""

    right: torch.Tensor  # (B, T, cols)
    left: torch.Tensor | None = None  # (B, T, rows)
    left_ids: torch.Tensor | None = None  # (B, T) integer rows


@dataclass
class _ParamUses:
    param: nn.Parameter
    outer: list[tuple[_LayerCall, _OuterFactors]] = field(default_factory=list)
    vectors: list[tuple[_LayerCall, torch.Tensor]] = field(default_factory=list)  # per-sample gradients (B, numel)


def _flatten_positions(tensor: torch.Tensor, batch_size: int) -> torch.Tensor:
    """(B, ..., features) -> (B, T, features): every non-batch, non-feature axis counts as a position."""
    return tensor.reshape(batch_size, -1, tensor.shape[-1])


class _GramCache:
    """Gram matrices of tensors fixed by the forward (layer inputs, token ids), computed once for all draws.

    Only the output-gradient side of a ghost norm changes from one draw to the next; Q, K and V projections even
    share one input tensor. Keys are tensor identities, valid while the recorder holds the forward's tensors.
    """

    def __init__(self) -> None:
        self.static_ids: set[int] = set()
        self._grams: dict[tuple[int, int], torch.Tensor] = {}

    def get(self, x: torch.Tensor, y: torch.Tensor, compute) -> torch.Tensor:
        if id(x) in self.static_ids and id(y) in self.static_ids:
            key = (id(x), id(y))
            if key not in self._grams:
                self._grams[key] = compute()
            return self._grams[key]
        return compute()

    def is_static(self, x: torch.Tensor | None) -> bool:
        return x is not None and id(x) in self.static_ids


def _dense_gram(x: torch.Tensor, y: torch.Tensor, cache: _GramCache) -> torch.Tensor:
    return cache.get(x, y, lambda: torch.bmm(x, y.transpose(1, 2)))


def _left_gram(a: _OuterFactors, b: _OuterFactors, cache: _GramCache) -> torch.Tensor:
    """(B, T_a, T_b) inner products of the left factors, one-hot rows handled without materialising them."""
    if a.left_ids is not None and b.left_ids is not None:
        return cache.get(
            a.left_ids, b.left_ids, lambda: (a.left_ids.unsqueeze(2) == b.left_ids.unsqueeze(1)).to(a.right.dtype)
        )
    if a.left_ids is not None:
        # <onehot(id_t), left_s> = left_s[id_t]
        dense = b.left.transpose(1, 2)  # (B, rows, T_b)
        return torch.gather(dense, 1, a.left_ids.unsqueeze(2).expand(-1, -1, dense.shape[2]))
    if b.left_ids is not None:
        return _left_gram(b, a, cache).transpose(1, 2)
    return _dense_gram(a.left, b.left, cache)


def _outer_inner_product(a: _OuterFactors, b: _OuterFactors, cache: _GramCache) -> torch.Tensor:
    """Per-sample Frobenius inner product of two outer-product gradients, shape (B,)."""
    right_gram = _dense_gram(a.right, b.right, cache)
    return (_left_gram(a, b, cache) * right_gram).sum(dim=(1, 2))


def _outer_squared_norm(a: _OuterFactors, cache: _GramCache) -> torch.Tensor:
    """Per-sample squared norm, through the T x T Gram form or the materialised gradient, whichever is cheaper
    (a Gram of a forward-fixed factor is free after the first draw)."""
    positions, cols = a.right.shape[1], a.right.shape[2]
    if a.left is not None:
        rows = a.left.shape[2]
        gram_cost = (0 if cache.is_static(a.left) else rows) + (0 if cache.is_static(a.right) else cols)
        if rows * cols < positions * gram_cost:
            return torch.einsum("btr,btc->brc", a.left, a.right).square().sum(dim=(1, 2))
    return _outer_inner_product(a, a, cache)


class GhostNormRecorder:
    """Records the calls of supported layers during a forward and returns per-sample squared gradient norms.

    Args:
        model: the module whose parameters are measured.
        params: the parameters that count (usually the trainable ones). Only those of supported layers
            (`nn.Linear`, transformers' `Conv1D`, `nn.Embedding`, `nn.LayerNorm`) are seen; the names of the others
            are in `unsupported`, for the caller to check that they receive no gradient.

    Use as a context manager around the forward; then call `outputs()` for the tensors to differentiate,
    `set_grad_outputs(...)` with their gradients, and `squared_norms(...)`.
    """

    def __init__(self, model: nn.Module, params: Sequence[nn.Parameter]) -> None:
        self.model = model
        self.params = list(params)
        wanted = {id(p) for p in self.params}
        self._modules: list[nn.Module] = []
        covered: set[int] = set()
        for module in model.modules():
            own = [p for p in module.parameters(recurse=False) if id(p) in wanted]
            if not own:
                continue
            if not isinstance(module, SUPPORTED_MODULE_TYPES):
                continue
            if isinstance(module, nn.Embedding) and (module.max_norm is not None or module.scale_grad_by_freq):
                continue
            if isinstance(module, nn.LayerNorm) and len(module.normalized_shape) != 1:
                continue
            self._modules.append(module)
            covered.update(id(p) for p in own)
        # Parameters outside the supported layers are left out of the per-sample norms. That is right when they
        # get no gradient (e.g. BERT's untied output bias, which the forward never uses) and wrong otherwise; the
        # estimator compares one context against a plain backward to tell the two apart.
        self.unsupported = [name for name, p in model.named_parameters() if id(p) in wanted and id(p) not in covered]
        self.calls: list[_LayerCall] = []
        self.batch_size: int | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> GhostNormRecorder:
        self.calls = []
        self._cache = _GramCache()
        self._static_views: dict[int, dict] = {}
        for module in self._modules:
            self._handles.append(module.register_forward_hook(self._record))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _record(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        if self.batch_size is None:
            raise RuntimeError("GhostNormRecorder.batch_size must be set before the forward.")
        inputs = args[0]
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            return None
        if output.shape[0] != self.batch_size:
            if output.shape[0] != 1:
                raise ValueError(
                    f"{type(module).__name__} produced an output with leading size {output.shape[0]} for a batch of "
                    f"{self.batch_size}: per-sample norms need batch-first layers. Use estimator='naive'."
                )
            # A broadcast call (e.g. position embeddings of shape (1, T, d)) serves every sample: expanding it
            # here gives each sample its own gradient at the output.
            output = output.expand(self.batch_size, *output.shape[1:])
            inputs = inputs.expand(self.batch_size, *inputs.shape[1:])
        call = _LayerCall(module=module, inputs=inputs.detach(), output=output)
        self.calls.append(call)
        return output

    def outputs(self) -> list[torch.Tensor]:
        return [call.output for call in self.calls]

    def set_grad_outputs(self, grads: Sequence[torch.Tensor | None]) -> None:
        for call, grad in zip(self.calls, grads, strict=True):
            call.grad_output = grad

    def _static(self, tensor: torch.Tensor, call: _LayerCall) -> torch.Tensor:
        """The same tensor object for every draw (so Gram matrices of it can be cached), marked as forward-fixed."""
        views = self._static_views.setdefault(id(call), {})
        key = (tensor.shape, tensor.dtype)
        if key not in views:
            views[key] = tensor
            self._cache.static_ids.add(id(tensor))
        return views[key]

    def _uses(self) -> dict[int, _ParamUses]:
        wanted = {id(p) for p in self.params}
        uses: dict[int, _ParamUses] = {}
        batch = self.batch_size

        def entry(param: nn.Parameter) -> _ParamUses:
            return uses.setdefault(id(param), _ParamUses(param))

        for call in self.calls:
            module, grad = call.module, call.grad_output
            if grad is None:
                continue
            weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
            g = _flatten_positions(grad, batch)
            if isinstance(module, nn.Linear):
                if weight is not None and id(weight) in wanted:
                    x = self._static(_flatten_positions(call.inputs, batch).to(g.dtype), call)
                    entry(weight).outer.append((call, _OuterFactors(left=g, right=x)))
            elif isinstance(module, Conv1D):
                if id(weight) in wanted:
                    x = self._static(_flatten_positions(call.inputs, batch).to(g.dtype), call)
                    entry(weight).outer.append((call, _OuterFactors(left=x, right=g)))
            elif isinstance(module, nn.Embedding):
                if id(weight) in wanted:
                    ids = self._static(call.inputs.reshape(batch, -1), call)
                    if module.padding_idx is not None:
                        # the padding row never receives a gradient
                        g = g * (ids != module.padding_idx).unsqueeze(-1).to(g.dtype)
                    entry(weight).outer.append((call, _OuterFactors(left_ids=ids, right=g)))
            elif isinstance(module, nn.LayerNorm):
                if weight is not None and id(weight) in wanted:
                    x = _flatten_positions(call.inputs, batch)
                    normalized = F.layer_norm(x, module.normalized_shape, None, None, module.eps).to(g.dtype)
                    entry(weight).vectors.append((call, (g * normalized).sum(dim=1)))
            if bias is not None and id(bias) in wanted and not isinstance(module, nn.Embedding):
                entry(bias).vectors.append((call, g.sum(dim=1)))
        return uses

    def squared_norms(self, exclude_self_terms_of: _LayerCall | None = None) -> torch.Tensor:
        """Per-sample squared norm of the gradient over `params`, shape (B,).

        With `exclude_self_terms_of`, the squared norms of that call's own weight and bias contributions are left
        out (its cross terms with other uses of the same parameters stay): the caller adds their expectation.
        """
        total = torch.zeros(self.batch_size, dtype=torch.float64, device=self.calls[0].output.device)
        for use in self._uses().values():
            if use.outer and use.vectors:
                raise ValueError("a parameter used both as a matrix and as a vector is not supported")
            for i, (call_i, factors_i) in enumerate(use.outer):
                if call_i is not exclude_self_terms_of:
                    total += _outer_squared_norm(factors_i, self._cache).double()
                for _, factors_j in use.outer[i + 1 :]:
                    total += 2 * _outer_inner_product(factors_i, factors_j, self._cache).double()
            for i, (call_i, vector_i) in enumerate(use.vectors):
                if call_i is not exclude_self_terms_of:
                    total += vector_i.square().sum(dim=1).double()
                for _, vector_j in use.vectors[i + 1 :]:
                    total += 2 * (vector_i * vector_j).sum(dim=1).double()
        return total
