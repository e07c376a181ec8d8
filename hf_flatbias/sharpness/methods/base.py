"""What every flatness method is (`FlatnessMethod`) and what it may ask of the trainer that runs it (`FlatnessHost`).

A method runs inside the host trainer's loop: the loop prefetches an update's micro-batches, calls ``training_step``
on each, then steps the optimizer. The method decides what one micro-batch's step is (its passes, their order, what
it remembers between updates); the host owns everything the loop owns (loss scaling under accumulation, backward
through the accelerator or DeepSpeed, logging, metrics, checkpoints). Keeping the host behind this protocol lets the
same method run in `Trainer` and trl's trainers alike, and under DDP, DeepSpeed ZeRO and FSDP2.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from ...tensors import Perturbation
from ..engines import PerturbableParameters
from ..functional_sam import FunctionOutputs


class FlatnessHost(Protocol):
    """The trainer as a flatness method sees it: `FlatnessTrainerMixin` on any `Trainer` subclass.

    Besides these, a method may read the `Trainer` attributes every host has: ``args`` (the training arguments with
    the flatness fields), ``accelerator``, ``model``, ``optimizer``, ``model_accepts_loss_kwargs``,
    ``current_gradient_accumulation_steps``, ``compute_loss`` and ``compute_loss_context_manager``.
    """

    args: Any
    accelerator: Any
    model: nn.Module
    optimizer: Any
    model_accepts_loss_kwargs: bool
    current_gradient_accumulation_steps: int

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], **kwargs: Any) -> Any: ...

    def compute_loss_context_manager(self) -> contextlib.AbstractContextManager: ...

    # ---- the passes of a step

    def start_flatness_step(self, model: nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
        """Train mode and the micro-batch on the device, as `Trainer.training_step` begins."""

    def prepare_flatness_inputs(self, model: nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
        """A micro-batch on the device, with what both passes of a step share (DPO's reference log-probabilities)."""

    def plain_training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any) -> torch.Tensor:
        """The host's own one-pass step."""

    def scaled_loss(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any) -> torch.Tensor:
        """The loss as `Trainer.training_step` scales it before backward."""

    def scaled_loss_and_function(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any
    ) -> tuple[torch.Tensor, FunctionOutputs]:
        """`scaled_loss` and what it was computed from, as Functional-SAM differentiates it (the logits)."""

    def loss_and_outputs(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any
    ) -> tuple[torch.Tensor, Any]:
        """The unscaled loss and model outputs carrying differentiable ``logits``."""

    def scale_for_accumulation(self, loss: torch.Tensor, num_items_in_batch: Any) -> torch.Tensor:
        """Scale a loss for accumulation as `Trainer.training_step` does."""

    def first_gradient(
        self, losses: torch.Tensor | Iterable[torch.Tensor], perturbable: PerturbableParameters
    ) -> list[torch.Tensor]:
        """The gradient of ``losses`` on ``perturbable``, outside the optimizer's ``.grad``, averaged over processes
        when ``sam_perturbation="global"``."""

    def flatness_backward(self, loss: torch.Tensor) -> None:
        """The backward of a step's second pass, through the accelerator or the DeepSpeed engine."""

    def step_deepspeed_after_restore(self) -> None:
        """Under DeepSpeed, the optimizer step that `flatness_backward` left for after ``w`` is restored."""

    def host_metrics_suspended(self) -> contextlib.AbstractContextManager:
        """The context of a second pass, in which the host's ``compute_loss`` records no metrics."""

    def head_gradients_in_forward(self) -> tuple[Callable[[], contextlib.AbstractContextManager] | None, str | None]:
        """For output-layer SAM with the trunk replayed: a context for each of the step's passes in which the host's
        loss forms the output layer's gradients in its forward, where it would recompute the layer in its backward
        (trl's fused LM head); or ``None`` and why not (``None, None`` where the host has nothing to save)."""

    # ---- SAM's schedule

    def is_sam_update(self) -> bool:
        """Whether this optimizer update takes the SAM second pass (``sam_every_k``, the SAM window)."""

    def sam_rho(self) -> float | None:
        """The radius of this update's perturbation, ``None`` outside the SAM window."""

    def deepspeed_engine(self) -> Any:
        """The DeepSpeed engine once the model is prepared, else ``None``."""

    # ---- logging

    def record_flatness_metric(self, key: str, value: float) -> None:
        """Log ``value`` under ``key`` with the next training loss (averaged over the steps since)."""

    def record_perturbation(self, perturbation: Perturbation, n_micro_batches: int) -> None:
        """Log the first gradient's and the perturbation's norms."""

    def record_perturbed_loss(self, loss: torch.Tensor) -> None:
        """Log the loss at the perturbed weights, summed over the update's micro-batches."""

    def warn_skipped_perturbation(self, consequence: str) -> None:
        """Count and report a step whose first gradient gave no direction."""

    def count_flos_of_extra_pass(self, inputs: dict[str, Any], share: float = 1.0) -> None:
        """Count the floating-point operations of a step's second pass: ``share`` of a whole forward/backward."""


class FlatnessMethod:
    """One flatness method: its training step, and the state it keeps from one update to the next.

    A subclass overrides ``training_step``; one whose steps depend on earlier updates (LookSAM's direction, the
    Fisher penalty's label draws) returns that state from ``state_dict`` and takes it back in ``load_state_dict``,
    so that a resumed run repeats an uninterrupted one. The host saves it with every checkpoint, one file per
    process.
    """

    #: What the checkpointed state is, in words, for the warning when a checkpoint lacks it (``None``: no state).
    checkpointed_state: ClassVar[str | None] = None

    def __init__(self, host: FlatnessHost):
        self.host = host

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any) -> torch.Tensor:
        """One micro-batch of this method; returns the loss at ``w`` as `Trainer.training_step` returns it."""
        return self.host.plain_training_step(model, inputs, num_items_in_batch)

    def keep_update_batches(self, micro_batches: list[dict[str, Any]]) -> None:
        """The micro-batches of the update about to start, all of them, before its first ``training_step``."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what ``state_dict`` returned (read from a checkpoint, tensors on the CPU)."""


class NoFlatnessMethod(FlatnessMethod):
    """``flatness_method="none"``: the host trainer's own step."""
