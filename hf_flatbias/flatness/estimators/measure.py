"""Running an estimator over contexts: the checks every estimate makes first, and the progress bar."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from ...constants import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_ESTIMATOR,
    DEFAULT_OUTPUT_PROBE,
    RECOMMENDED_N_DRAWS,
    TRACE_SYMBOLS,
)
from ..contexts import TraceContexts
from ..distributed import needs_lockstep
from ..groups import GroupOf, ParameterGroups, parameter_groups
from ..lm import check_lm_model, measured_parameters, output_vocab_size
from ..results import TraceSamples
from .base import TraceEstimator
from .registry import ESTIMATOR_REGISTRY, per_context_estimators
from .settings import TraceSettings


def compute_trace_samples(
    model: nn.Module,
    contexts: TraceContexts,
    *,
    indices: Sequence[int] | None = None,
    n_draws: int = RECOMMENDED_N_DRAWS,
    estimator: str = DEFAULT_ESTIMATOR,
    seed: int = 0,
    batch_size: int | str = DEFAULT_BATCH_SIZE,
    exact_output_expectation: bool = True,
    probe: str = "rademacher",
    output_probe: str = DEFAULT_OUTPUT_PROBE,
    by_group: bool | GroupOf = False,
    positions_per_sequence: int = 1,
    progress: bool = False,
    diagonal: dict[int, torch.Tensor] | None = None,
) -> TraceSamples:
    """Estimator values for the contexts ``indices`` (all by default), to be concatenated and summarized.

    The model must already be in the mode it is measured in (see `estimate_hessian_trace`). A process measuring a
    share of the contexts passes its own ``indices``; draws depend only on ``(seed, index)``. ``progress`` shows a
    bar over these contexts, with its time left, on stderr. ``diagonal`` (``per_sample`` and ``naive``), a dict to
    fill: ``diagonal[id(p)]`` accumulates, for every measured parameter ``p``, the sum over these contexts of the
    mean over draws of the squared per-draw gradient, elementwise (float64), from the same draws as the values
    (`hf_flatbias.flatness.diagonal`). The other arguments are those of `TraceSettings`.
    """
    settings = TraceSettings(
        n_draws=n_draws,
        estimator=estimator,
        seed=seed,
        batch_size=batch_size,
        exact_output_expectation=exact_output_expectation,
        probe=probe,
        output_probe=output_probe,
        by_group=by_group,
        positions_per_sequence=positions_per_sequence,
    )
    return trace_samples(model, contexts, settings, indices=indices, progress=progress, diagonal=diagonal)


def trace_samples(
    model: nn.Module,
    contexts: TraceContexts,
    settings: TraceSettings,
    *,
    indices: Sequence[int] | None = None,
    progress: bool = False,
    diagonal: dict[int, torch.Tensor] | None = None,
) -> TraceSamples:
    """`compute_trace_samples` with its settings already made."""
    indices = list(range(len(contexts))) if indices is None else list(indices)
    if not indices:
        raise ValueError("compute_trace_samples got no context indices.")
    check_lm_model(model)
    _check_vocabulary(model, contexts, indices)
    estimator = ESTIMATOR_REGISTRY[settings.estimator]
    if diagonal is not None and not estimator.per_context:
        raise ValueError(
            f"The Fisher diagonal needs estimator={_either(per_context_estimators())} (got {settings.estimator!r})."
        )
    if diagonal is not None and settings.positions_per_sequence > 1:
        raise ValueError(
            "The Fisher diagonal reads one position per context; use positions_per_sequence=1 "
            f"(got {settings.positions_per_sequence})."
        )
    _check_sharded(model, estimator, settings, diagonal)
    params = measured_parameters(model)
    groups = _groups(model, params, settings)
    bar = tqdm(
        total=len(indices),
        desc=f"{TRACE_SYMBOLS[settings.estimator]} ({settings.estimator})",
        unit="context",
        disable=not progress,
    )
    with torch.enable_grad(), bar:
        return estimator.measure(
            model, contexts, indices, params, settings, groups=groups, diagonal=diagonal, advance=bar.update
        )


def _check_sharded(model: nn.Module, estimator: TraceEstimator, settings: TraceSettings, diagonal: dict | None) -> None:
    """Refuse, before any pass, what would need the whole model's parameters or gradient on one rank of a model
    ZeRO-3 or FSDP2 shards (the estimate is measured module by module there)."""
    if not needs_lockstep(model):
        return
    sharded = "the model is sharded by ZeRO-3 or FSDP2"
    if not estimator.per_context:
        raise ValueError(
            f"estimator={settings.estimator!r} cannot measure a sharded model ({sharded}): its Hessian-vector products "
            "and probes are parameter-sized on every rank, the whole model the sharding avoids; use "
            "estimator='per_sample' (default) or 'naive'."
        )
    if diagonal is not None:
        raise ValueError(
            f"The Fisher diagonal is not measured on a sharded model ({sharded}): it is parameter-sized on every rank; "
            "measure it on one process or under DDP / ZeRO 0-2."
        )
    if settings.by_group is not False and estimator.name == "naive":
        raise ValueError(
            f"by_group with estimator='naive' needs each context's whole gradient on one rank ({sharded}); use "
            "estimator='per_sample' (default), which splits the trace by group module by module."
        )


def _check_vocabulary(model: nn.Module, contexts: TraceContexts, indices: Sequence[int]) -> None:
    vocab_size = output_vocab_size(model)
    largest = max(max(int(contexts.input_ids[i].max()), contexts.targets[i]) for i in indices)
    if largest >= vocab_size:
        raise ValueError(
            f"Token id {largest} is outside the model's vocabulary of {vocab_size}: the data was tokenized with a "
            "different tokenizer than the model's. Tokenize with the model's own tokenizer."
        )


def _groups(model: nn.Module, params: Sequence[nn.Parameter], settings: TraceSettings) -> ParameterGroups | None:
    if settings.by_group is False:
        return None
    if not ESTIMATOR_REGISTRY[settings.estimator].per_context:
        raise ValueError(
            f"by_group needs a per-context estimator ({_either(per_context_estimators())}), got "
            f"estimator={settings.estimator!r}."
        )
    return parameter_groups(model, params, None if settings.by_group is True else settings.by_group)


def _either(names: Sequence[str]) -> str:
    return " or ".join(repr(name) for name in names)
