"""Momentum-SAM (Becker, Altrock, Risse, arXiv 2401.12033): the gradient taken at ``w + e`` with
``e = -rho * d / ||d||``, ``d`` the optimizer's coming update as its state says
(`hf_flatbias.sharpness.coming_update`), so the step costs one forward/backward like a plain one.

Per micro-batch: ``w`` saved, the weights moved to ``w + e`` before the forward, the host's own step (forward,
backward, loss scaling and gradient sync through the accelerator) at ``w + e``, ``w`` put back bit for bit after the
backward; the host's loop then steps the optimizer from ``w``. Evaluation, checkpoints, ``save_model``, cards and the
trace only ever run between steps, so they see ``w``. The optimizer's state is all the method remembers, and the
Trainer checkpoints it: a resumed run takes the steps of an uninterrupted one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.utils import logging

from ..coming_update import coming_update_direction, momentum_sam_offsets, why_coming_update_unreadable
from .base import FlatnessHost, FlatnessMethod

logger = logging.get_logger(__name__)


class MomentumSam(FlatnessMethod):
    """``momentum_sam``: the host's one-pass step at ``w + e`` on every ``sam_every_k``-th update inside the SAM
    window (the plain step on the others, and on the first update, before the optimizer holds any state).

    Returns the loss at ``w + e``, the loss the step trains (no forward at ``w`` is taken).
    """

    def __init__(self, host: FlatnessHost):
        super().__init__(host)
        given = getattr(host, "optimizer", None)
        given_classes = getattr(host, "optimizer_cls_and_kwargs", None)
        for optimizer in (given, given_classes[0] if given_classes else None):
            why = None if optimizer is None else why_coming_update_unreadable(optimizer)
            if why is not None:
                raise ValueError(why)
        self._optimizer_checked = False

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch) -> torch.Tensor:
        host = self.host
        if not self._optimizer_checked:  # the Trainer builds its optimizer in train(): checked before the first pass
            why = why_coming_update_unreadable(host.optimizer)
            if why is not None:
                raise ValueError(why)
            self._optimizer_checked = True
        if not host.is_sam_update():
            return host.plain_training_step(model, inputs, num_items_in_batch)
        rho = host.sam_rho()
        optimizer = getattr(host.optimizer, "optimizer", host.optimizer)
        params = [param for group in optimizer.param_groups for param in group["params"] if param.requires_grad]
        directions = coming_update_direction(optimizer, params)
        offsets = momentum_sam_offsets(directions, rho)
        if offsets is None:  # the first update (no state yet): the plain step
            if any(direction is not None for direction in directions):
                # a state whose update is zero or not finite is a run gone wrong, not a first step: say so
                logger.warning(
                    "momentum_sam: the optimizer's coming update is zero or not finite; this step is taken without "
                    "perturbation."
                )
            return host.plain_training_step(model, inputs, num_items_in_batch)
        moved = [param for param, offset in zip(params, offsets, strict=True) if offset is not None]
        with torch.no_grad():
            saved = [param.detach().clone() for param in moved]
            torch._foreach_add_(moved, [offset for offset in offsets if offset is not None])
        try:
            loss = host.plain_training_step(model, inputs, num_items_in_batch)
        finally:
            with torch.no_grad():
                torch._foreach_copy_(moved, saved)
        host.record_flatness_metric("sam/rho", rho)
        return loss
