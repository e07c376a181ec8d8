"""Trainer callbacks: the paper's flatness measure logged during training (`HessianTraceCallback`, its settings in
`TraceCallbackConfig`), checkpoint selection by flatness (`FlatnessCheckpointSelector`) and a checkpoint saved on
Ctrl-C (`SaveOnInterruptCallback`)."""

from ..constants import TRACE_METRIC, TRACE_STDERR_METRIC
from .interrupt import SaveOnInterruptCallback
from .selector import FlatnessCheckpointSelector
from .trace import HessianTraceCallback, contexts_within_budget
from .trace_config import TraceCallbackConfig

__all__ = [
    "TRACE_METRIC",
    "TRACE_STDERR_METRIC",
    "FlatnessCheckpointSelector",
    "HessianTraceCallback",
    "SaveOnInterruptCallback",
    "TraceCallbackConfig",
    "contexts_within_budget",
]
