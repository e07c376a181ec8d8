"""One training run of a synthetic experiment: its spec, and training it through `FlatBiasTrainer` with evaluation."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from ..config import FlatBiasConfig
from ..synthetic import MaskedWordCollator
from ..trainer import FlatBiasTrainer
from .evaluation import CheckpointEvaluator, hessian_trace
from .language import LanguageSetup
from .models import build_model


@dataclass
class RunSpec:
    """One training run of a recipe."""

    label: str
    steps: int
    eval_every: int
    batch_size: int = 64
    learning_rate: float = 2e-3
    warmup_steps: int = 100
    # the paper's shape is AdamW with beta2 0.98 and a linear decay to 0 ("linear"); constant suits a trunk that
    # anneal-to-evaluate branches (experiments.branches) are taken from
    lr_scheduler_type: str = "constant_with_warmup"
    adam_beta2: float = 0.999
    dropout: float = 0.0
    weight_decay: float = 0.0
    flatness_method: str = "none"
    sam_rho: float = 0.05
    hidden: int = 64
    layers: int = 2
    seed: int = 0
    mask_probability: float = 0.0
    heads: int | None = None  # attention heads; None: build_model's default, hidden // 32
    # other FlatBiasConfig fields of this run (e.g. another flatness method and its settings)
    flatness_overrides: dict[str, Any] = field(default_factory=dict)
    # stop once a checkpoint's one-mask loss is at or below this (matched loss, not matched steps)
    target_loss: float | None = None
    # train wrap_model(model) (e.g. an AdversarialPretrainingModel around it) while evaluating the masked LM itself
    wrap_model: Callable[[Any], torch.nn.Module] | None = None
    task_column: str | None = None  # a training column the collator hands the model as ``task_labels``
    # further Trainer callbacks; with any, the Trainer also evaluates its loss on the contexts every eval_every steps
    callbacks: Sequence[TrainerCallback] = ()
    trace_model_fn: Callable[[Any], Any] | None = None  # see evaluate_checkpoint
    extra_metrics: Callable[[Any], dict[str, Any]] | None = None  # see evaluate_checkpoint
    # measure the trace only at the last checkpoint (the trained or loss-matched model), not at every one
    trace_final_only: bool = False
    # train on the CPU (the recipes' default); False lets the Trainer pick the accelerator (a GPU run)
    use_cpu: bool = True


def train_and_evaluate(
    setup: LanguageSetup, spec: RunSpec, output_dir: Path, *, trace_contexts: int, trace_draws: int
) -> list[dict[str, Any]]:
    """Train one masked LM with ``FlatBiasTrainer`` and evaluate it every ``spec.eval_every`` steps (and at 0).

    The optional `RunSpec` fields change only what they name: ``wrap_model`` trains a wrapper around the masked LM
    (records still describe the masked LM), ``target_loss`` stops at the first checkpoint that reaches it,
    ``callbacks`` join the Trainer (which then also evaluates on the contexts), ``flatness_overrides`` set further
    `FlatBiasConfig` fields, and ``trace_final_only`` measures the trace once, on the last checkpoint.
    """
    model = build_model(
        len(setup.tokenizer),
        hidden=spec.hidden,
        layers=spec.layers,
        dropout=spec.dropout,
        seed=spec.seed,
        heads=spec.heads,
    )
    evaluator = CheckpointEvaluator(
        setup,
        every=spec.eval_every,
        trace_contexts=0 if spec.trace_final_only else trace_contexts,
        trace_draws=trace_draws,
        label=spec.label,
        partial_path=output_dir / f"partial_{spec.label}.json",
        model=model if spec.wrap_model is not None else None,
        stop_below=spec.target_loss,
        trace_model_fn=spec.trace_model_fn,
        extra_metrics=spec.extra_metrics,
    )
    optional: dict[str, Any] = {}
    if spec.wrap_model is not None or spec.task_column is not None:
        optional["remove_unused_columns"] = False  # the wrapper's forward takes task_labels, not the model's
    if spec.callbacks:
        optional.update(eval_strategy="steps", eval_steps=spec.eval_every, per_device_eval_batch_size=256)
    settings = trainer_settings(spec, output_dir / spec.label)
    settings.update(optional)
    settings.update(spec.flatness_overrides)  # a method's own settings win over the shared ones
    args = FlatBiasConfig(**settings)
    trainer = FlatBiasTrainer(
        model=model if spec.wrap_model is None else spec.wrap_model(model),
        args=args,
        train_dataset=setup.train,
        eval_dataset=setup.contexts if spec.callbacks else None,
        data_collator=MaskedWordCollator(spec.mask_probability, seed=spec.seed, task_column=spec.task_column),
        callbacks=[evaluator, *spec.callbacks],
    )
    if not trainer.is_world_process_zero():
        trainer.train()  # under `accelerate launch` with several processes only the main one evaluates
        return []
    evaluator.evaluate(model, 0)
    trainer.train()
    if spec.trace_final_only and trace_contexts > 0:
        if evaluator.records[-1]["step"] != trainer.state.global_step:
            evaluator.evaluate(model, trainer.state.global_step)
        final = evaluator.records[-1]
        trace = hessian_trace(model, setup.contexts, n_contexts=trace_contexts, n_draws=trace_draws, seed=final["step"])
        final.update(
            hessian_trace=trace["mean"],
            hessian_trace_stderr=trace["stderr"],
            hessian_trace_estimator=trace["estimator"],
        )
    return evaluator.records


def trainer_settings(spec: RunSpec, output_dir: Path) -> dict[str, Any]:
    """`FlatBiasConfig` fields of ``spec``: one process (the CPU unless ``spec.use_cpu`` is False), no checkpoints,
    no reports (a recipe adds its own)."""
    return dict(
        output_dir=str(output_dir),
        max_steps=spec.steps,
        per_device_train_batch_size=spec.batch_size,
        learning_rate=spec.learning_rate,
        lr_scheduler_type=spec.lr_scheduler_type,
        adam_beta2=spec.adam_beta2,
        warmup_steps=spec.warmup_steps,
        weight_decay=spec.weight_decay,
        flatness_method=spec.flatness_method,
        sam_rho=spec.sam_rho,
        save_strategy="no",
        report_to=[],
        logging_steps=max(1, spec.eval_every),
        disable_tqdm=True,
        seed=spec.seed,
        use_cpu=spec.use_cpu,
        dataloader_num_workers=0,
    )
