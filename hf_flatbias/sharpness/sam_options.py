"""The options of the SAM step (``SAM_STEP_OPTION_NAMES``) as pure functions: the Adam preconditioner (Singh et al.,
ICML 2025), the radius schedule, which parameters are perturbed, and which rows take the ascent. The move to ``w + e``
itself is `hf_flatbias.tensors.perturb_weights`, shared with the trace's sharpness estimate.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Sequence

import torch
from transformers.trainer_utils import unwrap_peft_model


def adam_preconditioner(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    *,
    with_gradient: bool = True,
    chosen: str = "adam",
) -> list[torch.Tensor]:
    """Adam's per-coordinate denominator ``P = sqrt(v_hat) + eps`` from ``v_prev``, ``t``, ``betas`` and ``eps`` in
    ``optimizer``'s state and param groups.

    ``with_gradient=True`` (``sam_preconditioner="adam"``): ``v = beta2 * v_prev + (1 - beta2) * g^2`` and
    ``v_hat = v / (1 - beta2^(t + 1))``, the second moment torch's Adam/AdamW would hold after taking this step's
    gradient ``g`` at its step ``t + 1``. Including ``g`` defines the first step (no state: ``v_prev = 0``, ``t = 0``,
    so ``P = |g| + eps``) and keeps ``|g| / P <= sqrt((1 - beta2^(t+1)) / (1 - beta2))``.

    ``with_gradient=False`` (``"adam_stored_moment"``): the moment as the optimizer holds it,
    ``v_hat = v_prev / (1 - beta2^t)``, ``P = eps`` where it has no state yet (``t = 0``: every coordinate alike, so
    the first step's direction is plain SAM's). A coordinate that never had a gradient (the embedding row of a token
    not yet seen) gets ``P = eps`` there too and takes nearly the whole perturbation.

    ``chosen`` is the ``sam_preconditioner`` value asked for, named in the errors.

    Raises:
        ValueError: when a parameter's state exists but holds no ``exp_avg_sq`` (not an Adam-family optimizer).
    """
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    denominators = []
    for param, grad in zip(params, grads, strict=True):
        state = optimizer.state.get(param) or {}
        if state and "exp_avg_sq" not in state:
            raise ValueError(
                f"sam_preconditioner={chosen!r} needs Adam's second moment, but {type(optimizer).__name__}'s state "
                f"holds {sorted(state)}; use an AdamW optimizer or sam_preconditioner='none'."
            )
        group = group_of.get(id(param))
        if group is None:
            raise ValueError(
                f"sam_preconditioner={chosen!r}: a perturbed parameter is not in the optimizer's param groups."
            )
        beta2, eps = group["betas"][1], group["eps"]
        step = float(state["step"]) if state else 0.0
        if not with_gradient:
            if not state or step == 0:
                denominators.append(torch.full_like(grad, eps))
                continue
            bias_correction = math.sqrt(1 - beta2**step)
            denominators.append(state["exp_avg_sq"].sqrt().div_(bias_correction).add_(eps))
            continue
        second_moment = grad.detach().square().mul_(1 - beta2)
        if state:
            second_moment.add_(state["exp_avg_sq"], alpha=beta2)
        bias_correction = math.sqrt(1 - beta2 ** (step + 1))
        denominators.append(second_moment.sqrt_().div_(bias_correction).add_(eps))
    return denominators


def check_preconditioner_supports_optimizer(
    optimizer: object = None, optimizer_cls: object = None, *, chosen: str = "adam"
) -> None:
    """Raise a one-line ``ValueError`` when an Adam ``sam_preconditioner`` (``chosen``, named in the message) meets an
    optimizer given to the Trainer (``optimizers=``, or the class of ``optimizer_cls_and_kwargs``) that holds no Adam
    second moment for every parameter; ``None`` for either means not given (``optim`` is checked with the
    arguments)."""
    given = optimizer if optimizer is not None else optimizer_cls
    if given is None:
        return
    kind = given if isinstance(given, type) else type(given)
    if issubclass(kind, (torch.optim.Adam, torch.optim.AdamW)):
        return
    name = kind.__name__
    if "Muon" in name:
        raise ValueError(
            f"sam_preconditioner={chosen!r} is not defined for {name}: Muon keeps a momentum buffer and no "
            "per-coordinate second moment for its matrices (its update is the orthogonalised momentum, a "
            "spectral-norm geometry, not Adam's diagonal one), so there is no P = sqrt(v_hat) + eps to take; use "
            "sam_preconditioner='none' with Muon."
        )
    raise ValueError(
        f"sam_preconditioner={chosen!r} reads Adam's second moment from the optimizer's state, but the Trainer was "
        f"given a {name}; give it torch.optim.Adam/AdamW or use sam_preconditioner='none'."
    )


def scheduled_rho(
    rho: float, step: int, *, start: int = 0, end: int = -1, schedule: str = "constant", warmup_steps: int = 0
) -> float | None:
    """The SAM radius at optimizer update ``step``, or ``None`` outside the window ``[start, end)`` (``end=-1``: no
    end). ``"linear_warmup"`` grows it as ``rho * min(1, (step - start + 1) / warmup_steps)``."""
    if step < start or (end != -1 and step >= end):
        return None
    if schedule == "linear_warmup":
        return rho * min(1.0, (step - start + 1) / warmup_steps)
    if schedule != "constant":
        raise ValueError(f"Unknown rho schedule {schedule!r}; use 'constant' or 'linear_warmup'.")
    return rho


def select_parameters(
    named_parameters: Sequence[tuple[str, torch.nn.Parameter]],
    spec: str,
    *,
    output_layer: Sequence[torch.nn.Parameter] = (),
) -> list[torch.nn.Parameter]:
    """The parameters a SAM step perturbs: ``"all"`` of ``named_parameters``, those among them that belong to
    ``output_layer`` (``"output_layer"``), or those whose name matches one of the comma-separated fnmatch patterns.

    Raises:
        ValueError: when the selection is empty (the message lists a few names to match against).
    """
    spec = spec.strip()
    if spec == "all":
        return [p for _, p in named_parameters]
    if spec == "output_layer":
        wanted = {id(p) for p in output_layer}
        selected = [p for _, p in named_parameters if id(p) in wanted]
        what = "the output layer (model.get_output_embeddings())"
    else:
        patterns = [pattern.strip() for pattern in spec.split(",") if pattern.strip()]
        selected = [p for name, p in named_parameters if any(fnmatch.fnmatchcase(name, pat) for pat in patterns)]
        what = f"the patterns {patterns}"
    if not selected:
        names = [name for name, _ in named_parameters][:6]
        raise ValueError(
            f"sam_parameters={spec!r} selects no trainable parameter: {what} matched none of them (names look like "
            f"{names}); use 'all', 'output_layer' or fnmatch patterns of these names."
        )
    return selected


def select_sam_parameters(module: torch.nn.Module, spec: str) -> list[torch.nn.Parameter]:
    """`select_parameters` among the trainable parameters of ``module``, in its order; ``"output_layer"`` is the
    layer ``get_output_embeddings()`` returns (of the base model under peft). A compiled module (``torch.compile``'s
    wrapper, which accelerate's ``unwrap_model`` keeps) is read through the module it compiled, whose parameter names
    have no ``_orig_mod.`` prefix."""
    module = getattr(module, "_orig_mod", module)
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    output_layer = ()
    if spec.strip() == "output_layer":
        head = output_layer_of(module)
        if head is None:
            raise ValueError(
                f"sam_parameters='output_layer' but {type(module).__name__}.get_output_embeddings() returns no "
                "layer; name the parameters with fnmatch patterns instead (e.g. 'classifier.*')."
            )
        output_layer = tuple(head.parameters())
    return select_parameters(named, spec, output_layer=output_layer)


def output_layer_of(module: torch.nn.Module) -> torch.nn.Module | None:
    """The layer ``get_output_embeddings()`` returns (of the base model under peft, of the compiled module under
    ``torch.compile``), or ``None`` where the model has none."""
    get_output = getattr(unwrap_peft_model(getattr(module, "_orig_mod", module)), "get_output_embeddings", None)
    head = get_output() if callable(get_output) else None
    return head if isinstance(head, torch.nn.Module) else None


def ascent_rows(inputs: dict, fraction: float) -> dict:
    """The first ``ceil(fraction * rows)`` rows of a batch (every tensor whose first dimension is the batch's),
    the rows whose gradient defines a sub-batch SAM perturbation (Bahri et al., ACL 2022)."""
    sizes = {value.shape[0] for value in inputs.values() if isinstance(value, torch.Tensor) and value.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(
            f"sam_ascent_fraction < 1 needs every batch tensor to share its first (row) dimension; got sizes {sizes}."
        )
    (rows,) = sizes
    keep = max(1, math.ceil(fraction * rows))
    return {
        name: value[:keep] if isinstance(value, torch.Tensor) and value.dim() > 0 else value
        for name, value in inputs.items()
    }
