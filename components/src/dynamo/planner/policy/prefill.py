"""Prefill sizing: the frontend's arrivals (or a queue's change) in engines, a backlog's drain, held KV."""

from __future__ import annotations

from dataclasses import replace

from .decision import Signals, Sizing
from .robust import robust_verdict
from .state import PoolState
from .trend import trend_slope
from .view import PoolView, capacity_unknown


def arrival_engines(view: PoolView, rate: float | None) -> float | None:
    """Engines' worth of prefill work the frontend's arrivals bring, or None when it cannot be told.

    A pass of n prompt tokens takes ``a + b n`` seconds (the pool's pass-time fit, from every warm
    engine's passes, saturated or not); in a full pass of ``max_num_batched_tokens`` (B) the fixed part
    is shared, so a token costs ``b + a / B`` seconds, once ``b`` is known (``LinearFit.slope_known``:
    passes of one size do not tell it). Without such a fit, a token costs one over the rate measured on
    saturated engines. No source, no fit and no rate: None.
    """
    arrivals = view.arrivals
    if arrivals is None or not view.pool.engines:
        return None
    tokens_s = arrivals.prompt_tokens_per_s
    fit = view.pool.latency
    if (
        fit is not None
        and fit.samples >= view.cfg.sla.min_samples
        and len(fit.coef) == 2
        and fit.slope_known()
    ):
        a, b = fit.coef
        batch = view.pool.engines[0].capacity.max_num_batched_tokens or max(arrivals.mean_isl, 1.0)
        return tokens_s * (b + max(a, 0.0) / batch)
    if rate is not None and rate > 0:
        return tokens_s / rate
    return None


def prefill_sizing(view: PoolView, now: float) -> tuple[Sizing, PoolState]:
    """Prefill demand: the work the arrivals bring, in engines at full load.

    With an arrival source, the frontend's prompt tokens per second at the pool's measured cost per token
    (``arrival_engines``); without one, the engines saturated plus the queue's growth in engines (a saturated
    engine processes ``engine_rate`` tokens/s, measured from its passes); before any rate is measured, the
    queue over ``context_length`` (upstream's load). A backlog, sized to drain within ``demand_window_s``,
    is wanted on top, outside the samples (it ends); so is KV held for peers that have not read it
    (``EngineObs.held_kv_tokens``), until its lease ends.
    """
    pool, cfg = view.pool, view.cfg
    th = cfg.effective_thresholds()
    if (unknown := capacity_unknown(pool, "context_length")) is not None:
        return unknown, view.state
    up, target = th.prefill_up, th.prefill_target
    queued = [float(e.record.queued_requests.sum_prefill_tokens) for e in pool.engines]
    # ``capacity_unknown`` held every engine without a context length above: ``or 1`` only narrows the type.
    loads = [q / (e.capacity.context_length or 1) for q, e in zip(queued, pool.engines, strict=True)]
    rate = view.state.engine_rate
    for e, q in zip(pool.engines, queued, strict=True):
        s = e.record.scheduled_requests
        if q > 0 and s.sum_prefill_tokens > 0 and e.record.wall_time > 0:
            r = s.sum_prefill_tokens / e.record.wall_time
            rate = r if rate is None else 0.8 * rate + 0.2 * r
    backlog = sum(queued)
    # The queue's growth since the previous decision: it integrates arrivals, so two samples are enough.
    slope = trend_slope((*view.state.trend[-1:], (now, backlog)))
    st = replace(view.state, trend=((now, backlog),), engine_rate=rate)
    sig = Signals(
        queued_prefill_tokens=int(backlog),
        engine_rate_tok_s=None if rate is None else round(rate, 1),
        slope=round(slope, 3),
    )
    busy = arrival_engines(view, rate)
    saturated = sum(1 for ld in loads if ld >= up)
    if busy is not None:
        sig = replace(sig, arrival_engines=round(busy, 3))
        demand = busy
    elif rate is not None and rate > 0:
        demand = float(saturated) + max(slope, 0.0) / rate
    else:
        demand = sum(loads)
    drain = 0.0
    late = False
    if rate is not None and rate > 0 and backlog > 0:
        drain = backlog / (rate * cfg.demand_window_s)
        half_ttft_s = 0.5 * cfg.sla.ttft_ms / 1000.0
        waits_s = [q / rate for q in queued]  # each engine's queue, in seconds of its passes
        sig = replace(
            sig,
            queue_wait_s=round(max(waits_s), 3),
            late_engines=sum(1 for w in waits_s if w > half_ttft_s),
            drain_engines=round(drain, 3),
        )
        # Late: the backlog spread over the pool still waits over half the TTFT target. One engine's queue
        # behind a long prompt, with the others idle, stays on that engine: a replica more does not help it.
        pooled_wait_s = backlog / (rate * len(pool.engines))
        late = pooled_wait_s > half_ttft_s and slope >= 0 and view.starting == 0
    # KV the engines hold for peers that have not read it (a dead or slow decode worker) is capacity no new
    # prompt can use until the lease ends: the engines' worth of it is wanted on top while it lasts.
    held = sum(e.held_kv_tokens / e.capacity.kv_tokens for e in pool.engines if e.capacity.kv_tokens)
    extra, why = drain, "to drain the queue"
    if held > 0:
        sig = replace(sig, held_kv_engines=round(held, 3))
        extra, why = drain + held, ("to drain the queue and " if drain > 0 else "") + "for KV held for peers"
    view = replace(view, state=st)
    return robust_verdict(view, now, loads, demand, up, sig, extra, why, late, target)
