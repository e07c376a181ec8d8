"""The Fisher diagonal from the factors a `GhostNormRecorder` recorded: per-parameter sums of the squared per-sample
gradients, formed from the same layer inputs and output gradients as the ghost norms, with no further backward.

The squares are summed both ways at once: over the batch (the diagonal) and over each sample's entries (the
per-sample squared norms of the trace), so that a caller forming the diagonal needs no Gram matrices for the trace.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from .ghost import GhostNormRecorder, LayerCall, OuterFactors, ParamUses

# Per-sample gradients of a dense use are materialised this many elements at a time (a few samples of one layer, 4 MiB
# in float32): the squares and both sums then read them from the cache the product wrote them to, not from memory.
_DENSE_CHUNK_ELEMENTS = 2**20


def _dense_per_sample(factors: OuterFactors, rows: slice) -> torch.Tensor:
    """(b, rows, cols) per-sample gradients ``sum_t left_t right_t^T`` of the samples ``rows``, in the factors'
    dtype."""
    return torch.bmm(factors.left[rows].transpose(1, 2), factors.right[rows])


def _dense_squares(
    uses: Sequence[OuterFactors],
    shape: tuple[int, int],
    excluded: Sequence[OuterFactors] = (),
    *,
    out: torch.Tensor | None = None,
    weight: float = 1.0,
) -> torch.Tensor:
    """``Q_b = (sum_u G_{u,b})^2 - (sum_x X_{x,b})^2`` elementwise over the dense uses ``uses`` (at least one) and
    ``excluded`` (the squares of the per-sample gradients of every use, less the excluded uses' own terms; their cross
    terms with the others stay): ``weight x sum_b Q_b`` is added into ``out`` (shaped ``shape``, float64) unless
    ``out`` is None, and ``Q_b``'s sum over each sample's entries is returned ((B,), in the factors' dtype, float32
    at least).

    A single use at one position per sample (the decoder at the predicted position) is rank one per sample:
    ``sum_b l_b^2 (r_b^2)^T``, one matrix product of the squared factors. Otherwise the per-sample gradients are
    materialised a few samples at a time by batched matrix products (as costly as a weight gradient) and squared in
    place.
    """
    batch = uses[0].right.shape[0]
    if not excluded and len(uses) == 1 and uses[0].right.shape[1] == 1:
        left, right = uses[0].left[:, 0], uses[0].right[:, 0]  # (B, rows), (B, cols)
        dtype = torch.promote_types(left.dtype, torch.float32)
        left, right = left.to(dtype).square(), right.to(dtype).square()
        if out is not None:
            out.add_((left.T @ right).reshape(shape), alpha=weight)
        return left.sum(dim=1) * right.sum(dim=1)
    total, per_sample_sums = None, []
    step = max(1, _DENSE_CHUNK_ELEMENTS // (shape[0] * shape[1]))
    for start in range(0, batch, step):
        rows = slice(start, start + step)
        per_sample = _dense_per_sample(uses[0], rows)
        if per_sample.dtype not in (torch.float32, torch.float64):
            per_sample = per_sample.float()  # squares summed in bfloat16 or float16 would lose the small entries
        for factors in uses[1:]:
            per_sample += _dense_per_sample(factors, rows)
        if excluded:
            # (K + X)^2 - X^2 = K (K + 2 X)
            doubled = 2 * _dense_per_sample(excluded[0], rows)
            for factors in excluded[1:]:
                doubled += 2 * _dense_per_sample(factors, rows)
            doubled += per_sample
            per_sample *= doubled
        else:
            per_sample.square_()
        per_sample_sums.append(per_sample.sum(dim=(1, 2)))
        if out is not None:
            chunk = per_sample.sum(dim=0)
            total = chunk if total is None else total.add_(chunk)
    if out is not None:
        out.add_(total, alpha=weight)  # a batch's sum in the factors' precision, the totals in float64
    return torch.cat(per_sample_sums)


def _reaching_positions(factors: OuterFactors, input_is_left: bool) -> OuterFactors:
    """The same per-sample gradients summed over fewer positions: those whose output gradient is nonzero in some
    sample, each sample's gathered first (zero rows fill the rest). A position whose layer output does not reach the
    logits has a zero output gradient in every draw (in the last layer, every position but the predicted one, which
    makes each sample's gradient rank one; padding): its outer product adds nothing, but a batched product pays for
    it."""
    gradient = factors.right if input_is_left else factors.left
    positions = gradient.shape[1]
    # two one-pass reductions: a row is zero when both its largest and its smallest entry are
    reaching = gradient.amax(dim=2).ne(0) | gradient.amin(dim=2).ne(0)
    kept = int(reaching.sum(dim=1).max()) if positions else 0
    if kept == positions:
        return factors
    order = torch.argsort(reaching.to(torch.uint8), dim=1, descending=True, stable=True)[:, :kept].unsqueeze(2)
    return OuterFactors(
        left=factors.left.gather(1, order.expand(-1, -1, factors.left.shape[2])),
        right=factors.right.gather(1, order.expand(-1, -1, factors.right.shape[2])),
    )


def _sparse_rows(uses: Sequence[OuterFactors], n_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-sample gradients of embedding lookups as ``(sample, row, values)``: one entry per distinct (sample,
    looked-up row), the gradients of all its positions (and uses) summed."""
    samples, ids, values = [], [], []
    for factors in uses:
        batch, positions = factors.left_ids.shape
        samples.append(torch.arange(batch, device=factors.right.device).repeat_interleave(positions))
        ids.append(factors.left_ids.reshape(-1))
        values.append(factors.right.reshape(batch * positions, -1))
    samples, ids, values = torch.cat(samples), torch.cat(ids), torch.cat(values)
    keys, inverse = torch.unique(samples * n_rows + ids, return_inverse=True)
    summed = torch.zeros(len(keys), values.shape[1], dtype=torch.float64, device=values.device)
    summed.index_add_(0, inverse, values.double())
    return keys // n_rows, keys % n_rows, summed


def _dense_rows(factors: OuterFactors, samples: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Row ``ids[i]`` of sample ``samples[i]``'s dense per-sample gradient, for every ``i``: (n, cols)."""
    step = max(1, _DENSE_CHUNK_ELEMENTS // (factors.right.shape[1] * factors.right.shape[2]))
    out = []
    for start in range(0, len(samples), step):
        b, v = samples[start : start + step], ids[start : start + step]
        left = factors.left[b, :, v]  # (n, T)
        out.append(torch.einsum("nt,ntc->nc", left.double(), factors.right[b].double()))
    return torch.cat(out) if out else torch.zeros(0, factors.right.shape[2], dtype=torch.float64)


def _squared_gradient_sums(
    param: nn.Parameter,
    use: ParamUses,
    split: LayerCall | None,
    own_in_diagonal: bool,
    batch: int,
    out: torch.Tensor,
    weight: float,
    is_static: Callable[[torch.Tensor], bool],
) -> tuple[torch.Tensor, torch.Tensor]:
    """For the per-sample gradients ``g_b`` of one parameter over all its uses, with ``o_b`` the part from call
    ``split``'s own use: adds ``weight x sum_b q_b`` into ``out`` (float64, shaped like ``param``) and returns
    ``(||q_b||^2 summed per sample, ||o_b||^2 per sample)``, both (B,) float64, where ``q_b = g_b^2 - o_b^2``
    elementwise (its cross terms stay), or ``q_b = g_b^2`` in what is added with ``own_in_diagonal``.

    Embedding lookups add only the rows they looked up: no parameter-sized tensor is formed for them."""
    device = param.device
    own = torch.zeros(batch, dtype=torch.float64, device=device)
    if use.vectors:
        total = sum(vector for _, vector in use.vectors).double()
        squared = total.square()
        own_squares = torch.zeros_like(squared)
        for call, vector in use.vectors:
            if call is split:
                own_squares += vector.double().square()
        squared -= own_squares
        own += own_squares.sum(dim=1)
        elementwise = (squared + own_squares if own_in_diagonal else squared).sum(dim=0)
        out.add_(elementwise.reshape(param.shape), alpha=weight)
        return squared.sum(dim=1), own
    shape = (param.shape[0], param.shape[1])
    dense = [
        (call, _reaching_positions(factors, input_is_left=is_static(factors.left)))
        for call, factors in use.outer
        if factors.left is not None
    ]
    kept = [factors for call, factors in dense if call is not split]
    dropped = [factors for call, factors in dense if call is split]
    sparse = [factors for call, factors in use.outer if factors.left_ids is not None]
    if any(call is split for call, factors in use.outer if factors.left_ids is not None):
        raise ValueError("the output layer's own terms cannot be left out of an embedding lookup")
    if kept:
        # with no kept dense use, (K + X)^2 - X^2 is zero over the dense part: only the own terms and the lookups
        per_sample = _dense_squares(kept, shape, dropped, out=out, weight=weight).double()
    else:
        per_sample = torch.zeros(batch, dtype=torch.float64, device=device)
    if dropped:
        own += _dense_squares(dropped, shape, out=out if own_in_diagonal else None, weight=weight).double()
    if sparse:
        samples, ids, rows = _sparse_rows(sparse, shape[0])
        crossed = rows.square()
        for factors in kept + dropped:
            crossed += 2 * rows * _dense_rows(factors, samples, ids)
        out.index_add_(0, ids, crossed.to(out.dtype), alpha=weight)
        per_sample.index_add_(0, samples, crossed.sum(dim=1))
    return per_sample, own


def add_squared_gradients(
    recorder: GhostNormRecorder,
    totals: dict[int, torch.Tensor],
    *,
    weight: float = 1.0,
    split_self_terms_of: LayerCall | None = None,
    own_in_diagonal: bool = True,
) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """Add ``weight x sum_b g_b^2`` (elementwise, over the batch) of every measured parameter's per-sample gradient
    ``g_b`` to ``totals[id(param)]`` (created as float64 zeros shaped like the parameter), from the gradients the
    recorder was given (`GhostNormRecorder.set_grad_outputs`): no further backward.

    Returns the per-sample squared norms from the same squares, split as
    `GhostNormRecorder.squared_norm_terms(split_self_terms_of)` splits them: ``(by_parameter, own)``, the own terms of
    the call ``split_self_terms_of`` apart in ``own``. Without ``own_in_diagonal`` those own terms are left out of
    ``totals`` too, for the caller to add their expectation. Dense layers' per-sample gradients are materialised a
    few samples at a time (about the compute of one weight gradient per draw); embedding lookups stay sparse.
    """
    by_parameter: dict[int, torch.Tensor] = {}
    own = torch.zeros(recorder.batch_size, dtype=torch.float64, device=recorder._device())
    for key, use in recorder.parameter_uses().items():
        if use.outer and use.vectors:
            raise ValueError("a parameter used both as a matrix and as a vector is not supported")
        if key not in totals:
            totals[key] = torch.zeros(use.param.shape, dtype=torch.float64, device=use.param.device)
        per_sample, own_part = _squared_gradient_sums(
            use.param,
            use,
            split_self_terms_of,
            own_in_diagonal,
            recorder.batch_size,
            totals[key],
            weight,
            recorder.gram_cache.is_static,
        )
        by_parameter[key] = per_sample
        own += own_part
    return by_parameter, own
