"""Prefill sizing: the arrivals a queue's change shows, a backlog's drain, the frontend's arrivals."""

from __future__ import annotations

from dataclasses import replace

from .decision import Signals, Sizing
from .robust import robust_verdict
from .state import PoolState
from .trend import trend_slope
from .verdict import verdict
from .view import PoolView, capacity_unknown, needed_replicas, pool_trend


def arrival_engines(view: PoolView, rate: float | None) -> float | None:
    """Engines' worth of prefill work the frontend's arrivals bring, or None when it cannot be told.

    A pass of n prompt tokens takes ``a + b n`` seconds (the pool's pass-time fit, from every warm
    engine's passes, saturated or not); in a full pass of ``max_num_batched_tokens`` (B) the fixed part
    is shared, so a token costs ``b + a / B`` seconds. Without a fit, a token costs one over the rate
    measured on saturated engines. No source, no fit and no rate: None.
    """
    arrivals = view.arrivals
    if arrivals is None or not view.pool.engines:
        return None
    tokens_s = arrivals.prompt_tokens_per_s
    fit = view.pool.latency
    if fit is not None and fit.samples >= view.cfg.sla.min_samples and len(fit.coef) == 2 and fit.coef[1] > 0:
        a, b = fit.coef
        batch = view.pool.engines[0].capacity.max_num_batched_tokens or max(arrivals.mean_isl, 1.0)
        return tokens_s * (b + max(a, 0.0) / batch)
    if rate is not None and rate > 0:
        return tokens_s / rate
    return None


def prefill_sizing(view: PoolView, now: float) -> tuple[Sizing, PoolState]:
    """Prefill demand from the queue: the arrivals its latest change shows, in engines.

    A saturated engine (a queue behind its pass) processes ``engine_rate`` tokens/s, measured from its
    passes. The queue changes at (arrivals - what the saturated engines process): with the fleet that
    change was made on, that gives the arrivals (``_prefill_arrivals``); the backlog expected when new
    replicas are ready, drained in ``prefill_drain_s``, asks for more. Until a rate is measured, the
    queue over ``context_length`` is the load, as upstream's.
    """
    pool, cfg = view.pool, view.cfg
    th = cfg.effective_thresholds()
    if (unknown := capacity_unknown(pool, "context_length")) is not None:
        return unknown, view.state
    up, down, target = th.prefill_up, th.prefill_down, th.prefill_target
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
    samples = pool_trend(view, backlog, now)
    # The queue's growth over the last interval, not over the whole trend window: a burst's first
    # seconds must not be averaged with the quiet minute before it (the queue integrates arrivals,
    # so two samples are enough).
    recent = samples[-2:]
    slope = trend_slope(recent)
    st = replace(view.state, trend=samples, engine_rate=rate)
    sig = Signals(
        queued_prefill_tokens=int(backlog),
        engine_rate_tok_s=None if rate is None else round(rate, 1),
    )
    saturated = sum(1 for ld in loads if ld >= up)
    engines_then, saturated_then = view.state.prefill_engines or (len(loads), saturated)
    st = replace(st, prefill_engines=(len(loads), saturated))
    busy = arrival_engines(view, rate)
    if busy is not None:
        sig = replace(sig, arrival_engines=round(busy, 3))
    if cfg.variance_sizing:
        return _robust_prefill(view, st, now, loads, queued, rate, slope, busy, up, target, sig)
    if rate is None or rate <= 0 or saturated == 0:
        return verdict(view, loads, None, None, slope, up, down, target, sig, busy=busy), st
    deficit = max(slope, 0.0) / rate
    # Until the replicas already asked for serve, the queue keeps growing at this rate.
    probe = view.state.startup_probe
    lead = view.lead_s if probe is None else max(view.lead_s - (now - probe[0]), 0.0)
    growth = min(max(slope, 0.0) * lead, cfg.projection_cap * max(backlog, 1.0) * 10)
    # A queue that would wait longer than half the TTFT target needs more engines now, growing or not.
    wait_s = max(queued) / rate
    sig = replace(sig, queue_wait_s=round(wait_s, 3))
    # Only while the queue is not shrinking and nothing is on its way: under round-robin routing a
    # backlog stays on its engine, and the replicas asked for take new arrivals, not that backlog.
    late = wait_s > 0.5 * cfg.sla.ttft_ms / 1000.0 and slope >= 0 and view.starting == 0
    demand = _prefill_arrivals(engines_then, saturated_then, saturated, slope / rate)
    # Draining a backlog may at most double the fleet: under round-robin routing a backlog stays on
    # the engines that hold it, so more engines beyond that only take new arrivals off them.
    drain = min((backlog + growth) / (rate * cfg.prefill_drain_s), demand)
    projected = demand + drain * target  # the drain term is already in engines at the target
    sig = replace(sig, deficit_engines=round(deficit, 3), drain_engines=round(drain, 3))
    sizing = verdict(view, loads, demand, projected, slope, up, down, target, sig, late=late, busy=busy)
    if cfg.prefill_second_look and sizing.want == "up" and not late and saturated_then == 0:
        # A queue the previous decision did not see, short of the TTFT target: a Poisson burst on a busy
        # pool makes one (a steady 8 req/s of 8,000-token prompts on 2 engines: 30-70k tokens, 0.5-0.8 s,
        # gone 5 s later); a pool that is short keeps it, and scales up one interval later.
        why = sizing.why + f"; a {wait_s:.2f}s queue new since the last decision: scaling if it stays"
        return replace(sizing, want="steady", why=why, needed=None), st
    if not cfg.hold_prefill_drain and sizing.want == "up":
        # The drain's replicas are for a backlog that ends: once it has drained, only the arrivals' need
        # is held against a dip (docs/planner.md, "Sizing").
        sizing = replace(sizing, held_need=needed_replicas(demand / target, pool))
    return sizing, st


def _prefill_arrivals(engines_then: int, saturated_then: int, saturated: int, queue_slope: float) -> float:
    """Engines' worth of arrivals at the prefill pool, from the fleet its queue's latest change was made on.

    ``queue_slope`` is that change in engines (tokens/s over one engine's rate). While the queue grows,
    the engines then were all busy and the growth is a deficit on top: ``engines_then + queue_slope``.
    While it shrinks, under round-robin routing each engine receives the same share of arrivals and only
    the saturated ones' queues move, each by (its share - one engine): the pool receives
    ``engines_then x (1 + queue_slope / saturated_then)``. Counting every engine publishing now as busy
    instead reads a backlog left on the old engines as work for the new ones: on the fleet scale's peak,
    38 engines read as 38 + 12.5 when 25 carried it (docs/planner.md). Never fewer than the engines
    saturated now: a queue behind its pass keeps an engine busy. (Round-robin is the frontend's default
    ``--router-mode``; under ``least-loaded`` or ``kv``, which send new arrivals to idle engines, this
    reads low while the old ones drain and the pool holds: new engines that fall short saturate in turn,
    and their growth reads.)
    """
    if queue_slope >= 0 or saturated_then <= 0:
        arrivals = engines_then + max(queue_slope, 0.0)
    else:
        arrivals = engines_then * (1.0 + queue_slope / saturated_then)
    return max(arrivals, float(saturated))


def _robust_prefill(
    view: PoolView,
    st: PoolState,
    now: float,
    loads: list[float],
    queued: list[float],
    rate: float | None,
    slope: float,
    busy: float | None,
    up: float,
    target: float,
    sig: Signals,
) -> tuple[Sizing, PoolState]:
    """Prefill demand for the variance-aware sizing: the work the arrivals bring, in engines.

    With an arrival source, the frontend's prompt tokens per second at the pool's measured cost per token
    (``arrival_engines``); without one, the engines saturated plus the queue's growth in engines (what the
    queue's change shows); before any rate is measured, the queue over the context length (upstream's load).
    A backlog is drained in ``prefill_drain_s`` on top, outside the samples: it ends; so is KV held for
    peers that have not read it (``EngineObs.held_kv_tokens``), until its lease ends.
    """
    cfg = view.cfg
    backlog = sum(queued)
    saturated = sum(1 for ld in loads if ld >= up)
    if busy is not None:
        demand = busy
    elif rate is not None and rate > 0:
        demand = float(saturated) + max(slope, 0.0) / rate
    else:
        demand = sum(loads)
    drain = 0.0
    late = False
    if rate is not None and rate > 0 and backlog > 0:
        drain = backlog / (rate * cfg.prefill_drain_s)
        wait_s = max(queued) / rate
        sig = replace(sig, queue_wait_s=round(wait_s, 3), drain_engines=round(drain, 3))
        late = wait_s > 0.5 * cfg.sla.ttft_ms / 1000.0 and slope >= 0 and view.starting == 0
    # KV the engines hold for peers that have not read it (a dead or slow decode worker) is capacity no new
    # prompt can use until the lease ends: the engines' worth of it is wanted on top while it lasts.
    held = sum(e.held_kv_tokens / e.capacity.kv_tokens for e in view.pool.engines if e.capacity.kv_tokens)
    extra, why = drain, "to drain the queue"
    if held > 0:
        sig = replace(sig, held_kv_engines=round(held, 3))
        extra, why = drain + held, ("to drain the queue and " if drain > 0 else "") + "for KV held for peers"
    view = replace(view, state=st)
    return robust_verdict(view, now, loads, demand, up, sig, extra, why, late, target)
