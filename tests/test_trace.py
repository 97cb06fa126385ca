"""Reading Azure-format request traces: the shipped sample, the full trace, bad input."""

from __future__ import annotations

import pytest

from harvest.replay.trace import SAMPLE_TRACE, TraceError, read_trace


def test_sample_trace_is_shipped_and_sane():
    requests = read_trace(SAMPLE_TRACE)
    assert len(requests) == 300
    assert requests[0].arrival_s == 0.0
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(requests, requests[1:]))
    assert requests[0].context_tokens == 374 and requests[0].generated_tokens == 44
    # First row 18:15:46.6805900, second 18:15:50.9951690: the 7th fractional digit counts.
    assert requests[1].arrival_s == pytest.approx(4.314579, abs=1e-6)


def test_full_trace_when_present(full_trace):
    requests = read_trace(full_trace)
    # 19,366 rows (the trace README says 19,365; its last row has no trailing newline).
    assert len(requests) == 19366
    assert 3500 < requests[-1].arrival_s < 3700  # one hour


def test_limit():
    assert len(read_trace(SAMPLE_TRACE, limit=5)) == 5


@pytest.mark.parametrize(
    "body, message",
    [
        ("TIMESTAMP,ContextTokens\n0,1\n", r":1: missing column\(s\) GeneratedTokens"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n0,1,2\n1,x,2\n", r":3: ContextTokens='x' is not an integer"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n0,1,2\n1,3,-2\n", r":3: GeneratedTokens=-2 is negative"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n5,1,2\n4,3,2\n", r":3: TIMESTAMP goes backwards"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n-1,1,2\n", r":2: TIMESTAMP='-1' is negative"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n", r":2: TIMESTAMP='yesterday' is not a timestamp"),
    ],
)
def test_bad_trace_names_the_line(tmp_path, body, message):
    path = tmp_path / "trace.csv"
    path.write_text(body)
    with pytest.raises(TraceError, match=message):
        read_trace(path)
