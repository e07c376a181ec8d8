"""Forgetting: how much of the pre-training loss a checkpoint gives up when its encoder is fine-tuned for a few
steps on a downstream classification task.

The measurement, on a copy (the model passed in is never modified):

1. ``L_before``: the mean data-label cross-entropy of the LM on the pre-training contexts (rows as for
   `estimate_hessian_trace`), and optionally its Fisher trace (`estimate_hessian_trace`).
2. A sequence classifier of the same architecture (``AutoModelForSequenceClassification.from_config`` on a copy of
   the LM's config, ``num_labels`` set) gets the LM's encoder (``model.base_model``) weights; its new parts (the head,
   and BERT's pooler, which a masked LM does not have) are initialised from ``seed``.
3. ``steps`` optimizer steps on the task rows (``input_ids``, optional ``attention_mask``/``token_type_ids``, and
   ``label``), in ``train()`` mode, batches of ``batch_size`` rows in an order drawn from ``seed`` (a new permutation
   every pass over the rows), dropout drawn from ``seed``: every checkpoint sees the same data in the same order.
   No gradient clipping, no schedule.
4. The tuned encoder is copied into a copy of the LM (its own LM head, tied to the tuned embeddings where the LM ties
   them), and ``L_after`` measured on the same contexts; ``forgetting = L_after - L_before`` with the standard error of
   the mean per-context difference. The classifier's accuracy on ``eval_rows`` (the task rows when not given) is
   reported beside, before and after the steps.

Everything runs with the global random streams restored after. Nothing here knows about the Trainer.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForSequenceClassification

from ..constants import DEFAULT_BATCH_SIZE, FORGETTING_OPTIMIZERS
from .api import estimate_hessian_trace
from .contexts import prepare_contexts
from .lm import evaluation_mode, model_device, preserved_global_rng
from .results import TraceEstimate
from .weight_noise import check_positive_int, mean_and_stderr, per_context_losses


@dataclass
class ForgettingResult:
    """The pre-training loss (and optionally Fisher trace) before and after fine-tuning the encoder.

    Attributes:
        lm_loss_before, lm_loss_after: the mean data-label cross-entropy on the pre-training contexts.
        forgetting: ``lm_loss_after - lm_loss_before`` (as the mean of the per-context differences).
        stderr: its standard error (of the mean per-context difference; ``nan`` with one context).
        accuracy_before, accuracy_after: the classifier's accuracy on the evaluation rows with the fresh head and
            after the steps; ``accuracy_before_stderr``, ``accuracy_after_stderr`` their standard errors (of a mean
            of 0/1 values over the rows; ``nan`` with one row).
        train_losses: the task loss of each step's batch.
        trace_before, trace_after: `TraceEstimate` of the LM before and after, when asked (``trace=...``), else
            ``None``.
        steps, learning_rate, batch_size, optimizer, weight_decay, seed, num_labels: the fine-tuning settings.
        accuracy_on: ``"eval_rows"`` or ``"task_rows"`` (no evaluation rows were given).
        n_contexts: pre-training contexts the loss averages over.
        n_task_rows, n_eval_rows: rows fine-tuned on and evaluated on.
        seconds: wall-clock time.
        task, label_column: the downstream task's name (a GLUE task, a path) and class column, when the caller
            names them (the measures table does); ``None`` otherwise.
    """

    lm_loss_before: float
    lm_loss_after: float
    forgetting: float
    stderr: float
    accuracy_before: float
    accuracy_after: float
    steps: int
    learning_rate: float
    batch_size: int
    optimizer: str
    weight_decay: float
    seed: int
    num_labels: int
    accuracy_on: str
    n_contexts: int
    n_task_rows: int
    n_eval_rows: int
    seconds: float
    train_losses: list[float] = field(default_factory=list)
    trace_before: TraceEstimate | None = None
    trace_after: TraceEstimate | None = None
    accuracy_before_stderr: float = float("nan")
    accuracy_after_stderr: float = float("nan")
    task: str | None = None
    label_column: str | None = None

    @property
    def trace_change(self) -> float | None:
        """``trace_after.mean - trace_before.mean`` when both were measured."""
        if self.trace_before is None or self.trace_after is None:
            return None
        return self.trace_after.mean - self.trace_before.mean

    def to_dict(self) -> dict[str, Any]:
        values = asdict(self)
        values["trace_change"] = self.trace_change
        return values


def _task_label(row: Mapping[str, Any], index: int) -> int:
    for key in ("label", "labels"):
        if key in row:
            value = row[key]
            value = value.reshape(-1) if isinstance(value, torch.Tensor) else value
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    break
                value = value.item()
            return int(value)
    raise ValueError(
        f"Task row {index} has no single class 'label': fine-tuning rows need input_ids, attention_mask and an "
        "integer label (a sequence-classification dataset such as GLUE's, tokenized)."
    )


def checked_task_rows(rows: Iterable[Mapping[str, Any]], what: str) -> list[dict[str, Any]]:
    rows = list(rows)
    if not rows:
        raise ValueError(f"{what} is empty: pass tokenized classification rows (input_ids, attention_mask, label).")
    out = []
    for index, row in enumerate(rows):
        if "input_ids" not in row:
            raise ValueError(f"{what} row {index} has no 'input_ids'; tokenize the task data first.")
        ids = torch.as_tensor(row["input_ids"], dtype=torch.long).reshape(-1)
        entry = {
            "input_ids": ids,
            "attention_mask": torch.as_tensor(row["attention_mask"], dtype=torch.long).reshape(-1)
            if "attention_mask" in row
            else torch.ones_like(ids),
            "label": _task_label(row, index),
        }
        if "token_type_ids" in row:
            entry["token_type_ids"] = torch.as_tensor(row["token_type_ids"], dtype=torch.long).reshape(-1)
        out.append(entry)
    return out


def collate_task_rows(
    rows: Sequence[dict[str, Any]], pad_id: int, device: torch.device
) -> tuple[dict[str, torch.Tensor], Any]:
    length = max(len(r["input_ids"]) for r in rows)
    batch = {
        "input_ids": torch.full((len(rows), length), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros((len(rows), length), dtype=torch.long),
    }
    if "token_type_ids" in rows[0]:
        batch["token_type_ids"] = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        for key in batch:
            batch[key][i, :n] = row[key]
    labels = torch.tensor([r["label"] for r in rows], dtype=torch.long, device=device)
    return {k: v.to(device) for k, v in batch.items()}, labels


def padding_id(config: Any) -> int:
    """The id task rows are padded with: the LM's padding id, else its end-of-sequence id (as decoder tokenizers
    without a padding token are usually given), else 0."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(config, name, None)
        value = value[0] if isinstance(value, (list, tuple)) and value else value
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return 0


def sequence_classifier_from(model: nn.Module, num_labels: int, *, seed: int = 0) -> nn.Module:
    """A sequence classifier of the LM's architecture holding a copy of its encoder (``base_model``) weights, its
    new parts initialised from ``seed``, in the LM's dtype and device. The LM is not modified.

    Raises:
        ValueError: transformers has no sequence classifier for the architecture, or its encoder differs from the
            LM's (weights that would not load).
    """
    config = copy.deepcopy(model.config)
    # a decoder's classifier reads the last token that is not padding, and refuses batches without a padding id
    config.pad_token_id = padding_id(model.config)
    config.num_labels = num_labels
    config.problem_type = "single_label_classification"
    attn = getattr(model.config, "_attn_implementation", None)
    with preserved_global_rng():
        torch.manual_seed(seed)
        try:
            kwargs = {"attn_implementation": attn} if attn else {}
            classifier = AutoModelForSequenceClassification.from_config(config, **kwargs)
        except ValueError as error:
            raise ValueError(
                f"No sequence classifier for {type(model).__name__} ({error}): forgetting fine-tunes the encoder "
                "under a classification head of the same architecture (AutoModelForSequenceClassification)."
            ) from None
    reference = next(model.parameters())
    classifier.to(device=reference.device, dtype=reference.dtype)
    encoder = getattr(model, "base_model", model)
    if type(classifier.base_model) is not type(encoder):
        raise ValueError(
            f"{type(classifier).__name__}'s encoder is a {type(classifier.base_model).__name__}, the LM's a "
            f"{type(encoder).__name__}: their weights cannot be shared. Use an LM whose base model the sequence "
            "classifier of its architecture uses."
        )
    result = classifier.base_model.load_state_dict(encoder.state_dict(), strict=False)
    if result.unexpected_keys:
        raise ValueError(
            f"The classifier's encoder lacks the LM's weights {result.unexpected_keys[:3]}: the architectures differ."
        )
    return classifier


@torch.no_grad()
def _accuracy(
    classifier: nn.Module, rows: Sequence[dict[str, Any]], pad_id: int, batch_size: int
) -> tuple[float, float]:
    """The accuracy on ``rows`` and its standard error (that of the mean of the 0/1 outcomes)."""
    correct = []
    device = model_device(classifier)
    with evaluation_mode(classifier):
        for start in range(0, len(rows), batch_size):
            batch, labels = collate_task_rows(rows[start : start + batch_size], pad_id, device)
            correct.append((classifier(**batch).logits.argmax(dim=-1) == labels).cpu())
    return mean_and_stderr(torch.cat(correct).double())


def measure_forgetting(
    model: nn.Module,
    lm_dataset: Iterable[Mapping[str, Any]],
    task_rows: Iterable[Mapping[str, Any]],
    *,
    steps: int = 50,
    learning_rate: float = 2e-5,
    batch_size: int = 8,
    optimizer: str = "adamw",
    weight_decay: float = 0.0,
    num_labels: int | None = None,
    eval_rows: Iterable[Mapping[str, Any]] | None = None,
    seed: int = 0,
    trace: Mapping[str, Any] | None = None,
    n_contexts: int | None = None,
    lm_batch_size: int = DEFAULT_BATCH_SIZE,
    causal: bool | None = None,
) -> ForgettingResult:
    """Forgetting of the pre-training loss after ``steps`` steps of fine-tuning the encoder on a classification task.

    Args:
        model: a masked or causal LM of an architecture transformers has a sequence classifier for; not modified.
        lm_dataset: the held-out pre-training contexts (rows with ``input_ids``, ``attention_mask``, ``labels``).
        task_rows: tokenized classification rows, ``input_ids``, optional ``attention_mask``/``token_type_ids``,
            and an integer ``label``.
        steps: optimizer steps (0 measures nothing but the copy: zero forgetting).
        learning_rate, weight_decay: of the optimizer.
        batch_size: task rows per step.
        optimizer: ``"adamw"`` (default) or ``"sgd"`` (plain, no momentum).
        num_labels: classes; by default one more than the largest label of the task and evaluation rows.
        eval_rows: rows the accuracy is measured on; the task rows when not given.
        seed: the head's initialisation, the data order and dropout.
        trace: keyword arguments of `estimate_hessian_trace` (e.g. ``{"n_draws": 2, "seed": 0}``) to measure the
            trace before and after too; ``None`` (default) skips it.
        n_contexts, lm_batch_size, causal: the pre-training contexts used, contexts per forward, and whether the LM
            is causal (detected by default).

    Returns:
        A `ForgettingResult`.

    Raises:
        ValueError: bad settings, rows without labels, an architecture without a sequence classifier.
    """
    start_time = time.perf_counter()
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an integer >= 0 (got {steps!r}).")
    check_positive_int("batch_size", batch_size)
    check_positive_int("lm_batch_size", lm_batch_size)
    if not (isinstance(learning_rate, (int, float)) and learning_rate >= 0):
        raise ValueError(f"learning_rate must be a number >= 0 (got {learning_rate!r}).")
    if optimizer not in FORGETTING_OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not supported; choose one of {list(FORGETTING_OPTIMIZERS)}.")
    train = checked_task_rows(task_rows, "task_rows")
    evaluation = checked_task_rows(eval_rows, "eval_rows") if eval_rows is not None else train
    largest = max(r["label"] for r in train + (evaluation if eval_rows is not None else []))
    if num_labels is None:
        num_labels = largest + 1
    check_positive_int("num_labels", num_labels)
    if largest >= num_labels or min(r["label"] for r in train + evaluation) < 0:
        raise ValueError(f"Labels must lie in 0..{num_labels - 1} (num_labels={num_labels}); got up to {largest}.")
    lm_dataset = list(lm_dataset)
    contexts, n_used = prepare_contexts(model, lm_dataset, n_contexts, causal)
    trace_kwargs = {"n_contexts": n_contexts, "causal": causal, **trace} if trace is not None else None
    pad_id = padding_id(model.config)

    with preserved_global_rng():
        with evaluation_mode(model):
            before = per_context_losses(model, contexts, n_used, lm_batch_size)
        trace_before = estimate_hessian_trace(model, lm_dataset, **trace_kwargs) if trace_kwargs is not None else None

        classifier = sequence_classifier_from(model, num_labels, seed=seed)
        classifier.requires_grad_(True)
        accuracy_before, accuracy_before_stderr = _accuracy(classifier, evaluation, pad_id, batch_size)
        params = [p for p in classifier.parameters() if p.requires_grad]
        if optimizer == "adamw":
            opt = torch.optim.AdamW(params, lr=learning_rate, weight_decay=weight_decay, foreach=False)
        else:
            opt = torch.optim.SGD(params, lr=learning_rate, weight_decay=weight_decay, foreach=False)
        order = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)  # dropout
        device = model_device(classifier)
        queue: list[int] = []
        train_losses = []
        classifier.train()
        for _ in range(steps):
            if len(queue) < batch_size:
                queue.extend(torch.randperm(len(train), generator=order).tolist())
            chosen, queue = queue[:batch_size], queue[batch_size:]
            batch, labels = collate_task_rows([train[i] for i in chosen], pad_id, device)
            with torch.enable_grad():
                logits = classifier(**batch).logits
                loss = torch.nn.functional.cross_entropy(
                    logits.to(torch.promote_types(logits.dtype, torch.float32)), labels
                )
                opt.zero_grad(set_to_none=True)
                loss.backward()
            opt.step()
            train_losses.append(float(loss.detach()))
        accuracy_after, accuracy_after_stderr = _accuracy(classifier, evaluation, pad_id, batch_size)
        del opt

        tuned = copy.deepcopy(model)
        tuned_encoder = getattr(tuned, "base_model", tuned)
        tuned_keys = set(tuned_encoder.state_dict())
        encoder_state = {k: v for k, v in classifier.base_model.state_dict().items() if k in tuned_keys}
        missing = tuned_keys - set(encoder_state)
        if missing:
            raise ValueError(f"The classifier's encoder lacks the LM's weights {sorted(missing)[:3]}.")
        with torch.no_grad():
            tuned_encoder.load_state_dict(encoder_state, strict=True)
        del classifier
        with evaluation_mode(tuned):
            after = per_context_losses(tuned, contexts, n_used, lm_batch_size)
        trace_after = estimate_hessian_trace(tuned, lm_dataset, **trace_kwargs) if trace_kwargs is not None else None
        del tuned

    forgetting, stderr = mean_and_stderr(after - before)
    return ForgettingResult(
        lm_loss_before=float(before.mean()),
        lm_loss_after=float(after.mean()),
        forgetting=forgetting,
        stderr=stderr,
        accuracy_before=accuracy_before,
        accuracy_after=accuracy_after,
        steps=steps,
        learning_rate=float(learning_rate),
        batch_size=batch_size,
        optimizer=optimizer,
        weight_decay=float(weight_decay),
        seed=int(seed),
        num_labels=num_labels,
        accuracy_on="eval_rows" if eval_rows is not None else "task_rows",
        n_contexts=n_used,
        n_task_rows=len(train),
        n_eval_rows=len(evaluation),
        seconds=time.perf_counter() - start_time,
        train_losses=train_losses,
        trace_before=trace_before,
        trace_after=trace_after,
        accuracy_before_stderr=accuracy_before_stderr,
        accuracy_after_stderr=accuracy_after_stderr,
    )
