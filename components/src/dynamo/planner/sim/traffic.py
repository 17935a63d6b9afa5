"""The simulator's frontend view of each interval as the planner's arrival source.

Each snapshot's ``traffic`` holds what its frontend saw since the previous tick: the requests that
arrived (``num_req``) and their mean prompt length (``avg_isl``) over ``duration_s``, which is what a
live frontend's request and prompt-token counters give over the same interval (``arrivals.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..observations import Arrivals


def arrivals_from(traffic: Mapping[str, Any] | None) -> Arrivals | None:
    """One interval's ``traffic`` -> arrivals; None for a missing or empty interval (no duration)."""
    if not traffic:
        return None
    window = float(traffic.get("duration_s") or 0.0)
    if window <= 0:
        return None
    count = float(traffic.get("num_req") or 0.0)
    isl = float(traffic.get("avg_isl") or 0.0) if count else 0.0
    return Arrivals(count / window, isl, window)


class SimArrivals:
    """Hands the planner the latest snapshot's arrivals (set by the harness before each tick)."""

    def __init__(self) -> None:
        self.latest: Arrivals | None = None

    async def read(self, now: float) -> Arrivals | None:
        return self.latest
