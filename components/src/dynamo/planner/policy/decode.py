"""Decode sizing: the KV and slots engines hold and queue, in engines at full load; the forecast's growth."""

from __future__ import annotations

from dataclasses import replace

from .decision import Signals, Sizing
from .demand import decode_demand, decode_load
from .forecast import NONE, decode_forecast
from .robust import robust_verdict
from .state import PoolState
from .view import PoolView, capacity_unknown

# An engine's queue counts towards demand up to this many times what it holds. A queue behind full slots
# says the pool is short, not by how much: the backlog stays with its engine (it drains there), so counted
# in full it would size the fleet for a moment.
QUEUE_WEIGHT = 1.0


def decode_sizing(view: PoolView, now: float) -> tuple[Sizing, PoolState]:
    pool, cfg = view.pool, view.cfg
    th = cfg.effective_thresholds()
    if (unknown := capacity_unknown(pool, "kv_tokens")) is not None:
        return unknown, view.state
    up, target = th.decode_up, th.decode_target
    loads: list[float] = []
    transfer = waiting = bound = 0
    slot_max = 0.0
    demand = requests = 0.0
    for e in pool.engines:
        dd = decode_demand(e, up)
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
        demand += held + min(max(load - held, 0.0), QUEUE_WEIGHT * max(held, 1.0))
    sig = Signals(
        decode_kv_tokens=sum(e.record.scheduled_requests.sum_decode_kv_tokens for e in pool.engines),
        queued_decode_kv_tokens=sum(e.record.queued_requests.sum_decode_kv_tokens for e in pool.engines),
        decode_kv_transfer_tokens=transfer,
        decode_kv_waiting_tokens=waiting,
        transfer_bound_engines=bound,
        slot_load_max=round(slot_max, 4),
    )
    fc, st = NONE, view.state
    if cfg.forecast.enabled:
        fc, st, sig = decode_forecast(view, now, demand, loads, requests, target, sig)
    return robust_verdict(replace(view, state=st), now, loads, demand, up, sig, target=target, forecast=fc)
