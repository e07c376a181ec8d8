"""Estimators of the paper's flatness measure, the trace of the Hessian of the pre-training loss.

Liu et al. (2023, App. B.1) measure ``Tr(H) = E_{x,t} E_{y ~ f(x_-t)} ||grad_theta log f(x_-t)_y||^2``: the trace of the
Fisher information, with ``y`` drawn from the model's own prediction at one masked position per context. It equals
the Hessian trace of the loss when the model outputs the true conditionals.

One module per estimator (``estimator=``), found by name in `ESTIMATOR_REGISTRY`:

- `per_sample` (default): per-context squared gradient norms for a whole batch from one forward and one backward per
  draw, with ghost norms, and the output layer's own term in exact expectation over ``y``.
- `summed`: ``||sum of the sampled-label gradients||^2 / count`` over a batch; unbiased, but the cross terms add
  variance.
- `hutchinson`: ``v^T H v`` with random probes ``v`` (Rademacher by default, ``probe="gaussian"`` for standard normal
  entries) on the loss of the *data* labels: the Hessian trace of the data loss, which equals the Fisher trace only
  when the model's conditionals are the true ones. The paper's released code measures a related quantity with one
  Gaussian probe per batch of multi-mask sequences: `hf_flatbias.flatness.released_code` implements exactly that one.
- `hutchpp`: Hutch++ on the same Hessian, less error than ``hutchinson`` at equal products when a few eigenvalues
  dominate.
- `naive`: one forward and backward per draw; the reference loop, exact for any architecture.

Each draw of `per_sample` and `naive` backpropagates a random cotangent at the logits with covariance
``diag(p) - p p^T`` (`output_probes`): random signs by default, or the paper's sampled label.

Every estimator first produces `TraceSamples`: values per sampling unit (a context, or a batch of contexts for
``summed``/``hutchinson``/``hutchpp``) over a subset of context indices. Units can be computed on different processes
and concatenated before `summarize_trace_samples` turns them into a `TraceEstimate`; each context's random draws
depend only on ``(seed, context index)``. `TraceSettings` holds what decides the numbers, checked when it is made.
"""

from .base import TraceEstimator
from .measure import compute_trace_samples, trace_samples
from .registry import ESTIMATOR_REGISTRY, per_context_estimators, probed_estimators
from .settings import TraceSettings

__all__ = [
    "ESTIMATOR_REGISTRY",
    "TraceEstimator",
    "TraceSettings",
    "compute_trace_samples",
    "per_context_estimators",
    "probed_estimators",
    "trace_samples",
]
