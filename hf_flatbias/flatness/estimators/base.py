"""What every estimator is, and the pieces several share: the labels drawn per context and the length-sorted batches."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from ...constants import PROBED_ESTIMATORS
from ..contexts import TraceContexts, context_generator
from ..distributed import lockstep_minimum
from ..groups import ParameterGroups
from ..memory import auto_batch_size
from ..results import TraceSamples

if TYPE_CHECKING:
    from .settings import TraceSettings


class TraceEstimator(ABC):
    """One estimator of the trace: it turns contexts into `TraceSamples`, values per sampling unit."""

    name: ClassVar[str]
    """Its name in `hf_flatbias.constants.ESTIMATORS`, the module it lives in."""

    per_context: ClassVar[bool]
    """Whether its sampling unit is one context: only then can the trace be split by parameter group, the Fisher
    diagonal be filled from the same draws, and the contexts be shared across processes."""

    @property
    def reads_probe(self) -> bool:
        """Whether it draws probe vectors (``probe``) rather than labels (`hf_flatbias.constants.PROBED_ESTIMATORS`,
        which settings are checked against without importing the estimators)."""
        return self.name in PROBED_ESTIMATORS

    @abstractmethod
    def measure(
        self,
        model: nn.Module,
        contexts: TraceContexts,
        indices: Sequence[int],
        params: Sequence[nn.Parameter],
        settings: TraceSettings,
        *,
        groups: ParameterGroups | None,
        diagonal: dict[int, torch.Tensor] | None,
        advance: Callable[[int], object],
    ) -> TraceSamples:
        """The samples of the contexts ``indices``; ``advance(n)`` is called as ``n`` more contexts are done."""


class BatchEstimator(TraceEstimator):
    """An estimator whose sampling unit is a batch of contexts: one row of values per batch, weighted by its size."""

    per_context = False

    @abstractmethod
    def measure_batch(
        self,
        model: nn.Module,
        contexts: TraceContexts,
        indices: Sequence[int],
        params: Sequence[nn.Parameter],
        settings: TraceSettings,
    ) -> torch.Tensor:
        """(1, values) for the batch ``indices``."""

    def measure(self, model, contexts, indices, params, settings, *, groups, diagonal, advance) -> TraceSamples:
        batches = length_sorted_batches(contexts, indices, resolved_batch_size(model, contexts, indices, settings))
        parts = []
        for batch in batches:
            parts.append(self.measure_batch(model, contexts, batch, params, settings))
            advance(len(batch))
        return TraceSamples(
            values=torch.cat(parts),
            weights=torch.tensor([float(len(batch)) for batch in batches]),
            n_draws=settings.n_draws,
            estimator=self.name,
        )


def sample_labels(probs: torch.Tensor, indices: Sequence[int], n_draws: int, seed: int) -> torch.Tensor:
    """(B, n_draws) labels, row ``b`` drawn from ``probs[b]`` with the generator of context ``indices[b]``."""
    uniforms = torch.stack(
        [torch.rand(n_draws, generator=context_generator(seed, i), dtype=torch.float64) for i in indices]
    ).to(probs.device)
    cdf = probs.double().cumsum(dim=1)
    labels = torch.searchsorted(cdf, uniforms * cdf[:, -1:])
    return labels.clamp_(max=probs.shape[1] - 1)


def resolved_batch_size(
    model: nn.Module, contexts: TraceContexts, indices: Sequence[int], settings: TraceSettings
) -> int:
    """``settings.batch_size``, with ``"auto"`` measured on these contexts."""
    if settings.batch_size == "auto":
        # ranks measure different contexts; under ZeRO-3 and FSDP2 they must still run as many batches
        return lockstep_minimum(auto_batch_size(model, contexts, indices), model)
    return settings.batch_size


def length_sorted_batches(contexts: TraceContexts, indices: Sequence[int], batch_size: int) -> list[list[int]]:
    """Batches of similar lengths, so that padding costs little."""
    ordered = sorted(indices, key=lambda i: len(contexts.input_ids[i]))
    return [ordered[start : start + batch_size] for start in range(0, len(ordered), batch_size)]
