"""Small pure statistics of a simulated run: percentiles and direction changes of scaling actions."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method) of a non-empty sequence."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of no values")
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def direction_flips(changes: Sequence[tuple[int, int]]) -> int:
    """How often consecutive (from, to) replica changes of one pool reverse direction (up then down = 1)."""
    flips = 0
    last = 0
    for before, after in changes:
        step = (after > before) - (after < before)
        if step == 0:
            continue
        if last and step != last:
            flips += 1
        last = step
    return flips
