"""`FlatBiasTrainer`: the transformers `Trainer` with flatness-seeking steps.

This module orchestrates; the numbers come from `hf_flatbias.sharpness`. A SAM step inside the Trainer loop:

1. first gradient ``g`` on the *unwrapped* model with ``torch.autograd.grad`` (no DDP/DeepSpeed hook fires, no
   ``.grad`` is written, the optimizer is not involved), averaged over processes when ``sam_perturbation="global"``;
2. move the weights to ``w + e``;
3. the usual forward/backward through the accelerator at ``w + e``, so accumulation, gradient sync, loss scaling and
   clipping happen exactly as in a plain step;
4. restore ``w`` (bit for bit) before the Trainer loop steps the optimizer.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
from huggingface_hub.errors import HfHubHTTPError
from torch import nn
from transformers import Trainer, TrainingArguments
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.trainer_utils import unwrap_peft_model
from transformers.utils import logging

from .config import FlatBiasConfig
from .modelcard import FlatnessCard, flatness_card_from_trainer
from .sharpness.engines import (
    average_across_processes,
    check_deepspeed_supports_penalty,
    check_deepspeed_supports_sam,
    deepspeed_backward,
    gradients_of,
    perturbable_parameters,
    trainable_parameters,
)
from .sharpness.penalties import (
    add_looksam_component,
    fisher_penalty_coefficient,
    fisher_trace_from_mean_gradient,
    grad_norm_penalty_weights,
    labelled_logits,
    linear_term,
    orthogonal_direction,
    sample_model_labels,
    sampled_label_loss,
)
from .sharpness.sam import Perturbation, perturb_weights, squared_norm
from .utils import forward_normalizes_by_num_items

logger = logging.get_logger(__name__)


class FlatBiasTrainer(Trainer):
    """A drop-in replacement for [`~transformers.Trainer`] whose steps seek flat minima.

    Use it with a [`FlatBiasConfig`] exactly as you would use `Trainer` with `TrainingArguments`:

    ```python
    args = FlatBiasConfig("out", flatness_method="sam", sam_rho=0.05)
    trainer = FlatBiasTrainer(model=model, args=args, train_dataset=train, data_collator=collator)
    trainer.train()
    ```

    Callbacks that define ``bind_trainer(trainer)`` (such as `HessianTraceCallback`) are bound to this trainer so
    they can log through it.
    """

    _tag_names = ["hf_flatbias"]

    def __init__(self, model: nn.Module | None = None, args: TrainingArguments | None = None, **kwargs: Any):
        args = _as_flatbias_config(args)
        if model is not None and not any(p.requires_grad for p in model.parameters()):
            raise ValueError(
                "The model has no trainable parameter (every requires_grad is False): unfreeze some parameters or "
                "attach adapters (e.g. peft.get_peft_model) before building the trainer."
            )
        super().__init__(model=model, args=args, **kwargs)
        self._fix_loss_scaling_for_models_ignoring_num_items()
        self._sam_metrics: dict[str, list[float]] = defaultdict(list)
        self._update_micro_batches: list[dict[str, Any]] | None = None
        self._batch_perturbation: Perturbation | None = None
        self._skipped_perturbations = 0
        self._label_generator: torch.Generator | None = None
        self._looksam_plain_gradient: list[torch.Tensor] | None = None
        self._looksam_direction: list[torch.Tensor] | None = None
        if self.args.uses_sam:
            self._check_sam_is_supported()
        if self.args.uses_penalty or self.args.flatness_method == "looksam":
            self._check_regularizer_is_supported()
        for callback in self.callback_handler.callbacks:
            self._bind_callback(callback)

    # ------------------------------------------------------------------ setup

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any):
        """`Trainer.train`, after checking that the checkpoint to resume from is intact and of this model's shape."""
        if resume_from_checkpoint:
            from transformers.trainer_utils import get_last_checkpoint

            from .checkpoints import check_resumable

            if resume_from_checkpoint is True:
                last = get_last_checkpoint(self.args.output_dir) if os.path.isdir(self.args.output_dir) else None
                if last is None:
                    raise ValueError(
                        f"resume_from_checkpoint=True but {self.args.output_dir} holds no checkpoint-* folder; "
                        "start without resuming or pass the checkpoint's path."
                    )
                resume_from_checkpoint = last
            model_config = getattr(unwrap_peft_model(self.accelerator.unwrap_model(self.model)), "config", None)
            check_resumable(resume_from_checkpoint, model_config)
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def add_callback(self, callback) -> None:
        super().add_callback(callback)
        for registered in self.callback_handler.callbacks:
            self._bind_callback(registered)

    def _bind_callback(self, callback) -> None:
        bind = getattr(callback, "bind_trainer", None)
        if callable(bind):
            bind(self)

    def _fix_loss_scaling_for_models_ignoring_num_items(self) -> None:
        # transformers 5 assumes any forward with **kwargs normalises by num_items_in_batch and then skips the
        # division by the accumulation steps; for models that ignore it the gradient grows k-fold with k steps.
        if self.model_accepts_loss_kwargs and forward_normalizes_by_num_items(self.model) is False:
            self.model_accepts_loss_kwargs = False

    def _check_sam_is_supported(self) -> None:
        from accelerate.utils import DistributedType

        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            check_deepspeed_supports_sam(
                self.accelerator.state.deepspeed_plugin.deepspeed_config, self.args.sam_perturbation
            )

    def _check_regularizer_is_supported(self) -> None:
        from accelerate.utils import DistributedType

        if self.accelerator.distributed_type != DistributedType.DEEPSPEED:
            return
        if self.args.flatness_method == "looksam":
            raise ValueError(
                "flatness_method='looksam' is not supported with DeepSpeed (it reads and edits param.grad, which "
                "ZeRO keeps in its own buffers); use 'sam' with sam_every_k=1, or run LookSAM with DDP "
                "(accelerate launch --multi_gpu) or a single process."
            )
        check_deepspeed_supports_penalty(
            self.accelerator.state.deepspeed_plugin.deepspeed_config, self.args.flatness_method
        )

    def _deepspeed_engine(self):
        """The DeepSpeed engine once accelerate has prepared the model, else ``None``."""
        wrapped = getattr(self.accelerator, "deepspeed_engine_wrapped", None)
        return None if wrapped is None else wrapped.engine

    # ------------------------------------------------------------------ training step

    def _is_sam_update(self) -> bool:
        """Whether this optimizer update takes the SAM second pass (every ``sam_every_k``-th, starting with 0)."""
        return self.state.global_step % self.args.sam_every_k == 0

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        # The loop prefetches every micro-batch of an update; "batch"-scope SAM needs all of them before the first
        # backward, so keep them for the first training_step of the update.
        keep = self.args.uses_sam and self.args.sam_scope == "batch" and self._is_sam_update()
        self._update_micro_batches = batch_samples if keep else None
        return batch_samples, num_items_in_batch

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        if self.args.uses_penalty:
            return self._penalty_training_step(model, inputs, num_items_in_batch)
        if self.args.flatness_method == "looksam":
            return self._looksam_training_step(model, inputs, num_items_in_batch)
        if not self.args.uses_sam or not self._is_sam_update():
            return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)

        if self.args.sam_scope == "batch":
            if self._update_micro_batches is not None:
                micro_batches = [self._prepare_inputs(batch) for batch in self._update_micro_batches]
                self._update_micro_batches = None
                self._batch_perturbation = self._perturb(model, micro_batches, num_items_in_batch)
            perturbation = self._batch_perturbation
            restore_now = self.accelerator.sync_gradients
        else:
            perturbation = self._perturb(model, [inputs], num_items_in_batch)
            restore_now = True

        try:
            loss = self._scaled_loss(model, inputs, num_items_in_batch)
            self._backward(loss)
        except BaseException:
            restore_now = True
            raise
        finally:
            if perturbation is not None and restore_now:
                perturbation.restore()
                self._batch_perturbation = None
        self._step_deepspeed_after_restore()
        return loss.detach()

    def _scaled_loss(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch) -> torch.Tensor:
        """The loss exactly as `Trainer.training_step` scales it before backward."""
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        return self._scale_for_accumulation(loss, num_items_in_batch)

    def _scale_for_accumulation(self, loss: torch.Tensor, num_items_in_batch) -> torch.Tensor:
        if self.args.n_gpu > 1:
            loss = loss.mean()
        if self.loss_is_scaled_for_ga is not None:
            scaled_for_accumulation = self.loss_is_scaled_for_ga
        else:
            scaled_for_accumulation = (
                self.model_accepts_loss_kwargs and num_items_in_batch is not None
            ) or self.compute_loss_func is not None
        if not scaled_for_accumulation:
            loss = loss / self.current_gradient_accumulation_steps
        return loss

    def _step_deepspeed_after_restore(self) -> None:
        """Under DeepSpeed, the optimizer step `_backward` left out; only once ``w`` is back (ZeRO-0 steps the
        module's own weights)."""
        engine = self._deepspeed_engine()
        if engine is not None and self.accelerator.sync_gradients:
            engine.step()

    def _backward(self, loss: torch.Tensor) -> None:
        engine = self._deepspeed_engine()
        if engine is not None:
            deepspeed_backward(engine, loss, is_boundary=self.accelerator.sync_gradients)
        else:
            self.accelerator.backward(loss)

    def _perturb(
        self, model: nn.Module, micro_batches: list[dict[str, Any]], num_items_in_batch
    ) -> Perturbation | None:
        """Compute the first gradient over ``micro_batches`` and move the weights to ``w + e``."""
        module = self.accelerator.unwrap_model(model)
        perturbable = perturbable_parameters(module, self._deepspeed_engine())
        params = perturbable.params
        losses = (self._scaled_loss(module, batch, num_items_in_batch) for batch in micro_batches)
        grads = self._first_gradient(losses, params)
        perturbation = perturbable.perturb(
            grads, self.args.sam_rho, adaptive=self.args.flatness_method == "asam", eta=self.args.asam_eta
        )
        if perturbation is None:
            self._skipped_perturbations += 1
            logger.warning(
                "SAM: the first gradient is zero or not finite at step %d; this step is taken without perturbation "
                "(%d skipped so far).",
                self.state.global_step,
                self._skipped_perturbations,
            )
            return None
        self._sam_metrics["sam/first_grad_norm"].append(perturbation.grad_norm)
        self._sam_metrics["sam/perturbation_norm"].append(perturbation.norm)
        return perturbation

    # ------------------------------------------------------------------ explicit penalties and LookSAM

    def _first_gradient(
        self, losses: torch.Tensor | Iterable[torch.Tensor], params: list[torch.nn.Parameter]
    ) -> list[torch.Tensor]:
        """``d sum(losses) / d params`` off the engine's hooks, unscaled, averaged over processes when global.

        Losses come one at a time (a generator keeps one micro-batch graph alive at once). Under fp16 each is
        multiplied by the loss scale so small gradients do not underflow, and the sum is unscaled on our own copy:
        the optimizer's GradScaler never sees these gradients, so nothing is unscaled twice.
        """
        scaler = self.accelerator.scaler
        grads: list[torch.Tensor] | None = None
        for loss in [losses] if isinstance(losses, torch.Tensor) else losses:
            loss_grads = gradients_of(scaler.scale(loss) if scaler is not None else loss, params)
            if grads is None:
                grads = loss_grads
            else:
                torch._foreach_add_(grads, loss_grads)
        if scaler is not None:
            torch._foreach_div_(grads, scaler.get_scale())
        if self.args.sam_perturbation == "global":
            average_across_processes(grads)
        return grads

    def _sampled_labels(self, logits: torch.Tensor) -> torch.Tensor:
        # A generator of our own keeps the draws reproducible whatever else consumes the global RNG (dropout).
        if self._label_generator is None or self._label_generator.device != logits.device:
            seed = self.args.seed + 7919 * self.args.process_index
            self._label_generator = torch.Generator(device=logits.device).manual_seed(seed)
        return sample_model_labels(logits, self._label_generator)

    def _labelled_logits(self, module: nn.Module, outputs: Any, labels: torch.Tensor) -> torch.Tensor:
        logits = outputs.get("logits") if isinstance(outputs, dict) else None
        if logits is None:
            raise ValueError(
                "flatness_method='fisher_penalty' needs the model output to carry 'logits' (a ModelOutput or dict)."
            )
        shift = unwrap_peft_model(module)._get_name() in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
        return labelled_logits(logits, labels, shift=shift)

    def _penalty_training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch) -> torch.Tensor:
        """One micro-batch of ``fisher_penalty`` or ``grad_norm_penalty``: two forward/backward passes.

        Pass 1 (unwrapped model, ``autograd.grad``): the data loss at ``w`` and the gradient ``g`` that defines the
        finite-difference direction (of the sampled-label loss for the Fisher penalty, of the data loss for the
        gradient-norm penalty). Pass 2 (through the accelerator) at ``w + h g / ||g||``, whose loss combines the
        data loss, the direction loss and the linear term that contributes ``-c g``.
        """
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        fisher = self.args.flatness_method == "fisher_penalty"
        labels = inputs.get("labels")
        if fisher and labels is None:
            raise ValueError(
                "flatness_method='fisher_penalty' needs 'labels' in every batch (-100 where nothing is predicted), "
                "e.g. from DataCollatorForLanguageModeling."
            )
        module = self.accelerator.unwrap_model(model)
        perturbable = perturbable_parameters(module, self._deepspeed_engine())
        params = perturbable.params
        accumulation = self.current_gradient_accumulation_steps

        with self.compute_loss_context_manager():
            data_loss, outputs = self.compute_loss(
                module, dict(inputs), return_outputs=True, num_items_in_batch=num_items_in_batch
            )
        reported_loss = self._scale_for_accumulation(data_loss.detach(), num_items_in_batch)
        if fisher:
            logits = self._labelled_logits(module, outputs, labels)
            sampled = self._sampled_labels(logits)
            n_labels = sampled.numel()
            if self.args.sam_perturbation == "global":
                # g is averaged over ranks, so the trace estimate counts every rank's labels.
                n_labels = int(self.accelerator.reduce(torch.tensor(n_labels, device=logits.device), "sum"))
            direction_loss = sampled_label_loss(logits, sampled)
        else:
            direction_loss = data_loss
        del outputs
        grads = self._first_gradient(direction_loss, params)
        del direction_loss, data_loss
        grad_norm = float(squared_norm(grads).sqrt())
        step = self.args.penalty_fd_step
        first_gradient = [g.clone() for g in grads]
        perturbation = perturbable.perturb(grads, step)
        if perturbation is None:
            self._skipped_perturbations += 1
            logger.warning(
                "%s: the first gradient is zero or not finite at step %d; this micro-batch takes a plain step "
                "(%d skipped so far).",
                self.args.flatness_method,
                self.state.global_step,
                self._skipped_perturbations,
            )
            loss = self._scaled_loss(model, inputs, num_items_in_batch)
            self._backward(loss)
            self._step_deepspeed_after_restore()
            return loss.detach()

        try:
            if fisher:
                coefficient = fisher_penalty_coefficient(self.args.penalty_lambda, n_labels, grad_norm, step)
                with self.compute_loss_context_manager():
                    shifted_loss, outputs = self.compute_loss(
                        model, dict(inputs), return_outputs=True, num_items_in_batch=num_items_in_batch
                    )
                    shifted_direction_loss = sampled_label_loss(self._labelled_logits(module, outputs, labels), sampled)
                penalty_part = coefficient * (shifted_direction_loss - linear_term(params, first_gradient))
                loss = self._scale_for_accumulation(shifted_loss, num_items_in_batch) + penalty_part / accumulation
                self._sam_metrics["fisher_penalty/trace"].append(
                    fisher_trace_from_mean_gradient(grad_norm**2, n_labels)
                )
            else:
                at_w, at_shifted = grad_norm_penalty_weights(self.args.penalty_lambda, step)
                with self.compute_loss_context_manager():
                    shifted_loss = self.compute_loss(model, dict(inputs), num_items_in_batch=num_items_in_batch)
                combined = at_shifted * shifted_loss + at_w * linear_term(params, first_gradient)
                loss = self._scale_for_accumulation(combined, num_items_in_batch)
                self._sam_metrics["grad_norm_penalty/grad_norm"].append(grad_norm)
            self._backward(loss)
        finally:
            perturbation.restore()
        self._step_deepspeed_after_restore()
        return reported_loss

    def _looksam_training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch) -> torch.Tensor:
        """LookSAM: a SAM micro-batch on SAM updates (keeping the first gradient), else a plain one plus reuse."""
        if not self._is_sam_update():
            loss = super().training_step(model, inputs, num_items_in_batch)
            if self.accelerator.sync_gradients and self._looksam_direction is not None:
                grads = _grads_materialized(trainable_parameters(self.accelerator.unwrap_model(model)))
                add_looksam_component(grads, self._looksam_direction, self.args.looksam_alpha)
            return loss

        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        module = self.accelerator.unwrap_model(model)
        params = trainable_parameters(module)
        grads = self._first_gradient(self._scaled_loss(module, inputs, num_items_in_batch), params)
        if self._looksam_plain_gradient is None:
            self._looksam_plain_gradient = [g.clone() for g in grads]
        else:
            torch._foreach_add_(self._looksam_plain_gradient, grads)
        perturbation = perturb_weights(params, grads, self.args.sam_rho)
        if perturbation is not None:
            self._sam_metrics["sam/first_grad_norm"].append(perturbation.grad_norm)
            self._sam_metrics["sam/perturbation_norm"].append(perturbation.norm)
        try:
            loss = self._scaled_loss(model, inputs, num_items_in_batch)
            self._backward(loss)
        finally:
            if perturbation is not None:
                perturbation.restore()
        if self.accelerator.sync_gradients:
            sam_gradient = _grads_materialized(params)
            direction = orthogonal_direction(sam_gradient, self._looksam_plain_gradient)
            self._looksam_plain_gradient = None
            if direction is not None:
                if self.args.sam_perturbation != "global":
                    # Ranks saw different first gradients; one shared direction keeps their later steps identical.
                    average_across_processes(direction)
                    norm = squared_norm(direction).sqrt()
                    torch._foreach_div_(direction, norm)
                self._looksam_direction = direction
        return loss.detach()

    # ------------------------------------------------------------------ logging

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self._sam_metrics:
            for key, values in self._sam_metrics.items():
                logs[key] = sum(values) / len(values)
            self._sam_metrics.clear()
        super().log(logs, start_time)

    # ------------------------------------------------------------------ flatness model card
    # transformers' own card keeps only whitelisted metric names and would drop the Hessian trace, so every card
    # this trainer writes (checkpoints, final save, pushes) is the flatness card of `hf_flatbias.modelcard`.

    def flatness_card(self, **card_kwargs: Any) -> FlatnessCard:
        """The flatness card of the current state (trace, loss, method, GLUE); see `flatness_card_from_trainer`."""
        kwargs = {**getattr(self, "_flatness_card_kwargs", {}), **card_kwargs}
        return flatness_card_from_trainer(self, **kwargs)

    def create_model_card(
        self,
        language: str | None = None,
        license: str | None = None,  # noqa: A002 - transformers' parameter name
        tags: str | list[str] | None = None,
        model_name: str | None = None,
        finetuned_from: str | None = None,
        tasks: str | list[str] | None = None,
        dataset_tags: str | list[str] | None = None,
        dataset: str | list[str] | None = None,
        dataset_args: str | list[str] | None = None,
        glue_results: dict[str, dict[str, float]] | None = None,
    ) -> None:
        """Write the flatness card to ``output_dir/README.md`` in place of transformers' card (world rank 0 only).

        Raises ``ValueError`` (writing nothing) if the card would publish a non-finite trace or loss. The metadata
        given here is remembered for the cards of later checkpoints. ``tasks`` and ``dataset_args`` are accepted for
        compatibility with `Trainer.push_to_hub` and not used.
        """
        if not self.is_world_process_zero():
            return
        given = {
            "language": language,
            "license": license,
            "tags": tags,
            "model_name": model_name,
            "finetuned_from": finetuned_from,
            "dataset": dataset if dataset is not None else dataset_tags,
            "glue_results": glue_results,
        }
        remembered = getattr(self, "_flatness_card_kwargs", {})
        self._flatness_card_kwargs = {**remembered, **{k: v for k, v in given.items() if v is not None}}
        self.flatness_card().save(self.args.output_dir)

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        private: bool | None = None,
        **kwargs: Any,
    ):
        # Refuse a card with a non-finite trace before the weights are saved again and anything is uploaded.
        if self.is_world_process_zero():
            card_kwargs = {k: v for k, v in kwargs.items() if k in _CARD_KWARGS and v is not None}
            self.flatness_card(**card_kwargs).validate()
        try:
            return super().push_to_hub(
                commit_message=commit_message,
                blocking=blocking,
                token=token,
                revision=revision,
                private=private,
                **kwargs,
            )
        except HfHubHTTPError as error:
            error.append_to_message(
                f"\nThe push to {self.hub_model_id} did not complete; the saved model in {self.args.output_dir} is "
                "intact. Call trainer.push_to_hub() again to retry (files the Hub already has are skipped)."
            )
            raise

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        # Every save path of the 5.x Trainer (checkpoints, save_model, push_to_hub, DeepSpeed, FSDP full state)
        # ends in _save, so the card always sits next to the weights it describes.
        super()._save(output_dir, state_dict=state_dict)
        if not self.is_world_process_zero():
            return
        try:
            self.flatness_card().save(output_dir if output_dir is not None else self.args.output_dir)
        except ValueError as error:
            # A local checkpoint is never lost over its card; pushes re-check and refuse (see _push_from_checkpoint).
            logger.warning(f"Saved the checkpoint without a flatness card: {error}")

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        # hub_strategy pushes upload output_dir (its README.md included) besides the checkpoint folder, whose card
        # _save wrote; a non-finite trace stops the push with the card's ValueError before any upload starts.
        if self.is_world_process_zero() and self.args.hub_strategy != "end":
            previous = getattr(self, "push_in_progress", None)
            if previous is not None and not previous.is_done():
                # A background push still reads output_dir: huggingface_hub hashes each file when the upload starts
                # and reads it again to send it (LFS) or to commit it (README.md). This push overwrites those files
                # (the new weights, the new card), so the earlier push would send bytes that do not match their
                # sha256 (the Hub rejects the upload) or commit one step's weights with another's card.
                if not self.args.hub_always_push:
                    return  # transformers skips this push; leave the files of the running one alone
                self._finish_current_push()  # push every checkpoint, each intact: one after the other
            self.flatness_card().save(self.args.output_dir)
        super()._push_from_checkpoint(checkpoint_folder)
        # transformers runs these pushes in the background and never reads their result, so a failed upload would
        # go unnoticed: report it as soon as it happens. Only world rank 0 pushes and has `push_in_progress`.
        if not self.is_world_process_zero() or self.push_in_progress is None:
            return
        for job in self.push_in_progress.jobs:
            if not getattr(job, "_flatbias_watched", False):
                job._flatbias_watched = True
                job.add_done_callback(functools.partial(_report_failed_push, checkpoint_folder=checkpoint_folder))


def _report_failed_push(job, checkpoint_folder: str) -> None:
    error = None if job.cancelled() else job.exception()
    if error is not None:
        logger.warning(
            f"Pushing checkpoint {checkpoint_folder} to the Hub failed: {error}\nThe checkpoint on disk is intact; the "
            "next checkpoint push or trainer.push_to_hub() uploads the current state again."
        )


_CARD_KWARGS = ("language", "license", "tags", "model_name", "finetuned_from", "dataset", "glue_results")


def _grads_materialized(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """The parameters' ``.grad`` tensors, zero-filled where a parameter got no gradient."""
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    return [param.grad for param in params]


def _as_flatbias_config(args: TrainingArguments | None) -> FlatBiasConfig:
    if args is None:
        return FlatBiasConfig(output_dir="trainer_output")
    if isinstance(args, FlatBiasConfig):
        return args
    if isinstance(args, TrainingArguments):
        # A plain TrainingArguments means "no flatness method"; keep every value the user set.
        init_fields = {f.name for f in dataclasses.fields(args) if f.init}
        values = {name: getattr(args, name) for name in init_fields}
        return FlatBiasConfig(**values)
    raise TypeError(f"args must be a FlatBiasConfig or TrainingArguments, got {type(args).__name__}.")


__all__ = ["FlatBiasTrainer"]
