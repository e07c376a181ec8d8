"""The paper's flatness measure, the trace of the Hessian of the pre-training loss: estimators, exact references and
the contexts they run on. Nothing here knows about the Trainer."""

from ..constants import ESTIMATORS
from .api import estimate_hessian_trace
from .contexts import TraceContexts, build_masked_contexts
from .estimators import compute_trace_samples
from .exact import exact_fisher_trace, exact_hessian_trace, per_context_fisher_traces
from .groups import default_group_of, parameter_groups
from .results import GroupTrace, TraceEstimate, TraceSamples, summarize_trace_samples

__all__ = [
    "ESTIMATORS",
    "GroupTrace",
    "TraceContexts",
    "TraceEstimate",
    "TraceSamples",
    "build_masked_contexts",
    "compute_trace_samples",
    "default_group_of",
    "estimate_hessian_trace",
    "exact_fisher_trace",
    "exact_hessian_trace",
    "parameter_groups",
    "per_context_fisher_traces",
    "summarize_trace_samples",
]
