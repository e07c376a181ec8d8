"""hf_flatbias: flatness (the Hessian trace of the pre-training loss) as a training and evaluation signal.

After Liu, Xie, Li & Ma, "Same Pre-training Loss, Better Downstream: Implicit Bias Matters for Language Models"
(ICML 2023, arXiv:2210.14199).
"""

from .callbacks import HessianTraceCallback
from .config import FlatBiasConfig
from .enlarge import check_enlargeable, enlarge
from .flatness import (
    TraceEstimate,
    build_masked_contexts,
    estimate_hessian_trace,
    exact_fisher_trace,
    exact_hessian_trace,
)
from .glue import GlueResult, finetune_glue, load_glue_dataset, load_glue_metric
from .modelcard import FlatnessCard, add_glue_results, format_comparison_table, load_flatness_card
from .selection import CheckpointRecord, CheckpointSelection, FlatnessCheckpointSelector, select_flattest_checkpoint
from .trainer import FlatBiasTrainer

__version__ = "0.1.0"

__all__ = [
    "add_glue_results",
    "build_masked_contexts",
    "check_enlargeable",
    "CheckpointRecord",
    "CheckpointSelection",
    "enlarge",
    "estimate_hessian_trace",
    "exact_fisher_trace",
    "exact_hessian_trace",
    "finetune_glue",
    "FlatBiasConfig",
    "FlatBiasTrainer",
    "FlatnessCard",
    "FlatnessCheckpointSelector",
    "format_comparison_table",
    "GlueResult",
    "HessianTraceCallback",
    "load_flatness_card",
    "load_glue_dataset",
    "load_glue_metric",
    "select_flattest_checkpoint",
    "TraceEstimate",
    "__version__",
]
