"""The metrics the flatness steps log between two training losses, averaged when the loss is logged."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable

import torch

#: The loss at ``w + e`` of the SAM-family steps, logged beside the clean ``loss``.
PERTURBED_LOSS = "sam/perturbed_loss"


@dataclasses.dataclass
class FlatnessLog:
    """The flatness metrics of the steps since the last logged ``loss`` (averaged when logged)."""

    metrics: dict[str, list[float]] = dataclasses.field(default_factory=lambda: defaultdict(list))
    skipped_perturbations: int = 0
    #: Sums over the micro-batches of the current update, recorded as one value each when it ends.
    update_sums: dict[str, float] = dataclasses.field(default_factory=lambda: defaultdict(float))

    def record(self, key: str, value: float) -> None:
        self.metrics[key].append(value)

    def add_to_update(self, key: str, value: float) -> None:
        self.update_sums[key] += value

    def close_update(self) -> None:
        for key, value in self.update_sums.items():
            self.record(key, value)
        self.update_sums.clear()

    def average_over_processes(self, key: str, sum_over_processes: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace this process's values of ``key`` by their mean over every process's values (a collective: every
        process must call it, with or without values of its own)."""
        values = self.metrics.get(key, [])
        total, count = sum_over_processes(torch.tensor([sum(values), len(values)], dtype=torch.float64)).tolist()
        if count > 0:
            self.metrics[key] = [total / count]

    def drain_into(self, logs: dict[str, float]) -> None:
        for key, values in self.metrics.items():
            logs[key] = sum(values) / len(values)
        self.metrics.clear()
