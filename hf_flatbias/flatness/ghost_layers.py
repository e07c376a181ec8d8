"""The per-layer pieces of ghost norms (`hf_flatbias.flatness.ghost`): which modules the recorder can follow, what
one call of such a module records, and the per-sample contractions of its factors.

A weight used as ``dW = sum_t l_t r_t^T`` has the per-sample squared norm ``sum_{t,s} (l_t . l_s)(r_t . r_s)`` and
the inner product of two uses has the same form (`outer_squared_norm`, `outer_inner_product`); the Gram matrices of
the factors the forward fixes are computed once for all draws (`GramCache`). A module whose 1-D parameters act
elementwise on the last axis gets its per-sample gradient from ``d output / d parameter`` by forward-mode
differentiation (`elementwise_coefficients`). Nothing here hooks a model or knows about the Trainer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jvp
from transformers.pytorch_utils import Conv1D

# What each kind of layer is recognised by; "elementwise" is any parameter-leaf module whose parameters are all 1-D.
LAYER_KINDS = ("linear", "conv1d", "embedding", "layer_norm", "elementwise")


@dataclass
class LayerCall:
    """What one call of a hooked module saw: its input (ids for embeddings) and its output tensor.

    ``output_scale`` is the constant an embedding subclass multiplies its lookup by (Gemma's ``sqrt(hidden)``);
    ``coefficients`` holds, for an elementwise module, ``d output / d parameter`` per parameter name (the normalised
    input for an RMSNorm weight), shaped like the output. The output is held weakly (``output`` is ``None`` once only
    the recorder would keep it): its gradient arrives through a hook on the graph, and a layer output the graph does
    not save (a decoder layer's query, key, attention and MLP projections) is freed as soon as the forward is done
    with it.
    """

    module: nn.Module
    inputs: torch.Tensor
    output_ref: Callable[[], torch.Tensor | None]
    grad_output: torch.Tensor | None = None
    output_scale: float = 1.0
    coefficients: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def output(self) -> torch.Tensor | None:
        return self.output_ref()


@dataclass
class OuterFactors:
    """Per-sample gradient ``sum_t left_t right_t^T``; ``left_ids`` stands for one-hot rows (embedding lookups)."""

    right: torch.Tensor  # (B, T, cols)
    left: torch.Tensor | None = None  # (B, T, rows)
    left_ids: torch.Tensor | None = None  # (B, T) integer rows


@dataclass
class ParamUses:
    param: nn.Parameter
    outer: list[tuple[LayerCall, OuterFactors]] = field(default_factory=list)
    vectors: list[tuple[LayerCall, torch.Tensor]] = field(default_factory=list)  # per-sample gradients (B, numel)


def flatten_positions(tensor: torch.Tensor, batch_size: int) -> torch.Tensor:
    """(B, ..., features) -> (B, T, features): every non-batch, non-feature axis counts as a position."""
    return tensor.reshape(batch_size, -1, tensor.shape[-1])


class GramCache:
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

    def grams(self) -> list[torch.Tensor]:
        """The Gram matrices held so far (what the cache costs in memory)."""
        return list(self._grams.values())


def _dense_gram(x: torch.Tensor, y: torch.Tensor, cache: GramCache) -> torch.Tensor:
    return cache.get(x, y, lambda: torch.bmm(x, y.transpose(1, 2)))


def _left_gram(a: OuterFactors, b: OuterFactors, cache: GramCache) -> torch.Tensor:
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


def outer_inner_product(a: OuterFactors, b: OuterFactors, cache: GramCache) -> torch.Tensor:
    """Per-sample Frobenius inner product of two outer-product gradients, shape (B,)."""
    right_gram = _dense_gram(a.right, b.right, cache)
    return (_left_gram(a, b, cache) * right_gram).sum(dim=(1, 2))


def outer_squared_norm(a: OuterFactors, cache: GramCache) -> torch.Tensor:
    """Per-sample squared norm, through the T x T Gram form or the materialised gradient, whichever is cheaper
    (a Gram of a forward-fixed factor is free after the first draw)."""
    positions, cols = a.right.shape[1], a.right.shape[2]
    if a.left is not None:
        rows = a.left.shape[2]
        gram_cost = (0 if cache.is_static(a.left) else rows) + (0 if cache.is_static(a.right) else cols)
        if rows * cols < positions * gram_cost:
            return torch.einsum("btr,btc->brc", a.left, a.right).square().sum(dim=(1, 2))
    return outer_inner_product(a, a, cache)


def layer_kind(module: nn.Module) -> str | None:
    """Which of `LAYER_KINDS` a module with trainable parameters is, or ``None`` for one the recorder cannot follow."""
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, Conv1D):
        return "conv1d"
    if isinstance(module, nn.Embedding):
        return None if module.max_norm is not None or module.scale_grad_by_freq else "embedding"
    if isinstance(module, nn.LayerNorm) and type(module).forward is nn.LayerNorm.forward:
        return "layer_norm" if len(module.normalized_shape) == 1 else None
    own = list(module.parameters(recurse=False))
    # A parameter leaf (no sub-module holds parameters) with only vector parameters may be an elementwise norm; the
    # first call decides (`elementwise_coefficients`).
    if own and len(own) == sum(1 for _ in module.parameters()) and all(p.dim() == 1 for p in own):
        return "elementwise"
    return None


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype in (torch.float32, torch.float64) else 2e-2


def embedding_output_scale(module: nn.Embedding, ids: torch.Tensor, output: torch.Tensor) -> float | None:
    """The constant an embedding subclass scales its lookup by (1.0 for the stock forward), or ``None`` when its
    output is not a constant multiple of the looked-up rows."""
    if type(module).forward is nn.Embedding.forward:
        return 1.0
    with torch.no_grad():
        rows = F.embedding(ids, module.weight, module.padding_idx).double()
        out = output.detach().double()
        energy = rows.square().sum()
        scale = float((out * rows).sum() / energy) if energy > 0 else 1.0
        tol = _tolerance(output.dtype)
        if not torch.allclose(out, scale * rows, rtol=tol, atol=tol * float(out.abs().max().clamp_min(1e-30))):
            return None
    return scale


class _Unhooked(nn.Module):
    """Runs a module's own forward without its hooks: an engine's hooks (ZeRO-3's fetch and release) must not see the
    probe tensors `functional_call` puts in place of its parameters."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.inner.forward(inputs)


def elementwise_coefficients(
    module: nn.Module, inputs: torch.Tensor, output: torch.Tensor, names: Sequence[str], check: bool
) -> dict[str, torch.Tensor] | str:
    """``d output / d parameter`` in the all-ones direction for each named 1-D parameter, shaped like the output, or
    the reason the module is not elementwise in it.

    Forward-mode differentiation of the module's own forward gives the coefficient whatever the formula (``weight *
    normalised``, ``(1 + weight) * normalised``, a bias). With ``check``, a second, random direction must give the
    coefficient times that direction: the Jacobian is diagonal, so the per-sample gradient is ``sum_t g_t * c_t``.
    """
    params = dict(module.named_parameters(recurse=False))
    inputs = inputs.detach()
    coefficients = {}
    with torch.no_grad():
        for name in names:
            value = params[name].detach()
            if value.shape[0] != output.shape[-1]:
                return (
                    f"its parameter '{name}' has {value.shape[0]} entries but its output's last axis {output.shape[-1]}"
                )

            def forward(parameter: torch.Tensor, name: str = name, inputs: torch.Tensor = inputs) -> torch.Tensor:
                return functional_call(_Unhooked(module), {f"inner.{name}": parameter}, (inputs,))

            _, coefficient = jvp(forward, (value,), (torch.ones_like(value),))
            if check:
                # on the first sample only: the structure does not depend on the sample
                generator = torch.Generator().manual_seed(0)
                direction = (torch.rand(value.shape, generator=generator, dtype=torch.float64) + 0.5).to(value)
                _, along = jvp(partial(forward, inputs=inputs[:1]), (value,), (direction,))
                expected = coefficient[:1] * direction
                tol = _tolerance(output.dtype)
                scale = float(expected.abs().max().clamp_min(1e-30))
                if not torch.allclose(along, expected, rtol=tol, atol=tol * scale):
                    return f"its output does not depend on '{name}' elementwise along the last axis"
            coefficients[name] = coefficient
    return coefficients
