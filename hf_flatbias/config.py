"""Training arguments for flatness-aware training."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from transformers import TrainingArguments

SAM_METHODS = ("sam", "asam")
FLATNESS_METHODS = ("none", *SAM_METHODS)
SAM_SCOPES = ("micro_batch", "batch")
SAM_PERTURBATIONS = ("global", "per_rank")


@dataclass
class FlatBiasConfig(TrainingArguments):
    """[`~transformers.TrainingArguments`] with the options of [`FlatBiasTrainer`]'s flatness-seeking steps.

    Every field below can be given on the command line through [`~transformers.HfArgumentParser`] or in a YAML
    config, like any other training argument.
    """

    flatness_method: str = field(
        default="none",
        metadata={
            "help": "How training seeks flat minima. 'none': the plain Trainer step; 'sam': sharpness-aware "
            "minimization (Foret et al., 2021), the gradient taken at w + rho * g / ||g||; 'asam': adaptive SAM "
            "(Kwon et al., 2021), the neighbourhood scaled elementwise by |w| + asam_eta.",
            "choices": list(FLATNESS_METHODS),
        },
    )
    sam_rho: float = field(
        default=0.05,
        metadata={"help": "Radius of the SAM/ASAM neighbourhood. ASAM usually needs a larger value (about 0.5-2)."},
    )
    asam_eta: float = field(
        default=0.01,
        metadata={"help": "ASAM's offset in T_w = |w| + eta, so that zero weights are still perturbed."},
    )
    sam_scope: str = field(
        default="micro_batch",
        metadata={
            "help": "Which gradient defines the perturbation under gradient accumulation. 'micro_batch': each "
            "micro-batch is perturbed along its own gradient (m-sharpness, cheapest); 'batch': the exact SAM step "
            "of the whole accumulated batch (the first gradient is accumulated over all micro-batches of the "
            "update, then every micro-batch is re-run at w + e). Both are identical without accumulation.",
            "choices": list(SAM_SCOPES),
        },
    )
    sam_perturbation: str = field(
        default="global",
        metadata={
            "help": "With several processes: 'global' averages the first gradient over processes so every rank "
            "applies the same perturbation (the single-process SAM step on the global batch); 'per_rank' lets each "
            "rank use its own gradient (m-sharpness across ranks, no extra communication).",
            "choices": list(SAM_PERTURBATIONS),
        },
    )

    def __post_init__(self) -> None:
        self._validate_flatness_arguments()
        super().__post_init__()

    def _validate_flatness_arguments(self) -> None:
        if self.flatness_method not in FLATNESS_METHODS:
            raise ValueError(
                f"flatness_method={self.flatness_method!r} is not supported; choose one of {list(FLATNESS_METHODS)}."
            )
        if not isinstance(self.sam_rho, (int, float)) or not math.isfinite(self.sam_rho) or self.sam_rho <= 0:
            raise ValueError(f"sam_rho must be a finite number > 0 (got {self.sam_rho!r}); the SAM paper uses 0.05.")
        if not isinstance(self.asam_eta, (int, float)) or not math.isfinite(self.asam_eta) or self.asam_eta < 0:
            raise ValueError(f"asam_eta must be a finite number >= 0 (got {self.asam_eta!r}); ASAM uses 0.01.")
        if self.sam_scope not in SAM_SCOPES:
            raise ValueError(f"sam_scope={self.sam_scope!r} is not supported; choose one of {list(SAM_SCOPES)}.")
        if self.sam_perturbation not in SAM_PERTURBATIONS:
            raise ValueError(
                f"sam_perturbation={self.sam_perturbation!r} is not supported; choose one of {list(SAM_PERTURBATIONS)}."
            )

    @property
    def uses_sam(self) -> bool:
        return self.flatness_method in SAM_METHODS
