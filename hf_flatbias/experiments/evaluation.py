"""Checkpoint evaluation of the synthetic experiments: one-mask loss, Fisher trace and linear probes.

Every evaluated checkpoint becomes one record ``{step, loss, loss_gap_to_entropy, hessian_trace,
hessian_trace_stderr, probe_accuracy, ...}``: the one-mask MLM loss on the language's fixed validation contexts, its
gap to the exact entropy floor, the Fisher trace of the pre-training loss (paper App. B.1) and linear-probe accuracy
of the frozen encoder on the language's downstream tasks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from datasets import Dataset
from transformers import TrainerCallback

from ..constants import IGNORE_INDEX
from ..flatness import estimate_hessian_trace
from ..probe import extract_features, probe_accuracy
from ..synthetic import MaskedWordCollator
from .language import LanguageSetup
from .results import write_json


def context_batch(contexts: Dataset) -> dict[str, torch.Tensor]:
    """The masked contexts as one padded batch, padded exactly as the training collator pads labelled rows."""
    return MaskedWordCollator()(list(contexts))


@torch.no_grad()
def one_mask_loss(model, batch: dict[str, torch.Tensor], chunk: int = 256) -> float:
    """Mean cross-entropy at the single masked position of each context (eval mode, no dropout).

    Not `text_data.masked_lm_loss`: that one wants rows of equal length and a model with parameters, while the
    contexts here are padded to different lengths and `OracleMLM` (the lookup table) has no parameters.
    """
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for s in range(0, len(batch["input_ids"]), chunk):
        part = {k: v[s : s + chunk] for k, v in batch.items()}
        logits = model(input_ids=part["input_ids"], attention_mask=part["attention_mask"]).logits
        total += torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), part["labels"].reshape(-1), reduction="sum"
        ).item()
        count += int((part["labels"] != IGNORE_INDEX).sum())
    model.train(was_training)
    return total / count


def hessian_trace(model, contexts: Dataset, *, n_contexts: int, n_draws: int, seed: int) -> dict[str, Any]:
    """The Fisher trace of the pre-training loss on the first ``n_contexts`` contexts, the model in eval mode.

    Returns ``{"mean", "stderr", "estimator"}``, the fields every record stores.
    """
    subset = contexts.select(range(min(n_contexts, len(contexts)))).select_columns(
        ["input_ids", "attention_mask", "labels"]
    )
    was_training = model.training
    model.eval()
    try:
        estimate = estimate_hessian_trace(model, subset, n_contexts=len(subset), n_draws=n_draws, seed=seed)
    finally:
        model.train(was_training)
    return {"mean": float(estimate.mean), "stderr": float(estimate.stderr), "estimator": str(estimate.estimator)}


def probe_scores(model, setup: LanguageSetup, pooling: str | None = None) -> dict[str, dict[str, float]]:
    """Linear-probe results of each task on the frozen encoder's ``pooling`` features (the setup's by default)."""
    pooling = pooling or setup.probe_pooling
    fit = extract_features(model, setup.probe_rows, pooling=pooling)
    test = extract_features(model, setup.probe_test_rows, pooling=pooling)
    return features_probe_scores(fit, test, setup)


def features_probe_scores(fit: np.ndarray, test: np.ndarray, setup: LanguageSetup) -> dict[str, dict[str, float]]:
    """Linear-probe results of each task of ``setup`` on given features of its probe fit and test sentences."""
    out = {}
    for task, labels in setup.probe_tasks.items():
        result = probe_accuracy(fit, labels, test_features=test, test_labels=setup.probe_test_tasks[task])
        out[task] = result.to_dict()
    return out


def evaluate_checkpoint(
    model,
    setup: LanguageSetup,
    batch: dict[str, torch.Tensor],
    *,
    step: int,
    trace_contexts: int,
    trace_draws: int,
    trace_model_fn: Callable[[Any], Any] | None = None,
    extra_metrics: Callable[[Any], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The per-checkpoint record of the recipes' JSON.

    With ``trace_model_fn`` the trace is measured on ``trace_model_fn(model)`` (e.g. the model embedded into a larger
    architecture, so traces of different sizes share one parameter space) and the model's own trace is kept as
    ``hessian_trace_own_architecture``. ``extra_metrics(model)`` adds a recipe's own fields to the record.
    """
    start = time.perf_counter()
    loss = one_mask_loss(model, batch)

    def trace_of(measured) -> dict[str, Any]:
        if trace_contexts <= 0:
            return {"mean": None, "stderr": None, "estimator": None}
        return hessian_trace(measured, setup.contexts, n_contexts=trace_contexts, n_draws=trace_draws, seed=step)

    trace = trace_of(model if trace_model_fn is None else trace_model_fn(model))
    probes = probe_scores(model, setup)
    # the mean-pooled probe as a second, harder reading of transfer: pooling discards the position that the
    # concatenated features hand the probe for free, so it leaves more room between good and poor encoders
    mean_pooled = probes if setup.probe_pooling == "mean" else probe_scores(model, setup, "mean")
    record = {
        "step": step,
        "loss": loss,
        "loss_gap_to_entropy": loss - setup.entropy,
        "hessian_trace": trace["mean"],
        "hessian_trace_stderr": trace["stderr"],
        "hessian_trace_estimator": trace["estimator"],
        "probe_accuracy": float(np.mean([p["accuracy"] for p in probes.values()])),
        "probe": probes,
        "probe_accuracy_mean_pooled": float(np.mean([p["accuracy"] for p in mean_pooled.values()])),
    }
    if trace_model_fn is not None:
        own = trace_of(model)
        record["hessian_trace_own_architecture"] = own["mean"]
        record["hessian_trace_own_architecture_stderr"] = own["stderr"]
    if extra_metrics is not None:
        record.update(extra_metrics(model))
    record["eval_seconds"] = time.perf_counter() - start
    return record


class CheckpointEvaluator(TrainerCallback):
    """Evaluates the live model every ``every`` optimizer steps (main process only) and keeps the records.

    Not `HessianTraceCallback` or `FlatnessCheckpointSelector`: those measure the trace alone, on contexts they
    re-mask themselves with one fixed seed. A synthetic experiment needs the loss, the trace and the probes of one
    checkpoint in one record, the trace on the very contexts whose entropy floor the loss is compared with, drawn with
    the step as seed, and a run that stops at a matched loss (``stop_below``).
    """

    def __init__(
        self,
        setup: LanguageSetup,
        *,
        every: int,
        trace_contexts: int,
        trace_draws: int,
        label: str = "",
        partial_path: Path | None = None,
        model=None,
        stop_below: float | None = None,
        trace_model_fn: Callable[[Any], Any] | None = None,
        extra_metrics: Callable[[Any], dict[str, Any]] | None = None,
    ):
        self.setup = setup
        self.model = model  # evaluated instead of the Trainer's model (a wrapper around it, e.g. adversarial)
        self.stop_below = stop_below
        self.trace_model_fn = trace_model_fn
        self.extra_metrics = extra_metrics
        self.partial_path = partial_path
        self.every = every
        self.trace_contexts = trace_contexts
        self.trace_draws = trace_draws
        self.label = label
        self.batch = context_batch(setup.contexts)
        self.records: list[dict[str, Any]] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every == 0 and state.is_world_process_zero:
            record = self.evaluate(self.model if self.model is not None else model, state.global_step)
            if self.stop_below is not None and record["loss"] <= self.stop_below:
                control.should_training_stop = True  # matched loss reached: later checkpoints are not compared
            if self.partial_path is not None:
                # a long run that is stopped early still leaves its evaluated checkpoints behind
                write_json(self.partial_path, {"label": self.label, "records": self.records})

    def evaluate(self, model, step: int) -> dict[str, Any]:
        """Evaluate ``model`` as checkpoint ``step``, keep the record and print it."""
        record = evaluate_checkpoint(
            model,
            self.setup,
            self.batch,
            step=step,
            trace_contexts=self.trace_contexts,
            trace_draws=self.trace_draws,
            trace_model_fn=self.trace_model_fn,
            extra_metrics=self.extra_metrics,
        )
        self.records.append(record)
        print(f"[{self.label}] " + format_record(record), flush=True)
        return record


def format_record(r: dict[str, Any]) -> str:
    """One record as a line of the training log."""
    trace = "n/a" if r["hessian_trace"] is None else f"{r['hessian_trace']:.1f}+-{r['hessian_trace_stderr']:.1f}"
    tasks = " ".join(f"{k}={v['accuracy']:.3f}" for k, v in r["probe"].items())
    return f"step {r['step']}: loss {r['loss']:.4f} (gap {r['loss_gap_to_entropy']:.4f}) trace {trace} probe {tasks}"
