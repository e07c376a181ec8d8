"""Shared pieces of the PCFG paper-comparison recipes: data, MLM collator, training, and the three measurements.

The three numbers every recipe reports for a model, as in Liu et al. (2023):

* ``mlm_loss``: the one-mask MLM loss on validation contexts (one masked word per sentence), next to the grammar's
  exact entropy floor (``entropy_bound``), so "same pre-training loss" can be checked against the optimum;
* ``trace``: the Hessian (Fisher) trace of that loss, `estimate_hessian_trace` on the same kind of contexts;
* ``task_a`` (and B, C): held-out accuracy of a linear probe on the frozen ``[CLS]`` feature of the last layer.

Sizes are the smallest that show the effects on a shared 2-core machine; every recipe takes ``--quick`` for a smoke
run (used by the tests) and prints its results as JSON.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import BertConfig, TrainerCallback

from hf_flatbias.config import FlatBiasConfig
from hf_flatbias.flatness.estimators import estimate_hessian_trace
from hf_flatbias.probe import extract_features, probe_accuracy
from hf_flatbias.synthetic import PCFG, MaskedWordCollator, build_pcfg_dataset, entropy_bound, masked_contexts
from hf_flatbias.synthetic.tokenizer import N_SPECIAL, PAD_ID
from hf_flatbias.trainer import FlatBiasTrainer

IGNORE_INDEX = -100
MASK_PROBABILITY_HELP = (
    "chance of masking each word in training; 0 (default): exactly one masked word per sentence, the paper's "
    "one-mask objective whose optimum is the entropy floor"
)
TASKS = ("task_a", "task_b", "task_c")


@dataclass(frozen=True)
class ModelSize:
    hidden: int
    layers: int
    heads: int

    @property
    def name(self) -> str:
        return f"H{self.hidden}-L{self.layers}-A{self.heads}"

    def config(self, vocab_size: int, max_positions: int = 64) -> BertConfig:
        return BertConfig(
            vocab_size=vocab_size,
            hidden_size=self.hidden,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            intermediate_size=4 * self.hidden,
            max_position_embeddings=max_positions,
            # Dropout changes the function between train and eval; the paper's synthetic runs train without it.
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )


@dataclass
class PCFGData:
    language: PCFG
    train: Any
    validation: Any
    contexts: Any  # one-mask validation contexts: the loss, floor and trace are measured on them
    floor: float

    @property
    def vocab_size(self) -> int:
        return N_SPECIAL + self.language.n_words


def build_data(n_train: int, n_validation: int, *, grammar_seed: int = 0, data_seed: int = 0) -> PCFGData:
    language = PCFG.from_seed(grammar_seed)
    splits = build_pcfg_dataset(language, n_train, n_validation, seed=data_seed)
    contexts = masked_contexts(splits["validation"], seed=data_seed)
    return PCFGData(language, splits["train"], splits["validation"], contexts, entropy_bound(language, contexts))


def training_arguments(output_dir: str, *, steps: int, batch_size: int, learning_rate: float, seed: int, **extra):
    settings = dict(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=256,
        learning_rate=learning_rate,
        weight_decay=0.01,
        warmup_steps=min(100, steps // 10),
        lr_scheduler_type="constant_with_warmup",
        seed=seed,
        data_seed=seed,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=max(1, steps // 10),
        save_strategy="no",
        remove_unused_columns=False,
        dataloader_num_workers=0,
    )
    settings.update(extra)
    return FlatBiasConfig(**settings)


def train_mlm(
    model: torch.nn.Module,
    data: PCFGData,
    *,
    steps: int,
    batch_size: int = 64,
    learning_rate: float = 1e-3,
    seed: int = 0,
    task_column: str | None = None,
    mask_probability: float = 0.0,
    output_dir: str | None = None,
    callbacks: Sequence[Any] = (),
    **extra_arguments,
) -> FlatBiasTrainer:
    """Train ``model`` on the PCFG's training sentences with the MLM objective (or the adversarial wrapper)."""
    with tempfile.TemporaryDirectory() as scratch:
        args = training_arguments(
            output_dir or scratch,
            steps=steps,
            batch_size=batch_size,
            learning_rate=learning_rate,
            seed=seed,
            **extra_arguments,
        )
        trainer = FlatBiasTrainer(
            model=model,
            args=args,
            train_dataset=data.train,
            eval_dataset=data.contexts,
            data_collator=MaskedWordCollator(mask_probability, seed=seed, task_column=task_column),
            callbacks=list(callbacks),
        )
        trainer.train()
    return trainer


@torch.no_grad()
def one_mask_loss(model: torch.nn.Module, contexts: Any, *, batch_size: int = 256) -> float:
    """Mean cross-entropy at the masked word of each validation context (nats)."""
    was_training = model.training
    model.eval()
    collate = MaskedWordCollator()
    total, count = 0.0, 0
    for start in range(0, len(contexts), batch_size):
        batch = collate([contexts[i] for i in range(start, min(start + batch_size, len(contexts)))])
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        losses = F.cross_entropy(logits.transpose(1, 2), batch["labels"], ignore_index=IGNORE_INDEX, reduction="sum")
        total += float(losses)
        count += int((batch["labels"] != IGNORE_INDEX).sum())
    model.train(was_training)
    return total / count


def probe_tasks(
    model: torch.nn.Module, data: PCFGData, *, n_probe_train: int = 2000, tasks: Sequence[str] = TASKS, seed: int = 0
) -> dict[str, float]:
    """Held-out accuracy of a linear probe on the frozen last-layer ``[CLS]`` feature, per task."""
    n_probe_train = min(n_probe_train, len(data.train))
    train_rows = data.train.select(range(n_probe_train))
    train_features = extract_features(model, train_rows["input_ids"], pooling="cls", pad_token_id=PAD_ID)
    test_features = extract_features(model, data.validation["input_ids"], pooling="cls", pad_token_id=PAD_ID)
    accuracies = {}
    for task in tasks:
        result = probe_accuracy(
            train_features,
            np.asarray(train_rows[task]),
            test_features=test_features,
            test_labels=np.asarray(data.validation[task]),
            seed=seed,
        )
        accuracies[task] = result.accuracy
    return accuracies


def trace_of(model: torch.nn.Module, data: PCFGData, *, n_contexts: int, n_draws: int = 2, seed: int = 0):
    """The paper's flatness measure on the first ``n_contexts`` validation contexts."""
    return estimate_hessian_trace(model, data.contexts, n_contexts=n_contexts, n_draws=n_draws, seed=seed)


def measure(model, data: PCFGData, *, n_trace_contexts: int, trace_model=None, n_probe_train: int = 2000) -> dict:
    """Loss, trace (of ``trace_model`` when given, e.g. the model embedded in a larger architecture) and probes."""
    start = time.perf_counter()
    estimate = trace_of(trace_model if trace_model is not None else model, data, n_contexts=n_trace_contexts)
    return {
        "mlm_loss": one_mask_loss(model, data.contexts),
        "floor": data.floor,
        "trace": estimate.mean,
        "trace_stderr": estimate.stderr,
        **probe_tasks(model, data, n_probe_train=n_probe_train),
        "measure_seconds": time.perf_counter() - start,
    }


class StopAtLoss(TrainerCallback):
    """Stop training once the one-mask validation loss of ``model`` reaches ``target``: matched loss, not steps.

    It measures the wrapped masked LM itself (not the Trainer's eval loss, which for the adversarial wrapper also
    holds the adversarial terms). ``history`` keeps ``(step, loss)`` of every evaluation.
    """

    def __init__(self, model: torch.nn.Module, contexts: Any, target: float | None):
        self.model, self.contexts, self.target = model, contexts, target
        self.history: list[tuple[int, float]] = []

    def on_evaluate(self, args, state, control, **kwargs):
        loss = one_mask_loss(self.model, self.contexts)
        self.history.append((state.global_step, loss))
        if self.target is not None and loss <= self.target:
            control.should_training_stop = True

    @property
    def final_step(self) -> int | None:
        return self.history[-1][0] if self.history else None


def set_threads() -> None:
    """One thread: tiny ops are 40-70x slower with two on the shared machine (docs: NOTES.md)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


def format_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    def cell(value: Any) -> str:
        if isinstance(value, float):
            return "nan" if math.isnan(value) else f"{value:.4g}"
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def add_stopping_arguments(parser) -> None:
    """``--steps`` (at most 3000), ``--target-loss`` (stop at matched loss, see ``StopAtLoss``) and ``--eval-steps``."""
    parser.add_argument("--steps", type=int, default=3000, help="most training steps")
    parser.add_argument(
        "--target-loss",
        type=float,
        default=None,
        help="stop each model once its one-mask validation loss is at or below this (matched loss); checked every "
        "--eval-steps. Default: train every model for --steps.",
    )
    parser.add_argument("--eval-steps", type=int, default=200)


def add_training_arguments(parser) -> None:
    """The optimizer, data, measurement and output flags (``--learning-rate`` to ``--output``) the recipes share."""
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--mask-probability", type=float, default=0.0, help=MASK_PROBABILITY_HELP)
    parser.add_argument("--n-train", type=int, default=20000)
    parser.add_argument("--n-validation", type=int, default=1000)
    parser.add_argument("--trace-contexts", type=int, default=300)
    parser.add_argument("--probe-train", type=int, default=2000)
    parser.add_argument("--grammar-seed", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (tests)")
    parser.add_argument("--output", help="write the results as JSON here")


def write_result(result: dict, output: str | None) -> None:
    """Write a recipe's result as indented JSON to ``output`` (creating its folder); nothing when ``output`` is None."""
    if output:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        with open(output, "w") as handle:
            json.dump(result, handle, indent=2)
