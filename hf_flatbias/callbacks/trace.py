"""`HessianTraceCallback`: the paper's flatness measure logged while a model trains."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import fields, replace
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ..constants import (
    ADAM_PRECONDITIONED,
    TRACE_MEDIAN_OF_MEANS_METRIC,
    TRACE_METRIC,
    TRACE_STDERR_METRIC,
    TRACE_TOP_SHARE_METRIC,
)
from ..flatness.adam_preconditioner import why_optimizer_unreadable
from ..flatness.api import estimate_hessian_trace
from ..flatness.contexts import build_masked_contexts
from ..flatness.estimators import per_context_estimators
from ..flatness.lm import check_tokenizer_fits_model, is_causal_lm, output_vocab_size
from ..flatness.results import FlatnessRecord, TraceEstimate
from ..flatness.zero_update import check_zero_update_supported
from ..measures import MEASURE_TABLE, needs_downstream_task
from ..tensors import is_fully_sharded
from .trace_config import TraceCallbackConfig

SHARDED_MEASURES = ("top_eigenvalue", "critical_sharpness")
"""The measures beyond the trace that work on a sharded model (FSDP2, ZeRO-3): finite-difference products and a
forward-only line search through the engine's own passes, the contexts split over processes."""

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

    The trace covers the model's trainable parameters (``requires_grad``): with LoRA, the adapters only. The card
    records their count (``trainable_parameters``, beside ``num_parameters``) and what the contexts predict
    (``trace_objective``: a masked position, the next token, or as below inside trl).

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
    evaluation that does not fit is skipped. Measurements at ``every_n_steps`` and at the end are always taken.
    The final measurement (the one on the card) is outside the budget: by default (``full_final_measurement``) it
    uses all ``n_contexts`` contexts, one full estimate on top of the budgeted ones, even when an interim measurement
    at the same step was smaller, so the card is as precise as a measurement without a budget (measured: about 9-10
    training steps of 16 sequences for 256 contexts on a 15M BERT, 8.6% of a 100-step run and nothing to speak of
    in a long one); ``full_final_measurement=False`` sizes it by the budget like the others. The logged standard
    error is that of the contexts actually used, which are always the first ones of the same fixed set, with the
    same draws: a smaller measurement is noisier, never biased. `measurement_history` records each measurement's
    step, contexts and seconds.

    Measuring does not change training: the model is put in ``eval()`` and every module back in its own mode after,
    draws use their own generators and the global random streams are restored, no ``.grad`` is written
    (``torch.autograd.grad`` only; ``critical_sharpness`` sets it for the optimizer's proposed step and puts the
    previous one back), the optimizer's state is left as it was and parameters stay where they are.

    `FlatBiasTrainer` binds the callback to itself. With a plain `transformers.Trainer`, call
    ``callback.bind_trainer(trainer)`` after building the trainer.

    Args:
        eval_dataset: tokenized rows (``input_ids``, optionally ``attention_mask``); the trainer's ``eval_dataset``
            when ``None``. Existing labels are ignored: contexts are re-masked one position per row.
        **settings: the fields of `TraceCallbackConfig` (``n_contexts``, ``n_draws``, ``every_n_steps``,
            ``on_evaluate``, ``measure_at_end``, ``estimator``, ``seed``, ``batch_size``, ``mask_token_id``,
            ``by_group``, ``also_measure``, ``eigenvalue_matrix``, ``sam_rho``, ``measure_settings``, ``max_overhead``,
            ``full_final_measurement``), documented and checked there; they are kept in `config`. ``also_measure`` names
            measures of `hf_flatbias.measures.MEASURE_TABLE` (top_eigenvalue, spectrum_shape, sam_sharpness,
            weight_noise, quantization, critical_sharpness, relative_critical_sharpness, gradient_alignment,
            forgetting), logged under their entry's keys (``flatness/<name>`` with
            ``..._stderr``), kept in `flatness_record` and recorded on the card with their settings and step; every
            process computes ``sam_sharpness``, ``weight_noise``, ``quantization``, ``forgetting`` (and
            ``top_eigenvalue`` with exact products) whole, while ``critical_sharpness`` and finite-difference
            ``top_eigenvalue`` split the contexts over processes and are the two that work under FSDP2 and ZeRO-3
            (`SHARDED_MEASURES`; the vectors in the shard space, nothing gathered beyond the engine's own passes).
            ``sam_rho``'s batches are the trainer's
            ``per_device_train_batch_size`` contexts, each taking its own ascent step as SAM does in training.
            ``critical_sharpness`` searches along the trainer's optimizer's next update for each batch's gradient
            (`hf_flatbias.flatness.proposed_update`; under DeepSpeed ZeRO-1/2/3 the ZeRO optimizer's,
            `hf_flatbias.flatness.zero_update`): weights, optimizer state, ``.grad`` and random streams are left
            bit for bit as they were. ``forgetting`` fine-tunes a copy on ``measure_settings["forgetting_task"]``
            (loaded and tokenized by the trainer's tokenizer at the start of training): the trained weights and the
            random streams are untouched.
            ``by_group`` logs each group's trace as ``flatness/hessian_trace/<group>``.
    """

    def __init__(self, eval_dataset: Iterable[Mapping[str, Any]] | None = None, **settings: Any) -> None:
        unknown = sorted(set(settings) - {f.name for f in fields(TraceCallbackConfig)})
        if unknown:
            raise TypeError(
                f"HessianTraceCallback got unexpected keyword arguments {unknown}; it takes eval_dataset and the "
                "fields of TraceCallbackConfig."
            )
        self.config = TraceCallbackConfig(**settings)
        self.eval_dataset = eval_dataset
        self.measurement_history: list[dict[str, float]] = []
        self.flatness_record = FlatnessRecord()
        self._trainer = None
        self._contexts: list[dict[str, list[int]]] | None = None
        self._forgetting_task = None
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
        self._forgetting_task = self._load_forgetting_task()  # bad task data fails now, not at the first measurement
        self._measured_step = None
        self._train_start = time.perf_counter()
        self._measuring_seconds = 0.0
        self.measurement_history = []

    def _check_engine_supports_estimator(self) -> None:
        # Fail at the start of training, not at the first measurement hours later.
        plugin = getattr(self._trainer.accelerator.state, "deepspeed_plugin", None)
        stage = None if plugin is None else plugin.deepspeed_config.get("zero_optimization", {}).get("stage")
        sharded = stage == 3 or is_fully_sharded(self._trainer.model)
        whole_model_only = [name for name in self.config.also_measure if name not in SHARDED_MEASURES]
        if sharded and whole_model_only:
            raise ValueError(
                f"HessianTraceCallback(also_measure={whole_model_only}) does not support a sharded model (DeepSpeed "
                f"ZeRO-3, FSDP2): these measures take gradients of the whole model on each process; measure "
                f"{' and '.join(SHARDED_MEASURES)} only, or leave also_measure empty."
            )
        if (
            "critical_sharpness" in self.config.also_measure
            and self.config.settings().critical_direction == "optimizer"
        ):
            check_zero_update_supported(self._trainer.optimizer)  # an offloaded or Muon ZeRO optimizer: refused now
        preconditioned = [
            name for name in self.config.also_measure if "eigenvalue_matrix" in MEASURE_TABLE[name].settings
        ]
        if preconditioned and self.config.eigenvalue_matrix == ADAM_PRECONDITIONED:
            why = why_optimizer_unreadable(self._trainer.optimizer)  # its state is checked at each measurement
            if sharded:
                why = (
                    f"eigenvalue_matrix={ADAM_PRECONDITIONED!r} takes exact products on whole parameters, which a "
                    "sharded model (ZeRO-3, FSDP2) does not hold; choose eigenvalue_matrix='hessian' or 'fisher'."
                )
            if why is not None:
                raise ValueError(f"HessianTraceCallback(also_measure={preconditioned}): {why}")
        several_processes = stage == 3 or self._trainer.args.world_size > 1
        if several_processes and self.config.estimator not in per_context_estimators():
            raise ValueError(
                f"HessianTraceCallback(estimator={self.config.estimator!r}) on several processes needs a per-context "
                "estimator: pass estimator='per_sample' (default) or 'naive'."
            )

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        scheduled = self.config.every_n_steps is not None and state.global_step % self.config.every_n_steps == 0
        # the last step's checkpoint is saved right after on_step_end: measuring here puts its trace on its card
        last = self.config.measure_at_end and state.max_steps > 0 and state.global_step >= state.max_steps
        if scheduled or last:
            self._measure_once_at(state.global_step, required=True, final=last)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        # a run stopped early (e.g. EarlyStoppingCallback) ends before max_steps; the final save and push follow
        if not self.config.measure_at_end or state.global_step == 0:
            return
        step = state.global_step
        if args.load_best_model_at_end and state.best_model_checkpoint and state.best_global_step is not None:
            step = state.best_global_step  # the Trainer has just loaded that checkpoint's weights
        self._measure_once_at(step, required=True, final=True)

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if self.config.on_evaluate:
            self._measure_once_at(state.global_step, required=False)

    def _measure_once_at(self, step: int, *, required: bool, final: bool = False) -> None:
        # an evaluation right after a scheduled measurement sees the same weights: measuring again only costs time
        if self._measured_step == step and not (final and self._needs_full_final()):
            return
        if final and self.config.full_final_measurement:
            n_contexts = len(self._contexts) if self._contexts is not None else self.config.n_contexts
        else:
            n_contexts = self._contexts_within_budget(required)
        if n_contexts > 0:
            self.measure(step=step, n_contexts=n_contexts)

    def _needs_full_final(self) -> bool:
        """Whether the latest measurement is smaller than the full one ``full_final_measurement`` asks for."""
        if not self.config.full_final_measurement or not self.measurement_history or self._contexts is None:
            return False
        return self.measurement_history[-1]["n_contexts"] < len(self._contexts)

    def _contexts_within_budget(self, required: bool) -> int:
        """Contexts the next measurement may use under ``max_overhead`` (0: skip it), the same on every process."""
        available = len(self._contexts) if self._contexts is not None else self.config.n_contexts
        if self.config.max_overhead is None:
            return available
        previous = self.measurement_history[-1] if self.measurement_history else None
        train_seconds = time.perf_counter() - self._train_start - self._measuring_seconds
        n_contexts = contexts_within_budget(
            max_overhead=self.config.max_overhead,
            train_seconds=train_seconds,
            measuring_seconds=self._measuring_seconds,
            seconds_per_context=None if previous is None else previous["seconds"] / previous["n_contexts"],
            n_contexts=available,
            min_contexts=min(self.config.batch_size, available),
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
            n_draws=self.config.n_draws,
            estimator=self.config.estimator,
            seed=self.config.seed,
            batch_size=self.config.batch_size,
            by_group=self.config.by_group,
            # every rank runs the callbacks: each measures its share of the contexts, all get the whole estimate
            across_processes=self._trainer.args.world_size > 1,
            # a long measurement shows a bar as the trainer's evaluation does, and is silenced with it
            progress=False if self._trainer.args.disable_tqdm else None,
        )
        step = int(self._trainer.state.global_step if step is None else step)
        self.flatness_record = replace(self.flatness_record, trace=estimate, trace_step=step)
        self._measured_step = step
        logs = {TRACE_METRIC: estimate.mean, TRACE_STDERR_METRIC: estimate.stderr}
        if estimate.median_of_means is not None:  # what FlatnessCheckpointSelector(trace_summary=...) ranks by
            logs[TRACE_MEDIAN_OF_MEANS_METRIC] = estimate.median_of_means
        if estimate.top_share is not None and math.isfinite(estimate.top_share):
            logs[TRACE_TOP_SHARE_METRIC] = estimate.top_share
        for group, part in (estimate.by_group or {}).items():
            logs[f"{TRACE_METRIC}/{group}"] = part.mean
        self._log(logs)
        if self.config.also_measure:
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
        # one loop over the table: each measure's function, settings, record and log keys come from its entry
        settings = self.config.settings()
        if needs_downstream_task(self.config.also_measure) and self._forgetting_task is None:
            self._forgetting_task = self._load_forgetting_task()
        if settings.sam_batch_size is None:  # SAM's batches are the training batches it would perturb
            settings = replace(settings, sam_batch_size=self._trainer.args.per_device_train_batch_size)
        if settings.critical_max_grad_norm is None:  # the update the optimizer takes is of the clipped gradient
            settings = replace(settings, critical_max_grad_norm=self._trainer.args.max_grad_norm or 0.0)
        logs = {}
        for name in self.config.also_measure:
            spec = MEASURE_TABLE[name]
            result = spec.function()(
                self._trainer.model,
                self._contexts,
                n_contexts=n_contexts,
                settings=settings,
                seed=self.config.seed,
                batch_size=self.config.batch_size,
                optimizer=self._trainer.optimizer,
                task=self._forgetting_task,
            )
            self.flatness_record = self.flatness_record.with_measure(name, result, step)
            record = spec.record(result)
            logs[spec.metric] = record["value"]
            if spec.stderr_metric is not None and "stderr" in record:
                logs[spec.stderr_metric] = record["stderr"]
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

    def _load_forgetting_task(self):
        """Forgetting's downstream task, tokenized by the trainer's tokenizer; ``None`` when forgetting is not
        measured."""
        if not needs_downstream_task(self.config.also_measure):
            return None
        from ..flatness.forgetting_task import load_forgetting_task
        from ..glue.tasks import DEFAULT_MAX_LENGTH

        settings = self.config.settings()
        model = self._trainer.model
        tokenizer = getattr(self._trainer, "processing_class", None)
        positions = getattr(model.config, "max_position_embeddings", None) or DEFAULT_MAX_LENGTH
        return load_forgetting_task(
            settings.forgetting_task,
            tokenizer=getattr(tokenizer, "tokenizer", tokenizer),  # processors wrap their tokenizer
            label_column=settings.forgetting_label_column,
            n_train=settings.forgetting_train_rows,
            n_eval=settings.forgetting_eval_rows,
            seed=self.config.seed,
            max_length=min(DEFAULT_MAX_LENGTH, positions),
            vocab_size=output_vocab_size(model),
        )

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
        context_rows = getattr(trainer, "trace_context_rows", lambda row: [row])
        kept = self._kept_columns()
        rows = []
        for row in dataset:
            for context_row in context_rows(row):
                rows.append({key: context_row[key] for key in (*_CONTEXT_COLUMNS, *kept) if key in context_row})
            if len(rows) >= self.config.n_contexts:
                break
        rows = rows[: self.config.n_contexts]
        model = trainer.model
        causal = is_causal_lm(model)
        tokenizer = getattr(trainer, "processing_class", None)
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # processors wrap their tokenizer
        mask_token_id = self.config.mask_token_id
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
            n_contexts=self.config.n_contexts,
            seed=self.config.seed,
            special_token_ids=special,
            keep_columns=kept,
        )

    def _kept_columns(self) -> tuple[str, ...]:
        """Columns a measure reads from each context beside the tokens: gradient alignment's source column."""
        if "gradient_alignment" not in self.config.also_measure:
            return ()
        return (self.config.settings().alignment_column,)


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
