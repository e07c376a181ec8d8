"""The paper-shaped protocol's runs: a constant-rate trunk with annealed branches, each branch measured, resumable.

[`measure_branch`] is what every compared point gets: KL to the exact conditionals over every position (`saturation`),
the Fisher trace (``per_sample``), the Hutchinson trace of the data-label loss (the released code's quantity) and the
fixed-width probes. [`train_with_branches`] trains the trunk through `FlatBiasTrainer`, saving a checkpoint after every
branch so a stopped run resumes from its last branch; [`reference_rows`] measures what no pre-training gives.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset

from hf_flatbias.checkpoints import newest_intact_checkpoint
from hf_flatbias.config import FlatBiasConfig
from hf_flatbias.flatness import estimate_hessian_trace
from hf_flatbias.results import write_json
from hf_flatbias.synthetic import MaskedWordCollator, build_model
from hf_flatbias.trainer import FlatBiasTrainer

from .branches import BranchEvaluator
from .paper_language import PaperLanguage
from .paper_probes import (
    encoder_features,
    exact_conditional_features,
    lexical_features,
    probe_all_tasks,
    without_predictions,
)
from .runs import RunSpec, trainer_settings
from .saturation import measure_saturation

#: The cotangent every pre-registered rule here was written and run with: a sampled label (the package's default until
#: 2026-12-03, when the random signs became it). Kept so that a study's units measure alike whenever they run.
FISHER_OUTPUT_PROBE = "label"
TRUNK_CHECKPOINT_EVERY = 5000  # steps between a trunk's checkpoints when its branches are further apart


def measure_branch(
    model: torch.nn.Module,
    language: PaperLanguage,
    *,
    trace_contexts: int,
    trace_draws: int,
    hutchinson_draws: int,
    seed: int = 0,
    probe_layers: Sequence[int] = (),
    probes: bool = True,
) -> dict[str, Any]:
    """KL saturation, Fisher trace, Hutchinson trace of the data-label loss and probes of one (annealed) model.

    ``trace_contexts=0`` skips both traces (reference rows); ``hutchinson_draws=0`` skips the data-label trace alone.
    ``seed`` seeds the bootstrap and the trace draws. The primary probe reads the last layer (the released code's
    read-out); ``probe_layers`` (``hidden_states`` indices, e.g. ``0, 1, 2`` of a 3-layer BERT) are probed beside it
    into ``probe_by_layer``, without per-row predictions. ``probes=False``: no probe at all (KL/trace-only pilots).
    """
    start = time.perf_counter()
    kl = measure_saturation(
        model,
        language.kl_sentences.word_ids,
        language.kl_conditionals,
        language.kl_sentences.lengths,
        seed=seed,
    )
    record: dict[str, Any] = {"kl": kl.kl, "saturated": kl.saturated, "saturation": kl.to_dict()}
    if trace_contexts > 0:
        n = min(trace_contexts, len(language.trace_contexts))
        # by_group separates the output layer's own term (how confident the model is) from the encoder's share
        fisher = estimate_hessian_trace(
            model,
            language.trace_contexts,
            n_contexts=n,
            n_draws=trace_draws,
            seed=seed,
            progress=False,
            by_group=True,
            output_probe=FISHER_OUTPUT_PROBE,
        )
        record.update(
            fisher_trace=fisher.mean,
            fisher_trace_stderr=fisher.stderr,
            fisher_trace_output_layer=fisher.by_group["output_layer"].mean,
            fisher_trace_output_layer_stderr=fisher.by_group["output_layer"].stderr,
            fisher_trace_rest=fisher.mean - fisher.by_group["output_layer"].mean,
            fisher_trace_by_group={name: asdict(part) for name, part in fisher.by_group.items()},
            trace_contexts=n,
        )
    if trace_contexts > 0 and hutchinson_draws > 0:
        # the released calculate_hessian.py: v^T H v of the loss of the data labels (not the model's own samples)
        data_loss = estimate_hessian_trace(
            model,
            language.trace_contexts,
            n_contexts=min(trace_contexts, len(language.trace_contexts)),
            n_draws=hutchinson_draws,
            estimator="hutchinson",
            seed=seed,
            progress=False,
        )
        record.update(
            hutchinson_trace_data_loss=data_loss.mean,
            hutchinson_trace_data_loss_stderr=data_loss.stderr,
        )
    if probes:
        record.update(probe_all_tasks(encoder_features(model, language), language))
    if probes and probe_layers:
        record["probe_by_layer"] = {
            str(layer): without_predictions(probe_all_tasks(encoder_features(model, language, layer), language))
            for layer in probe_layers
        }
    record["measure_seconds"] = time.perf_counter() - start
    return record


def reference_rows(language: PaperLanguage, spec: RunSpec) -> dict[str, Any]:
    """Probe rows without pre-training: lexical baseline, the untrained encoder of ``spec``, the exact conditionals."""
    untrained = build_model(
        len(language.tokenizer), hidden=spec.hidden, layers=spec.layers, seed=spec.seed, heads=spec.heads
    )
    return {
        "lexical_baseline": probe_all_tasks(lexical_features(language), language),
        "untrained_encoder": probe_all_tasks(encoder_features(untrained, language), language),
        "exact_conditionals": probe_all_tasks(exact_conditional_features(language), language),
    }


def train_with_branches(
    language: PaperLanguage,
    spec: RunSpec,
    output_dir: Path,
    *,
    branch_every: int,
    anneal_steps: int,
    measure_kwargs: dict[str, Any],
    start_model: torch.nn.Module | None = None,
    keep_branches: bool = False,
    train_dataset: Dataset | None = None,
    stop_when: Callable[[list[dict[str, Any]]], bool] | None = None,
    checkpoint_every: int = TRUNK_CHECKPOINT_EVERY,
) -> list[dict[str, Any]]:
    """Train ``spec``'s trunk and measure an annealed branch every ``branch_every`` steps; resumes where it stopped.

    ``start_model``: the trunk starts from a copy of these weights (e.g. a distilled, saturated model) instead of
    ``spec``'s fresh initialisation; the model passed is left untouched. A resumed run reads its checkpoint instead.
    ``keep_branches``: save each annealed branch (weights and config) under ``output_dir/branches/step-N``.
    ``train_dataset``: the trunk's and branches' rows (default ``language.train``). ``stop_when(records)``: checked
    after every branch (also on the records a resumed run kept); True stops the trunk there. With ``spec.wrap_model``
    the trunk and its branches train the wrapper (e.g. `AdversarialPretrainingModel`, fed ``spec.task_column``) and the
    masked LM inside it (``.model``) is measured, and the wrapper is checkpointed whole.

    ``output_dir/branches.json`` is rewritten after every branch and the trunk (weights, optimizer, scheduler, random
    states) is saved right after it, and also every ``checkpoint_every`` steps between branches (a single branch at
    the end of a 40,000-step trunk would otherwise outlast a session and be lost whole), so a rerun continues from the
    last checkpoint: the records up to that step are kept and the trunk's Trainer resumes from its checkpoint (the
    masking collator restarts its own stream).
    """
    if branch_every < 1 or spec.steps < branch_every:
        raise ValueError(f"need 1 <= branch_every <= steps, got {branch_every} and {spec.steps}.")
    trunk_dir = output_dir / "trunk"
    records_path = output_dir / "branches.json"
    # the newest checkpoint the Trainer finished writing: a process killed mid-save leaves one that would not resume
    intact = newest_intact_checkpoint(trunk_dir) if trunk_dir.is_dir() else None
    last = str(intact) if intact is not None else None
    records: list[dict[str, Any]] = []
    if last is not None and records_path.exists():
        resumed_step = int(Path(last).name.split("-")[-1])
        records = [r for r in json.loads(records_path.read_text())["records"] if r["step"] <= resumed_step]
        print(f"resuming from {last} with {len(records)} measured branches", flush=True)
        if stop_when is not None and records and stop_when(records):
            return records  # decided before the run was stopped: nothing more to train
    elif last is not None:
        last = None  # a checkpoint without its records: start again rather than lose branches silently
    if last is None:
        # written before the first checkpoint, so one taken ahead of the first branch resumes with no records lost
        write_json(records_path, {"records": []})
    train_dataset = language.train if train_dataset is None else train_dataset
    model = _model_for(spec, language)
    if start_model is not None:
        model.load_state_dict(start_model.state_dict())  # a copy: the trunk's steps never write into start_model
    wrapped = spec.wrap_model is not None
    if wrapped:
        model = spec.wrap_model(model)

    def measure(branch, step):
        branch = branch.model if wrapped else branch
        record = measure_branch(branch, language, seed=step, **measure_kwargs)
        if keep_branches:
            branch.save_pretrained(output_dir / "branches" / f"step-{step}")
        print(
            f"[seed {spec.seed}] branch {step}: KL {record['kl']:.4f} "
            f"[{record['saturation']['ci_low']:.4f}, {record['saturation']['ci_high']:.4f}] "
            f"Fisher {record.get('fisher_trace', float('nan')):.1f} "
            f"probe {record.get('probe_accuracy', float('nan')):.3f} "
            f"({record['measure_seconds']:.0f} s)",
            flush=True,
        )
        return record

    evaluator = BranchEvaluator(
        train_dataset,
        every=branch_every,
        anneal_steps=anneal_steps,
        batch_size=spec.batch_size,
        measure=measure,
        seed=spec.seed,
        task_column=spec.task_column,
        partial_path=records_path,
        stop_when=stop_when,
    )
    evaluator.records = records
    settings = trainer_settings(spec, trunk_dir)
    settings.update(logging_steps=branch_every)
    # the evaluator also asks for a save at every branch, so each measured branch has a checkpoint at its step
    settings.update(save_strategy="steps", save_steps=min(branch_every, checkpoint_every), save_total_limit=1)
    trainer = FlatBiasTrainer(
        model=model,
        args=FlatBiasConfig(**settings),
        train_dataset=train_dataset,
        data_collator=MaskedWordCollator(0.0, seed=spec.seed, task_column=spec.task_column),
        callbacks=[evaluator],
    )
    trainer.train(resume_from_checkpoint=last)
    return evaluator.records


def _model_for(spec: RunSpec, language: PaperLanguage) -> torch.nn.Module:
    """The freshly initialised BERT that ``spec`` describes, sized to the language's vocabulary."""
    return build_model(
        len(language.tokenizer),
        hidden=spec.hidden,
        layers=spec.layers,
        dropout=spec.dropout,
        seed=spec.seed,
        heads=spec.heads,
    )
