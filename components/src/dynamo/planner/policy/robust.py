"""Variance-aware sizing: a pool is sized for the mean of its recent demand plus a multiple of its spread.

Per-tick demand is noisy on real traffic: with heavy-tailed prompts one request can hold a large share of an
engine's KV, and prompt bursts arrive in clumps. Reading one tick's demand as the pool's need shrinks the
pool into the next spike (and grows it for a spike that is gone when the replica lands). Here every tick's
demand (engines' worth of work at full load) joins a window of ``demand_window_s``; the pool is sized to carry
``mean + headroom_sigmas x standard deviation`` of it at the engines' ``up`` load, so the headroom follows the
traffic's own variability (little on smooth traffic, more on bursty). Around the replicas' capacity lies a
band of ``TOLERANCE`` either side: once the level is beyond capacity by the tolerance (the HPA's), the pool
grows to carry all of it, and it shrinks only to replicas that carry the level with that margin to spare.
A decode engine's demand reads higher on fewer engines (bigger batches step slower, so each request stays
longer): measured on the Azure conversation trace at x2, 0.50 engines on one decode engine against 0.31 on
two; a shrink sized without the margin lands within a spike of growing back. Every tick's recommendation is
recorded, and a scale-down goes no lower than the highest recommendation within
``scale_down_stabilization_s`` (the Kubernetes HPA's scale-down stabilization), which ``rules.rule_load``
applies. A pool with no work at all for a whole demand window needs no replica: the stabilization then steps
it down to its ``min_replicas``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace

from .decision import Signals, Sizing, summarise
from .demand import engine_idle
from .forecast import NONE, Forecast
from .state import PoolState, Want
from .trend import within_window
from .view import PoolView, consolidated_load, needed_replicas, per_worker

# The band around the replicas' capacity (the Kubernetes HPA's default tolerance): a level or today's demand
# over capacity by more than this share grows the pool; a shrink leaves the replicas this share to spare.
TOLERANCE = 0.1


def mean_and_spread(values: Iterable[float]) -> tuple[float, float]:
    """(mean, population standard deviation) of the values; (0, 0) for none."""
    xs = list(values)
    if not xs:
        return 0.0, 0.0
    mean = sum(xs) / len(xs)
    var = sum((x - mean) ** 2 for x in xs) / len(xs)
    return mean, math.sqrt(var)


def robust_level(samples: Iterable[tuple[float, float]], sigmas: float) -> tuple[float, float, float]:
    """(mean, spread, level) of the demand samples' values: the level is mean + ``sigmas`` x spread, never
    above the highest sample (a fall in demand widens the spread: it must not read as more demand)."""
    values = [v for _, v in samples]
    mean, spread = mean_and_spread(values)
    return mean, spread, min(mean + sigmas * spread, max(values, default=0.0))


def robust_verdict(
    view: PoolView,
    now: float,
    loads: list[float],
    demand: float,
    up: float,
    sig: Signals,
    extra: float = 0.0,
    extra_why: str = "",
    late: bool = False,
    target: float | None = None,
    forecast: Forecast = NONE,
) -> tuple[Sizing, PoolState]:
    """Up / down / steady from the window's robust level of demand (engines at full load).

    The replicas needed carry the mean at ``target`` (the utilisation an engine is sized for on average), a
    demand that has held for two samples at ``up``, today's demand at ``up`` plus ``TOLERANCE`` (a step is
    answered at once; a one-tick excess within the tolerance is not), and the level (mean +
    ``headroom_sigmas`` x spread) within the band: it grows the pool beyond ``up`` plus the tolerance, and
    a shrink keeps it under ``up`` less the tolerance.
    ``extra``: engines wanted on top for a while (a backlog's drain), outside the samples so that a
    transient does not inflate the spread. ``forecast``: its growth over a startup; today's demand plus it
    is sized at ``target`` when the trend is sustained (out of the noise) or rising (consistent) while the
    pool is short already. ``late``: a queue already waits too long, so at least one replica more than
    counted. A pool idle (no work scheduled or queued on any engine) for ``demand_window_s`` needs none.
    """
    pool, cfg = view.pool, view.cfg
    cons, silent, _ = consolidated_load(loads, pool, up)
    silent_busy = max(silent - view.starting * per_worker(pool), 0.0)
    today = demand + silent_busy * up  # replicas that should publish and do not count as loaded
    samples = within_window(view.state.demand_window, cfg.demand_window_s, now, today)
    idle = extra <= 0 and today <= 0 and all(engine_idle(e) for e in pool.engines)
    idle_since = (view.state.idle_since if view.state.idle_since is not None else now) if idle else None
    st = replace(view.state, demand_window=samples, idle_since=idle_since)
    mean, spread, level = robust_level(samples, cfg.headroom_sigmas)
    held = min(v for _, v in samples[-2:])  # what the last two samples both show
    floor = max(held / up, today / (up * (1 + TOLERANCE)), mean / target if target else 0.0)
    more = max(extra, 0.0) / up
    # A band around capacity, the HPA's tolerance either side: once the level is beyond the replicas'
    # capacity by the tolerance, the pool grows to carry all of it (as the HPA sizes a ratio outside its
    # tolerance in full); it shrinks only to replicas that carry the level with the tolerance to spare.
    beyond = needed_replicas(max(level / (up * (1 + TOLERANCE)), floor) + more, pool) > view.replicas
    shrunk = needed_replicas(max(level * (1 + TOLERANCE) / up, floor) + more, pool)
    if beyond:
        need = needed_replicas(max(level / up, floor) + more, pool)
    else:
        need = shrunk if shrunk < view.replicas else view.replicas
    idle_for = now - idle_since if idle_since is not None else 0.0
    if idle_since is not None and idle_for >= cfg.demand_window_s:
        need = 0
    growth = forecast.growth
    if growth > 0 and (forecast.sustained or (forecast.rising and need > view.replicas)):
        # The forecast sizes today's demand and its growth over a startup at the target, as a projection.
        need = max(need, needed_replicas((today + growth) / (target or up) + max(extra, 0.0) / up, pool))
        extra, extra_why = extra + growth, (extra_why + " and " if extra > 0 else "") + "forecast growth"
    if late:
        need = max(need, view.replicas + 1)
    sig = replace(
        sig,
        loads=summarise(loads),
        up=up,
        target=target,
        needed=need,
        demand_mean=round(mean, 4),
        demand_spread=round(spread, 4),
        consolidated=round(cons, 4) if math.isfinite(cons) else None,
    )
    name = pool.name
    why = (
        f"{name} demand {today:.2f} engines, mean {mean:.2f} + {cfg.headroom_sigmas:g} x spread {spread:.2f} "
        f"over {len(samples)} samples"
    )
    if extra > 0:
        why += f" + {extra:.2f} {extra_why}"
    why += f" -> {need} replicas at {up:g}"
    if late:
        why += "; a queue waits over half the TTFT target"
    if need == 0:
        why += f"; no work for {idle_for:.0f}s"
    if silent_busy:
        why += f" ({silent_busy:g} silent engines counted at {up:g})"
    want: Want = "up" if need > view.replicas else "down" if need < view.replicas else "steady"
    sizing = Sizing(
        want,
        why,
        load_max=max(loads),
        demand=round(today, 4),
        projected=round(level + max(extra, 0.0), 4),
        needed=need,
        consolidated=cons if math.isfinite(cons) else None,
        signals=sig,
    )
    return sizing, st
