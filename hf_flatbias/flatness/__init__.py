"""The paper's flatness measure, the trace of the Hessian of the pre-training loss: estimators, exact references and
the contexts they run on; the measures beyond it (top eigenvalues, spectral density, SAM's and critical sharpness);
and what flatness is judged to buy (weight-noise and quantization sensitivity, forgetting). Nothing here knows about
the Trainer."""

from ..constants import ESTIMATORS
from .api import estimate_hessian_trace
from .contexts import TraceContexts, build_masked_contexts
from .critical_sharpness import (
    CriticalSharpness,
    ProposedUpdate,
    estimate_critical_sharpness,
    proposed_update,
    warm_started,
)
from .diagonal import FisherDiagonal, estimate_fisher_diagonal
from .estimators import TraceSettings, compute_trace_samples
from .exact import exact_fisher_diagonal, exact_fisher_trace, exact_hessian_trace, per_context_fisher_traces
from .finite_difference import FINITE_DIFFERENCE_STEPS
from .forgetting import ForgettingResult, measure_forgetting
from .forgetting_task import ForgettingTask, load_forgetting_task
from .gradient_alignment import GradientAlignment, alignment_from_gram, estimate_gradient_alignment
from .groups import default_group_of, parameter_groups
from .quantization import (
    QuantizationPoint,
    QuantizationSensitivity,
    estimate_quantization_sensitivity,
    quantized_weight_matrices,
    round_to_nearest,
)
from .relative_critical_sharpness import (
    RelativeCriticalSharpnessEstimate,
    downstream_update,
    estimate_relative_critical_sharpness,
)
from .results import FlatnessRecord, GroupTrace, TraceEstimate, TraceSamples, summarize_trace_samples
from .robust_summary import median_of_means, top_share
from .spectrum import (
    SharpnessEstimate,
    SpectralDensity,
    TopEigenvalues,
    estimate_sam_sharpness,
    estimate_spectral_density,
    estimate_top_eigenvalues,
)
from .spectrum_shape import PowerLawFit, SpectrumShape, fit_power_law
from .weight_noise import WeightNoisePoint, WeightNoiseSensitivity, estimate_weight_noise_sensitivity, weight_noise
from .zero_update import zero_proposed_update

__all__ = [
    "ESTIMATORS",
    "FINITE_DIFFERENCE_STEPS",
    "CriticalSharpness",
    "FisherDiagonal",
    "FlatnessRecord",
    "ForgettingResult",
    "ForgettingTask",
    "GroupTrace",
    "ProposedUpdate",
    "QuantizationPoint",
    "QuantizationSensitivity",
    "SharpnessEstimate",
    "SpectralDensity",
    "TopEigenvalues",
    "TraceContexts",
    "TraceEstimate",
    "TraceSamples",
    "TraceSettings",
    "WeightNoisePoint",
    "WeightNoiseSensitivity",
    "build_masked_contexts",
    "compute_trace_samples",
    "default_group_of",
    "estimate_critical_sharpness",
    "estimate_fisher_diagonal",
    "estimate_hessian_trace",
    "estimate_quantization_sensitivity",
    "estimate_sam_sharpness",
    "estimate_spectral_density",
    "estimate_top_eigenvalues",
    "estimate_weight_noise_sensitivity",
    "exact_fisher_diagonal",
    "exact_fisher_trace",
    "exact_hessian_trace",
    "load_forgetting_task",
    "measure_forgetting",
    "parameter_groups",
    "per_context_fisher_traces",
    "proposed_update",
    "warm_started",
    "quantized_weight_matrices",
    "round_to_nearest",
    "summarize_trace_samples",
    "median_of_means",
    "GradientAlignment",
    "alignment_from_gram",
    "estimate_gradient_alignment",
    "PowerLawFit",
    "SpectrumShape",
    "fit_power_law",
    "RelativeCriticalSharpnessEstimate",
    "downstream_update",
    "estimate_relative_critical_sharpness",
    "top_share",
    "weight_noise",
    "zero_proposed_update",
]
