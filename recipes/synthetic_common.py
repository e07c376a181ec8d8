"""Shared pieces of the synthetic-language recipes: language setup, model, per-checkpoint evaluation, reports.

Every recipe trains BERT-style masked LMs on a synthetic language whose exact conditionals are known, and at each
evaluated checkpoint records ``{step, loss, loss_gap_to_entropy, hessian_trace, hessian_trace_stderr,
probe_accuracy}``: the one-mask MLM loss on fixed validation contexts, its gap to the exact entropy floor, the
Fisher trace of the pre-training loss (paper App. B.1) and linear-probe accuracy of the frozen encoder on the
language's downstream tasks.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import BertConfig, BertForMaskedLM, TrainerCallback  # noqa: E402

from hf_flatbias.probe import extract_features, probe_accuracy  # noqa: E402
from hf_flatbias.synthetic import (  # noqa: E402
    HMM,
    PCFG,
    MaskedWordCollator,
    build_hmm_dataset,
    build_pcfg_dataset,
    entropy_bound,
    make_tokenizer,
    masked_contexts,
)

IGNORE_INDEX = -100


# ---------------------------------------------------------------------------------------------------- language
@dataclass
class LanguageSetup:
    """A language, its datasets, fixed evaluation contexts and probe tasks."""

    name: str
    language: Any
    tokenizer: Any
    train: Dataset
    contexts: Dataset
    probe_rows: list[list[int]]
    probe_tasks: dict[str, np.ndarray]
    entropy: float
    probe_test_rows: list[list[int]] = field(default_factory=list)
    probe_test_tasks: dict[str, np.ndarray] = field(default_factory=dict)
    probe_pooling: str = "mean"


def setup_language(
    name: str,
    *,
    n_train: int,
    n_contexts: int,
    n_probe: int,
    seed: int = 0,
    hmm_length: int = 24,
    probe_pooling: str = "mean",
    train_columns: Sequence[str] = (),
) -> LanguageSetup:
    """Build the language from ``seed``, its training set and the fixed evaluation material.

    The probe is fitted on ``n_probe`` held-out sentences and scored on ``n_probe`` others; contexts are a third,
    disjoint set so the loss and the trace are measured on sentences the probe never saw either. ``train_columns``
    keeps extra columns of the training sentences (e.g. ``task_a`` for adversarial pre-training, which reads it).
    """
    n_eval = n_contexts + 2 * n_probe
    if name == "pcfg":
        language = PCFG.from_seed(seed)
        data = build_pcfg_dataset(language, n_train, n_eval, seed=seed)
        task_columns = {"A": "task_a", "B": "task_b", "C": "task_c"}
    elif name == "hmm":
        language = HMM.from_seed(seed)
        data = build_hmm_dataset(language, n_train, n_eval, length=hmm_length, seed=seed)
        task_columns = {}
    else:
        raise ValueError(f"unknown language {name!r}; choose 'pcfg' or 'hmm'.")
    evaluation = data["validation"]
    contexts = masked_contexts(evaluation.select(range(n_contexts)), seed=seed + 1)
    probe_fit = evaluation.select(range(n_contexts, n_contexts + n_probe))
    probe_test = evaluation.select(range(n_contexts + n_probe, n_eval))

    def tasks(split: Dataset) -> dict[str, np.ndarray]:
        if name == "pcfg":
            return {task: np.asarray(split[column]) for task, column in task_columns.items()}
        states = np.asarray(split["states"])
        # Task-k: the hidden state at position k, at the start, the middle and the end of the sequence
        return {f"state@{k}": states[:, k] for k in (0, hmm_length // 2, hmm_length - 1)}

    return LanguageSetup(
        name=name,
        language=language,
        tokenizer=make_tokenizer(language.words()),
        train=data["train"].select_columns(["input_ids", "attention_mask", *train_columns]),
        contexts=contexts,
        probe_rows=list(probe_fit["input_ids"]),
        probe_tasks=tasks(probe_fit),
        probe_test_rows=list(probe_test["input_ids"]),
        probe_test_tasks=tasks(probe_test),
        entropy=entropy_bound(language, contexts),
        probe_pooling=probe_pooling,
    )


# ---------------------------------------------------------------------------------------------------- model
def build_model(
    vocab_size: int,
    *,
    hidden: int = 64,
    layers: int = 2,
    dropout: float = 0.0,
    seed: int = 0,
    heads: int | None = None,
):
    """A small BERT masked LM built from a config (nothing is downloaded); ``heads`` defaults to ``hidden // 32``."""
    torch.manual_seed(seed)
    config = bert_config(vocab_size, hidden=hidden, layers=layers, dropout=dropout, heads=heads)
    return BertForMaskedLM(config)


def bert_config(
    vocab_size: int, *, hidden: int = 64, layers: int = 2, dropout: float = 0.0, heads: int | None = None
) -> BertConfig:
    """The config of `build_model` (also the target architecture a smaller model is embedded into)."""
    heads = max(1, hidden // 32) if heads is None else heads
    if heads < 1 or hidden % heads:
        raise ValueError(f"hidden size {hidden} is not divisible into {heads} attention heads; pick heads dividing it.")
    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=64,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        type_vocab_size=1,
    )


def pad_contexts(contexts: Dataset, pad_id: int = 0) -> dict[str, torch.Tensor]:
    rows, labels = contexts["input_ids"], contexts["labels"]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    lab = torch.full_like(ids, IGNORE_INDEX)
    for i, (r, y) in enumerate(zip(rows, labels, strict=True)):
        ids[i, : len(r)] = torch.as_tensor(r)
        mask[i, : len(r)] = 1
        lab[i, : len(y)] = torch.as_tensor(y)
    return {"input_ids": ids, "attention_mask": mask, "labels": lab}


@torch.no_grad()
def one_mask_loss(model, batch: dict[str, torch.Tensor], chunk: int = 256) -> float:
    """Mean cross-entropy at the single masked position of each context (eval mode, no dropout)."""
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


# ---------------------------------------------------------------------------------------------------- trace
def hessian_trace(model, contexts: Dataset, *, n_contexts: int, n_draws: int, seed: int) -> dict[str, Any]:
    """Fisher trace of the pre-training loss through issue 3's estimator, or a naive stand-in until it lands.

    The stand-in is the paper's estimator written plainly: for each context, ``n_draws`` labels ``y`` drawn from
    the model's own prediction at the masked position, one backward each, ``||grad log f(x_-t)_y||^2`` averaged.
    """
    try:
        from hf_flatbias.flatness import estimate_hessian_trace
    except ImportError:
        estimate_hessian_trace = None
    subset = contexts.select(range(min(n_contexts, len(contexts)))).select_columns(
        ["input_ids", "attention_mask", "labels"]
    )
    was_training = model.training
    model.eval()
    try:
        if estimate_hessian_trace is not None:
            est = estimate_hessian_trace(model, subset, n_contexts=len(subset), n_draws=n_draws, seed=seed)
            return {"mean": float(est.mean), "stderr": float(est.stderr), "estimator": str(est.estimator)}
        return _naive_fisher_trace(model, subset, n_draws=n_draws, seed=seed)
    finally:
        model.train(was_training)


def _naive_fisher_trace(model, contexts: Dataset, *, n_draws: int, seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    per_context = []
    for row, labels in zip(contexts["input_ids"], contexts["labels"], strict=True):
        ids = torch.as_tensor([row])
        position = int(np.flatnonzero(np.asarray(labels) != IGNORE_INDEX)[0])
        log_probs = torch.log_softmax(model(input_ids=ids).logits[0, position], -1)
        draws = torch.multinomial(log_probs.detach().exp(), n_draws, replacement=True, generator=generator)
        values = []
        for j, y in enumerate(draws):
            grads = torch.autograd.grad(log_probs[y], params, retain_graph=j < n_draws - 1)
            values.append(sum(float(g.pow(2).sum()) for g in grads))
        per_context.append(np.mean(values))
    per_context = np.asarray(per_context)
    return {
        "mean": float(per_context.mean()),
        "stderr": float(per_context.std(ddof=1) / math.sqrt(len(per_context))) if len(per_context) > 1 else math.nan,
        "estimator": "recipe_naive_fallback",
    }


# ---------------------------------------------------------------------------------------------------- probes
def probe_scores(model, setup: LanguageSetup, pooling: str | None = None) -> dict[str, dict[str, float]]:
    pooling = pooling or setup.probe_pooling
    fit = extract_features(model, setup.probe_rows, pooling=pooling)
    test = extract_features(model, setup.probe_test_rows, pooling=pooling)
    return features_probe_scores(fit, test, setup)


def features_probe_scores(fit: np.ndarray, test: np.ndarray, setup: LanguageSetup) -> dict[str, dict[str, float]]:
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
    """Evaluates the live model every ``every`` optimizer steps (main process only) and keeps the records."""

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
        self.batch = pad_contexts(setup.contexts, setup.tokenizer.pad_token_id)
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
    trace = "n/a" if r["hessian_trace"] is None else f"{r['hessian_trace']:.1f}+-{r['hessian_trace_stderr']:.1f}"
    tasks = " ".join(f"{k}={v['accuracy']:.3f}" for k, v in r["probe"].items())
    return f"step {r['step']}: loss {r['loss']:.4f} (gap {r['loss_gap_to_entropy']:.4f}) trace {trace} probe {tasks}"


# ---------------------------------------------------------------------------------------------------- reports
def spearman(x, y) -> float | None:
    from scipy.stats import spearmanr

    pairs = [(a, b) for a, b in zip(x, y, strict=True) if a is not None and b is not None]
    if len(pairs) < 3:
        return None
    rho = spearmanr(*zip(*pairs, strict=True)).statistic
    return None if rho is None or not np.isfinite(rho) else float(rho)


def matched_loss(records: list[dict[str, Any]], tolerance: float) -> list[dict[str, Any]]:
    """Checkpoints whose loss is within ``tolerance`` nats of the best: the 'same pre-training loss' set."""
    best = min(r["loss"] for r in records)
    return [r for r in records if r["loss"] <= best + tolerance]


def partial_spearman(x, y, control) -> float | None:
    """Spearman correlation of ``x`` and ``y`` with ``control`` partialled out (first-order partial correlation of
    the ranks): does the trace say anything about accuracy that the loss does not already say?"""
    rho_xy, rho_xc, rho_yc = spearman(x, y), spearman(x, control), spearman(y, control)
    if None in (rho_xy, rho_xc, rho_yc) or max(abs(rho_xc), abs(rho_yc)) >= 1.0:
        return None
    return (rho_xy - rho_xc * rho_yc) / math.sqrt((1 - rho_xc**2) * (1 - rho_yc**2))


def at_common_loss(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Each run's checkpoint nearest to the lowest loss that every run reached: a like-for-like comparison of runs
    that converge at different speeds (the paper compares at the same, saturated loss)."""
    trained = {label: [r for r in records if r["step"] > 0] for label, records in runs.items()}
    untrained = [label for label, records in trained.items() if not records]
    if untrained:
        raise ValueError(
            f"runs {untrained} have no checkpoint after step 0; evaluate them at least once (--eval-every)."
        )
    target = max(min(r["loss"] for r in records) for records in trained.values())
    return {
        "target_loss": target,
        "checkpoints": {
            label: min(records, key=lambda r: (abs(r["loss"] - target), r["step"]))
            for label, records in trained.items()
        },
    }


def correlations(records: list[dict[str, Any]]) -> dict[str, float | None]:
    """Spearman correlations of trace and of loss with probe accuracy, and of trace with accuracy at fixed loss."""
    trace, loss = [r["hessian_trace"] for r in records], [r["loss"] for r in records]
    out: dict[str, float | None] = {"n_checkpoints": len(records)}
    for suffix, key in (("", "probe_accuracy"), ("_mean_pooled", "probe_accuracy_mean_pooled")):
        if not all(key in r for r in records):
            continue
        accuracy = [r[key] for r in records]
        out[f"spearman_trace_vs_accuracy{suffix}"] = spearman(trace, accuracy)
        out[f"spearman_loss_vs_accuracy{suffix}"] = spearman(loss, accuracy)
        out[f"partial_spearman_trace_vs_accuracy_given_loss{suffix}"] = partial_spearman(trace, accuracy, loss)
    return out


def flatness_selection(records: list[dict[str, Any]], tolerance: float) -> dict[str, Any] | None:
    """What `select_flattest_checkpoint` keeps among ``records`` next to the lowest-loss checkpoint, with the probe
    accuracy of each (which the selector never sees): the paper's advice, applied to one run's checkpoints. None when
    no checkpoint has a trace (``--trace-contexts 0``): there is nothing to select by."""
    from hf_flatbias.selection import CheckpointRecord, select_flattest_checkpoint

    if all(r["hessian_trace"] is None for r in records):
        return None

    by_step = {r["step"]: r for r in records}
    selection = select_flattest_checkpoint(
        [
            CheckpointRecord(
                step=r["step"], eval_loss=r["loss"], hessian_trace=r["hessian_trace"], stderr=r["hessian_trace_stderr"]
            )
            for r in records
            if r["hessian_trace"] is not None
        ],
        loss_tolerance=tolerance,
    )
    chosen, lowest = by_step[selection.chosen.step], by_step[selection.lowest_loss.step]
    return {
        "loss_tolerance": tolerance,
        "candidates": [c.step for c in selection.candidates],
        "flattest": {k: chosen[k] for k in ("step", "loss", "hessian_trace", "probe_accuracy")},
        "lowest_loss": {k: lowest[k] for k in ("step", "loss", "hessian_trace", "probe_accuracy")},
        "accuracy_gain": chosen["probe_accuracy"] - lowest["probe_accuracy"],
    }


def is_main_process() -> bool:
    """True on the process that writes results (the only one under plain ``python``)."""
    from accelerate import PartialState

    return PartialState().is_main_process


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=float))


def final_row(
    records: list[dict[str, Any]], *, target_loss: float | None, train_seconds: float, **fields: Any
) -> dict[str, Any]:
    """A run's last record as one row of a recipe's table: ``fields`` (the run's name...), ``steps``, whether the
    loss reached ``target_loss`` (None without one), ``train_seconds``, then the record's measurements."""
    final = records[-1]
    return {
        **fields,
        "steps": final["step"],
        "reached_target": None if target_loss is None else final["loss"] <= target_loss,
        "train_seconds": train_seconds,
        **{k: v for k, v in final.items() if k != "step"},
    }


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """``rows`` as a markdown table of ``columns`` (floats to 4 significant digits, missing cells empty)."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return "nan" if math.isnan(value) else f"{value:.4g}"
        return "" if value is None else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def task_accuracies(record: dict[str, Any], key: str = "probe") -> dict[str, float]:
    """``{"probe_<task>": accuracy}`` of a record's per-task probe results, for flat tables."""
    return {f"{key}_{task}": result["accuracy"] for task, result in record[key].items()}


def write_results(
    output_dir: Path,
    recipe: str,
    args,
    setup: LanguageSetup,
    started: float,
    *,
    table: Sequence[dict[str, Any]] = (),
    columns: Sequence[str] = (),
    **fields: Any,
) -> dict[str, Any]:
    """Write ``output_dir/results.json`` (``recipe``, ``language``, ``entropy_bound``, ``config``, ``fields``,
    ``seconds`` since ``started``), print ``table`` as markdown (with each row's per-task probe accuracies as
    ``probe_<task>`` columns) and return the payload."""
    payload = {
        "recipe": recipe,
        "language": setup.name,
        "entropy_bound": setup.entropy,
        "config": config_of(args),
        **fields,
        "seconds": time.perf_counter() - started,
    }
    write_json(output_dir / "results.json", payload)
    if table:
        print(markdown_table([{**row, **task_accuracies(row)} if "probe" in row else row for row in table], columns))
    print(f"wrote {output_dir / 'results.json'} in {payload['seconds']:.0f} s")
    return payload


def plot_runs(runs: dict[str, list[dict[str, Any]]], path: Path, title: str, matched: dict[str, list] | None = None):
    """Panels: loss gap to the entropy floor, trace and probe accuracy against the step; accuracy against the trace
    at matched loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for label, records in runs.items():
        steps = [r["step"] for r in records]
        axes[0].semilogy(steps, [r["loss_gap_to_entropy"] for r in records], marker="o", label=label)
        if any(r["hessian_trace"] is not None for r in records):
            axes[1].plot(steps, [r["hessian_trace"] for r in records], marker="o", label=label)
        axes[2].plot(steps, [r["probe_accuracy"] for r in records], marker="o", label=label)
        chosen = (matched or {}).get(label, records)
        if any(r["hessian_trace"] is not None for r in chosen):
            axes[3].scatter([r["hessian_trace"] for r in chosen], [r["probe_accuracy"] for r in chosen], label=label)
    axes[0].set(xlabel="step", ylabel="loss - entropy floor (nats)", title="loss gap vs step")
    axes[1].set(xlabel="step", ylabel="Tr(H) (Fisher)", title="trace vs step")
    axes[2].set(xlabel="step", ylabel="mean probe accuracy", title="probe accuracy vs step")
    axes[3].set(xlabel="Tr(H) (Fisher)", ylabel="mean probe accuracy", title="accuracy vs trace (matched loss)")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------- training
@dataclass
class RunSpec:
    """One training run of a recipe."""

    label: str
    steps: int
    eval_every: int
    batch_size: int = 64
    learning_rate: float = 2e-3
    warmup_steps: int = 100
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


def add_common_arguments(parser, *, steps: int, eval_every: int) -> None:
    parser.add_argument("--language", choices=["pcfg", "hmm"], default="pcfg")
    parser.add_argument("--steps", type=int, default=steps, help="optimizer steps of each run")
    parser.add_argument("--eval-every", type=int, default=eval_every, help="steps between evaluated checkpoints")
    parser.add_argument("--batch-size", type=int, default=64)
    # defaults: the runs of docs/reproduction/synthetic.md, sized so a 30,000-step run fits in 30 minutes on 2 cores
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--hidden", type=int, default=64, help="BERT hidden size (64 x 2 layers: 0.11M parameters)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=None, help="attention heads (default: hidden // 32)")
    parser.add_argument("--n-train", type=int, default=400_000, help="training sentences")
    parser.add_argument("--n-contexts", type=int, default=2000, help="masked validation contexts for the loss")
    parser.add_argument("--n-probe", type=int, default=2000, help="sentences to fit the probe (and as many to score)")
    parser.add_argument("--trace-contexts", type=int, default=1000, help="contexts of the trace estimate (0: skip)")
    parser.add_argument("--trace-draws", type=int, default=2, help="labels drawn per context for the trace")
    parser.add_argument(
        "--probe-pooling",
        choices=["mean", "cls", "concat"],
        default="concat",
        help="encoder features for the probe: all positions of the last layer concatenated (the paper's linear "
        "probe), their mean, or the [CLS] vector",
    )
    parser.add_argument(
        "--mask-probability",
        type=float,
        default=0.0,
        help="chance of masking each word in training; 0: exactly one masked word per sentence (the paper's "
        "objective, whose optimum is the entropy floor)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (under 2 minutes) for tests")


def add_target_loss_argument(parser) -> None:
    """``--target-loss``: the matched-loss stop of `RunSpec.target_loss`."""
    parser.add_argument(
        "--target-loss",
        type=float,
        default=None,
        help="stop each model at its first checkpoint whose one-mask loss is at or below this (matched loss); "
        "default: train every model for --steps",
    )


def apply_smoke(args) -> None:
    """Shrink everything so the whole recipe runs in well under 2 minutes on one thread."""
    args.steps, args.eval_every = 20, 10
    args.batch_size, args.hidden, args.layers = 16, 32, 1
    args.n_train, args.n_contexts, args.n_probe = 400, 64, 100
    args.trace_contexts, args.trace_draws = 8, 1


def parse_recipe_arguments(parser, argv, default_language: str):
    """Parse a recipe's arguments with ``--language`` defaulting to ``default_language``; ``--smoke`` shrinks them."""
    parser.set_defaults(language=default_language)
    args = parser.parse_args(argv)
    if args.smoke:
        apply_smoke(args)
    return args


def setup_language_from_args(args, *, train_columns: Sequence[str] = ()) -> LanguageSetup:
    """``setup_language`` with the sizes, seed and probe pooling of ``add_common_arguments``."""
    return setup_language(
        args.language,
        n_train=args.n_train,
        n_contexts=args.n_contexts,
        n_probe=args.n_probe,
        seed=args.seed,
        probe_pooling=args.probe_pooling,
        train_columns=train_columns,
    )


def run_spec_arguments(args) -> dict[str, Any]:
    """The ``RunSpec`` fields every recipe takes from its arguments (warm-up: a tenth of the steps, at most 100)."""
    return dict(
        steps=args.steps,
        eval_every=args.eval_every,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        warmup_steps=min(100, args.steps // 10),
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        seed=args.seed,
        mask_probability=args.mask_probability,
    )


def config_of(args) -> dict[str, Any]:
    """The arguments as a JSON-ready dict (paths as strings), for a recipe's ``results.json``."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def train_and_evaluate(
    setup: LanguageSetup, spec: RunSpec, output_dir: Path, *, trace_contexts: int, trace_draws: int
) -> list[dict[str, Any]]:
    """Train one masked LM with ``FlatBiasTrainer`` and evaluate it every ``spec.eval_every`` steps (and at 0).

    The optional `RunSpec` fields change only what they name: ``wrap_model`` trains a wrapper around the masked LM
    (records still describe the masked LM), ``target_loss`` stops at the first checkpoint that reaches it,
    ``callbacks`` join the Trainer (which then also evaluates on the contexts), ``flatness_overrides`` set further
    `FlatBiasConfig` fields, and ``trace_final_only`` measures the trace once, on the last checkpoint.
    """
    from hf_flatbias import FlatBiasConfig
    from hf_flatbias.trainer import FlatBiasTrainer

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
    settings: dict[str, Any] = dict(
        output_dir=str(output_dir / spec.label),
        max_steps=spec.steps,
        per_device_train_batch_size=spec.batch_size,
        learning_rate=spec.learning_rate,
        lr_scheduler_type="constant_with_warmup",  # constant: training continues at full speed after convergence
        warmup_steps=spec.warmup_steps,
        weight_decay=spec.weight_decay,
        flatness_method=spec.flatness_method,
        sam_rho=spec.sam_rho,
        save_strategy="no",
        report_to=[],
        logging_steps=max(1, spec.eval_every),
        disable_tqdm=True,
        seed=spec.seed,
        use_cpu=True,
        dataloader_num_workers=0,
    )
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
