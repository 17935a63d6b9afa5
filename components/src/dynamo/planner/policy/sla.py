"""``target: sla``: sizing from the online latency models' predicted TTFT and ITL."""

from __future__ import annotations

import math
from dataclasses import replace

from .decision import Signals, Sizing, summarise
from .demand import decode_demand
from .view import PoolView


def sla_sizing(view: PoolView) -> Sizing:
    """``target: sla``: the online latency models predict TTFT / ITL per engine; one step at a time."""
    pool, cfg = view.pool, view.cfg
    fit = pool.latency
    assert fit is not None  # pool_sizing falls back to the thresholds without a model
    engines = pool.engines
    n = len(engines)
    head = cfg.sla.headroom
    if pool.name == "prefill":
        target = cfg.sla.ttft_ms / 1000.0
        a, b = fit.coef

        def ttft(q: float, chunk: int | None) -> float:
            """Time to compute ``q`` queued tokens in passes of at most ``chunk`` tokens."""
            c = chunk or max(q, 1.0)
            passes = max(1.0, math.ceil(q / c))
            return passes * max(a + b * min(q, c), 0.0)

        qs = [float(e.record.queued_requests.sum_prefill_tokens) for e in engines]
        est = [ttft(q, e.capacity.max_num_batched_tokens) for q, e in zip(qs, engines, strict=True)]
        ratios = [x / target for x in est]
        sig = Signals(ttft_est_s=summarise(est), ttft_target_s=target, samples=fit.samples)
        cons = (
            ttft(sum(qs) / (n - 1), engines[0].capacity.max_num_batched_tokens) / target
            if n > 1
            else math.inf
        )
        kv_over = False
    else:
        target = cfg.sla.itl_ms / 1000.0
        demands = [decode_demand(e, 1.0) for e in engines]
        reqs = [dd.requests for dd in demands]
        kvs = [dd.tokens for dd in demands]
        a, b, c = fit.coef
        est = [max(a + b * r + c * k, 0.0) for r, k in zip(reqs, kvs, strict=True)]
        ratios = [x / target for x in est]
        caps = [e.capacity.kv_tokens for e in engines]
        kv_over = any(c and k > c for k, c in zip(kvs, caps, strict=True)) or any(
            e.capacity.max_num_seqs and r > e.capacity.max_num_seqs
            for r, e in zip(reqs, engines, strict=True)
        )
        cons = fit.predict(sum(reqs) / (n - 1), sum(kvs) / (n - 1)) / target if n > 1 else math.inf
        cap_min = min((c for c in caps if c), default=None)
        if n > 1 and cap_min and sum(kvs) / (n - 1) > cap_min * head:
            cons = math.inf
        sig = Signals(itl_est_s=summarise(est), itl_target_s=target, samples=fit.samples, kv_over=kv_over)
    if pool.replicas > pool.workers:
        cons = math.inf  # silent replicas: their load is unknown, so no consolidation
    mx = max(ratios)
    finite = cons if math.isfinite(cons) else None
    sig = replace(sig, consolidated=None if finite is None else round(cons, 4))
    if min(ratios) > 1.0 or kv_over:
        why = f"{pool.name} predicted latency {mx:.2f}x the SLA on every engine"
        return Sizing("up", why, mx, needed=view.replicas + 1, consolidated=finite, signals=sig)
    if cons <= head:
        why = f"{pool.name} on {n - 1} engines predicted at {cons:.2f}x the SLA <= {head:g}"
        return Sizing("down", why, mx, consolidated=finite, signals=sig)
    why = f"{pool.name} predicted latency {mx:.2f}x the SLA"
    return Sizing("steady", why, mx, consolidated=finite, signals=sig)
