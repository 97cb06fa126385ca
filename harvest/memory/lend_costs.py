"""What lending and reclaiming one KV chunk costs, and where the figure comes from.

The server's auto reserve and the replay's memory model charge each reclaimed chunk
``reclaim_ms_per_chunk`` (the replay each lent one ``lend_ms_per_chunk`` too). One
resolution for both, first found wins: (1) an explicit figure (harvest.yaml's
``memory.reclaim_ms_per_chunk``; the replay's ``--memory``), per chunk of the pool, as
given; (2) the profile's measured ``memory`` section (``harvest profile``,
:mod:`harvest.memory.lend_timing`), scaled by the pool's chunk bytes over the measured
chunk's (the driver's work is per page); (3) the stated default, 7 ms, with a warning
naming it. Every figure must be finite and >= 0: anything else is refused naming it.
Pure arithmetic: no torch. Rules: docs/design.md §1, 'What a lend and a reclaim cost'.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

MIB = 2**20
# The H100 measured 5-7 ms per 128 MiB chunk, lend and reclaim alike (gpu-validation.md),
# when a reclaim made 132 driver calls; it makes 3 now, so this errs long (a larger
# reserve), never short, until a GPU measures the figure again.
DEFAULT_MS_PER_CHUNK = 7.0
DEFAULT_FIGURE_CHUNK_BYTES = 128 * MIB  # the chunk that figure is for (Llama-3-8B: 64 pages of 2 MiB)
CONFIGURED, MEASURED, DEFAULT = "configured", "profile", "default"
FIELD_PREFIX = "profile.memory."  # how the profile's fields are named in messages


@dataclasses.dataclass(frozen=True)
class LendCosts:
    """Per chunk of the pool. ``source``: CONFIGURED, MEASURED or DEFAULT; ``label``: the
    reclaim figure's origin in a few words (the auto reserve's reasons); ``detail``: both
    figures' origin in words, for logs and reports; ``warning``: set when the default
    stands in for a figure nobody gave (say it once)."""

    lend_ms_per_chunk: float
    reclaim_ms_per_chunk: float
    source: str
    label: str
    detail: str
    warning: str | None = None

    def __post_init__(self) -> None:
        check_ms("lend_ms_per_chunk", self.lend_ms_per_chunk)
        check_ms("reclaim_ms_per_chunk", self.reclaim_ms_per_chunk)


def check_ms(field: str, value: Any) -> float:
    """``value`` as a float when it is a finite number of ms >= 0, else ValueError naming ``field``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{field}={value!r}: must be a finite number of ms >= 0")
    return float(value)


def resolve(
    chunk_bytes: int,
    *,
    measured: Any = None,
    measured_where: str | None = "the profile",
    configured_reclaim_ms: float | None = None,
    configured_where: str = "memory.reclaim_ms_per_chunk",
    default_chunk_bytes: int | None = None,
) -> LendCosts:
    """The costs of one chunk of ``chunk_bytes`` (module doc).

    ``measured``: the profile's ``memory`` section (``chunk_bytes``,
    ``lend_ms_per_chunk``, ``reclaim_ms_per_chunk``) or None; ``measured_where`` names the
    profile in messages (None: there is no profile). ``configured_reclaim_ms``: an
    explicit reclaim figure (None: not given); it replaces the reclaim cost only, the lend
    cost still comes from the profile or the default. ``default_chunk_bytes``: None: the
    default is 7 ms per chunk whatever its size (the server: harvest.yaml's stated
    default); a size: 7 ms per chunk of that size, scaled (the replay, whose chunk is a
    modelling choice)."""
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"chunk_bytes={chunk_bytes!r}: must be an integer >= 1")
    profile = measured_where or "the profile"
    warning = None
    if measured is not None:
        if isinstance(measured.chunk_bytes, bool) or not isinstance(measured.chunk_bytes, int) or measured.chunk_bytes < 1:
            raise ValueError(f"{profile}: {FIELD_PREFIX}chunk_bytes={measured.chunk_bytes!r}: must be an integer >= 1")
        scale = chunk_bytes / measured.chunk_bytes
        lend = check_ms(f"{profile}: {FIELD_PREFIX}lend_ms_per_chunk", measured.lend_ms_per_chunk) * scale
        reclaim = check_ms(f"{profile}: {FIELD_PREFIX}reclaim_ms_per_chunk", measured.reclaim_ms_per_chunk) * scale
        source, label = MEASURED, "measured by `harvest profile`"
        detail = f"{profile}'s memory section, measured for a {_mib(measured.chunk_bytes)} chunk"
        if measured.chunk_bytes != chunk_bytes:
            detail += f", scaled to {_mib(chunk_bytes)}"
    else:
        scale = 1.0 if default_chunk_bytes is None else chunk_bytes / default_chunk_bytes
        lend = reclaim = DEFAULT_MS_PER_CHUNK * scale
        source, label = DEFAULT, "the default"
        per = "chunk" if default_chunk_bytes is None else f"{_mib(default_chunk_bytes)} chunk"
        detail = f"the default, {DEFAULT_MS_PER_CHUNK:g} ms per {per}"
        if default_chunk_bytes is not None and default_chunk_bytes != chunk_bytes:
            detail += f", scaled to {_mib(chunk_bytes)}"
        if configured_reclaim_ms is None:
            missing = (f"{measured_where} has no lend/reclaim figures ({FIELD_PREFIX}reclaim_ms_per_chunk and "
                       "lend_ms_per_chunk absent)" if measured_where else "no profile, so no measured lend/reclaim figures")
            here = "" if default_chunk_bytes in (None, chunk_bytes) else f" ({reclaim:.3g} ms per {_mib(chunk_bytes)} chunk here)"
            warning = (f"{missing}: a reclaim and a lend cost the default {DEFAULT_MS_PER_CHUNK:g} ms per {per}{here}; "
                       f"measure them with `harvest profile` (its memory section), or set {configured_where}")
    if configured_reclaim_ms is not None:
        reclaim = check_ms(configured_where, configured_reclaim_ms)
        source, label = CONFIGURED, configured_where
        detail = f"reclaim: {configured_where}; lend: {detail}"
    return LendCosts(lend, reclaim, source, label, detail, warning)


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / MIB:.4g} MiB"
