"""Names every part of hf_flatbias shares: one definition each."""

# The flatness methods (names, options, what each supports, classes) are one table, read from there:
# `hf_flatbias.sharpness.methods.table.METHOD_TABLE` (FLATNESS_METHODS, SAM_METHODS, ...), torch-free like this module.
# Not re-exported here: the table names the methods' modules, which import this one.

IGNORE_INDEX = -100
"""The label of positions that are not predicted (the default ``ignore_index`` of PyTorch's cross-entropy)."""

# The trace's names are here, not in flatness/, so that the command line can offer them without importing torch;
# `hf_flatbias.flatness.estimators.ESTIMATOR_REGISTRY` finds each estimator's module by its name.
TRACE_SYMBOLS = {
    "per_sample": "Tr(F)",
    "summed": "Tr(F)",
    "hutchinson": "Tr(H)",
    "hutchpp": "Tr(H)",
    "naive": "Tr(F)",
}
"""The Hessian-trace estimators of ``estimate_hessian_trace`` and what each measures, in a plot's or a table's few
characters: the sampled-label estimators measure the Fisher trace Tr(F) (the paper's measure), Hutchinson's probes
the Hessian trace Tr(H) of the data-label loss; the two agree only where the model's conditionals are the true ones."""

ESTIMATORS = tuple(TRACE_SYMBOLS)
"""The names of the Hessian-trace estimators, the command line's choices."""

DEFAULT_ESTIMATOR = "per_sample"
"""The estimator used when none is named: the paper's Fisher trace from per-context gradient norms, one backward per
draw (`DEFAULT_OUTPUT_PROBE` its cotangent)."""

TRACE_QUANTITIES = {
    estimator: f"{'Fisher' if symbol == 'Tr(F)' else 'Hessian'} trace {symbol}"
    for estimator, symbol in TRACE_SYMBOLS.items()
}
"""What each estimator measures, as cards and printed lines name it: "Fisher trace Tr(F)" or "Hessian trace Tr(H)"."""

HUTCHINSON_PROBES = ("rademacher", "gaussian")
"""Probe distributions of the ``hutchinson`` and ``hutchpp`` estimators; Rademacher (the default) has the smaller
variance."""

PROBED_ESTIMATORS = ("hutchinson", "hutchpp")
"""The estimators that draw probe vectors (``probe=``) rather than labels."""

OUTPUT_PROBES = ("label", "rademacher")
"""The cotangent at the logits per draw of ``per_sample`` and ``naive``: a sampled label's ``e_y - p``, or a
random-sign combination ``sqrt(p) * z - p (sqrt(p) . z)`` of the same covariance ``diag(p) - p p^T``
(`hf_flatbias.flatness.estimators.output_probes`)."""

DEFAULT_OUTPUT_PROBE = "rademacher"
"""The cotangent used when none is named: the random signs, whose one-draw variance was 1.8-8.9x lower than the
sampled label's on every trained model measured (1.08-1.45x on random initialisations; benchmarks/RESULTS.md)."""

OUTPUT_PROBED_ESTIMATORS = ("per_sample", "naive")
"""The estimators that read ``output_probe`` (the others sample labels, or probe the data-label Hessian)."""

DEFAULT_BATCH_SIZE = 32
"""Contexts per forward pass of a trace estimate."""

# Measured in benchmarks/RESULTS.md: 1-2 draws per context gave the least error per second, both on a random
# 4.5M BERT and on a small BERT trained on a synthetic Markov language (2 was best there, 8 cost 1.75x more); two
# draws also measure the variance split behind `suggested_n_draws`. The paper used 50 as a secondary summary gives it
# (unverified).
RECOMMENDED_N_DRAWS = 2
"""Draws per context recommended for a trace estimate."""

DEFAULT_N_CONTEXTS = 1000
"""Contexts of a one-off trace measurement (``hf-flatbias trace``, the recipes' final trace). The released code
averages one probe per batch of 128 sequences over many batches; the paper's own count is unverified here. The
callback, which measures again at every evaluation, takes fewer by default."""

MAX_N_DRAWS = 10_000
"""The most draws per context a measurement takes: 200x the paper's 50; past a few draws the error is the contexts'
(see `RECOMMENDED_N_DRAWS`), and each draw costs a backward per context."""

MAX_N_CONTEXTS = 1_000_000
"""The most contexts a measurement takes: 100x the paper's 10,000."""

DEFAULT_SAM_RHO = 0.05
"""SAM's neighbourhood radius when none is given: the value of Foret et al. (2021) and of every recipe here."""

TRACE_METRIC = "flatness/hessian_trace"
"""The logged name of the Hessian trace (``log_history``, TensorBoard, checkpoint selection)."""

TRACE_STDERR_METRIC = "flatness/hessian_trace_stderr"
"""The logged name of the trace's standard error."""

TRACE_MEDIAN_OF_MEANS_METRIC = "flatness/hessian_trace_median_of_means"
"""The logged name of the trace's median of means (`hf_flatbias.flatness.robust_summary`)."""

TRACE_TOP_SHARE_METRIC = "flatness/hessian_trace_top_share"
"""The logged name of the share of the trace carried by its largest 1% of contexts."""

TRACE_SUMMARIES = {"mean": TRACE_METRIC, "median_of_means": TRACE_MEDIAN_OF_MEANS_METRIC}
"""The summaries of a trace estimate a rank-based rule may rank by, and the logged key of each; ``mean`` is the
default until an experiment says otherwise."""

# The measures beyond the trace (their names, functions, settings, log keys) are one table:
# `hf_flatbias.measures.MEASURE_TABLE`, torch-free like this module.

CURVATURE_MATRICES = ("fisher", "hessian")
"""The matrices whose products `hf_flatbias.flatness.curvature.CurvatureOperator` forms directly."""

ADAM_PRECONDITIONED = "adam_preconditioned"
"""The Hessian seen by Adam, ``P^-1/2 H P^-1/2`` with ``P = diag(sqrt(v_hat) + eps)`` from the optimizer's state: its
top eigenvalue is the one Adam's stability threshold bounds (Cohen et al., arXiv 2207.14484)."""

SPECTRUM_MATRICES = (*CURVATURE_MATRICES, ADAM_PRECONDITIONED)

CRITICAL_DIRECTIONS = ("optimizer", "gradient_descent")
"""The lines critical sharpness searches along: the optimizer's next update (the negative gradient without one), or
the negative gradient."""

CURVATURE_PRODUCTS = ("auto", "exact", "finite_difference")
"""How `estimate_top_eigenvalues` forms its matrix-vector products: ``exact`` (double backward / forward mode, whole
parameters on one process), ``finite_difference`` (central differences of gradients or logits, through the engine's
own forward and backward: works sharded and with fused attention), ``auto`` (finite differences when the parameters
are sharded across processes, exact otherwise)."""
"""The matrices whose eigenvalues can be measured: the Fisher (Gauss-Newton) matrix, whose trace is the paper's
measure, or the Hessian of the data-label loss."""

TOP_EIGENVALUE_METRIC = "flatness/top_eigenvalue"
"""The logged name of the largest eigenvalue."""

SAM_SHARPNESS_METRIC = "flatness/sam_sharpness"
"""The logged name of SAM's sharpness, ``L(w + rho g/||g||) - L(w)`` averaged over batches."""

SAM_SHARPNESS_STDERR_METRIC = "flatness/sam_sharpness_stderr"
"""The logged name of its standard error over batches."""

NOISE_SCALES = ("rms", "absolute")
"""How weight-noise sensitivity scales its noise: ``rms``, ``sigma * rms(w_p) * eps`` on tensor ``p`` with ``rms(w_p) =
sqrt(mean(w_p^2))`` of the unperturbed tensor (a tensor of zeros gets no noise; the default); ``absolute``, ``sigma *
eps`` on every weight."""

FORGETTING_OPTIMIZERS = ("adamw", "sgd")
"""The optimizers forgetting fine-tunes with: AdamW, or plain SGD (no momentum)."""
