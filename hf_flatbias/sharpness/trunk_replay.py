"""Output-layer SAM with one trunk forward: the trunk's outputs of the clean pass serve the perturbed pass.

When a SAM step perturbs only the output layer (logits-SAM; Phung, Luo et al., ICLR 2026), the trunk (everything the
output layer reads from) computes the same hidden states at ``w`` and at ``w + e``. Instead of a second forward of the
whole model, the perturbed pass runs the model's own forward again with every trunk module answering from what it
returned in the clean pass: the model's glue, its output layer and its loss (a full-logits head, trl's chunked fused
head, DPO's log-probabilities) run as written, at ``w + e``, and the backward reaches the trunk through the clean
pass's graph. Nothing of the loss is re-implemented, so every loss the host computes is differentiated exactly as
in the two-pass step, and the logits of the two passes are never alive at once (the clean ones are freed by the
first gradient).

The trunk is cut along the path from the model down to its output layer: every child, on that path, of a module on
that path is a trunk module unless it is on the path itself. A replayed call answers only when its inputs are those
of the recorded call (the same tensor object where gradients flow, equal values elsewhere); any other call runs the
module, so a model whose glue feeds the head's output back into a trunk module still gets the exact answer, just
without the saving. A trunk that draws random numbers (dropout, noise) would see different draws in a second forward;
`TrunkReplay` notices it from the generators' states and replays nothing then, which is the two-pass step exactly.

Pure: nothing here knows about trainers, optimizers or engines.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree


def trunk_modules(root: nn.Module, head: nn.Module) -> list[nn.Module]:
    """The modules of ``root`` whose outputs the output layer ``head`` reads and which do not contain it: the
    children of each module on the path from ``root`` to ``head`` that are not on the path.

    Raises:
        ValueError: when ``head`` is not a submodule of ``root``.
    """
    path = _path_to(root, head)
    trunk: list[nn.Module] = []
    for parent, next_on_path in zip(path[:-1], path[1:], strict=True):
        trunk.extend(child for child in parent.children() if child is not next_on_path)
    return trunk


def why_trunk_cannot_be_replayed(root: nn.Module, head: nn.Module, perturbed: Sequence[torch.Tensor]) -> str | None:
    """Why the trunk's outputs at ``w`` are not its outputs at ``w + e`` (or cannot be replayed), as a clause for a
    message; ``None`` when they are. ``perturbed`` are the parameters a step moves, all of ``head`` or some."""
    if hasattr(root, "_orig_mod"):
        return "the model is compiled (torch.compile), whose graph cannot take the trunk's recorded outputs"
    in_head = {id(p) for p in head.parameters()}
    if any(id(p) not in in_head for p in perturbed):
        return "the perturbed parameters are not all in the output layer"
    in_trunk = {id(p) for module in trunk_modules(root, head) for p in module.parameters()}
    if any(id(p) in in_trunk for p in perturbed):
        return (
            "the output layer shares its weights with the trunk (tied input embeddings), so moving it moves the "
            "trunk's input too"
        )
    return None


def extra_pass_share(root: nn.Module, head: nn.Module) -> float:
    """The cost of what a replayed step adds to a plain step, as a share of one forward/backward of ``root``: the
    output layer's forward and its weight gradient, ``4 * |head|`` of ``6 * |root|`` floating-point operations per
    token (parameters counted as `PreTrainedModel.floating_point_ops` counts them, input embeddings excluded)."""
    count = getattr(root, "num_parameters", None)
    total = count(exclude_embeddings=True) if callable(count) else sum(p.numel() for p in root.parameters())
    head_size = sum(p.numel() for p in head.parameters())
    return min(1.0, 4 * head_size / (6 * total)) if total else 1.0


class TrunkReplay:
    """Record the trunk modules' outputs in a clean pass, answer the perturbed pass's calls with them.

    ``recording()`` wraps the clean pass's forward, whose loss is then differentiable in the output layer's parameters
    only (the outputs of trunk modules upstream of it reach it detached); ``replaying()`` wraps the perturbed pass's;
    ``clear()`` drops what was recorded (the trunk's activations stay alive from one to the other, as in a plain
    step's backward). Counts of the calls answered from the record (``replayed``) and run again (``computed``) are
    kept for the last pass.
    """

    def __init__(self, modules: Sequence[nn.Module]):
        self.modules = list(modules)
        self._calls: dict[int, deque[tuple[Any, Any, Any]]] = {}
        #: Whether the recorded pass drew random numbers (then ``replaying`` replays nothing).
        self.drew_random_numbers = False
        self.replayed = 0
        self.computed = 0

    @property
    def recorded(self) -> bool:
        return any(self._calls.values())

    def clear(self) -> None:
        self._calls = {}

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record every trunk module's calls (inputs and output) in the pass this context wraps."""
        self.clear()
        calls: dict[int, deque[tuple[Any, Any, Any]]] = {id(module): deque() for module in self.modules}

        def record(module: nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            output = forward(*args, **kwargs)
            calls[id(module)].append((args, kwargs, output))
            if any(leaf.requires_grad for leaf in _tensor_leaves((args, kwargs))):
                return output  # downstream of the output layer: the first gradient may flow through it
            # Upstream of the output layer, the output carries no gradient of the recorded pass (which differentiates
            # the output layer only): handed on detached, the head never computes the hidden states' gradient (a
            # fused head, such as trl's, computes every gradient its inputs require); the second pass
            # backpropagates into the trunk through the recorded output instead.
            return pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, output)

        before = _generator_states()
        with _forwards_replaced(self.modules, record):
            yield
        self.drew_random_numbers = not _same_states(before, _generator_states())
        self._calls = calls

    @contextlib.contextmanager
    def replaying(self) -> Iterator[bool]:
        """Answer the trunk modules' calls from the record where their inputs are the recorded ones; yields whether
        anything is replayed (not when nothing was recorded or the recorded pass drew random numbers)."""
        self.replayed = self.computed = 0
        if not self.recorded or self.drew_random_numbers:
            yield False
            return

        def replay(module: nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            pending = self._calls.get(id(module))
            if pending:
                recorded_args, recorded_kwargs, output = pending.popleft()
                if _same_inputs((recorded_args, recorded_kwargs), (args, kwargs)):
                    self.replayed += 1
                    return output
            self.computed += 1
            return forward(*args, **kwargs)

        with _forwards_replaced(self.modules, replay):
            yield True


def _path_to(root: nn.Module, target: nn.Module) -> list[nn.Module]:
    for name, module in root.named_modules():
        if module is target:
            path = [root]
            for part in name.split(".") if name else []:
                path.append(getattr(path[-1], part))
            return path
    raise ValueError(f"The output layer {type(target).__name__} is not a submodule of {type(root).__name__}.")


@contextlib.contextmanager
def _forwards_replaced(modules: Sequence[nn.Module], handler: Callable[..., Any]) -> Iterator[None]:
    """Route each module's ``forward`` through ``handler(module, original_forward, *args, **kwargs)``. The instance
    attribute is replaced, so ``__call__`` and every hook (DeepSpeed's, accelerate's, a user's) still run around it."""
    saved = []
    try:
        for module in modules:
            saved.append((module, module.__dict__.get("forward")))
            original = module.forward

            def forward(*args: Any, _module=module, _original=original, **kwargs: Any) -> Any:
                return handler(_module, _original, *args, **kwargs)

            module.forward = forward
    except BaseException:
        _restore_forwards(saved)
        raise
    try:
        yield
    finally:
        _restore_forwards(saved)


def _restore_forwards(saved: list[tuple[nn.Module, Any]]) -> None:
    for module, own in saved:
        if own is None:
            del module.forward
        else:
            module.forward = own


def _same_inputs(recorded: Any, now: Any) -> bool:
    """Whether a call sees the recorded call's inputs: where gradients flow the same tensor (a value-equal one could
    depend on other parameters), elsewhere equal values, and an equal structure around them."""
    recorded_leaves, recorded_spec = pytree.tree_flatten(recorded)
    leaves, spec = pytree.tree_flatten(now)
    if spec != recorded_spec:
        return False
    return all(_same_leaf(a, b) for a, b in zip(recorded_leaves, leaves, strict=True))


def _same_leaf(recorded: Any, now: Any) -> bool:
    if recorded is now:
        return True
    if isinstance(recorded, torch.Tensor) or isinstance(now, torch.Tensor):
        return (
            isinstance(recorded, torch.Tensor)
            and isinstance(now, torch.Tensor)
            and not recorded.requires_grad
            and not now.requires_grad
            and recorded.shape == now.shape
            and recorded.dtype == now.dtype
            and recorded.device == now.device
            and torch.equal(recorded, now)
        )
    if type(recorded) is not type(now):
        return False
    try:
        return bool(recorded == now)
    except Exception:  # an object without a usable equality: run the module
        return False


def _tensor_leaves(tree: Any) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


def _generator_states() -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.extend(torch.cuda.get_rng_state_all())
    return states


def _same_states(before: list[torch.Tensor], after: list[torch.Tensor]) -> bool:
    return len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
