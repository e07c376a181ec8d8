"""`FlatnessTrainerMixin`, the flatness-seeking steps for any `Trainer` subclass, and `FlatBiasTrainer` = the mixin on
the transformers `Trainer`.

This module orchestrates: ``training_step`` hands each micro-batch to the configured method (a `FlatnessMethod` of
`hf_flatbias.sharpness.methods`), and the mixin is the `FlatnessHost` the methods call for what the host trainer's
loop owns (the passes' loss scaling and backward, logging, the methods' checkpointed state, the hooks trl's trainers
fill in); the flatness card on every save and push comes from `hf_flatbias.modelcard.publishing`. A SAM step inside
the Trainer loop:

1. first gradient ``g`` on the *unwrapped* model with ``torch.autograd.grad`` (no DDP/DeepSpeed hook fires, no
   ``.grad`` is written, the optimizer is not involved), averaged over processes when ``sam_perturbation="global"``;
2. move the weights to ``w + e``;
3. the usual forward/backward through the accelerator at ``w + e``, so accumulation, gradient sync, loss scaling and
   clipping happen exactly as in a plain step;
4. restore ``w`` (bit for bit) before the Trainer loop steps the optimizer.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils import DistributedType
from torch import nn
from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import unwrap_peft_model
from transformers.utils import logging

from .checkpoints import (
    checkpoint_to_resume,
    output_dir_lock,
    saved_with_save_pretrained,
    state_dict_without_shared_tensors,
    tied_missing_keys,
)
from .config import FlatBiasConfig, FlatnessArguments, as_flatness_config
from .corpus import CorpusSpec
from .modelcard import FlatnessCard, flatness_card_from_trainer
from .modelcard.publishing import (
    card_metadata,
    card_ready_for_checkpoint_push,
    explained_push_failures,
    report_failed_checkpoint_pushes,
    save_card_beside_weights,
)
from .sharpness.engines import (
    PerturbableParameters,
    deepspeed_backward,
    sync_gradients_every_backward,
)
from .sharpness.functional_sam import FunctionOutputs, Logits
from .sharpness.methods import FlatnessMethod
from .sharpness.methods.table import check_method_supports, method_spec
from .sharpness.sam_options import check_preconditioner_supports_optimizer, scheduled_rho
from .sharpness.step_log import PERTURBED_LOSS, FlatnessLog
from .sharpness.support import (
    check_deepspeed_supports_method,
    check_fsdp_supports_method,
    check_requested_engine_is_active,
    requested_engine,
)
from .tensors import Perturbation, is_fully_sharded
from .token_weighting import TokenWeightedLossMixin

logger = logging.get_logger(__name__)


class FlatnessTrainerMixin(TokenWeightedLossMixin):
    """Every flatness method of this package for any [`~transformers.Trainer`] subclass.

    Put it first among the bases, before the host trainer, so that it owns ``training_step`` and the saves:
    ``class MyTrainer(FlatnessTrainerMixin, Trainer)``. The host's config must carry the `FlatnessArguments`
    fields (`FlatBiasConfig` for `Trainer`); a config without them is converted to ``flatness_config_class``
    with every value kept, which means "no flatness method".

    Callbacks that define ``bind_trainer(trainer)`` (such as `HessianTraceCallback`) are bound to the trainer so
    they can log through it.
    """

    #: The config a plain host config (or ``None``) is converted to: the host's config plus `FlatnessArguments`.
    flatness_config_class: type[FlatnessArguments] = FlatBiasConfig

    def __init__(self, model: nn.Module | None = None, args: TrainingArguments | None = None, **kwargs: Any):
        args = as_flatness_config(args, self.flatness_config_class)
        if isinstance(model, nn.Module) and not any(p.requires_grad for p in model.parameters()):
            raise ValueError(
                "The model has no trainable parameter (every requires_grad is False): unfreeze some parameters or "
                "attach adapters (e.g. peft.get_peft_model) before building the trainer."
            )
        # On the arguments, before Trainer.__init__ builds the Accelerator: refused after it, accelerate's DeepSpeed
        # state (ACCELERATE_USE_DEEPSPEED=true in os.environ) would make every later trainer of the process DeepSpeed.
        if args.deepspeed_plugin is not None:
            check_deepspeed_supports_method(args.deepspeed_plugin.deepspeed_config, args)
        super().__init__(model=model, args=args, **kwargs)
        self._check_requested_engine_is_active()
        if self.args.sam_preconditioner != "none":
            given_cls = self.optimizer_cls_and_kwargs[0] if self.optimizer_cls_and_kwargs is not None else None
            check_preconditioner_supports_optimizer(self.optimizer, given_cls, chosen=self.args.sam_preconditioner)
        if self.accelerator.state.deepspeed_plugin is not None:  # again, with what accelerate filled in
            check_deepspeed_supports_method(self.accelerator.state.deepspeed_plugin.deepspeed_config, self.args)
        self._fix_loss_scaling_for_models_ignoring_num_items()
        self._flatness_log = FlatnessLog()
        self._flatness_card_metadata: dict[str, Any] = {}
        if self.accelerator.distributed_type == DistributedType.FSDP:
            check_fsdp_supports_method(self.args, fsdp_version=self.accelerator.state.fsdp_plugin.fsdp_version)
        if self.accelerator.distributed_type.name.startswith("MULTI_"):  # DDP over any device kind
            check_method_supports(self.args.flatness_method, "ddp")
        if _has_peft_adapters(self.model):
            check_method_supports(self.args.flatness_method, "adapters")
        #: The configured method, with the state it keeps between updates.
        self.flatness_method: FlatnessMethod = method_spec(self.args.flatness_method).load_class()(self)
        for callback in self.callback_handler.callbacks:
            self._bind_callback(callback)

    # ------------------------------------------------------------------ setup

    def _check_requested_engine_is_active(self) -> None:
        """Refuse an FSDP/DeepSpeed launch that accelerate did not start as such (see
        `check_requested_engine_is_active`), before any rank takes a step or the output folder's lock."""
        if dist.is_available() and dist.is_initialized():
            launched = dist.get_world_size()
        else:
            launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
        check_requested_engine_is_active(
            requested_engine(os.environ, fsdp=self.args.fsdp, deepspeed=self.args.deepspeed),
            self.accelerator.distributed_type.name,
            accelerate_processes=self.accelerator.num_processes,
            launched_processes=launched,
        )

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any):
        """`Trainer.train`, after checking that the checkpoint to resume from is intact and of this model's shape."""
        if resume_from_checkpoint:
            model_config = getattr(unwrap_peft_model(self.accelerator.unwrap_model(self.model)), "config", None)
            resume_from_checkpoint = checkpoint_to_resume(resume_from_checkpoint, self.args.output_dir, model_config)
        if not self.is_world_process_zero():
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        with output_dir_lock(self.args.output_dir):  # a second training into the same folder is refused
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def add_callback(self, callback) -> None:
        super().add_callback(callback)
        for registered in self.callback_handler.callbacks:
            self._bind_callback(registered)

    def _bind_callback(self, callback) -> None:
        bind = getattr(callback, "bind_trainer", None)
        if callable(bind):
            bind(self)

    # ------------------------------------------------------------------ training step

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        self.flatness_method.keep_update_batches(batch_samples)
        return batch_samples, num_items_in_batch

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        return self.flatness_method.training_step(model, inputs, num_items_in_batch)

    # ------------------------------------------------------------------ what the methods call (`FlatnessHost`)

    def plain_training_step(
        self, model: nn.Module, inputs: dict[str, torch.Tensor | Any], num_items_in_batch
    ) -> torch.Tensor:
        """The host trainer's own step: one forward/backward at ``w`` and no flatness pass."""
        return super().training_step(model, inputs, num_items_in_batch)

    def start_flatness_step(self, model: nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
        """What `Trainer.training_step` does before its forward: train mode (model and schedule-free optimizers),
        inputs on the device; plus what both passes of the step share (`prepare_flatness_inputs`)."""
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        if is_fully_sharded(model):
            sync_gradients_every_backward(model)
        return self.prepare_flatness_inputs(model, inputs)

    def prepare_flatness_inputs(self, model: nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
        """The micro-batch on the device, with what both passes of a step share (`_add_values_shared_by_passes`)."""
        return self._prepare_inputs(self._add_values_shared_by_passes(model, inputs))

    def is_sam_update(self) -> bool:
        """Whether this optimizer update takes the SAM second pass (every ``sam_every_k``-th, starting with 0,
        inside the window ``[sam_start_step, sam_end_step)``)."""
        return self.state.global_step % self.args.sam_every_k == 0 and self.sam_rho() is not None

    def sam_rho(self) -> float | None:
        """The radius of this update's perturbation (``sam_rho_schedule``), ``None`` outside the SAM window."""
        args = self.args
        return scheduled_rho(
            args.sam_rho,
            self.state.global_step,
            start=args.sam_start_step,
            end=args.sam_end_step,
            schedule=args.sam_rho_schedule,
            warmup_steps=args.sam_rho_warmup_steps,
        )

    def deepspeed_engine(self):
        """The DeepSpeed engine once accelerate has prepared the model, else ``None``."""
        wrapped = getattr(self.accelerator, "deepspeed_engine_wrapped", None)
        return None if wrapped is None else wrapped.engine

    # Hooks for host trainers whose loss does more than a forward (trl's): each defaults to the plain Trainer's.

    def _add_values_shared_by_passes(self, model: nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
        """Add to the micro-batch, in place, what both passes of a flatness step must share rather than recompute
        at ``w + e`` (DPO: the reference model's log-probabilities), and return it. Written into the loop's own
        batch so that a ``sam_scope="batch"`` update, whose first pass runs every micro-batch, computes it once."""
        return inputs

    def host_metrics_suspended(self) -> contextlib.AbstractContextManager:
        """The context of a step's second pass (at ``w + e`` or ``w + h u``), and of `HessianTraceCallback`'s logs: a
        host whose ``compute_loss`` records metrics (trl's token accuracy, rewards, token counts) records them in the
        first pass only and logs them with the training loss."""
        return contextlib.nullcontext()

    def head_gradients_in_forward(self) -> tuple[Callable[[], contextlib.AbstractContextManager] | None, str | None]:
        """For output-layer SAM with the trunk replayed: a context for both passes in which the loss forms the output
        layer's gradients in its forward, or ``None`` and why not. The plain Trainer's loss reads whole logits, whose
        backward computes each gradient once: nothing to save."""
        return None, None

    def loss_and_outputs(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch
    ) -> tuple[torch.Tensor, Any]:
        """The loss and the model outputs with differentiable ``logits`` (the Fisher penalty samples from them)."""
        return self.compute_loss(model, dict(inputs), return_outputs=True, num_items_in_batch=num_items_in_batch)

    def scaled_loss(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch) -> torch.Tensor:
        """The loss exactly as `Trainer.training_step` scales it before backward."""
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        return self.scale_for_accumulation(loss, num_items_in_batch)

    def scaled_loss_and_function(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch
    ) -> tuple[torch.Tensor, FunctionOutputs]:
        """`scaled_loss` and the logits it was computed from (Functional-SAM differentiates through them)."""
        with self.compute_loss_context_manager():
            loss, outputs = self.compute_loss(
                model, dict(inputs), return_outputs=True, num_items_in_batch=num_items_in_batch
            )
        logits = outputs.get("logits") if isinstance(outputs, dict) else getattr(outputs, "logits", None)
        if logits is None:
            raise ValueError(
                "flatness_method='functional_sam' needs the model output to carry 'logits' (a ModelOutput or dict): "
                "its update differentiates the logits against dL/dF."
            )
        return self.scale_for_accumulation(loss, num_items_in_batch), Logits(logits)

    def scale_for_accumulation(self, loss: torch.Tensor, num_items_in_batch) -> torch.Tensor:
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

    def step_deepspeed_after_restore(self) -> None:
        """Under DeepSpeed, the optimizer step `flatness_backward` left out; only once ``w`` is back (ZeRO-0 steps
        the module's own weights)."""
        engine = self.deepspeed_engine()
        if engine is not None and self.accelerator.sync_gradients:
            engine.step()

    def flatness_backward(self, loss: torch.Tensor) -> None:
        engine = self.deepspeed_engine()
        if engine is not None:
            deepspeed_backward(engine, loss, is_boundary=self.accelerator.sync_gradients)
        else:
            self.accelerator.backward(loss)

    def first_gradient(
        self, losses: torch.Tensor | Iterable[torch.Tensor], perturbable: PerturbableParameters
    ) -> list[torch.Tensor]:
        return perturbable.first_gradient(
            losses,
            scaler=self.accelerator.scaler,
            average_over_processes=self.args.sam_perturbation == "global",
        )

    def record_flatness_metric(self, key: str, value: float) -> None:
        self._flatness_log.record(key, value)

    def record_perturbation(self, perturbation: Perturbation, n_micro_batches: int) -> None:
        # The first gradient is of the micro-batches' share of the update's loss: scaled back to a whole update, the
        # norm does not depend on how many micro-batches the update is cut into.
        share = n_micro_batches / self.current_gradient_accumulation_steps
        self._flatness_log.record("sam/first_grad_norm", perturbation.grad_norm / share)
        self._flatness_log.record("sam/perturbation_norm", perturbation.norm)

    def record_perturbed_loss(self, loss: torch.Tensor) -> None:
        """Sum the scaled second-pass losses over the update, as the Trainer sums ``loss``, and log the sum."""
        self._flatness_log.add_to_update(PERTURBED_LOSS, float(loss.detach()))
        if self.accelerator.sync_gradients:
            self._flatness_log.close_update()

    def count_flos_of_extra_pass(self, inputs: dict[str, Any], share: float = 1.0) -> None:
        """The Trainer counts one forward/backward per micro-batch; a flatness step took a second one, or ``share``
        of one (output-layer SAM reusing the trunk's outputs)."""
        self.current_flos += share * float(self.floating_point_ops(inputs))

    def warn_skipped_perturbation(self, consequence: str) -> None:
        self._flatness_log.skipped_perturbations += 1
        logger.warning(
            "%s: the first gradient is zero or not finite at step %d; %s (%d skipped so far).",
            self.args.flatness_method,
            self.state.global_step,
            consequence,
            self._flatness_log.skipped_perturbations,
        )

    # ------------------------------------------------------------------ checkpoints
    # A method's state (LookSAM's direction, the Fisher penalty's label generator) travels with the optimizer's so
    # that a resumed run takes the very steps of an uninterrupted one. One file per process, as the Trainer keeps RNG
    # states: each rank draws its own labels.

    def _flatness_state_file(self, checkpoint: str) -> str:
        name = f"flatness_state_{self.args.process_index}.pt" if self.args.world_size > 1 else "flatness_state.pt"
        return os.path.join(checkpoint, name)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        state = self.flatness_method.state_dict()
        if any(value is not None for value in state.values()):
            torch.save(state, self._flatness_state_file(output_dir))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = self._flatness_state_file(checkpoint)
        if os.path.isfile(path):
            self.flatness_method.load_state_dict(torch.load(path, weights_only=True))
        elif self.flatness_method.checkpointed_state is not None:
            logger.warning(
                f"{path} is missing: the {self.args.flatness_method} run resumes without "
                f"{self.flatness_method.checkpointed_state} and will not repeat an uninterrupted run exactly."
            )

    def _issue_warnings_after_load(self, load_result: Any) -> None:
        # A checkpoint leaves out tied weights (BERT's decoder shares the word embeddings): transformers 5 then warns
        # that they are missing on every resume. Only keys that share their tensor with a loaded one are dropped.
        tied = tied_missing_keys(unwrap_peft_model(self.model), load_result.missing_keys)
        if tied:
            load_result = load_result._replace(missing_keys=[k for k in load_result.missing_keys if k not in tied])
        super()._issue_warnings_after_load(load_result)

    # ------------------------------------------------------------------ logging

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:
            if self.args.uses_sam and self.args.world_size > 1:
                # Like `loss`, the perturbed loss describes the global batch: each rank only saw its own rows.
                # Every rank logs the training loss at the same step, so this collective is reached by all of them.
                self._flatness_log.average_over_processes(PERTURBED_LOSS, self._sum_over_processes)
            self._flatness_log.drain_into(logs)
        super().log(logs, start_time)

    def _sum_over_processes(self, values: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(values.to(self.args.device), reduction="sum").cpu()

    # ------------------------------------------------------------------ flatness model card

    def flatness_card(self, **card_kwargs: Any) -> FlatnessCard:
        """The flatness card of the current state (trace, loss, method, GLUE); see `flatness_card_from_trainer`."""
        return flatness_card_from_trainer(self, **{**self._flatness_card_metadata, **card_kwargs})

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
        pretraining_corpus: CorpusSpec | dict[str, Any] | None = None,
    ) -> None:
        """Write the flatness card to ``output_dir/README.md`` in place of transformers' card (world rank 0 only).

        Raises ``ValueError`` (writing nothing) if the card would publish a non-finite trace or loss. The metadata
        given here is remembered for the cards of later checkpoints. ``tasks`` and ``dataset_args`` are accepted for
        compatibility with `Trainer.push_to_hub` and not used.
        """
        if not self.is_world_process_zero():
            return
        given = dict(
            language=language,
            license=license,
            tags=tags,
            model_name=model_name,
            finetuned_from=finetuned_from,
            dataset=dataset if dataset is not None else dataset_tags,
            glue_results=glue_results,
            pretraining_corpus=pretraining_corpus,
        )
        self._flatness_card_metadata = card_metadata(given, self._flatness_card_metadata)
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
            self.flatness_card(**card_metadata(kwargs)).validate()
        with explained_push_failures(self.hub_model_id, self.args.output_dir):
            return super().push_to_hub(
                commit_message=commit_message,
                blocking=blocking,
                token=token,
                revision=revision,
                private=private,
                **kwargs,
            )

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        # Every save path of the 5.x Trainer (checkpoints, save_model, push_to_hub, DeepSpeed, FSDP full state)
        # ends in _save, so the card always sits next to the weights it describes.
        if state_dict is None and not saved_with_save_pretrained(
            self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        ):
            state_dict = state_dict_without_shared_tensors(self.model)  # e.g. a wrapped masked LM's tied decoder
        super()._save(output_dir, state_dict=state_dict)
        if self.is_world_process_zero():
            save_card_beside_weights(self.flatness_card, output_dir if output_dir is not None else self.args.output_dir)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        rank_zero = self.is_world_process_zero()  # only world rank 0 pushes and has `push_in_progress`
        if rank_zero and self.args.hub_strategy != "end" and not card_ready_for_checkpoint_push(self):
            return
        super()._push_from_checkpoint(checkpoint_folder)
        if rank_zero:
            report_failed_checkpoint_pushes(self.push_in_progress, checkpoint_folder)


def _has_peft_adapters(model: nn.Module | None) -> bool:
    return model is not None and unwrap_peft_model(model) is not model


class FlatBiasTrainer(FlatnessTrainerMixin, Trainer):
    """A drop-in replacement for [`~transformers.Trainer`] whose steps seek flat minima.

    Use it with a [`FlatBiasConfig`] exactly as you would use `Trainer` with `TrainingArguments`:

    ```python
    args = FlatBiasConfig("out", flatness_method="sam", sam_rho=0.05)
    trainer = FlatBiasTrainer(model=model, args=args, train_dataset=train, data_collator=collator)
    trainer.train()
    ```
    """

    _tag_names = ["hf_flatbias"]


__all__ = ["FlatBiasTrainer", "FlatnessTrainerMixin"]
