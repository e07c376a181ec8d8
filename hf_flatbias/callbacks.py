"""Trainer callbacks: the paper's flatness measure logged during training, and checkpoint selection by flatness."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from .constants import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_ESTIMATOR,
    DEFAULT_SAM_RHO,
    ESTIMATORS,
    MEASURES,
    RECOMMENDED_N_DRAWS,
    SAM_SHARPNESS_METRIC,
    SAM_SHARPNESS_STDERR_METRIC,
    SPECTRUM_MATRICES,
    TOP_EIGENVALUE_METRIC,
    TRACE_METRIC,
    TRACE_STDERR_METRIC,
)
from .flatness.api import estimate_hessian_trace
from .flatness.contexts import build_masked_contexts
from .flatness.lm import check_tokenizer_fits_model, is_causal_lm, output_vocab_size
from .flatness.results import FlatnessRecord, TraceEstimate
from .selection import SELECTION_FILE, CheckpointRecord, CheckpointSelection, select_flattest_checkpoint

logger = logging.getLogger(__name__)

_CONTEXT_COLUMNS = ("input_ids", "attention_mask", "token_type_ids", "completion_mask")


class HessianTraceCallback(TrainerCallback):
    """Log the trace of the Hessian of the pre-training loss (Liu et al., 2023) while a model trains.

    A fixed, seeded set of contexts (one masked position each, as in the paper) is built once from ``eval_dataset``
    or the trainer's eval set; every measurement uses the same contexts and draws, so values are comparable across
    steps. The estimate is logged as ``flatness/hessian_trace`` and ``flatness/hessian_trace_stderr`` through
    ``Trainer.log``, so it lands in ``state.log_history`` and reaches every reporter (TensorBoard, W&B, ...), and the
    latest `TraceEstimate` stays in `flatness_record` (a `FlatnessRecord`, with the step of the weights measured) for
    the model card; `last_estimate` and `last_estimate_step` read it.

    By default the callback also measures at the last step of training when its latest measurement is older, so
    the final checkpoint and ``trainer.train(); trainer.push_to_hub()`` publish the trace of the weights they carry.

    The trace covers the model's trainable parameters (``requires_grad``): with LoRA, the adapters only.

    Inside trl (`FlatBiasSFTTrainer`, `FlatBiasDPOTrainer`, whose eval sets trl has tokenized) it is the next-token
    Fisher trace at positions the fine-tuning trains: SFT's trained tokens (the completions with the
    completion-only loss; each packed document on its own), DPO's chosen responses after their prompts, measured
    on the policy (the reference model is not measured).

    Measuring costs about what training on the same number of sequences does: one estimate of 256 contexts of 128
    tokens at 2 draws took 24 CPU seconds on a 15M-parameter BERT, as long as 10 training steps of 16 sequences
    (`benchmarks/callback_overhead.py`). So that adding the callback costs little, ``max_overhead`` (5% by default)
    caps the time it spends as a share of the training time so far: each measurement uses as many of the
    ``n_contexts`` contexts as fit in what is left of that share, judged from the seconds per context of the
    previous measurement (the first uses one batch), and never fewer than one batch; a measurement after an
    evaluation that does not fit is skipped. Measurements at ``every_n_steps`` and at the end are always taken. The
    logged standard error is that of the contexts actually used, which are always the first ones of the same fixed
    set, with the same draws: a smaller measurement is noisier, never biased. `measurement_history` records each
    measurement's step, contexts and seconds.

    Measuring does not change training: the model is put in ``eval()`` and every module back in its own mode after,
    draws use their own generators and the global random streams are restored, no ``.grad`` is written
    (``torch.autograd.grad`` only), the optimizer is never touched and parameters stay where they are.

    `FlatBiasTrainer` binds the callback to itself. With a plain `transformers.Trainer`, call
    ``callback.bind_trainer(trainer)`` after building the trainer.

    Args:
        eval_dataset: tokenized rows (``input_ids``, optionally ``attention_mask``); the trainer's ``eval_dataset``
            when ``None``. Existing labels are ignored: contexts are re-masked one position per row.
        n_contexts: contexts per measurement (rows are reused with other positions if there are fewer).
        n_draws: draws of ``y`` per context. The default, 2, measured a better error per second than 50 (the
            paper's, unverified; see `estimate_hessian_trace`).
        every_n_steps: also measure every that many optimizer steps; ``None`` measures only on evaluation.
        on_evaluate: measure after each evaluation.
        measure_at_end: measure at the end of training (its last step, or where it stopped early) unless the latest
            measurement was taken on those weights; ``False`` measures only when ``every_n_steps`` or
            ``on_evaluate`` say so.
        estimator: see `estimate_hessian_trace`.
        seed: fixes both the contexts and the draws.
        batch_size: contexts per forward; also the smallest measurement ``max_overhead`` allows.
        max_overhead: the share of the training time the callback may spend measuring (see above); ``None`` measures
            all ``n_contexts`` contexts at every measurement, whatever it costs.
        mask_token_id: the mask id for masked LMs; from the trainer's ``processing_class`` when ``None``.
        by_group: also split the trace by parameter group (embeddings, each block, final norm, head, the decoder's
            own output-layer term; see `estimate_hessian_trace`), log each group's trace as
            ``flatness/hessian_trace/<group>`` and record the split in the model card.
        also_measure: measures taken with the trace on the same contexts, opt-in: ``"top_eigenvalue"`` (logged as
            ``flatness/top_eigenvalue``, kept in `flatness_record`) and ``"sam_sharpness"`` (logged as
            ``flatness/sam_sharpness`` and ``..._stderr``, kept there too); the card records each with
            its settings and step. Every process computes them whole (they are not split across processes).
        eigenvalue_matrix: ``"fisher"`` (default) or ``"hessian"``, for ``"top_eigenvalue"``.
        sam_rho: the radius of ``"sam_sharpness"``; its batches are the trainer's ``per_device_train_batch_size``
            contexts, each taking its own ascent step as SAM does in training.
    """

    def __init__(
        self,
        eval_dataset: Iterable[Mapping[str, Any]] | None = None,
        *,
        n_contexts: int = 256,
        n_draws: int = RECOMMENDED_N_DRAWS,
        every_n_steps: int | None = None,
        on_evaluate: bool = True,
        measure_at_end: bool = True,
        estimator: str = DEFAULT_ESTIMATOR,
        seed: int = 0,
        batch_size: int = DEFAULT_BATCH_SIZE,
        mask_token_id: int | None = None,
        by_group: bool = False,
        also_measure: Sequence[str] = (),
        eigenvalue_matrix: str = "fisher",
        sam_rho: float = DEFAULT_SAM_RHO,
        max_overhead: float | None = 0.05,
    ) -> None:
        if n_contexts < 1:
            raise ValueError(f"n_contexts must be >= 1 (got {n_contexts}).")
        if not isinstance(n_draws, int) or n_draws < 1:
            raise ValueError(f"n_draws must be an integer >= 1 (got {n_draws!r}).")
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1 or None (got {every_n_steps}).")
        if estimator not in ESTIMATORS:  # here, not at the first measurement some steps into training
            raise ValueError(f"estimator={estimator!r} is not one of {list(ESTIMATORS)}.")
        if max_overhead is not None and not (isinstance(max_overhead, (int, float)) and max_overhead > 0):
            raise ValueError(f"max_overhead must be a number > 0 or None for no budget (got {max_overhead!r}).")
        self.also_measure = _check_extra_measures(also_measure, eigenvalue_matrix, sam_rho)
        self.eigenvalue_matrix = eigenvalue_matrix
        self.sam_rho = sam_rho
        self.eval_dataset = eval_dataset
        self.n_contexts = n_contexts
        self.n_draws = n_draws
        self.every_n_steps = every_n_steps
        self.measure_on_evaluate = on_evaluate
        self.measure_at_end = measure_at_end
        self.estimator = estimator
        self.seed = seed
        self.batch_size = batch_size
        self.mask_token_id = mask_token_id
        self.by_group = by_group
        self.max_overhead = max_overhead
        self.measurement_history: list[dict[str, float]] = []
        self.flatness_record = FlatnessRecord()
        self._trainer = None
        self._contexts: list[dict[str, list[int]]] | None = None
        self._measured_step: int | None = None
        self._train_start = time.perf_counter()
        self._measuring_seconds = 0.0

    @property
    def last_estimate(self) -> TraceEstimate | None:
        """The latest trace estimate (``flatness_record.trace``)."""
        return self.flatness_record.trace

    @property
    def last_estimate_step(self) -> int | None:
        """The training step of the weights the latest trace was measured on (``flatness_record.trace_step``)."""
        return self.flatness_record.trace_step

    def bind_trainer(self, trainer) -> None:
        """Give the callback the trainer it logs through (`FlatBiasTrainer` does this itself)."""
        self._trainer = trainer

    # ------------------------------------------------------------------ events

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if self._trainer is None:
            raise RuntimeError(
                "HessianTraceCallback is not bound to a trainer, so it cannot log. FlatBiasTrainer binds its "
                "callbacks itself; with a plain transformers.Trainer call callback.bind_trainer(trainer) after "
                "creating the trainer."
            )
        self._check_engine_supports_estimator()
        self._contexts = self._build_contexts()
        self._measured_step = None
        self._train_start = time.perf_counter()
        self._measuring_seconds = 0.0
        self.measurement_history = []

    def _check_engine_supports_estimator(self) -> None:
        # Fail at the start of training, not at the first measurement hours later.
        plugin = getattr(self._trainer.accelerator.state, "deepspeed_plugin", None)
        stage = None if plugin is None else plugin.deepspeed_config.get("zero_optimization", {}).get("stage")
        if stage == 3 and self.also_measure:
            raise ValueError(
                f"HessianTraceCallback(also_measure={list(self.also_measure)}) does not support DeepSpeed ZeRO-3 (each "
                "process computes these measures on the whole model); leave also_measure empty under ZeRO-3."
            )
        if (stage == 3 or self._trainer.args.world_size > 1) and self.estimator not in ("per_sample", "naive"):
            raise ValueError(
                f"HessianTraceCallback(estimator={self.estimator!r}) on several processes needs a per-context "
                "estimator: pass estimator='per_sample' (default) or 'naive'."
            )

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        scheduled = self.every_n_steps is not None and state.global_step % self.every_n_steps == 0
        # the last step's checkpoint is saved right after on_step_end: measuring here puts its trace on its card
        last = self.measure_at_end and state.max_steps > 0 and state.global_step >= state.max_steps
        if scheduled or last:
            self._measure_once_at(state.global_step, required=True)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        # a run stopped early (e.g. EarlyStoppingCallback) ends before max_steps; the final save and push follow
        if not self.measure_at_end or state.global_step == 0:
            return
        step = state.global_step
        if args.load_best_model_at_end and state.best_model_checkpoint and state.best_global_step is not None:
            step = state.best_global_step  # the Trainer has just loaded that checkpoint's weights
        self._measure_once_at(step, required=True)

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if self.measure_on_evaluate:
            self._measure_once_at(state.global_step, required=False)

    def _measure_once_at(self, step: int, *, required: bool) -> None:
        # an evaluation right after a scheduled measurement sees the same weights: measuring again only costs time
        if self._measured_step == step:
            return
        n_contexts = self._contexts_within_budget(required)
        if n_contexts > 0:
            self.measure(step=step, n_contexts=n_contexts)

    def _contexts_within_budget(self, required: bool) -> int:
        """Contexts the next measurement may use under ``max_overhead`` (0: skip it), the same on every process."""
        available = len(self._contexts) if self._contexts is not None else self.n_contexts
        if self.max_overhead is None:
            return available
        previous = self.measurement_history[-1] if self.measurement_history else None
        train_seconds = time.perf_counter() - self._train_start - self._measuring_seconds
        n_contexts = contexts_within_budget(
            max_overhead=self.max_overhead,
            train_seconds=train_seconds,
            measuring_seconds=self._measuring_seconds,
            seconds_per_context=None if previous is None else previous["seconds"] / previous["n_contexts"],
            n_contexts=available,
            min_contexts=min(self.batch_size, available),
            required=required,
        )
        accelerator = getattr(self._trainer, "accelerator", None)
        if accelerator is not None and accelerator.num_processes > 1:
            # clocks differ between processes; the estimate needs the same contexts on all of them
            counts = accelerator.gather(torch.tensor([n_contexts], device=accelerator.device))
            n_contexts = int(counts.min())
        return n_contexts

    # ------------------------------------------------------------------ measuring

    def measure(self, step: int | None = None, n_contexts: int | None = None) -> TraceEstimate:
        """Estimate the trace now on the trainer's model, log it through the trainer and return it.

        ``step``: the training step of the model's weights, kept in `flatness_record` for the card; the trainer's
        current step by default. ``n_contexts``: measure on the first that many of the callback's contexts; all of
        them by default (``max_overhead`` applies to the measurements the callback schedules itself).
        """
        if self._trainer is None:
            raise RuntimeError("HessianTraceCallback.measure needs a trainer: call bind_trainer(trainer) first.")
        if self._contexts is None:
            self._contexts = self._build_contexts()
        start = time.perf_counter()
        n_contexts = len(self._contexts) if n_contexts is None else min(n_contexts, len(self._contexts))
        estimate = estimate_hessian_trace(
            self._trainer.model,
            self._contexts,
            n_contexts=n_contexts,
            n_draws=self.n_draws,
            estimator=self.estimator,
            seed=self.seed,
            batch_size=self.batch_size,
            by_group=self.by_group,
            # every rank runs the callbacks: each measures its share of the contexts, all get the whole estimate
            across_processes=self._trainer.args.world_size > 1,
            # a long measurement shows a bar as the trainer's evaluation does, and is silenced with it
            progress=False if self._trainer.args.disable_tqdm else None,
        )
        step = int(self._trainer.state.global_step if step is None else step)
        self.flatness_record = replace(self.flatness_record, trace=estimate, trace_step=step)
        self._measured_step = step
        logs = {TRACE_METRIC: estimate.mean, TRACE_STDERR_METRIC: estimate.stderr}
        for group, part in (estimate.by_group or {}).items():
            logs[f"{TRACE_METRIC}/{group}"] = part.mean
        self._log(logs)
        if self.also_measure:
            self._measure_beyond_trace(step, n_contexts)
        seconds = time.perf_counter() - start
        self._measuring_seconds += seconds
        self.measurement_history.append(
            {
                "step": step,
                "n_contexts": n_contexts,
                "seconds": seconds,
                "trace": estimate.mean,
                "stderr": estimate.stderr,
            }
        )
        return estimate

    def _measure_beyond_trace(self, step: int, n_contexts: int) -> None:
        from .flatness.spectrum import estimate_sam_sharpness, estimate_top_eigenvalues

        model, logs = self._trainer.model, {}
        if "top_eigenvalue" in self.also_measure:
            eigenvalues = estimate_top_eigenvalues(
                model,
                self._contexts,
                matrix=self.eigenvalue_matrix,
                n_contexts=n_contexts,
                seed=self.seed,
                batch_size=self.batch_size,
            )
            self.flatness_record = replace(self.flatness_record, top_eigenvalues=eigenvalues, top_eigenvalues_step=step)
            logs[TOP_EIGENVALUE_METRIC] = eigenvalues.top
        if "sam_sharpness" in self.also_measure:
            sharpness = estimate_sam_sharpness(
                model,
                self._contexts,
                self.sam_rho,
                batch_size=self._trainer.args.per_device_train_batch_size,
                n_contexts=n_contexts,
            )
            self.flatness_record = replace(self.flatness_record, sam_sharpness=sharpness, sam_sharpness_step=step)
            logs[SAM_SHARPNESS_METRIC] = sharpness.mean
            logs[SAM_SHARPNESS_STDERR_METRIC] = sharpness.stderr
        self._log(logs)

    def _log(self, logs: dict[str, float]) -> None:
        # Trainer.log passes through CallbackHandler.on_log, which clears control.should_log: logging from
        # on_step_end would swallow the training loss the loop was about to log at this step.
        trainer = self._trainer
        should_log = trainer.control.should_log
        # trl's log adds (and clears) the metrics its loss collected: they belong with the next training loss
        with getattr(trainer, "host_metrics_suspended", contextlib.nullcontext)():
            trainer.log(logs)
        trainer.control.should_log = should_log

    def _build_contexts(self) -> list[dict[str, list[int]]]:
        trainer = self._trainer
        dataset = self.eval_dataset if self.eval_dataset is not None else trainer.eval_dataset
        if dataset is None:
            raise ValueError(
                "HessianTraceCallback needs contexts: pass eval_dataset=... (tokenized rows) or give the trainer an "
                "eval_dataset."
            )
        if isinstance(dataset, Mapping) and "input_ids" not in dataset:
            raise ValueError(
                "The trainer has several eval datasets; pass the one to measure on as "
                "HessianTraceCallback(eval_dataset=...)."
            )
        # trl's trainers say which sequences and positions their rows hold (packed documents, prompt + chosen)
        context_rows = getattr(trainer, "_trace_context_rows", lambda row: [row])
        rows = []
        for row in dataset:
            for context_row in context_rows(row):
                rows.append({key: context_row[key] for key in _CONTEXT_COLUMNS if key in context_row})
            if len(rows) >= self.n_contexts:
                break
        rows = rows[: self.n_contexts]
        model = trainer.model
        causal = is_causal_lm(model)
        tokenizer = getattr(trainer, "processing_class", None)
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # processors wrap their tokenizer
        mask_token_id = self.mask_token_id
        if mask_token_id is None and not causal:
            mask_token_id = getattr(tokenizer, "mask_token_id", None)
            if mask_token_id is None:
                raise ValueError(
                    "HessianTraceCallback needs the mask token of this masked LM: give the trainer its tokenizer "
                    "(processing_class=tokenizer) or pass HessianTraceCallback(mask_token_id=...)."
                )
        special = list(getattr(tokenizer, "all_special_ids", []) or [])
        if tokenizer is not None:
            check_tokenizer_fits_model(tokenizer, output_vocab_size(model), source="the trainer's processing_class")
        return build_masked_contexts(
            rows,
            mask_token_id=mask_token_id,
            causal=causal,
            n_contexts=self.n_contexts,
            seed=self.seed,
            special_token_ids=special,
        )


def contexts_within_budget(
    *,
    max_overhead: float,
    train_seconds: float,
    measuring_seconds: float,
    seconds_per_context: float | None,
    n_contexts: int,
    min_contexts: int,
    required: bool,
) -> int:
    """How many contexts a measurement may use so that all measurements stay within ``max_overhead`` of the training
    time: what is left of ``max_overhead x train_seconds`` after ``measuring_seconds``, at ``seconds_per_context``,
    between ``min_contexts`` and ``n_contexts``. An optional (not ``required``) measurement that does not fit even at
    ``min_contexts`` gets 0 (skip it). With no cost known yet (``seconds_per_context`` ``None``) the measurement
    takes ``min_contexts``, which measures the cost."""
    if seconds_per_context is None:
        return min_contexts
    left = max_overhead * train_seconds - measuring_seconds
    fit = min(n_contexts, math.floor(left / seconds_per_context)) if seconds_per_context > 0 else n_contexts
    if fit >= min_contexts:
        return fit
    return min_contexts if required else 0


def _check_extra_measures(also_measure: Sequence[str], eigenvalue_matrix: str, sam_rho: float) -> tuple[str, ...]:
    extra = tuple(name for name in MEASURES if name != "trace")
    also_measure = (also_measure,) if isinstance(also_measure, str) else tuple(also_measure)
    unknown = [name for name in also_measure if name not in extra]
    if unknown:
        raise ValueError(f"also_measure={list(also_measure)}: {unknown} unknown; choose from {list(extra)}.")
    if eigenvalue_matrix not in SPECTRUM_MATRICES:
        raise ValueError(f"eigenvalue_matrix={eigenvalue_matrix!r}; choose one of {list(SPECTRUM_MATRICES)}.")
    if not sam_rho > 0:
        raise ValueError(f"sam_rho must be > 0 (got {sam_rho!r}).")
    return also_measure


TraceFunction = Callable[[Any], Any]


@dataclass
class FlatnessCheckpointSelector(TrainerCallback):
    """Trainer callback: make the flattest checkpoint within a loss tolerance the run's "best" checkpoint.

    After every evaluation it records the step's validation loss and Hessian trace; after every save it re-runs
    [`select_flattest_checkpoint`] over the saved checkpoints and sets ``state.best_model_checkpoint`` (and
    ``state.best_global_step``) to the choice, so ``load_best_model_at_end=True`` loads the flattest near-best
    checkpoint instead of the lowest-loss one. At the end of training it writes the selection to
    ``<output_dir>/flatness_selection.json``.

    Where the trace comes from, first found wins: a ``trace_metric`` entry logged at the step (what
    ``HessianTraceCallback`` logs on every evaluation, ``flatness/hessian_trace``), the same key in the evaluation
    metrics, or ``trace_fn(model)``, which returns an object with ``mean`` and ``stderr`` (such as a
    ``TraceEstimate``) or a ``(mean, stderr)`` pair.

    Use with ``save_total_limit=None``: the Trainer's checkpoint rotation protects the lowest-loss checkpoint only.
    """

    loss_tolerance: float = field(
        default=0.01, metadata={"help": "Absolute (or, with relative_tolerance, fractional) slack on the best loss."}
    )
    relative_tolerance: bool = field(default=False, metadata={"help": "Read loss_tolerance as a fraction."})
    trace_margin: float = field(
        default=0.0, metadata={"help": "Traces within this many combined standard errors count as equally flat."}
    )
    loss_metric: str = field(default="eval_loss", metadata={"help": "Evaluation metric holding the validation loss."})
    trace_metric: str = field(
        default=TRACE_METRIC, metadata={"help": "Logged (or evaluation) key holding the trace estimate."}
    )
    stderr_metric: str = field(
        default=TRACE_STDERR_METRIC, metadata={"help": "Logged (or evaluation) key holding its standard error."}
    )
    trace_fn: TraceFunction | None = field(
        default=None, metadata={"help": "Called with the model at an evaluation that logged no trace."}
    )
    selection: CheckpointSelection | None = field(default=None, init=False)
    _losses: dict[int, float] = field(default_factory=dict, init=False, repr=False)
    _traces: dict[int, tuple[float, float | None]] = field(default_factory=dict, init=False, repr=False)
    _paths: dict[int, str] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        # Fail at construction, not after the first evaluation has been paid for.
        select_flattest_checkpoint(
            [CheckpointRecord(0, 0.0, 0.0)],
            loss_tolerance=self.loss_tolerance,
            relative_tolerance=self.relative_tolerance,
            trace_margin=self.trace_margin,
        )

    @property
    def records(self) -> dict[int, CheckpointRecord]:
        """One record per evaluated step: its loss, its trace when one was measured, its checkpoint when saved."""
        records = {}
        for step, loss in sorted(self._losses.items()):
            trace, stderr = self._traces.get(step, (None, None))
            records[step] = CheckpointRecord(step, loss, trace, stderr, self._paths.get(step))
        return records

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if args.save_total_limit is not None:
            raise ValueError(
                f"FlatnessCheckpointSelector needs every evaluated checkpoint kept, but save_total_limit="
                f"{args.save_total_limit} lets the Trainer delete the flattest one; set save_total_limit=None."
            )
        if args.eval_strategy == "no":
            raise ValueError("FlatnessCheckpointSelector needs evaluations: set eval_strategy to 'steps' or 'epoch'.")

    def on_log(self, args, state, control, logs: dict[str, float] | None = None, **kwargs):
        if logs and self.trace_metric in logs:
            self._traces[state.global_step] = (float(logs[self.trace_metric]), _optional(logs.get(self.stderr_metric)))

    def on_evaluate(self, args, state, control, metrics: dict[str, float] | None = None, model=None, **kwargs):
        metrics = metrics or {}
        if self.loss_metric not in metrics:
            return
        step = state.global_step
        self._losses[step] = float(metrics[self.loss_metric])
        if self.trace_metric in metrics:
            self._traces[step] = (float(metrics[self.trace_metric]), _optional(metrics.get(self.stderr_metric)))
        elif step not in self._traces and self.trace_fn is not None and model is not None:
            # A HessianTraceCallback placed after this one logs later in the same evaluation and overwrites this.
            self._traces[step] = _mean_and_stderr(self.trace_fn(model))

    def on_save(self, args, state, control, **kwargs):
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if os.path.isdir(folder):
            self._paths[state.global_step] = folder
        saved = [r for r in self.records.values() if r.path and os.path.isdir(r.path) and r.hessian_trace is not None]
        if not saved:
            return
        self.selection = self._select(saved)
        state.best_model_checkpoint = self.selection.chosen.path
        state.best_global_step = self.selection.chosen.step
        state.best_metric = self.selection.chosen.eval_loss

    def on_train_end(self, args, state, control, **kwargs):
        if self.selection is None and any(r.hessian_trace is not None for r in self.records.values()):
            # No checkpoint saved: still report which evaluated step would have been chosen.
            self.selection = self._select(list(self.records.values()))
        if self.selection is not None and state.is_world_process_zero:
            os.makedirs(args.output_dir, exist_ok=True)
            with open(os.path.join(args.output_dir, SELECTION_FILE), "w") as handle:
                json.dump(self.selection.to_dict(), handle, indent=2)
            logger.info("Flatness checkpoint selection: %s", self.selection.reason)

    def _select(self, records: list[CheckpointRecord]) -> CheckpointSelection:
        return select_flattest_checkpoint(
            records,
            loss_tolerance=self.loss_tolerance,
            relative_tolerance=self.relative_tolerance,
            trace_margin=self.trace_margin,
        )


def _optional(value: Any) -> float | None:
    return None if value is None else float(value)


def _mean_and_stderr(estimate: Any) -> tuple[float, float | None]:
    if hasattr(estimate, "mean"):
        return float(estimate.mean), None if getattr(estimate, "stderr", None) is None else float(estimate.stderr)
    if isinstance(estimate, tuple | list) and len(estimate) == 2:
        return float(estimate[0]), None if estimate[1] is None else float(estimate[1])
    return float(estimate), None


class SaveOnInterruptCallback(TrainerCallback):
    """On Ctrl-C during training: finish the optimizer step in progress, save a checkpoint, then interrupt.

    The Trainer saves only on its schedule, so an interrupt loses every step since the last save. With this callback
    the first signal asks the Trainer to save (``control.should_save``) at the end of the current step; once
    ``checkpoint-N`` is written (model, optimizer, scheduler and random states) ``trainer.train()`` raises
    ``KeyboardInterrupt``, as Ctrl-C does without the callback, and nothing else runs (no end-of-training
    measurement, no final save). ``trainer.train(resume_from_checkpoint=True)`` continues from the checkpoint. A
    second signal interrupts at once. `interrupted` says whether training stopped this way.

    The handler is installed from ``on_train_begin`` until training ends, in the main thread only. With several
    processes the ranks agree on the step to stop at (one all-reduce of a flag per step), so they save together.

    Args:
        signals: the signals handled this way (default: ``SIGINT``, Ctrl-C).
    """

    def __init__(self, signals: Sequence[int] = (signal.SIGINT,)) -> None:
        self.signals = tuple(signals)
        self.interrupted = False
        self._requested = False
        self._previous: dict[int, Any] = {}

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self.interrupted = self._requested = False
        if threading.current_thread() is threading.main_thread():
            self._previous = {number: signal.signal(number, self._request) for number in self.signals}

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if _any_rank(self._requested, args.device):
            self.interrupted = True
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if not self.interrupted:
            return
        self._restore_handlers()
        if state.is_world_process_zero:
            logger.warning(
                "Interrupted: saved %s; train(resume_from_checkpoint=True) continues from it.",
                os.path.join(args.output_dir, f"checkpoint-{state.global_step}"),
            )
        raise KeyboardInterrupt

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self._restore_handlers()

    def _restore_handlers(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}

    def _request(self, number: int, frame: Any) -> None:
        if self._requested:  # the second signal: stop now, as without this callback
            self._restore_handlers()
            raise KeyboardInterrupt
        self._requested = True
        print(
            "Interrupt: saving a checkpoint after the current step (interrupt again to stop at once).",
            file=sys.stderr,
            flush=True,
        )


def _any_rank(flag: bool, device: Any) -> bool:
    """``flag`` or-ed over the processes of a distributed run; ``flag`` itself in one process."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())
