"""The paper's flatness measure, the trace of the Hessian of the pre-training loss: estimators, exact references and
the contexts they run on; and the measures beyond it, the top eigenvalues, the spectral density and SAM's sharpness
(`spectrum`). Nothing here knows about the Trainer."""

from ..constants import ESTIMATORS
from .api import estimate_hessian_trace
from .contexts import TraceContexts, build_masked_contexts
from .diagonal import FisherDiagonal, estimate_fisher_diagonal
from .estimators import compute_trace_samples
from .exact import exact_fisher_diagonal, exact_fisher_trace, exact_hessian_trace, per_context_fisher_traces
from .groups import default_group_of, parameter_groups
from .results import FlatnessRecord, GroupTrace, TraceEstimate, TraceSamples, summarize_trace_samples
from .spectrum import (
    SharpnessEstimate,
    SpectralDensity,
    TopEigenvalues,
    estimate_sam_sharpness,
    estimate_spectral_density,
    estimate_top_eigenvalues,
)

# isort: split
from .critical_sharpness import CriticalSharpness, ProposedUpdate, estimate_critical_sharpness, proposed_update

__all__ = [
    "ESTIMATORS",
    "FisherDiagonal",
    "FlatnessRecord",
    "GroupTrace",
    "SharpnessEstimate",
    "SpectralDensity",
    "TopEigenvalues",
    "TraceContexts",
    "TraceEstimate",
    "TraceSamples",
    "build_masked_contexts",
    "compute_trace_samples",
    "default_group_of",
    "estimate_fisher_diagonal",
    "estimate_hessian_trace",
    "estimate_sam_sharpness",
    "estimate_spectral_density",
    "estimate_top_eigenvalues",
    "exact_fisher_diagonal",
    "exact_fisher_trace",
    "exact_hessian_trace",
    "parameter_groups",
    "per_context_fisher_traces",
    "summarize_trace_samples",
    "CriticalSharpness",
    "ProposedUpdate",
    "estimate_critical_sharpness",
    "proposed_update",
]
