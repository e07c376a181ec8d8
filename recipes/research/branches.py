"""Anneal-to-evaluate: measure converged copies of a constant-learning-rate run without disturbing it.

At constant learning rate a run never settles (its loss sits on a noise floor that only a decaying rate removes),
and a run with one decay to 0 is converged only at its end. The protocol here keeps a *trunk* at constant rate and,
at each evaluation step, copies the trunk's weights and optimizer state into a *branch* that is annealed linearly to
learning rate 0 over a fixed number of steps and then measured. Every compared point is thereby converged, and the
trunk continues exactly as if no branch had been taken: the branch draws its own batches and the global random state
is restored afterwards.

[`anneal_branch`] is the numerical core (a plain PyTorch loop on a copy); [`BranchEvaluator`] calls it from a
Trainer callback.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from datasets import Dataset
from transformers import TrainerCallback

from hf_flatbias.results import write_json
from hf_flatbias.synthetic import MaskedWordCollator


def linear_anneal_rates(learning_rate: float, steps: int) -> list[float]:
    """Rates of an anneal from ``learning_rate`` down to 0: step ``i`` of ``steps`` uses ``lr * (1 - i / steps)``."""
    if steps < 1 or learning_rate < 0:
        raise ValueError(f"need steps >= 1 and learning_rate >= 0, got {steps} and {learning_rate}.")
    return [learning_rate * (1 - i / steps) for i in range(steps)]


def anneal_branch(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[dict[str, torch.Tensor]],
    *,
    steps: int,
    learning_rate: float,
    max_grad_norm: float | None = None,
) -> torch.nn.Module:
    """A copy of ``model`` trained ``steps`` more steps with the learning rate falling linearly to 0.

    The copy starts from the trunk's weights *and* optimizer state (Adam moments included), with the optimizer's
    class and hyper-parameters; the model, the optimizer and torch's global random state (the CPU's, and the
    model's GPU's when it is on one) are left as they were.

    Args:
        model: the trunk.
        optimizer: the trunk's optimizer (an accelerate wrapper is unwrapped).
        batches: training batches of the branch (``model(**batch).loss`` must be the training loss); at least
            ``steps`` of them.
        steps: anneal length.
        learning_rate: the rate the anneal starts from (normally the trunk's current one).
        max_grad_norm: clip the branch's gradients to this norm, as the trunk's Trainer does (``None``: no clipping).

    Returns:
        The annealed copy, in eval mode.
    """
    inner = getattr(optimizer, "optimizer", optimizer)
    rates = linear_anneal_rates(learning_rate, steps)
    device = next(model.parameters()).device
    # the CPU's random state and, on a GPU, that device's (its dropout draws there): the trunk's stay untouched
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        branch = copy.deepcopy(model)
        branch.train()
        # the branch's optimizer has the trunk's class and parameter groups, over the copied parameters (deepcopy
        # keeps their order); load_state_dict then restores every group setting and the moments
        twin = {id(a): b for a, b in zip(model.parameters(), branch.parameters(), strict=True)}
        groups = [{"params": [twin[id(p)] for p in group["params"]]} for group in inner.param_groups]
        accepted = inspect.signature(type(inner)).parameters
        branch_optimizer = type(inner)(groups, **{k: v for k, v in inner.defaults.items() if k in accepted})
        branch_optimizer.load_state_dict(copy.deepcopy(inner.state_dict()))
        for rate in rates:
            batch = {name: tensor.to(device) for name, tensor in next(batches).items()}
            for group in branch_optimizer.param_groups:
                group["lr"] = rate
            loss = branch(**batch).loss
            loss.backward()
            if max_grad_norm is not None and max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(branch.parameters(), max_grad_norm)
            branch_optimizer.step()
            branch_optimizer.zero_grad(set_to_none=True)
    return branch.eval()


def branch_batches(
    dataset: Dataset, *, batch_size: int, seed: int, mask_probability: float = 0.0, task_column: str | None = None
) -> Iterator[dict[str, torch.Tensor]]:
    """Endless shuffled, masked batches of ``dataset``'s rows from their own generators (the trunk's stay untouched);
    with ``task_column``, each batch also carries that column as ``task_labels`` (as `MaskedWordCollator`)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    collator = MaskedWordCollator(mask_probability, seed=seed, task_column=task_column)
    rng = np.random.default_rng(seed)
    columns = dataset.select_columns(["input_ids", "attention_mask", *([task_column] if task_column else [])])
    while True:
        order = rng.permutation(len(columns))
        for start in range(0, len(order) - batch_size + 1, batch_size):
            # one batched read (Dataset.__getitems__): reading row by row cost 57 ms per 1024 rows
            yield collator(columns.__getitems__(order[start : start + batch_size].tolist()))


class BranchEvaluator(TrainerCallback):
    """At every ``every`` optimizer steps, anneals a branch off the trunk and records ``measure(branch, step)``.

    Args:
        train: sentences the branch trains on (normally the trunk's training set; the branch shuffles its own copy).
        every: steps between branches.
        anneal_steps: length of each branch's linear anneal to learning rate 0.
        batch_size: the branch's batch size (normally the trunk's).
        measure: ``measure(branch, step) -> dict`` (e.g. KL saturation, trace and probes of the annealed branch).
        mask_probability: as `MaskedWordCollator`'s.
        task_column: a column of ``train`` the branch's batches carry as ``task_labels`` (an adversarial objective).
        seed: the branch at step ``s`` draws its batches from seed ``seed + s``.
        partial_path: records are rewritten there after every branch, so a stopped run keeps what it measured.
        stop_when: ``stop_when(records) -> bool`` after every branch; True stops the trunk there (a pilot whose rule
            is decided before the last planned branch).
    """

    def __init__(
        self,
        train: Dataset,
        *,
        every: int,
        anneal_steps: int,
        batch_size: int,
        measure: Callable[[torch.nn.Module, int], dict[str, Any]],
        mask_probability: float = 0.0,
        task_column: str | None = None,
        seed: int = 0,
        partial_path: Path | None = None,
        stop_when: Callable[[list[dict[str, Any]]], bool] | None = None,
    ):
        if every < 1 or anneal_steps < 1:
            raise ValueError(f"every and anneal_steps must be >= 1, got {every} and {anneal_steps}.")
        self.train = train
        self.every = every
        self.anneal_steps = anneal_steps
        self.batch_size = batch_size
        self.measure = measure
        self.mask_probability = mask_probability
        self.task_column = task_column
        self.seed = seed
        self.partial_path = partial_path
        self.stop_when = stop_when
        self.records: list[dict[str, Any]] = []

    def branch(self, model: torch.nn.Module, optimizer, learning_rate: float, step: int, max_grad_norm=None):
        """The annealed branch at ``step`` (also usable outside a Trainer)."""
        batches = branch_batches(
            self.train,
            batch_size=self.batch_size,
            seed=self.seed + step,
            mask_probability=self.mask_probability,
            task_column=self.task_column,
        )
        return anneal_branch(
            model,
            optimizer,
            batches,
            steps=self.anneal_steps,
            learning_rate=learning_rate,
            max_grad_norm=max_grad_norm,
        )

    def on_step_end(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        if state.global_step % self.every or not state.is_world_process_zero:
            return
        rate = lr_scheduler.get_last_lr()[0] if lr_scheduler is not None else args.learning_rate
        branch = self.branch(model, optimizer, rate, state.global_step, args.max_grad_norm)
        record = {"step": state.global_step, "trunk_learning_rate": rate, "anneal_steps": self.anneal_steps}
        record.update(self.measure(branch, state.global_step))
        self.records.append(record)
        if self.partial_path is not None:
            write_json(self.partial_path, {"records": self.records})
        if args.save_strategy != "no":
            control.should_save = True  # a checkpoint at the branch's step: a rerun resumes after this branch
        if self.stop_when is not None and self.stop_when(self.records):
            control.should_training_stop = True
