"""Estimator name -> estimator: each name in `hf_flatbias.constants.ESTIMATORS` is the module its estimator lives in.

The names themselves stay in `constants`, which the command line reads without importing torch; adding an estimator
is a module here named after it, exporting ``ESTIMATOR``, and its name and symbol in ``constants.TRACE_SYMBOLS``.
"""

from __future__ import annotations

from importlib import import_module

from ...constants import ESTIMATORS
from .base import TraceEstimator

ESTIMATOR_REGISTRY: dict[str, TraceEstimator] = {
    name: import_module(f"{__package__}.{name}").ESTIMATOR for name in ESTIMATORS
}
"""Every estimator by its name, in the order of `hf_flatbias.constants.ESTIMATORS`."""


def per_context_estimators() -> tuple[str, ...]:
    """The estimators whose sampling unit is one context (`TraceEstimator.per_context`)."""
    return tuple(name for name, estimator in ESTIMATOR_REGISTRY.items() if estimator.per_context)


def probed_estimators() -> tuple[str, ...]:
    """The estimators that draw probe vectors (`TraceEstimator.reads_probe`)."""
    return tuple(name for name, estimator in ESTIMATOR_REGISTRY.items() if estimator.reads_probe)
