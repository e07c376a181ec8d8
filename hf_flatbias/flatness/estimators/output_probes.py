"""The cotangent at the logits of each draw (``output_probe=``) of the per-context estimators (`per_sample`, `naive`).

A draw's squared gradient norm is ``||J^T c||^2`` for the Jacobian ``J`` of the logits at the predicted position and a
random cotangent ``c``; its expectation is the context's Fisher trace ``Tr(J^T Sigma J)`` whenever
``E[c c^T] = Sigma = diag(p) - p p^T``. Two such cotangents, the same backward each:

- ``"label"``: ``e_y - p`` with ``y ~ p`` (the paper's sampled label). A one-hot draw: a confident model's rare labels
  give rare, large norms.
- ``"rademacher"``: ``L z`` with random signs ``z`` and the factor ``L = diag(sqrt p) - p sqrt(p)^T`` of ``Sigma``
  (``L L^T = Sigma`` because ``sum p = 1``), i.e. ``sqrt(p) * z - p (sqrt(p) . z)``: Hutchinson's estimator on the
  ``V x V`` matrix ``L^T J J^T L``, every label weighted by ``sqrt(p_y)`` in every draw.

Both are unbiased draw by draw (the output layer's exact expectation and the Fisher diagonal keep theirs). Context
``i``'s draws depend only on ``(seed, i)``: its labels' uniforms first, then its signs, one draw at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..contexts import context_generator
from .base import sample_labels


class OutputProbes:
    """The cotangents of ``n_draws`` draws for a batch of contexts, formed one draw at a time (`cotangent`).

    Args:
        probs: (B, V) the model's probabilities at each context's predicted position (float64).
        indices: the contexts' indices (their random streams).
        n_draws: draws per context.
        seed: the estimate's seed.
        kind: one of `hf_flatbias.constants.OUTPUT_PROBES`.
    """

    def __init__(self, probs: torch.Tensor, indices: Sequence[int], n_draws: int, seed: int, kind: str) -> None:
        self.probs = probs.double()
        self.kind = kind
        self.n_draws = n_draws
        # drawn for the signs too: `per_sample`'s check against a plain backward is of a sampled label's gradient
        self.labels = sample_labels(self.probs, indices, n_draws, seed)
        if kind == "label":
            return
        self._root = self.probs.sqrt()
        self._generators = []
        for i in indices:
            generator = context_generator(seed, i)
            # the labels' uniforms come first in a context's stream: its signs follow them
            torch.rand(n_draws, generator=generator, dtype=torch.float64)
            self._generators.append(generator)

    def cotangent(self, draw: int) -> torch.Tensor:
        """(B, V) float64 cotangents of draw ``draw``; the draws of the signs' kind must be asked for in order."""
        if self.kind == "label":
            return label_cotangent(self.probs, self.labels[:, draw])
        vocab = self.probs.shape[1]
        signs = torch.stack([torch.randint(0, 2, (vocab,), generator=g, dtype=torch.int8) for g in self._generators])
        # moved as int8, widened where the probabilities are
        z = signs.to(self.probs.device).to(torch.float64).mul_(2).sub_(1)
        weighted = self._root * z
        return weighted - self.probs * weighted.sum(dim=1, keepdim=True)

    def first_label_cotangents(self) -> torch.Tensor:
        """(B, V) ``e_y - p`` of each context's first sampled label, whatever ``kind``."""
        return label_cotangent(self.probs, self.labels[:, 0])


def label_cotangent(probs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``e_y - p`` per row: the gradient of ``log p_y`` with respect to the logits."""
    cotangent = -probs.clone()
    cotangent[torch.arange(len(labels)), labels] += 1.0
    return cotangent
