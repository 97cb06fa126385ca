"""Read request traces in the Azure LLM inference 2023 format.

Columns: ``TIMESTAMP`` (``YYYY-MM-DD HH:MM:SS.fffffff``, or seconds as a number),
``ContextTokens``, ``GeneratedTokens``. Rows must be in time order. Every problem is
reported with its file and line number; nothing is skipped silently.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime as dt
from pathlib import Path

REQUIRED_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
SAMPLE_TRACE = Path(__file__).resolve().parent.parent / "data" / "azure_llm_2023_conv_sample.csv"
# The full one-hour trace, where the shared checkout keeps it (../shared/traces next to the project).
FULL_TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "azure_llm_2023_conv.csv"


class TraceError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    arrival_s: float  # seconds since the first request of the trace
    context_tokens: int
    generated_tokens: int


def _parse_timestamp(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    # Python's fromisoformat takes at most 6 fractional digits; the trace has 7.
    head, dot, frac = text.strip().partition(".")
    stamp = dt.datetime.fromisoformat(head)
    return stamp.timestamp() + (float("0." + frac) if dot and frac else 0.0)


def _parse_count(text: str, column: str, where: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise TraceError(f"{where}: {column}={text!r} is not an integer") from None
    if value < 0:
        raise TraceError(f"{where}: {column}={value} is negative")
    return value


def read_trace(path: str | Path, *, limit: int | None = None) -> list[TraceRequest]:
    path = Path(path)
    requests: list[TraceRequest] = []
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        missing = [c for c in REQUIRED_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise TraceError(f"{path}:1: missing column(s) {', '.join(missing)} (need {', '.join(REQUIRED_COLUMNS)})")
        first = previous = None
        for row in reader:
            where = f"{path}:{reader.line_num}"
            try:
                stamp = _parse_timestamp(row["TIMESTAMP"])
            except ValueError:
                raise TraceError(f"{where}: TIMESTAMP={row['TIMESTAMP']!r} is not a timestamp") from None
            if stamp < 0:
                raise TraceError(f"{where}: TIMESTAMP={row['TIMESTAMP']!r} is negative")
            if previous is not None and stamp < previous:
                raise TraceError(f"{where}: TIMESTAMP goes backwards (rows must be sorted by time)")
            first = stamp if first is None else first
            previous = stamp
            requests.append(
                TraceRequest(
                    arrival_s=stamp - first,
                    context_tokens=_parse_count(row["ContextTokens"], "ContextTokens", where),
                    generated_tokens=_parse_count(row["GeneratedTokens"], "GeneratedTokens", where),
                )
            )
            if limit is not None and len(requests) >= limit:
                break
    return requests
