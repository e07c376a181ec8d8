"""Which layout a flatness step perturbs: one of the engines' (`hf_flatbias.sharpness.engines`: plain PyTorch and
DDP, DeepSpeed ZeRO-3, FSDP2) or FSDP2's per-rank one (`hf_flatbias.sharpness.fsdp_per_rank`), which builds on them.

Apart from both so that neither imports the other back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..tensors import is_fully_sharded, trainable_parameters
from .engines import FullyShardedParameters, PerturbableParameters, ZeroStage3Parameters, deepspeed_zero_stage
from .fsdp_per_rank import PerRankFullyShardedParameters


def perturbable_parameters(
    model: torch.nn.Module,
    engine: object | None = None,
    params: Sequence[torch.nn.Parameter] | None = None,
    *,
    per_rank: bool = False,
) -> PerturbableParameters:
    """The trainable parameters of ``model`` (the unwrapped module), or the subset ``params`` of them, in the layout
    ``engine`` keeps them.

    ``engine`` is the DeepSpeed engine wrapping ``model``, or ``None`` for plain PyTorch, DDP and FSDP2 (which is
    recognised from the module). ``per_rank``: each rank perturbs along its own first gradient
    (``sam_perturbation="per_rank"``), which under FSDP2 takes its own layout (`PerRankFullyShardedParameters`).
    """
    params = trainable_parameters(model) if params is None else list(params)
    if is_fully_sharded(model):
        if per_rank:
            return PerRankFullyShardedParameters(model, params)
        return FullyShardedParameters(params)
    if deepspeed_zero_stage(engine) == 3:
        return ZeroStage3Parameters(params, engine.optimizer)
    return PerturbableParameters(params)
