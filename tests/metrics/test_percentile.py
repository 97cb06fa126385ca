"""The nearest-rank percentile the demo and the benchmarks report."""

from __future__ import annotations

import math

from harvest.metrics.percentile import nearest_rank


def test_nearest_rank_picks_a_measured_value_without_interpolating():
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert nearest_rank(values, 0.0) == 1.0 and nearest_rank(values, 1.0) == 5.0
    assert nearest_rank(values, 0.5) == 3.0
    assert nearest_rank(values, 0.6) == 3.0  # rank round(0.6 * 4) = 2: no interpolation toward 4.0
    assert nearest_rank(range(100), 0.99) == 98  # rank round(0.99 * 99) = 98
    assert nearest_rank([7.0], 0.99) == 7.0


def test_no_values_give_nan():
    assert math.isnan(nearest_rank([], 0.99))
