"""Static-fleet baselines: the cheapest N+N fleet that reaches a goodput target on a trace.

A static fleet's workers are ready from the start, so its outcome does not depend on the cold start.
Goodput grows with N (more engines never slow a request here), so a doubling search then a bisection
finds the smallest N in about 2 log2(N) runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .harness import SimSpec, simulate


def static_summary(spec: SimSpec, n: int) -> dict[str, Any]:
    return simulate(replace(spec, static=(n, n)), None)["summary"]


def cheapest_static(
    spec: SimSpec,
    target_pct: float = 95.0,
    max_n: int = 128,
    run: Callable[[SimSpec, int], dict[str, Any]] = static_summary,
) -> tuple[int, dict[str, Any]] | None:
    """(N, summary) of the smallest N+N fleet with goodput >= ``target_pct``; None if ``max_n`` is not
    enough."""
    tried: dict[int, dict[str, Any]] = {}

    def ok(n: int) -> bool:
        if n not in tried:
            tried[n] = run(spec, n)
        return float(tried[n]["goodput_pct"]) >= target_pct

    n = smallest_passing(ok, max_n)
    return None if n is None else (n, tried[n])


def smallest_passing(ok: Callable[[int], bool], max_n: int) -> int | None:
    """Smallest n in [1, max_n] with ``ok(n)``, for a monotone ``ok``: doubling, then bisection (about
    2 log2(n) calls); None if not even ``max_n`` passes."""
    hi = 1
    while not ok(hi):
        if hi >= max_n:
            return None
        hi = min(hi * 2, max_n)
    lo = hi // 2  # known to fail (or 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi
