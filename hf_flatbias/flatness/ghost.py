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
(`GhostNormRecorder.check_unsupported_unused`). The per-layer pieces (which modules are followed, what a call records,
the contractions of its factors) live in `hf_flatbias.flatness.ghost_layers`. Nothing here knows about the Trainer.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from .distributed import differentiated_parameters
from .ghost_layers import (
    GramCache,
    LayerCall,
    OuterFactors,
    ParamUses,
    elementwise_coefficients,
    embedding_output_scale,
    flatten_positions,
    layer_kind,
    outer_inner_product,
    outer_squared_norm,
)


def _deliver(recorder: weakref.ref[GhostNormRecorder], call: LayerCall, grad: torch.Tensor) -> None:
    alive = recorder()
    if alive is not None:
        alive._arrived(call, grad)


# the records a recorder hands out stay importable from here, where their users (ghost_diagonal) look for them
__all__ = ["GhostNormRecorder", "LayerCall", "OuterFactors", "ParamUses"]


class GhostNormRecorder:
    """Records the calls of supported layers during a forward and returns per-sample squared gradient norms.

    Args:
        model: the module whose parameters are measured.
        params: the parameters that count (usually the trainable ones). Those of `nn.Linear`, transformers'
            `Conv1D`, `nn.Embedding` (also a subclass scaling its lookup by a constant), `nn.LayerNorm` and of
            modules acting elementwise through 1-D parameters (RMSNorm and its kin) are measured; the others are
            listed in `unsupported`, and `check_unsupported_unused` refuses them if the forward uses them.
        keep_outputs_of: modules whose recorded outputs stay held (`LayerCall.output`), e.g. the decoder, whose
            output the caller compares with the logits; the others are held weakly.

    Use as a context manager around the forward; then `gradients_at_outputs(root, grad_root)` (one backward that
    reaches every recorded output) and `squared_norms(...)`, or `streamed_squared_norm_terms`, which forms each
    layer's terms as its gradient arrives. Inside, `gram_cache` (a `GramCache`) holds the Gram matrices of the
    tensors the forward fixed, shared by every draw.
    """

    def __init__(
        self, model: nn.Module, params: Sequence[nn.Parameter], keep_outputs_of: Sequence[nn.Module] = ()
    ) -> None:
        self.model = model
        self._keep_outputs_of = tuple(keep_outputs_of)
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
            kind = layer_kind(module)
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
        self._receive: Callable[[LayerCall, torch.Tensor], None] | None = None

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
        self._kept_outputs: list[torch.Tensor] = []
        self._anchors: dict[torch.device, torch.Tensor] = {}
        self.gram_cache = GramCache()
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
        call = LayerCall(module=module, inputs=inputs.detach(), output_ref=weakref.ref(output))
        if kind == "embedding":
            scale = embedding_output_scale(module, inputs, output)
            if scale is None:
                self._refuse(module, f"a {type(module).__name__} whose output is not a constant times its lookup")
                return None
            call.output_scale = scale
        elif kind == "elementwise":
            names = list(self._measured[module])
            self._probing = True
            try:
                found = elementwise_coefficients(module, inputs, output, names, check=module not in self._checked)
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
            call.inputs = call.inputs.expand(self.batch_size, *call.inputs.shape[1:])
            call.coefficients = {name: c.expand(self.batch_size, *c.shape[1:]) for name, c in call.coefficients.items()}
        # a zero leaf added to every recorded output puts each on a path to one tensor, so that one backward to that
        # leaf reaches them all and their gradients can be consumed as they arrive (`streamed_squared_norm_terms`)
        output = output + self._anchor(output)
        # held weakly, its gradient caught by a hook that lives on the graph, not on the tensor: an output the graph
        # does not save is freed as soon as the forward is done with it
        call.output_ref = weakref.ref(output)
        if any(module is m for m in self._keep_outputs_of):
            self._kept_outputs.append(output)
        # the hook holds the recorder weakly: the graph it lives on must not keep the recorder (and, through the kept
        # outputs, the graph itself) alive in a reference cycle after the measurement
        output.register_hook(partial(_deliver, weakref.ref(self), call))
        self.calls.append(call)
        return output

    def _anchor(self, output: torch.Tensor) -> torch.Tensor:
        if output.device not in self._anchors:
            self._anchors[output.device] = torch.zeros((), device=output.device, requires_grad=True)
        return self._anchors[output.device]

    def _arrived(self, call: LayerCall, grad: torch.Tensor) -> None:
        # a call dropped by `_refuse` after its output was hooked is no longer measured
        if self._receive is not None and call.module in self._kinds:
            self._receive(call, grad)

    def _store(self, call: LayerCall, grad: torch.Tensor) -> None:
        call.grad_output = grad

    def gradients_at_outputs(
        self,
        root: torch.Tensor,
        grad_root: torch.Tensor,
        *,
        retain_graph: bool = False,
        receive: Callable[[LayerCall, torch.Tensor], None] | None = None,
    ) -> None:
        """One backward of ``grad_root`` from ``root`` that reaches every recorded output: each call's gradient goes
        to ``receive(call, grad)`` as it arrives, or by default into ``call.grad_output`` (``None`` for a call the
        root does not depend on)."""
        for call in self.calls:
            call.grad_output = None
        self._receive = self._store if receive is None else receive
        try:
            if self.calls:
                anchors = list(self._anchors.values())
                torch.autograd.grad(root, anchors, grad_root, retain_graph=retain_graph, allow_unused=True)
        finally:
            self._receive = None

    def set_grad_outputs(self, grads: Sequence[torch.Tensor | None]) -> None:
        for call, grad in zip(self.calls, grads, strict=True):
            call.grad_output = grad

    def _static(self, tensor: torch.Tensor, call: LayerCall) -> torch.Tensor:
        """The same tensor object for every draw (so Gram matrices of it can be cached), marked as forward-fixed."""
        views = self._static_views.setdefault(id(call), {})
        key = (tensor.shape, tensor.dtype)
        if key not in views:
            views[key] = tensor
            self.gram_cache.static_ids.add(id(tensor))
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
            g = flatten_positions(grad, batch)
            if kind == "elementwise":
                for name, coefficient in call.coefficients.items():
                    c = flatten_positions(coefficient, batch).to(g.dtype)
                    entry(measured[name]).vectors.append((call, (g * c).sum(dim=1)))
                continue
            if kind == "linear":
                if weight is not None:
                    x = self._static(flatten_positions(call.inputs, batch).to(g.dtype), call)
                    entry(weight).outer.append((call, OuterFactors(left=g, right=x)))
            elif kind == "conv1d":
                if weight is not None:
                    x = self._static(flatten_positions(call.inputs, batch).to(g.dtype), call)
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
                    x = flatten_positions(call.inputs, batch)
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
        return self.calls[0].inputs.device if self.calls else self.params[0].device

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

        self.gradients_at_outputs(root, grad_root, retain_graph=retain_graph, receive=receive)
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
                    total += outer_squared_norm(factors_i, self.gram_cache).double()
                elif own_terms:
                    own += outer_squared_norm(factors_i, self.gram_cache).double()
                for _, factors_j in use.outer[i + 1 :]:
                    total += 2 * outer_inner_product(factors_i, factors_j, self.gram_cache).double()
            for i, (call_i, vector_i) in enumerate(use.vectors):
                if call_i is not split_self_terms_of:
                    total += vector_i.square().sum(dim=1).double()
                elif own_terms:
                    own += vector_i.square().sum(dim=1).double()
                for _, vector_j in use.vectors[i + 1 :]:
                    total += 2 * (vector_i * vector_j).sum(dim=1).double()
            by_parameter[key] = total
        return by_parameter, own
