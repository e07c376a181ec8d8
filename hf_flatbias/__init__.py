"""hf_flatbias: flatness (the Hessian trace of the pre-training loss) as a training and evaluation signal.

After Liu, Xie, Li & Ma, "Same Pre-training Loss, Better Downstream: Implicit Bias Matters for Language Models"
(ICML 2023, arXiv:2210.14199).
"""

from __future__ import annotations

import importlib.metadata
from typing import TYPE_CHECKING

from .lazy_imports import lazy_module_attributes

# pyproject.toml holds the version; a source tree put on the path without being installed has none to report.
try:
    __version__: str = importlib.metadata.version("hf_flatbias")
except importlib.metadata.PackageNotFoundError:
    __version__ = "0+unknown"

# Names are imported on first use (see lazy_imports). The trl names need the `trl` extra: without it they raise an
# ImportError naming it, the other names are unaffected.
_import_structure: dict[str, list[str]] = {
    "callbacks": ["FlatnessCheckpointSelector", "HessianTraceCallback", "SaveOnInterruptCallback"],
    "config": ["FlatBiasConfig", "FlatnessArguments"],
    "corpus": ["CorpusSpec"],
    "enlarge": ["check_enlargeable", "enlarge"],
    "flatness": [
        "FisherDiagonal",
        "FlatnessRecord",
        "GroupTrace",
        "SharpnessEstimate",
        "SpectralDensity",
        "TopEigenvalues",
        "TraceEstimate",
        "build_masked_contexts",
        "estimate_fisher_diagonal",
        "estimate_hessian_trace",
        "estimate_sam_sharpness",
        "estimate_spectral_density",
        "estimate_top_eigenvalues",
        "exact_fisher_diagonal",
        "exact_fisher_trace",
        "exact_hessian_trace",
    ],
    "glue": ["GlueResult", "finetune_glue", "load_glue_dataset", "load_glue_metric"],
    "integrations.trl": ["FlatBiasDPOConfig", "FlatBiasDPOTrainer", "FlatBiasSFTConfig", "FlatBiasSFTTrainer"],
    "modelcard": ["FlatnessCard", "add_glue_results", "format_comparison_table", "load_flatness_card"],
    "optimizers": ["MuonWithAdamW"],
    "selection": [
        "CheckpointRecord",
        "CheckpointSelection",
        "select_flattest_checkpoint",
    ],
    "trainer": ["FlatBiasTrainer", "FlatnessTrainerMixin"],
}
_module_of_name: dict[str, str] = {name: f".{module}" for module, names in _import_structure.items() for name in names}

__all__: list[str] = sorted(_module_of_name, key=str.lower) + ["__version__"]

if TYPE_CHECKING:
    from .callbacks import FlatnessCheckpointSelector, HessianTraceCallback, SaveOnInterruptCallback
    from .config import FlatBiasConfig, FlatnessArguments
    from .corpus import CorpusSpec
    from .enlarge import check_enlargeable, enlarge
    from .flatness import (
        FisherDiagonal,
        FlatnessRecord,
        GroupTrace,
        SharpnessEstimate,
        SpectralDensity,
        TopEigenvalues,
        TraceEstimate,
        build_masked_contexts,
        estimate_fisher_diagonal,
        estimate_hessian_trace,
        estimate_sam_sharpness,
        estimate_spectral_density,
        estimate_top_eigenvalues,
        exact_fisher_diagonal,
        exact_fisher_trace,
        exact_hessian_trace,
    )
    from .glue import GlueResult, finetune_glue, load_glue_dataset, load_glue_metric
    from .integrations.trl import FlatBiasDPOConfig, FlatBiasDPOTrainer, FlatBiasSFTConfig, FlatBiasSFTTrainer
    from .modelcard import FlatnessCard, add_glue_results, format_comparison_table, load_flatness_card
    from .optimizers import MuonWithAdamW
    from .selection import (
        CheckpointRecord,
        CheckpointSelection,
        select_flattest_checkpoint,
    )
    from .trainer import FlatBiasTrainer, FlatnessTrainerMixin


__getattr__, __dir__ = lazy_module_attributes(__name__, _module_of_name)
