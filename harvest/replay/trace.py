"""Read request traces in the Azure LLM inference 2023 format.

Columns: ``TIMESTAMP`` (``YYYY-MM-DD HH:MM:SS.fffffff``, any ISO 8601 date and time, UTC
unless it names a zone; or seconds as a plain number, one format per trace),
``ContextTokens`` (>= 1), ``GeneratedTokens`` (>= 0; 0 or 1: the request never reaches
decode); other columns are ignored. Rows must be in time order. The file is UTF-8, with
or without a byte-order mark (Windows exports of the Azure trace have one).

Every problem is a :class:`TraceError` naming the file, the line and the column; nothing
is skipped silently. Times are integer nanoseconds until they are made relative to the
first request, so a trace's absolute epoch does not eat the precision of its arrivals.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime as dt
import io
import re
from fractions import Fraction
from pathlib import Path

REQUIRED_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
SAMPLE_TRACE = Path(__file__).resolve().parent.parent / "data" / "azure_llm_2023_conv_sample.csv"
# The full one-hour trace (19,366 requests) is not shipped: a user downloads it and passes
# its path. The bundled sample is its first 300 requests (harvest/data/README.md).
FULL_TRACE_SOURCE = "data/AzureLLMInferenceTrace_conv.csv of https://github.com/Azure/AzurePublicDataset"
TRACE_HELP = (
    "Azure-format trace CSV (default: the bundled sample, the first 300 requests of the Azure LLM inference "
    "trace 2023, conversation service). For the full one-hour trace, download " + FULL_TRACE_SOURCE
    + " (CC-BY 4.0) and pass its path here"
)
# Token counts are int32 in SGLang and torch; a larger one is no request, and the
# simulator's int64 step arrays must hold a batch's sum of them.
MAX_TOKENS = 2**31 - 1
# ~31 years: further apart, arrivals as float seconds lose the resolution of a decode step.
MAX_SPAN_S = 1e9
_NS = 10**9

_SECONDS = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d{1,3})?", re.ASCII)
_NOT_FINITE = {"nan", "inf", "infinity"}
# The trace writes 7 fractional digits, which datetime (6 at most) cannot hold: split them off.
_DATE = re.compile(r"(?P<whole>[^.]+)(?:\.(?P<fraction>\d+))?(?P<zone>Z|[+-]\d\d(?::?\d\d)?)?", re.ASCII)
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
_COUNT = re.compile(r"-?\d+", re.ASCII)


class TraceError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    arrival_s: float  # seconds since the first request of the trace
    context_tokens: int
    generated_tokens: int
    line: int = dataclasses.field(default=0, compare=False)  # its line in the trace file (0: not read from one)


def _shown(text: str) -> str:
    return repr(text) if len(text) <= 40 else repr(text[:37]) + "..."


def _parse_timestamp(text: str, where: str) -> tuple[str, int]:
    """(``"seconds"`` or ``"date"``, nanoseconds since the trace's zero or the epoch)."""
    stripped = text.strip()
    if _SECONDS.fullmatch(stripped):
        seconds = Fraction(stripped)
        if seconds < 0:
            raise TraceError(f"{where}: TIMESTAMP={_shown(text)} is negative")
        return "seconds", round(seconds * _NS)
    if stripped.lower().lstrip("+-") in _NOT_FINITE:
        raise TraceError(f"{where}: TIMESTAMP={_shown(text)} is not a finite time")
    match = _DATE.fullmatch(stripped)
    try:
        if match is None:
            raise ValueError
        stamp = dt.datetime.fromisoformat(match["whole"] + (match["zone"] or ""))
    except ValueError:
        raise TraceError(f"{where}: TIMESTAMP={_shown(text)} is not a timestamp") from None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=dt.timezone.utc)
    since = stamp - _EPOCH
    nanoseconds = (since.days * 86400 + since.seconds) * _NS + since.microseconds * 1000
    if match["fraction"]:
        nanoseconds += int(match["fraction"][:9].ljust(9, "0"))
    return "date", nanoseconds


def _parse_count(text: str, column: str, where: str, minimum: int) -> int:
    stripped = text.strip()
    if not _COUNT.fullmatch(stripped):
        raise TraceError(f"{where}: {column}={_shown(text)} is not an integer")
    if stripped.startswith("-") and stripped.strip("-0"):
        raise TraceError(f"{where}: {column}={stripped} is negative")
    if len(stripped) > len(str(MAX_TOKENS)) or int(stripped) > MAX_TOKENS:
        raise TraceError(f"{where}: {column}={_shown(stripped)} is more than {MAX_TOKENS} tokens, no request's")
    value = int(stripped)
    if value < minimum:
        raise TraceError(f"{where}: {column}={value}: must be >= {minimum} (a request has a prompt)")
    return value


def _decoded(path: Path) -> str:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from exc
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise TraceError(f"{path}:1: the file is UTF-16; save the trace as UTF-8")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        start = exc.start
        line_start = raw.rfind(b"\n", 0, start) + 1
        line = raw.count(b"\n", 0, start) + 1
        field = raw.count(b",", line_start, start)
        header = raw.split(b"\n", 1)[0].decode("utf-8-sig", "replace").strip().split(",")
        column = header[field].strip() if line > 1 and field < len(header) else f"field {field + 1}"
        raise TraceError(
            f"{path}:{line}: byte 0x{raw[start]:02x} in column {column} (byte {start - line_start + 1} of the line) "
            "is not UTF-8; save the trace as UTF-8"
        ) from None


def read_trace(path: str | Path, *, limit: int | None = None) -> list[TraceRequest]:
    """The requests of trace ``path`` (at most ``limit``), arrivals relative to the first;
    TraceError naming the file and line for anything that is not a valid trace."""
    path = Path(path)
    reader = csv.reader(io.StringIO(_decoded(path), newline=""), strict=True)
    try:
        return _requests(reader, path, limit)
    except csv.Error as exc:
        raise TraceError(f"{path}:{reader.line_num}: not valid CSV: {exc}") from None


def _requests(reader, path: Path, limit: int | None) -> list[TraceRequest]:
    header = next(reader, None)
    if header is None:
        raise TraceError(f"{path}:1: empty file; expected the header {','.join(REQUIRED_COLUMNS)}")
    names = [name.strip() for name in header]
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        raise TraceError(f"{path}:1: missing column(s) {', '.join(missing)} (need {', '.join(REQUIRED_COLUMNS)})")
    twice = [c for c in REQUIRED_COLUMNS if names.count(c) > 1]
    if twice:
        raise TraceError(f"{path}:1: column(s) {', '.join(twice)} named more than once")
    stamp_at, context_at, generated_at = (names.index(c) for c in REQUIRED_COLUMNS)
    requests: list[TraceRequest] = []
    kind = first = previous = None
    first_line = 0
    for fields in reader:
        where = f"{path}:{reader.line_num}"
        if not fields or (len(fields) == 1 and not fields[0].strip()):
            continue  # a blank line
        if len(fields) != len(names):
            raise TraceError(f"{where}: {len(fields)} field(s), the header has {len(names)} ({','.join(names)})")
        text = fields[stamp_at]
        stamp_kind, stamp = _parse_timestamp(text, where)
        if kind is None:
            kind, first, previous, first_line = stamp_kind, stamp, stamp, reader.line_num
        elif stamp_kind != kind:
            raise TraceError(f"{where}: TIMESTAMP={_shown(text)} is {stamp_kind}, line {first_line}'s {kind}: one format per trace")
        if stamp < previous:
            raise TraceError(f"{where}: TIMESTAMP goes backwards (rows must be sorted by time)")
        if stamp - first > MAX_SPAN_S * _NS:
            raise TraceError(
                f"{where}: TIMESTAMP={_shown(text)} is more than {MAX_SPAN_S:g} s after line {first_line}'s; "
                "a trace may span no more"
            )
        previous = stamp
        requests.append(
            TraceRequest(
                arrival_s=(stamp - first) / _NS,
                context_tokens=_parse_count(fields[context_at], "ContextTokens", where, minimum=1),
                generated_tokens=_parse_count(fields[generated_at], "GeneratedTokens", where, minimum=0),
                line=reader.line_num,
            )
        )
        if limit is not None and len(requests) >= limit:
            break
    if not requests:
        raise TraceError(f"{path}:{reader.line_num}: no request rows after the header")
    return requests
