"""Decode sizing: the KV and slots engines hold and queue, projected over a startup, bounded by throughput."""

from __future__ import annotations

import math
from dataclasses import replace

from .decision import Signals, Sizing
from .demand import decode_demand, decode_load
from .robust import robust_verdict
from .state import PoolState
from .trend import span, trend_fit, trend_slope, within_window
from .verdict import verdict
from .view import PoolView, capacity_unknown, pool_trend


def decode_sizing(view: PoolView, now: float) -> tuple[Sizing, PoolState]:
    pool, cfg = view.pool, view.cfg
    th = cfg.effective_thresholds()
    if (unknown := capacity_unknown(pool, "kv_tokens")) is not None:
        return unknown, view.state
    up, down, target = th.decode_up, th.decode_down, th.decode_target
    loads: list[float] = []
    transfer = waiting = bound = 0
    slot_max = 0.0
    # The pool's demand: what the engines hold, plus their queues counted up to ``decode_queue_weight``
    # times what they hold. A queue behind full slots says the pool is short, not by how much: the
    # backlog stays with its engine (it drains there), so counted in full it sizes the fleet for a moment.
    cap = cfg.decode_queue_weight
    demand = held_total = requests = 0.0
    for e in pool.engines:
        dd = decode_demand(e, cfg.transfer_bound_weight, up)
        load = decode_load(e, dd)
        loads.append(load)
        requests += dd.requests
        transfer += dd.transfer_tokens
        waiting += dd.waiting_tokens
        bound += dd.transfer_bound
        seqs = e.capacity.max_num_seqs
        s = e.record.scheduled_requests
        held = s.sum_decode_kv_tokens / (e.capacity.kv_tokens or 1)
        if seqs:
            slot_max = max(slot_max, dd.requests / seqs)
            held = max(held, s.num_decode_requests / seqs)
        demand += held + min(max(load - held, 0.0), cap * max(held, 1.0))
        held_total += held
    sig = Signals(
        decode_kv_tokens=sum(e.record.scheduled_requests.sum_decode_kv_tokens for e in pool.engines),
        queued_decode_kv_tokens=sum(e.record.queued_requests.sum_decode_kv_tokens for e in pool.engines),
        decode_kv_transfer_tokens=transfer,
        decode_kv_waiting_tokens=waiting,
        transfer_bound_engines=bound,
        slot_load_max=round(slot_max, 4),
    )
    samples = pool_trend(view, demand, now)
    st = replace(view.state, trend=samples)
    slope, r2 = trend_fit(samples)
    growth = slope
    if cfg.decode_trend == "held":
        held_samples = within_window(view.state.held_trend, cfg.trend_window_s, now, held_total)
        st = replace(st, held_trend=held_samples)
        growth = trend_slope(held_samples)
        sig = replace(sig, held_slope=round(growth, 6))
    # A trend is a guess: never project more than ``projection_cap`` times today's demand on top of it.
    projected = demand + min(max(growth, 0.0) * view.lead_s, cfg.projection_cap * max(demand, 1.0))
    # A consistent rise holds a scale-down from 4 samples; it triggers a scale-up ahead of today's demand
    # (the costly direction) from 6, so that one step after three flat samples does not read as a ramp.
    rising = len(samples) >= 4 and slope > 0 and r2 >= cfg.trend_min_r2
    rise, noise = slope * span(samples), _trend_noise(view, samples, demand, requests)
    if noise is not None:
        sig = replace(sig, trend_rise=round(rise, 4), trend_noise=round(noise, 4))
    sustained = rising and len(samples) >= 6 and (noise is None or rise >= noise)
    sig = replace(sig, trend_r2=round(r2, 3))
    throughput, st = _throughput_bound(view, st, now, loads, requests)
    if throughput is not None:
        completed, limit = throughput
        sig = replace(sig, completed_per_s=round(completed, 4), throughput_bound=round(limit, 4))
        projected = min(projected, max(limit, demand))
    if cfg.variance_sizing:
        # The forecast's growth (``robust_verdict`` says when it counts).
        growth = projected - demand if cfg.forecast.enabled else 0.0
        view = replace(view, state=st)
        return robust_verdict(
            view,
            now,
            loads,
            demand,
            up,
            sig,
            target=target,
            growth=growth,
            sustained=sustained,
            rising=rising,
        )
    return verdict(view, loads, demand, projected, slope, up, down, target, sig, sustained, rising=rising), st


def _throughput_bound(
    view: PoolView, st: PoolState, now: float, loads: list[float], requests: float
) -> tuple[tuple[float, float] | None, PoolState]:
    """(requests completed per second, the engines' bound on the projection), or None when it cannot be
    told: a saturated decode pool's throughput says how many engines the arrivals expected one startup
    ahead keep busy, whatever its demand's trend reads.

    While every engine is saturated (load >= 1: slots or KV full, a queue behind them), the pool completes
    what arrives less what it piles up: arrivals - the growth of the requests it holds and queues (their
    slope while saturated, from 3 samples). A queue that keeps growing on a short pool reads as a rising
    trend, and a startup's projection of it asks for replicas a burst's steady load never fills
    (docs/planner-evaluation.md, "Measured in session 19"). The arrivals ahead are today's plus their own
    consistent rise over the startup (a ramp); a resumption from none starts their window afresh, since a
    step from zero is an onset, not a trend. The bound is ``throughput_cap`` times arrivals ahead over
    each engine's completions.
    """
    arrivals, cfg = view.arrivals, view.cfg
    if arrivals is None or cfg.throughput_cap <= 0 or arrivals.requests_per_s <= 0:
        return None, replace(st, arrival_trend=(), saturated_requests=())
    rate = arrivals.requests_per_s
    admitted = within_window(st.arrival_trend, cfg.trend_window_s, now, rate)
    st = replace(st, arrival_trend=admitted)
    if not loads or min(loads) < 1.0:
        return None, replace(st, saturated_requests=())
    held = within_window(st.saturated_requests, cfg.trend_window_s, now, requests)
    st = replace(st, saturated_requests=held)
    completed = rate - trend_slope(held)
    if len(held) < 3 or completed <= 0:
        return None, st
    ahead = rate
    slope, r2 = trend_fit(admitted)
    if len(admitted) >= 4 and slope > 0 and r2 >= cfg.trend_min_r2:
        ahead += slope * view.lead_s
    return (completed, cfg.throughput_cap * ahead * len(loads) / completed), st


def _trend_noise(
    view: PoolView, samples: tuple[tuple[float, float], ...], demand: float, requests: float
) -> float | None:
    """How far the demand may rise over the trend's window by chance: ``trend_noise_z`` standard
    deviations of the requests' wander, in engines; None when it cannot be told (no arrivals) or is off.

    At a steady rate the count of R requests in flight is Poisson and changes over a span t by a
    standard deviation of sqrt(2 R min(t / life, 1)) requests (a request's life = R / arrival rate):
    a 40 s window over requests that live 30 s can rise consistently by chance alone. Demand is about
    proportional to the count.
    """
    arrivals, z = view.arrivals, view.cfg.trend_noise_z
    if z <= 0 or arrivals is None or arrivals.requests_per_s <= 0 or requests < 1 or len(samples) < 2:
        return None
    life = requests / arrivals.requests_per_s
    return z * demand * math.sqrt(2.0 * min(span(samples) / life, 1.0) / requests)
