"""Static-fleet baselines: the cheapest N+N, or P+D, fleet that reaches a goodput target on a trace.

A static fleet's workers are ready from the start, so its outcome does not depend on the cold start.
Goodput grows with N (more engines never slow a request here), so a doubling search then a bisection
finds the smallest N in about 2 log2(N) runs. Starting the doubling from a fleet known to be near the
answer (a scenario's starting fleet) skips the small fleets, which are the slowest runs: an overloaded
fleet's simulator holds every queued request (the fleet scale's 1+1 runs 125 s, its 64+64 44 s).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .harness import SimSpec, simulate


def static_summary(spec: SimSpec, n: int) -> dict[str, Any]:
    return simulate(replace(spec, static=(n, n)), None)["summary"]


def static_fleet_summary(spec: SimSpec, fleet: tuple[int, int]) -> dict[str, Any]:
    return simulate(replace(spec, static=fleet), None)["summary"]


def cheapest_static_pools(
    spec: SimSpec,
    target_pct: float = 95.0,
    max_n: int = 128,
    run: Callable[[SimSpec, tuple[int, int]], dict[str, Any]] = static_fleet_summary,
    start: int = 1,
) -> tuple[tuple[int, int], dict[str, Any]] | None:
    """((P, D), summary) of the cheapest static P+D fleet with goodput >= ``target_pct``, each pool searched
    on its own; None if ``max_n``+``max_n`` is not enough.

    The cheapest N+N fleet bounds both pools; with prefill at that N the smallest passing D is searched,
    then with that D the smallest passing P. A pool's need barely depends on the other pool's size once
    both serve, but not exactly: the pair found is run and, if it misses the target, the pool whose one more
    engine gains the most goodput grows until it passes.
    """
    tried: dict[tuple[int, int], dict[str, Any]] = {}

    def goodput(fleet: tuple[int, int]) -> float:
        if fleet not in tried:
            tried[fleet] = run(spec, fleet)
        return float(tried[fleet]["goodput_pct"])

    n = smallest_passing(lambda k: goodput((k, k)) >= target_pct, max_n, start)
    if n is None:
        return None
    d = smallest_passing(lambda k: goodput((n, k)) >= target_pct, n, max(spec.initial[1], 1)) or n
    p = smallest_passing(lambda k: goodput((k, d)) >= target_pct, n, max(spec.initial[0], 1)) or n
    while goodput((p, d)) < target_pct:
        p, d = max([(p + 1, d), (p, d + 1)], key=goodput)
    return (p, d), tried[(p, d)]


def cheapest_static(
    spec: SimSpec,
    target_pct: float = 95.0,
    max_n: int = 128,
    run: Callable[[SimSpec, int], dict[str, Any]] = static_summary,
    start: int = 1,
) -> tuple[int, dict[str, Any]] | None:
    """(N, summary) of the smallest N+N fleet with goodput >= ``target_pct``; None if ``max_n`` is not
    enough. ``start``: where the search begins (the same answer, in fewer runs when it is close)."""
    tried: dict[int, dict[str, Any]] = {}

    def ok(n: int) -> bool:
        if n not in tried:
            tried[n] = run(spec, n)
        return float(tried[n]["goodput_pct"]) >= target_pct

    n = smallest_passing(ok, max_n, start)
    return None if n is None else (n, tried[n])


def smallest_passing(ok: Callable[[int], bool], max_n: int, start: int = 1) -> int | None:
    """Smallest n in [1, max_n] with ``ok(n)``, for a monotone ``ok``: doubling up (or halving down)
    from ``start`` until the answer is bracketed (one call per factor of 2 between them), then bisection
    of that bracket (log2 of its width); None if not even ``max_n`` passes."""
    if max_n < 1:
        raise ValueError(f"max_n must be >= 1, got {max_n}")
    hi = min(max(start, 1), max_n)
    if ok(hi):
        lo = hi // 2  # halve down until a fleet fails (or 0: n = 1 passes)
        while lo >= 1 and ok(lo):
            hi, lo = lo, lo // 2
    else:
        while True:
            if hi >= max_n:
                return None
            lo, hi = hi, min(hi * 2, max_n)
            if ok(hi):
                break
    # ok(hi) holds and ok(lo) fails (lo = 0 stands for "nothing smaller").
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi
