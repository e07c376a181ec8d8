"""hf_flatbias.stats: the Student-t interval taken in one place (issue 58: it was computed in three)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as scipy_stats

from hf_flatbias.stats import mean_interval, paired_difference, t_half_width


@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_mean_interval_is_scipys_t_interval(confidence):
    values = np.array([0.81, 0.79, 0.84, 0.8, 0.77])
    low, high = scipy_stats.t.interval(confidence, 4, loc=values.mean(), scale=scipy_stats.sem(values))
    interval = mean_interval(values, confidence)
    assert (interval.low, interval.high) == pytest.approx((low, high), rel=1e-12)
    assert interval.estimate == pytest.approx(values.mean()) and interval.n == 5


def test_t_half_width_takes_any_standard_error_and_degrees_of_freedom():
    assert t_half_width(0.5, 3) == pytest.approx(3.182446305284263 * 0.5, rel=1e-12)  # t(0.975, 3), from tables
    errors = np.array([0.1, 0.2])
    assert t_half_width(errors, 7, 0.9) == pytest.approx(scipy_stats.t.ppf(0.95, 7) * errors, rel=1e-12)


def test_a_paired_difference_is_the_mean_interval_of_the_differences():
    a, b = [0.8, 0.7, 0.9], [0.75, 0.72, 0.8]
    assert paired_difference(a, b) == mean_interval(np.subtract(a, b))
    assert np.isnan(mean_interval([1.0]).low)
