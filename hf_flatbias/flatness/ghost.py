"""Per-sample squared gradient norms from one batched backward ("ghost norms").

For a layer whose weight gradient is a sum of outer products over positions, ``dW = sum_t l_t r_t^T``, the squared
norm of one sample's gradient is ``sum_{t,s} (l_t . l_s)(r_t . r_s)``: it needs the layer's input and the gradient
at its output, never the per-sample weight gradient itself. Tied weights (a word embedding reused as the decoder)
add the cross terms ``2 <dW_u, dW_v>`` between their uses, which have the same form. Norm layers' gradients are
per-sample vectors and are formed directly: LayerNorm by its formula, and any other module whose 1-D parameters act
elementwise on the last axis (RMSNorm in its Llama, Mistral, Qwen2 and Gemma ``(1 + weight)`` forms, T5's LayerNorm,
...) through the derivative of its output with respect to each parameter, taken by forward-mode differentiation and
checked on the first call to really be elementwise.

``GhostNormRecorder`` hooks the supported modules of a model, records what each call saw during a forward, and turns
the gradients at the recorded outputs (one ``torch.autograd.grad`` for the whole batch) into per-sample squared
norms over the chosen parameters. A parameter it cannot follow is refused by name if the forward uses it
(`GhostNormRecorder.check_unsupported_unused`). Nothing here knows about the Trainer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jvp
from transformers.pytorch_utils import Conv1D

from .distributed import differentiated_parameters

# What each kind of layer is recognised by; "elementwise" is any parameter-leaf module whose parameters are all 1-D.
LAYER_KINDS = ("linear", "conv1d", "embedding", "layer_norm", "elementwise")


@dataclass
class LayerCall:
    """What one call of a hooked module saw: its input (ids for embeddings) and its output tensor.

    ``output_scale`` is the constant an embedding subclass multiplies its lookup by (Gemma's ``sqrt(hidden)``);
    ``coefficients`` holds, for an elementwise module, ``d output / d parameter`` per parameter name (the normalised
    input for an RMSNorm weight), shaped like the output.
    """

    module: nn.Module
    inputs: torch.Tensor
    output: torch.Tensor
    grad_output: torch.Tensor | None = None
    output_scale: float = 1.0
    coefficients: dict[str, torch.Tensor] = field(default_factory=dict)


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


def _left_gram(a: OuterFactors, b: OuterFactors, cache: _GramCache) -> torch.Tensor:
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


def _outer_inner_product(a: OuterFactors, b: OuterFactors, cache: _GramCache) -> torch.Tensor:
    """Per-sample Frobenius inner product of two outer-product gradients, shape (B,)."""
    right_gram = _dense_gram(a.right, b.right, cache)
    return (_left_gram(a, b, cache) * right_gram).sum(dim=(1, 2))


def _outer_squared_norm(a: OuterFactors, cache: _GramCache) -> torch.Tensor:
    """Per-sample squared norm, through the T x T Gram form or the materialised gradient, whichever is cheaper
    (a Gram of a forward-fixed factor is free after the first draw)."""
    positions, cols = a.right.shape[1], a.right.shape[2]
    if a.left is not None:
        rows = a.left.shape[2]
        gram_cost = (0 if cache.is_static(a.left) else rows) + (0 if cache.is_static(a.right) else cols)
        if rows * cols < positions * gram_cost:
            return torch.einsum("btr,btc->brc", a.left, a.right).square().sum(dim=(1, 2))
    return _outer_inner_product(a, a, cache)


def _layer_kind(module: nn.Module) -> str | None:
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
    # first call decides (`_elementwise_coefficients`).
    if own and len(own) == sum(1 for _ in module.parameters()) and all(p.dim() == 1 for p in own):
        return "elementwise"
    return None


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype in (torch.float32, torch.float64) else 2e-2


def _embedding_output_scale(module: nn.Embedding, ids: torch.Tensor, output: torch.Tensor) -> float | None:
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


def _elementwise_coefficients(
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


class GhostNormRecorder:
    """Records the calls of supported layers during a forward and returns per-sample squared gradient norms.

    Args:
        model: the module whose parameters are measured.
        params: the parameters that count (usually the trainable ones). Those of `nn.Linear`, transformers'
            `Conv1D`, `nn.Embedding` (also a subclass scaling its lookup by a constant), `nn.LayerNorm` and of
            modules acting elementwise through 1-D parameters (RMSNorm and its kin) are measured; the others are
            listed in `unsupported`, and `check_unsupported_unused` refuses them if the forward uses them.

    Use as a context manager around the forward; then call `outputs()` for the tensors to differentiate,
    `set_grad_outputs(...)` with their gradients, and `squared_norms(...)`.
    """

    def __init__(self, model: nn.Module, params: Sequence[nn.Parameter]) -> None:
        self.model = model
        self.params = list(params)
        wanted = {id(p) for p in self.params}
        self._kinds: dict[nn.Module, str] = {}
        self._refused: dict[nn.Module, str] = {}
        self._module_names: dict[nn.Module, str] = {}
        # Which of each module's parameters are measured, by name, as the model holds them now: FSDP2 swaps a module's
        # sharded parameters for unsharded ones while it runs, so identities seen inside a pass are not these.
        self._measured: dict[nn.Module, dict[str, nn.Parameter]] = {}
        self._named_parameters = list(model.named_parameters())
        for name, module in model.named_modules():
            measured = {n: p for n, p in module.named_parameters(recurse=False) if id(p) in wanted}
            if not measured:
                continue
            self._measured[module] = measured
            self._module_names[module] = name
            kind = _layer_kind(module)
            if kind is None:
                self._refused[module] = f"a {type(module).__name__} is not a layer per_sample can follow"
            else:
                self._kinds[module] = kind
        self.calls: list[LayerCall] = []
        self._wanted_ids = wanted
        self.batch_size: int | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._checked: set[nn.Module] = set()
        self._probing = False

    def _covered_ids(self) -> set[int]:
        return {id(p) for module in self._kinds for p in self._measured[module].values()}

    def measures(self, module: nn.Module, name: str) -> bool:
        """Whether ``module``'s parameter ``name`` is among those measured."""
        return name in self._measured.get(module, {})

    def unsupported_parameters(self) -> list[tuple[str, nn.Parameter, str]]:
        """``(name, parameter, reason)`` for every wanted parameter outside the layers the recorder follows."""
        wanted, covered = {id(p) for p in self.params}, self._covered_ids()
        owners = {id(p): module for module in self._refused for p in self._measured[module].values()}
        found = []
        for name, param in self._named_parameters:
            if id(param) in wanted and id(param) not in covered:
                owner = owners.get(id(param))
                reason = self._refused.get(owner, "") if owner is not None else ""
                found.append((name, param, reason))
        return found

    @property
    def unsupported(self) -> list[str]:
        return [name for name, _, _ in self.unsupported_parameters()]

    def check_unsupported_unused(self, root: torch.Tensor, grad_root: torch.Tensor) -> None:
        """Raise a `ValueError` naming every parameter outside the followed layers that ``root`` depends on.

        Parameters the forward never uses (BERT's untied output bias) get no gradient and contribute nothing; a
        used one would be silently missing from the norms.
        """
        missing = self.unsupported_parameters()
        if not missing:
            return
        grads = torch.autograd.grad(
            root,
            differentiated_parameters(self.model, [p for _, p, _ in missing]),
            grad_outputs=grad_root,
            retain_graph=True,
            allow_unused=True,
        )
        used = [
            f"'{name}' ({reason})" if reason else f"'{name}'"
            for (name, _, reason), g in zip(missing, grads, strict=True)
            if g is not None
        ]
        if used:
            raise ValueError(
                f"estimator='per_sample' cannot form per-sample gradients of {', '.join(used[:8])}"
                f"{f' and {len(used) - 8} more' if len(used) > 8 else ''}: it follows Linear, Conv1D, Embedding, "
                "LayerNorm and elementwise norm layers (RMSNorm) only. Use estimator='naive' (exact for any model, "
                "slower), or freeze those parameters (requires_grad=False) to leave them out of the trace."
            )

    def __enter__(self) -> GhostNormRecorder:
        self.calls = []
        self._anchors: dict[torch.device, torch.Tensor] = {}
        self._cache = _GramCache()
        self._static_views: dict[int, dict] = {}
        for module in self._kinds:
            # first among the module's forward hooks: ZeRO-3's own release the module's gathered parameters, which
            # an elementwise or scaled-embedding check reads here
            self._handles.append(module.register_forward_hook(self._record, with_kwargs=True, prepend=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _refuse(self, module: nn.Module, reason: str) -> None:
        """Stop following a module whose first call showed it is not what its structure suggested."""
        self._kinds.pop(module, None)
        self._refused[module] = reason
        self.calls = [call for call in self.calls if call.module is not module]

    def _record(self, module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor | None:
        if self._probing or module not in self._kinds:
            return None
        if self.batch_size is None:
            raise RuntimeError("GhostNormRecorder.batch_size must be set before the forward.")
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            return None
        kind = self._kinds[module]
        if not args or not isinstance(args[0], torch.Tensor) or (kind == "elementwise" and (len(args) > 1 or kwargs)):
            self._refuse(module, f"a {type(module).__name__} called with other than one tensor argument")
            return None
        inputs = args[0]
        call = LayerCall(module=module, inputs=inputs.detach(), output=output)
        if kind == "embedding":
            scale = _embedding_output_scale(module, inputs, output)
            if scale is None:
                self._refuse(module, f"a {type(module).__name__} whose output is not a constant times its lookup")
                return None
            call.output_scale = scale
        elif kind == "elementwise":
            names = list(self._measured[module])
            self._probing = True
            try:
                found = _elementwise_coefficients(module, inputs, output, names, check=module not in self._checked)
            finally:
                self._probing = False
            if isinstance(found, str):
                self._refuse(module, f"a {type(module).__name__}: {found}")
                return None
            self._checked.add(module)
            call.coefficients = found
        if output.shape[0] != self.batch_size:
            if output.shape[0] != 1:
                raise ValueError(
                    f"{type(module).__name__} produced an output with leading size {output.shape[0]} for a batch of "
                    f"{self.batch_size}: per-sample norms need batch-first layers. Use estimator='naive'."
                )
            # A broadcast call (e.g. position embeddings of shape (1, T, d)) serves every sample: expanding it
            # here gives each sample its own gradient at the output.
            output = output.expand(self.batch_size, *output.shape[1:])
            call.output = output
            call.inputs = call.inputs.expand(self.batch_size, *call.inputs.shape[1:])
            call.coefficients = {name: c.expand(self.batch_size, *c.shape[1:]) for name, c in call.coefficients.items()}
        # a zero leaf added to every recorded output puts each on a path to one tensor, so that one backward to that
        # leaf reaches them all and their gradients can be consumed as they arrive (`streamed_squared_norm_terms`)
        output = output + self._anchor(output)
        call.output = output
        self.calls.append(call)
        return output

    def _anchor(self, output: torch.Tensor) -> torch.Tensor:
        if output.device not in self._anchors:
            self._anchors[output.device] = torch.zeros((), device=output.device, requires_grad=True)
        return self._anchors[output.device]

    def outputs(self) -> list[torch.Tensor]:
        return [call.output for call in self.calls]

    def set_grad_outputs(self, grads: Sequence[torch.Tensor | None]) -> None:
        for call, grad in zip(self.calls, grads, strict=True):
            call.grad_output = grad

    def _static(self, tensor: torch.Tensor, call: LayerCall) -> torch.Tensor:
        """The same tensor object for every draw (so Gram matrices of it can be cached), marked as forward-fixed."""
        views = self._static_views.setdefault(id(call), {})
        key = (tensor.shape, tensor.dtype)
        if key not in views:
            views[key] = tensor
            self._cache.static_ids.add(id(tensor))
        return views[key]

    def parameter_uses(self, calls: Sequence[LayerCall] | None = None) -> dict[int, ParamUses]:
        """The uses of each measured parameter by the recorded calls (or by ``calls``) that have an output
        gradient."""
        uses: dict[int, ParamUses] = {}
        batch = self.batch_size

        def entry(param: nn.Parameter) -> ParamUses:
            return uses.setdefault(id(param), ParamUses(param))

        for call in self.calls if calls is None else calls:
            module, grad = call.module, call.grad_output
            if grad is None:
                continue
            kind = self._kinds[module]
            measured = self._measured[module]
            weight, bias = measured.get("weight"), measured.get("bias")
            g = _flatten_positions(grad, batch)
            if kind == "elementwise":
                for name, coefficient in call.coefficients.items():
                    c = _flatten_positions(coefficient, batch).to(g.dtype)
                    entry(measured[name]).vectors.append((call, (g * c).sum(dim=1)))
                continue
            if kind == "linear":
                if weight is not None:
                    x = self._static(_flatten_positions(call.inputs, batch).to(g.dtype), call)
                    entry(weight).outer.append((call, OuterFactors(left=g, right=x)))
            elif kind == "conv1d":
                if weight is not None:
                    x = self._static(_flatten_positions(call.inputs, batch).to(g.dtype), call)
                    entry(weight).outer.append((call, OuterFactors(left=x, right=g)))
            elif kind == "embedding":
                if weight is not None:
                    ids = self._static(call.inputs.reshape(batch, -1), call)
                    if call.output_scale != 1.0:
                        g = g * call.output_scale
                    if module.padding_idx is not None:
                        # the padding row never receives a gradient
                        g = g * (ids != module.padding_idx).unsqueeze(-1).to(g.dtype)
                    entry(weight).outer.append((call, OuterFactors(left_ids=ids, right=g)))
            elif kind == "layer_norm":
                if weight is not None:
                    x = _flatten_positions(call.inputs, batch)
                    normalized = F.layer_norm(x, module.normalized_shape, None, None, module.eps).to(g.dtype)
                    entry(weight).vectors.append((call, (g * normalized).sum(dim=1)))
            if bias is not None and kind != "embedding":
                entry(bias).vectors.append((call, g.sum(dim=1)))
        return uses

    def squared_norms(self, exclude_self_terms_of: LayerCall | None = None) -> torch.Tensor:
        """Per-sample squared norm of the gradient over `params`, shape (B,).

        With `exclude_self_terms_of`, the squared norms of that call's own weight and bias contributions are left
        out (its cross terms with other uses of the same parameters stay): the caller adds their expectation.
        """
        by_parameter, _ = self.squared_norm_terms(exclude_self_terms_of, own_terms=False)
        total = torch.zeros(self.batch_size, dtype=torch.float64, device=self._device())
        for value in by_parameter.values():
            total += value
        return total

    def _device(self) -> torch.device:
        return self.calls[0].output.device if self.calls else self.params[0].device

    def streamed_squared_norm_terms(
        self,
        root: torch.Tensor,
        grad_root: torch.Tensor,
        split_self_terms_of: LayerCall | None = None,
        *,
        own_terms: bool = True,
        retain_graph: bool = False,
    ) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """`squared_norm_terms` of the gradients one backward of ``grad_root`` from ``root`` gives at the recorded
        outputs, formed as each arrives: the gradient at a call whose parameters no other call uses is turned into
        its terms and dropped at once, so the backward never holds the gradients at every layer output together
        (about one activation's worth); those of parameters with several uses (tied weights, for their cross terms)
        are kept to the end."""
        users: dict[int, int] = {}
        for call in self.calls:
            for key in self._measured_ids(call):
                users[key] = users.get(key, 0) + 1
        by_parameter: dict[int, torch.Tensor] = {}
        own = torch.zeros(self.batch_size, dtype=torch.float64, device=self._device())
        held: list[LayerCall] = []

        def receive(call: LayerCall, grad: torch.Tensor) -> None:
            call.grad_output = grad
            if any(users[key] > 1 for key in self._measured_ids(call)):
                held.append(call)
                return
            nonlocal own
            parts, own_part = self.squared_norm_terms(split_self_terms_of, own_terms=own_terms, calls=[call])
            by_parameter.update(parts)
            own = own + own_part
            call.grad_output = None

        handles = [call.output.register_hook(partial(receive, call)) for call in self.calls]
        try:
            if self.calls:
                anchors = list(self._anchors.values())
                torch.autograd.grad(root, anchors, grad_root, retain_graph=retain_graph, allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        parts, own_part = self.squared_norm_terms(split_self_terms_of, own_terms=own_terms, calls=held)
        by_parameter.update(parts)
        for call in held:
            call.grad_output = None
        return by_parameter, own + own_part

    def _measured_ids(self, call: LayerCall) -> list[int]:
        return [id(p) for p in call.module.parameters(recurse=False) if id(p) in self._wanted_ids]

    def squared_norm_terms(
        self,
        split_self_terms_of: LayerCall | None = None,
        *,
        own_terms: bool = True,
        calls: Sequence[LayerCall] | None = None,
    ) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """The per-sample squared norm split into parts that add up to it: ``(by_parameter, own)``.

        ``by_parameter[id(p)]`` (B,) is parameter ``p``'s squared gradient norm (tied uses and their cross terms
        included), less the own terms of the call `split_self_terms_of`, summed apart in ``own`` (left at zero,
        and not computed, with ``own_terms=False``). With ``calls``, over the parameters of those calls only (every
        use of them must be among ``calls``).
        """
        by_parameter: dict[int, torch.Tensor] = {}
        own = torch.zeros(self.batch_size, dtype=torch.float64, device=self._device())
        for key, use in self.parameter_uses(calls).items():
            if use.outer and use.vectors:
                raise ValueError("a parameter used both as a matrix and as a vector is not supported")
            total = torch.zeros_like(own)
            for i, (call_i, factors_i) in enumerate(use.outer):
                if call_i is not split_self_terms_of:
                    total += _outer_squared_norm(factors_i, self._cache).double()
                elif own_terms:
                    own += _outer_squared_norm(factors_i, self._cache).double()
                for _, factors_j in use.outer[i + 1 :]:
                    total += 2 * _outer_inner_product(factors_i, factors_j, self._cache).double()
            for i, (call_i, vector_i) in enumerate(use.vectors):
                if call_i is not split_self_terms_of:
                    total += vector_i.square().sum(dim=1).double()
                elif own_terms:
                    own += vector_i.square().sum(dim=1).double()
                for _, vector_j in use.vectors[i + 1 :]:
                    total += 2 * (vector_i * vector_j).sum(dim=1).double()
            by_parameter[key] = total
        return by_parameter, own
