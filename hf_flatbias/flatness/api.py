"""The public entry point: `estimate_hessian_trace` on rows of contexts, in one process or shared across processes."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn
from transformers.utils.logging import is_progress_bar_enabled

from ..constants import DEFAULT_BATCH_SIZE, DEFAULT_ESTIMATOR, DEFAULT_OUTPUT_PROBE, RECOMMENDED_N_DRAWS
from .contexts import TraceContexts
from .distributed import gather_trace_samples, needs_lockstep, release_zero3_leftovers, share_of_contexts, world
from .estimators import TraceSettings, per_context_estimators, trace_samples
from .groups import GroupOf
from .lm import check_lm_model, evaluation_mode, is_causal_lm, measured_parameters, preserved_global_rng
from .results import TraceEstimate, TraceSamples, summarize_trace_samples

PROGRESS_MIN_CONTEXT_DRAWS = 500
"""Contexts x draws from which ``progress=None`` shows a bar: smaller estimates of the default sizes take seconds."""


def estimate_hessian_trace(
    model: nn.Module,
    dataset: Iterable[Mapping[str, Any]],
    *,
    n_contexts: int | None = None,
    n_draws: int = RECOMMENDED_N_DRAWS,
    estimator: str = DEFAULT_ESTIMATOR,
    seed: int = 0,
    batch_size: int | str = DEFAULT_BATCH_SIZE,
    exact_output_expectation: bool = True,
    causal: bool | None = None,
    probe: str = "rademacher",
    output_probe: str = DEFAULT_OUTPUT_PROBE,
    by_group: bool | GroupOf = False,
    positions_per_sequence: int = 1,
    across_processes: bool = False,
    progress: bool | None = None,
) -> TraceEstimate:
    """Estimate the paper's flatness measure, the trace of the Hessian (Fisher) of the pre-training loss.

    Args:
        model: a masked or causal LM (``...ForMaskedLM`` / ``...ForCausalLM``). The trace is over its trainable
            parameters. It is measured in ``eval()`` mode; every module's mode, the parameters' ``.grad`` and the
            global random streams are left as they were.
        dataset: rows with ``input_ids``, ``attention_mask`` and ``labels`` (-100 except at the predicted positions;
            each labelled position is one context), a list or a `datasets.Dataset`.
            `hf_flatbias.flatness.contexts.build_masked_contexts` makes such rows from tokenized text.
        n_contexts: use the first ``n_contexts`` contexts; all by default.
        n_draws: draws of ``y`` per context (probes for ``hutchinson``, Hessian products per batch for
            ``hutchpp``). The default, 2 (`hf_flatbias.constants.RECOMMENDED_N_DRAWS`), measured a better error per
            second with ``per_sample`` than 50 (the paper's number as a secondary summary gives it, unverified);
            `TraceEstimate`'s ``suggested_n_draws`` reports the best value on your model.
        estimator: ``"per_sample"`` (default, fastest), ``"summed"``, ``"hutchinson"``, ``"hutchpp"`` or
            ``"naive"`` (see `hf_flatbias.flatness.estimators`).
        seed: the draws of context ``i`` depend only on ``(seed, i)``.
        batch_size: contexts per forward, or ``"auto"``: as many as keep the measurement's working memory under
            80% of the free GPU memory (half the available RAM on CPU), measured on the longest context
            (`hf_flatbias.flatness.memory.auto_batch_size`, which also takes a stated budget).
        exact_output_expectation: with ``per_sample``, replace the output layer's own term by its exact expectation
            over ``y`` (unbiased, less noise). ``False`` gives the plain sampled norms, draw for draw equal to
            ``naive``.
        causal: whether the model is a causal LM; detected from the model class by default.
        probe: the probe distribution of ``hutchinson`` and ``hutchpp``, ``"rademacher"`` (default) or ``"gaussian"``.
        output_probe: with ``per_sample`` and ``naive``, the cotangent at the logits of each draw:
            ``"rademacher"`` (default) ``sqrt(p) * z - p (sqrt(p) . z)`` with random signs ``z``, or ``"label"`` the
            sampled label's ``e_y - p`` (the paper's draw). Both have the covariance ``diag(p) - p p^T``, so both are
            unbiased for the same Fisher trace; the signs weight every label by ``sqrt(p_y)`` in every draw instead
            of hitting one, and had 1.8-8.9x less draw variance on trained models (`benchmarks/RESULTS.md`).
        by_group: also split the trace by parameter group (`TraceEstimate.by_group`): ``True`` for embeddings,
            each block, final norm, LM head and the decoder's own output-layer term
            (`hf_flatbias.flatness.groups`), or a function from parameter name to group name. ``per_sample`` and
            ``naive`` only; off by default, when it costs nothing.
        positions_per_sequence: causal LMs with ``per_sample``: read up to this many labelled positions of each row
            with one forward and one backward per draw, each position's cotangent drawn as it would be alone
            (independent, mean zero: the cross terms between positions vanish in expectation, so the sum of the
            positions' traces is unbiased). Each row is then one sampling unit whose value is its mean trace per
            position; ``mean`` is the mean trace per position, ``stderr`` is over rows and ``n_contexts`` counts
            positions. Rows with that many labels: `build_masked_contexts(..., positions_per_sequence=...)`.
        across_processes: with several processes (DDP, DeepSpeed), every process calls this with the same
            arguments, measures every world-size-th context and gets the whole estimate: the one-process estimate
            on the same contexts and draws. Per-context estimators (``per_sample``, ``naive``) only. Under DeepSpeed
            ZeRO-3 and FSDP2 the model stays sharded: each pass gathers and frees one module's (one FSDP unit's)
            parameters at a time, through the engine's own hooks, as training does; ``by_group`` with ``naive`` is
            refused there (it needs the whole gradient at once).
        progress: a bar with the time left on stderr, on the main process only (rank 0, counting its own share of
            the contexts). ``None`` shows it for estimates of at least `PROGRESS_MIN_CONTEXT_DRAWS` contexts x draws
            unless transformers' progress bars are disabled; ``True``/``False`` force it on or off.

    Returns:
        A `TraceEstimate`.

    Raises:
        ValueError: a model without an LM head, rows without a labelled position, ``n_draws < 1``, token ids outside
            the model's vocabulary, or too few contexts.
    """
    start = time.perf_counter()
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
    _, contexts, indices = contexts_to_measure(model, dataset, n_contexts=n_contexts, causal=causal)
    _check_partitioned_model(model, across_processes)
    if across_processes and positions_per_sequence > 1 and world()[1] > 1:
        raise ValueError(
            "positions_per_sequence > 1 is measured on one process: a row's positions must share a forward. Use "
            "across_processes=False or positions_per_sequence=1."
        )
    shows_progress = _shows_progress(progress, len(indices) * n_draws)
    with evaluation_mode(model), preserved_global_rng():
        if across_processes:
            samples = _samples_across_processes(model, contexts, indices, settings, shows_progress)
        else:
            samples = trace_samples(model, contexts, settings, indices=indices, progress=shows_progress)
    return summarize_trace_samples(samples, seconds=time.perf_counter() - start)


def contexts_to_measure(
    model: nn.Module, dataset: Iterable[Mapping[str, Any]], *, n_contexts: int | None, causal: bool | None
) -> tuple[list[nn.Parameter], TraceContexts, list[int]]:
    """What every estimate over contexts checks and builds first: the model is an LM with trainable parameters
    (returned), the rows' contexts (causal as the model is, unless ``causal`` says), and the indices of the first
    ``n_contexts`` of them (all by default); raises `ValueError` on a bad model, rows or ``n_contexts``."""
    check_lm_model(model)
    params = measured_parameters(model)
    contexts = TraceContexts.from_rows(dataset, causal=is_causal_lm(model) if causal is None else causal)
    if n_contexts is not None and not 1 <= n_contexts <= len(contexts):
        raise ValueError(f"n_contexts={n_contexts} but the data holds {len(contexts)} contexts (labelled positions).")
    return params, contexts, list(range(len(contexts) if n_contexts is None else n_contexts))


def _shows_progress(progress: bool | None, context_draws: int) -> bool:
    if world()[0] != 0:  # one bar, not one per process
        return False
    if progress is None:
        return context_draws >= PROGRESS_MIN_CONTEXT_DRAWS and is_progress_bar_enabled()
    return progress


def _check_partitioned_model(model: nn.Module, across_processes: bool) -> None:
    if not needs_lockstep(model):
        return
    if not across_processes:
        raise ValueError(
            "The model's parameters are partitioned across processes (DeepSpeed ZeRO-3 or FSDP2): every forward is "
            "a collective over all processes. Call estimate_hessian_trace on every process with across_processes=True."
        )


def _samples_across_processes(
    model: nn.Module, contexts: TraceContexts, indices: list[int], settings: TraceSettings, progress: bool
) -> TraceSamples:
    rank, world_size = world()
    if world_size == 1:
        samples = trace_samples(model, contexts, settings, indices=indices, progress=progress)
        release_zero3_leftovers(model)
        return samples
    if settings.estimator not in per_context_estimators():
        raise ValueError(
            f"across_processes=True needs a per-context estimator "
            f"({' or '.join(repr(name) for name in per_context_estimators())}), got {settings.estimator!r}: its "
            "units are batches of contexts, which would differ from one process."
        )
    share = share_of_contexts(indices, rank, world_size, lockstep=needs_lockstep(model))
    # under ZeRO-3 and FSDP2 the engines gather and free each module's parameters per pass, as in training
    local = (
        trace_samples(model, contexts, settings, indices=share.indices, progress=progress) if share.indices else None
    )
    release_zero3_leftovers(model)
    return gather_trace_samples(local, share.n_measured, world_size)
