"""SAM, ASAM and Functional-SAM: a first pass for the gradient at ``w``, the move to ``w + e``, the second pass there,
``w`` restored. Per micro-batch, or with one perturbation held across the update (``sam_scope="batch"``). When only
the output layer moves, the second pass reuses the first pass's trunk outputs (`hf_flatbias.sharpness.trunk_replay`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from transformers.utils import logging

from ...flatness.lm import is_causal_lm
from ...tensors import Perturbation, is_fully_sharded
from ..layouts import perturbable_parameters
from ..sam_options import adam_preconditioner, ascent_rows, output_layer_of, select_sam_parameters
from ..trunk_replay import TrunkReplay, extra_pass_share, trunk_modules, why_trunk_cannot_be_replayed
from .base import FlatnessHost, FlatnessMethod

logger = logging.get_logger(__name__)


@dataclasses.dataclass
class BatchScopeState:
    """``sam_scope="batch"``: the update's micro-batches until its first step perturbs, then that perturbation,
    held across the update's micro-batches until the last one restores ``w``."""

    micro_batches: list[dict[str, Any]] | None = None
    perturbation: Perturbation | None = None
    #: The loss at ``w`` of each micro-batch not yet stepped (the first pass computed them all).
    clean_losses: list[torch.Tensor] = dataclasses.field(default_factory=list)
    #: Functional-SAM: each of those micro-batches' ``dL/dF`` at ``w``.
    cotangents: list[Any] = dataclasses.field(default_factory=list)


class SamFamily(FlatnessMethod):
    """What ``sam``, ``asam`` and ``functional_sam`` share: the SAM step on every ``sam_every_k``-th update inside
    the SAM window, the host's plain step on the others. Each method is a subclass that sets its geometry."""

    #: ASAM: the neighbourhood scaled elementwise by ``|w| + asam_eta``.
    adaptive: bool = False
    #: Functional-SAM: the second pass differentiates ``<F(w + e), dL/dF at w>``, not the loss at ``w + e``.
    functional: bool = False

    def __init__(self, host: FlatnessHost):
        super().__init__(host)
        self.batch_scope = BatchScopeState()
        # A selection that matches nothing fails here, before any compute. Not kept: preparing the model (FSDP2's
        # fully_shard) replaces its parameters with sharded ones.
        select_sam_parameters(host.model, host.args.sam_parameters)
        self._selected: tuple[nn.Module, list[nn.Parameter]] | None = None
        self._replay: tuple[nn.Module, TrunkReplay | None, float] | None = None
        # with the replay, the host's context for both passes in which its loss forms the output layer's gradients in
        # the forward (`FlatnessHost.head_gradients_in_forward`), chosen with the replay
        self._head_passes: Callable[[], contextlib.AbstractContextManager] | None = None
        self._told: set[str] = set()

    def perturbed_parameters(self, module: nn.Module) -> list[nn.Parameter]:
        """The trainable parameters of ``module`` the step perturbs (``sam_parameters``), chosen once per module."""
        if self._selected is None or self._selected[0] is not module:
            self._selected = (module, select_sam_parameters(module, self.host.args.sam_parameters))
        return self._selected[1]

    def trunk_replay(self, module: nn.Module) -> tuple[TrunkReplay | None, float]:
        """When the step perturbs parameters of the output layer only: the replay of the trunk's outputs that lets
        the second pass skip the trunk's forward, and the cost that pass then adds as a share of a whole pass.
        ``(None, 1.0)`` where both passes run the whole forward (said once, with the reason, where the selection is
        in the output layer). Chosen once per module."""
        if self._replay is not None and self._replay[0] is module:
            return self._replay[1], self._replay[2]
        replay, share = None, 1.0
        self._head_passes = None
        head = output_layer_of(module)
        perturbed = self.perturbed_parameters(module)
        if head is not None and {id(p) for p in perturbed} <= {id(p) for p in head.parameters()}:
            reason = self._why_no_replay(module) or why_trunk_cannot_be_replayed(module, head, perturbed)
            if reason is None:
                replay, share = TrunkReplay(trunk_modules(module, head)), extra_pass_share(module, head)
                self._head_passes = self._head_gradients_in_forward()
            else:
                self._tell_once(reason, f"the step runs the whole forward twice: {reason}.")
        self._replay = (module, replay, share)
        return replay, share

    def _head_gradients_in_forward(self) -> Callable[[], contextlib.AbstractContextManager] | None:
        """The host's context for the passes of a replayed step where its loss would recompute the output layer in
        the backward (trl's fused LM head); what keeps the host from it is said once."""
        if self.functional:
            return None  # its second pass differentiates a surrogate, not the head's log-probabilities
        passes, reason = self.host.head_gradients_in_forward()
        if reason is not None:
            self._tell_once(reason, f"the output layer's logits are recomputed in its backward: {reason}.")
        return passes

    def _head_context(self, replay: TrunkReplay | None) -> contextlib.AbstractContextManager:
        if replay is None or self._head_passes is None:
            return contextlib.nullcontext()
        return self._head_passes()

    def _why_no_replay(self, module: nn.Module) -> str | None:
        """What of the run (options, engine) keeps the second pass from reusing the first pass's trunk outputs."""
        args = self.host.args
        if args.sam_scope == "batch":
            return (
                "sam_scope='batch' takes every micro-batch's first pass before the first second pass, so the trunk "
                "activations of all of them would stay alive at once"
            )
        if args.sam_ascent_fraction < 1:
            return "sam_ascent_fraction < 1 takes the first pass on a subset of the rows, the second on all of them"
        if is_fully_sharded(module):
            return "under FSDP2 the first gradient is a whole backward, which frees the trunk's graph"
        return None

    def _tell_once(self, key: str, message: str) -> None:
        if key not in self._told:
            self._told.add(key)
            logger.warning("sam_parameters=%r: %s", self.host.args.sam_parameters, message)

    def keep_update_batches(self, micro_batches: list[dict[str, Any]]) -> None:
        # The loop prefetches every micro-batch of an update; "batch"-scope SAM needs all of them before the first
        # backward, so keep them for the first training_step of the update.
        keep = self.host.args.sam_scope == "batch" and self.host.is_sam_update()
        self.batch_scope.micro_batches = micro_batches if keep else None

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch) -> torch.Tensor:
        """One micro-batch of a SAM/ASAM update: the first gradient, the step to ``w + e``, backward there, ``w``.

        Returns the loss at ``w`` (the first pass), so that ``loss`` means the same for every method; the loss at
        ``w + e`` is logged as ``sam/perturbed_loss``.
        """
        host = self.host
        if not host.is_sam_update():
            return host.plain_training_step(model, inputs, num_items_in_batch)
        inputs = host.start_flatness_step(model, inputs)
        batch_scope = self.batch_scope
        if host.args.sam_scope == "batch":
            if batch_scope.micro_batches is not None:
                micro_batches = [host.prepare_flatness_inputs(model, batch) for batch in batch_scope.micro_batches]
                batch_scope.micro_batches = None
                batch_scope.perturbation, batch_scope.clean_losses, batch_scope.cotangents = self.perturb(
                    model, micro_batches, num_items_in_batch
                )
            perturbation = batch_scope.perturbation
            clean_loss = batch_scope.clean_losses.pop(0)
            cotangent = batch_scope.cotangents.pop(0) if batch_scope.cotangents else None
            restore_now = host.accelerator.sync_gradients
        else:
            perturbation, (clean_loss,), cotangents = self.perturb(model, [inputs], num_items_in_batch)
            cotangent = cotangents[0] if cotangents else None
            restore_now = True

        replay, share = self.trunk_replay(host.accelerator.unwrap_model(model))
        replayed = False
        try:
            with host.host_metrics_suspended(), self._head_context(replay), self.replaying(replay) as replayed:
                if cotangent is None:
                    loss = host.scaled_loss(model, inputs, num_items_in_batch)
                else:
                    # Functional-SAM: the Jacobian at w + e against dL/dF at w; the loss at w + e is only logged
                    loss, function = host.scaled_loss_and_function(model, inputs, num_items_in_batch)
            host.flatness_backward(loss if cotangent is None else function.surrogate(cotangent))
        except BaseException:
            restore_now = True
            raise
        finally:
            if replay is not None:
                replay.clear()
            if perturbation is not None and restore_now:
                perturbation.restore()
                batch_scope.perturbation = None
        host.step_deepspeed_after_restore()
        host.record_perturbed_loss(loss)
        fraction = host.args.sam_ascent_fraction
        host.count_flos_of_extra_pass(
            inputs if fraction == 1 else ascent_rows(inputs, fraction), share=share if replayed else 1.0
        )
        return clean_loss

    @contextlib.contextmanager
    def replaying(self, replay: TrunkReplay | None):
        """The second pass's context: the trunk answers from the first pass where ``replay`` recorded it (yields
        whether it does), and what kept it from doing so is said once."""
        if replay is None:
            yield False
            return
        with replay.replaying() as replayed:
            yield replayed
        if replay.drew_random_numbers:
            self._tell_once(
                "random",
                "the step runs the whole forward twice: the trunk draws random numbers (dropout or noise), which a "
                "second forward draws anew; with the trunk's dropout at 0 its forward runs once per step.",
            )
        elif replay.computed:
            self._tell_once(
                "computed",
                f"{replay.computed} trunk module calls ran again in the second pass: their inputs differ from the "
                "first pass's (they depend on the output layer), so their outputs could not be reused.",
            )

    def perturb(
        self, model: nn.Module, micro_batches: list[dict[str, Any]], num_items_in_batch
    ) -> tuple[Perturbation | None, list[torch.Tensor], list[Any]]:
        """Compute the first gradient over ``micro_batches`` and move the weights to ``w + e``.

        Returns the perturbation (``None`` when skipped), each micro-batch's loss at ``w``, scaled as
        `Trainer.training_step` scales the loss it returns, and (Functional-SAM only, else empty) each micro-batch's
        ``dL/dF`` at ``w`` of that same scaled loss.
        """
        host = self.host
        args = host.args
        module = host.accelerator.unwrap_model(model)
        params = self.perturbed_parameters(module)
        perturbable = perturbable_parameters(
            module, host.deepspeed_engine(), params=params, per_rank=args.sam_perturbation == "per_rank"
        )
        functional = self.functional
        fraction = args.sam_ascent_fraction
        clean_losses: list[torch.Tensor] = []
        cotangents: list[Any] = []
        replay, _ = self.trunk_replay(module)
        # the second pass will answer the trunk's calls from this record (one micro-batch: trunk_replay says None
        # for sam_scope="batch" and for ascent rows)
        recording = replay.recording if replay is not None else contextlib.nullcontext

        def losses() -> Iterable[torch.Tensor]:
            for batch in micro_batches:
                if functional:
                    with recording():
                        loss, function = host.scaled_loss_and_function(module, batch, num_items_in_batch)
                    cotangents.append(function.cotangent(loss))
                elif fraction < 1:
                    rows = ascent_rows(batch, fraction)
                    loss = host.scaled_loss(module, rows, num_items_in_batch)
                    clean_losses.append(loss.detach() * self.ascent_loss_scale(batch, rows, num_items_in_batch))
                    yield loss
                    continue
                else:
                    with recording(), self._head_context(replay):
                        loss = host.scaled_loss(module, batch, num_items_in_batch)
                clean_losses.append(loss.detach())
                yield loss

        grads = host.first_gradient(losses(), perturbable)
        rho = host.sam_rho()
        preconditioner = None
        if args.sam_preconditioner != "none":
            optimizer = getattr(host.optimizer, "optimizer", host.optimizer)  # accelerate's wrapper holds the state
            # at the scale of a whole update's gradient, the scale Adam's second moment was built from
            share = len(micro_batches) / host.current_gradient_accumulation_steps
            preconditioner = adam_preconditioner(
                optimizer,
                perturbable.params,
                torch._foreach_div(grads, share),
                with_gradient=args.sam_preconditioner != "adam_stored_moment",
                chosen=args.sam_preconditioner,
            )
        perturbation = perturbable.perturb(
            grads,
            rho,
            adaptive=self.adaptive,
            eta=args.asam_eta,
            preconditioner=preconditioner,
            preconditioned_ball=args.sam_preconditioner == "adam_preconditioned_ball",
        )
        if perturbation is None:
            host.warn_skipped_perturbation("this step is taken without perturbation")
        else:
            host.record_perturbation(perturbation, len(micro_batches))
            host.record_flatness_metric("sam/rho", rho)
        return perturbation, clean_losses, cotangents

    def ascent_loss_scale(self, batch: dict[str, Any], rows: dict[str, Any], num_items_in_batch) -> float:
        """What turns the ascent rows' scaled loss into an estimate of the whole micro-batch's: a loss summed over
        the update's labelled tokens (``num_items_in_batch``) scales with the labels counted, a mean does not."""
        host = self.host
        if num_items_in_batch is None or not host.model_accepts_loss_kwargs or "labels" not in batch:
            return 1.0
        shift = is_causal_lm(host.accelerator.unwrap_model(host.model))

        def count(labels: torch.Tensor) -> int:
            return int(((labels[..., 1:] if shift else labels) != -100).sum())

        in_rows = count(rows["labels"])
        return count(batch["labels"]) / in_rows if in_rows else 1.0


class Sam(SamFamily):
    """``sam``: the gradient taken at ``w + rho * g / ||g||``."""


class Asam(SamFamily):
    """``asam``: SAM in the neighbourhood scaled elementwise by ``|w| + asam_eta``."""

    adaptive = True


class FunctionalSam(SamFamily):
    """``functional_sam``: SAM's perturbation, the update the backward of ``<F(w + e), dL/dF at w>``."""

    functional = True
