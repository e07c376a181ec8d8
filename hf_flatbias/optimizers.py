"""`MuonWithAdamW`: ``torch.optim.Muon`` on the matrices and ``torch.optim.AdamW`` on the rest, as the one optimizer
a `Trainer` takes.

``torch.optim.Muon`` (torch >= 2.9) refuses any parameter that is not 2-D; biases, norms (and usually embeddings and
the output layer) need another optimizer. The Trainer steps, clips, schedules and checkpoints one optimizer, so the
two are held together here: the scheduler sees every param group (the inner optimizers' own group dicts, so a learning
rate it sets reaches them), ``step`` steps both, and the state dict holds both. Give it to the Trainer as
``optimizers=(MuonWithAdamW(model.parameters(), ...), None)`` or ``optimizer_cls_and_kwargs=(MuonWithAdamW, kwargs)``
(with the Trainer's decay/no-decay groups, each group's ``weight_decay`` applies in both inner optimizers).
"""

from __future__ import annotations

import math
from collections import ChainMap
from collections.abc import Callable, Iterable
from numbers import Integral, Real
from typing import Any

import torch


def _check_options(**options: Any) -> None:
    """A `ValueError` naming the option and its range, as torch's optimizers raise: torch's Muon takes ns_steps=0 and
    momentum=1.5 without a word and meets lr='abc' with a TypeError from a comparison."""

    def number(value: Any) -> bool:
        if isinstance(value, torch.Tensor) and value.numel() == 1:  # torch's optimizers take a tensor lr
            value = value.item()
        return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)

    for name in ("lr", "weight_decay", "adamw_eps", "adamw_weight_decay"):
        value = options[name]
        if not (number(value) and value >= 0):
            raise ValueError(f"MuonWithAdamW: {name} must be a finite number >= 0 (got {value!r}).")
    adamw_lr = options["adamw_lr"]
    if adamw_lr is not None and not (number(adamw_lr) and adamw_lr >= 0):
        raise ValueError(f"MuonWithAdamW: adamw_lr must be a finite number >= 0 or None to take lr (got {adamw_lr!r}).")
    momentum = options["momentum"]
    if not (number(momentum) and 0 <= momentum < 1):
        raise ValueError(f"MuonWithAdamW: momentum must be a number in [0, 1) (got {momentum!r}).")
    ns_steps = options["ns_steps"]
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, Integral) or ns_steps < 1:
        raise ValueError(f"MuonWithAdamW: ns_steps must be a whole number >= 1 (got {ns_steps!r}); 5 is Muon's.")
    betas = options["adamw_betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(number(b) and 0 <= b < 1 for b in betas)):
        raise ValueError(f"MuonWithAdamW: adamw_betas must be two numbers in [0, 1) (got {betas!r}).")


class MuonWithAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` for the 2-D parameters given (or, with ``adamw_for``, those it does not pick out) and
    ``torch.optim.AdamW`` for the others.

    Args:
        params: parameters or param groups, as for any torch optimizer.
        lr, weight_decay, momentum, nesterov, ns_steps, adjust_lr_fn: Muon's (see ``torch.optim.Muon``).
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: AdamW's; ``adamw_lr=None`` takes ``lr``. A group's own
            ``lr``/``weight_decay`` override both optimizers' for its parameters.
        adamw_for: a predicate on a parameter that sends a 2-D parameter to AdamW too (embeddings, the head).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 0.02,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
        adamw_for: Callable[[torch.Tensor], bool] | None = None,
    ):
        _check_options(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            ns_steps=ns_steps,
            adamw_lr=adamw_lr,
            adamw_betas=adamw_betas,
            adamw_eps=adamw_eps,
            adamw_weight_decay=adamw_weight_decay,
        )
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        muon_groups, adamw_groups = [], []
        for group in groups:
            options = {key: value for key, value in group.items() if key != "params"}
            tensors = list(group["params"])
            matrices = [p for p in tensors if p.ndim == 2 and not (adamw_for is not None and adamw_for(p))]
            chosen = {id(p) for p in matrices}
            others = [p for p in tensors if id(p) not in chosen]
            if matrices:
                muon_groups.append({**options, "params": matrices})
            if others:
                adamw_options = {"weight_decay": adamw_weight_decay, **options}
                adamw_groups.append({**adamw_options, "params": others})
        if not muon_groups and not adamw_groups:
            raise ValueError("MuonWithAdamW got no parameters.")
        #: The inner optimizers, Muon's first (absent when it has no parameter).
        self.muon = (
            torch.optim.Muon(
                muon_groups,
                lr=lr,
                weight_decay=weight_decay,
                momentum=momentum,
                nesterov=nesterov,
                ns_steps=ns_steps,
                adjust_lr_fn=adjust_lr_fn,
            )
            if muon_groups
            else None
        )
        self.adamw = (
            torch.optim.AdamW(
                adamw_groups,
                lr=lr if adamw_lr is None else adamw_lr,
                betas=adamw_betas,
                eps=adamw_eps,
                weight_decay=adamw_weight_decay,
            )
            if adamw_groups
            else None
        )
        self.optimizers = [opt for opt in (self.muon, self.adamw) if opt is not None]
        # The inner optimizers' own group dicts: what a scheduler writes into them is what they step with.
        super().__init__([group for opt in self.optimizers for group in opt.param_groups], {})
        self.state = ChainMap(*(opt.state for opt in self.optimizers))  # read-only view of both states

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for optimizer in self.optimizers:
            optimizer.step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.muon and self.muon.state_dict(), "adamw": self.adamw and self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name in ("muon", "adamw"):
            optimizer = getattr(self, name)
            if (optimizer is None) != (state_dict.get(name) is None):
                raise ValueError(f"The state dict's {name} part does not match this MuonWithAdamW's parameters.")
            if optimizer is not None:
                optimizer.load_state_dict(state_dict[name])


__all__ = ["MuonWithAdamW"]
