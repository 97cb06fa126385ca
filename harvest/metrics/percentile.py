"""The nearest-rank percentile the demo and the benchmarks report step times with."""

from __future__ import annotations

import math
from typing import Iterable


def nearest_rank(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` as one of them: the element at rank
    ``round(q * (n - 1))`` in sorted order, no interpolation; NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]
