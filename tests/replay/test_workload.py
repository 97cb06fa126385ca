"""Trace windows, time scaling and rate scaling."""

from __future__ import annotations

import pytest

from harvest.replay.trace import SAMPLE_TRACE, read_trace
from harvest.replay.workload import TraceWindow, prepare

from tests.replay.helpers import requests

TEN = requests(*[(float(i), 100 + i, 10 + i) for i in range(10)])


def test_default_window_is_the_whole_trace():
    assert prepare(TEN, TraceWindow()) == TEN


def test_window_rebases_arrivals_and_limits_requests():
    out = prepare(TEN, TraceWindow(start_s=2.5, duration_s=5.0))
    assert [r.arrival_s for r in out] == [0.5, 1.5, 2.5, 3.5, 4.5]
    assert out[0].context_tokens == 103
    assert len(prepare(TEN, TraceWindow(start_s=2.5, max_requests=2))) == 2


def test_time_scale_stretches_arrivals():
    assert [r.arrival_s for r in prepare(TEN, TraceWindow(time_scale=2.0))][:3] == [0.0, 2.0, 4.0]


def test_rate_scale_multiplies_and_thins_with_a_seed():
    sample = read_trace(SAMPLE_TRACE)
    doubled = prepare(sample, TraceWindow(rate_scale=2.0), seed=0)
    assert len(doubled) == 600
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(doubled, doubled[1:]))
    assert doubled[-1].arrival_s <= sample[-1].arrival_s  # the time base is kept
    half = prepare(sample, TraceWindow(rate_scale=0.5), seed=0)
    assert 120 < len(half) < 180
    assert half == prepare(sample, TraceWindow(rate_scale=0.5), seed=0)
    assert half != prepare(sample, TraceWindow(rate_scale=0.5), seed=1)
    assert TraceWindow(rate_scale=0.5).is_random and not TraceWindow(time_scale=3.0).is_random


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"start_s": -1.0}, "--start-s"),
        ({"duration_s": 0.0}, "--duration-s"),
        ({"max_requests": 0}, "--max-requests"),
        ({"time_scale": 0.0}, "--time-scale"),
        ({"rate_scale": float("nan")}, "--rate-scale"),
    ],
)
def test_bad_window_settings_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        TraceWindow(**kwargs)


def test_empty_window_is_an_error():
    with pytest.raises(ValueError, match="no request arrives"):
        prepare(TEN, TraceWindow(start_s=100.0))
    with pytest.raises(ValueError, match="kept none"):
        prepare(TEN[:1], TraceWindow(rate_scale=0.001), seed=0)
