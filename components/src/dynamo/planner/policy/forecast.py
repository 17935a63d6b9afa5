"""The forecast: growth of a decode pool's demand over one startup, from its trend (``forecast.enabled``).

Sizing for today's demand and its spread (``robust``) answers a rise one startup late. The forecast fits a
line to the pool's demand over ``forecast.window_s`` and, when the rise is consistent (r squared at least
``forecast.min_r2``) and larger than the requests' own wander (``forecast.noise_z``), offers its slope
times the startup as growth to size for (``robust.robust_verdict`` says when it counts). Three bounds keep
a guess from becoming a fleet: the growth is at most ``forecast.projection_cap`` times today's demand, and
while every engine is saturated at most ``forecast.throughput_cap`` times the engines the arrivals expected
one startup ahead keep busy at the pool's measured completions. Everything the forecast reads and keeps is
here, so that switching it off leaves the sizing untouched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .decision import Signals
from .state import PoolState
from .trend import span, trend_fit, trend_slope, within_window
from .view import PoolView, per_worker

# The forecast counts only a load that is already a real share of the pool (a quarter of what its replicas
# carry at the target): a warm-up's few requests rise "consistently" too.
MIN_SHARE = 0.25


@dataclass(frozen=True, slots=True)
class Forecast:
    """Engines' worth of growth over a startup, and how far the trend behind it may be trusted."""

    growth: float = 0.0
    rising: bool = False  # a consistent rise (r squared >= ``min_r2``, 4 samples or more)
    sustained: bool = False  # rising over 6 samples or more, and out of the requests' wander


NONE = Forecast()


def decode_forecast(
    view: PoolView,
    now: float,
    demand: float,
    loads: list[float],
    requests: float,
    target: float,
    sig: Signals,
) -> tuple[Forecast, PoolState, Signals]:
    """The decode pool's growth over a startup from its demand's trend, bounded; with the state and signals.

    A consistent rise counts from 4 samples while the pool is short already; it sizes a scale-up ahead of
    today's demand (the costly direction) from 6, so that one step after three flat samples does not read as
    a ramp; a load under ``MIN_SHARE`` of the pool is not forecast.
    """
    fc = view.cfg.forecast
    samples = within_window(view.state.trend, fc.window_s, now, demand)
    st = replace(view.state, trend=samples)
    slope, r2 = trend_fit(samples)
    projected = demand + min(max(slope, 0.0) * view.lead_s, fc.projection_cap * max(demand, 1.0))
    rising = len(samples) >= 4 and slope > 0 and r2 >= fc.min_r2
    rise, noise = slope * span(samples), _trend_noise(view, samples, demand, requests)
    sig = replace(sig, slope=round(slope, 6), trend_r2=round(r2, 3))
    if noise is not None:
        sig = replace(sig, trend_rise=round(rise, 4), trend_noise=round(noise, 4))
    sustained = rising and len(samples) >= 6 and (noise is None or rise >= noise)
    throughput, st = _throughput_bound(replace(view, state=st), now, loads, requests)
    if throughput is not None:
        completed, limit = throughput
        sig = replace(sig, completed_per_s=round(completed, 4), throughput_bound=round(limit, 4))
        projected = min(projected, max(limit, demand))
    if demand < MIN_SHARE * target * view.replicas * per_worker(view.pool):
        return NONE, st, sig
    return Forecast(max(projected - demand, 0.0), rising, sustained), st, sig


def _throughput_bound(
    view: PoolView, now: float, loads: list[float], requests: float
) -> tuple[tuple[float, float] | None, PoolState]:
    """(requests completed per second, the engines' bound on the projection), or None when it cannot be
    told: a saturated decode pool's throughput says how many engines the arrivals expected one startup
    ahead keep busy, whatever its demand's trend reads.

    While every engine is saturated (load >= 1: slots or KV full, a queue behind them), the pool completes
    what arrives less what it piles up: arrivals - the growth of the requests it holds and queues (their
    slope while saturated, from 3 samples). A queue that keeps growing on a short pool reads as a rising
    trend, and a startup's projection of it asks for replicas a burst's steady load never fills. The
    arrivals ahead are today's plus their own consistent rise over the startup (a ramp). The bound is
    ``throughput_cap`` times arrivals ahead over each engine's completions.
    """
    arrivals, fc, st = view.arrivals, view.cfg.forecast, view.state
    if arrivals is None or fc.throughput_cap <= 0 or arrivals.requests_per_s <= 0:
        return None, replace(st, arrival_trend=(), saturated_requests=())
    rate = arrivals.requests_per_s
    admitted = within_window(st.arrival_trend, fc.window_s, now, rate)
    st = replace(st, arrival_trend=admitted)
    if not loads or min(loads) < 1.0:
        return None, replace(st, saturated_requests=())
    held = within_window(st.saturated_requests, fc.window_s, now, requests)
    st = replace(st, saturated_requests=held)
    completed = rate - trend_slope(held)
    if len(held) < 3 or completed <= 0:
        return None, st
    ahead = rate
    slope, r2 = trend_fit(admitted)
    if len(admitted) >= 4 and slope > 0 and r2 >= fc.min_r2:
        ahead += slope * view.lead_s
    return (completed, fc.throughput_cap * ahead * len(loads) / completed), st


def _trend_noise(
    view: PoolView, samples: tuple[tuple[float, float], ...], demand: float, requests: float
) -> float | None:
    """How far the demand may rise over the trend's window by chance: ``noise_z`` standard deviations of
    the requests' wander, in engines; None when it cannot be told (no arrivals) or is off.

    At a steady rate the count of R requests in flight is Poisson and changes over a span t by a
    standard deviation of sqrt(2 R min(t / life, 1)) requests (a request's life = R / arrival rate):
    a 40 s window over requests that live 30 s can rise consistently by chance alone. Demand is about
    proportional to the count.
    """
    arrivals, z = view.arrivals, view.cfg.forecast.noise_z
    if z <= 0 or arrivals is None or arrivals.requests_per_s <= 0 or requests < 1 or len(samples) < 2:
        return None
    life = requests / arrivals.requests_per_s
    return z * demand * math.sqrt(2.0 * min(span(samples) / life, 1.0) / requests)
