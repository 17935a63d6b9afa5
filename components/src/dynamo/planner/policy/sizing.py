"""A pool's sizing: idle, the SLA models, or the thresholds' prefill or decode sizing."""

from __future__ import annotations

from dataclasses import replace

from .decision import Sizing
from .decode import decode_sizing
from .demand import engine_idle
from .prefill import prefill_sizing
from .sla import sla_sizing
from .state import PoolState
from .view import PoolView


def pool_sizing(view: PoolView, now: float) -> tuple[Sizing, PoolState]:
    pool = view.pool
    if not pool.engines:
        return Sizing("idle", f"{pool.name}: no engines publishing"), view.state
    # With variance-aware sizing an idle tick is a sample of zero demand like any other: a fast engine
    # between two prompts is idle at most ticks, and bursty traffic pauses for a minute between bursts. A
    # scale-down still goes no lower than the window's highest recommendation (the stabilization).
    if all(engine_idle(e) for e in pool.engines) and not view.cfg.variance_sizing:
        st = replace(view.state, trend=((now, 0.0),))
        if pool.name == "prefill":
            st = replace(st, prefill_engines=(len(pool.engines), 0))
        return Sizing("idle", f"{pool.name}: no scheduled or queued work on {len(pool.engines)} engines"), st
    cfg = view.cfg
    if cfg.target == "sla":
        fit = pool.latency
        if fit is not None and fit.samples >= cfg.sla.min_samples:
            return sla_sizing(view), view.state
        n = 0 if fit is None else fit.samples
        sizing, st = (prefill_sizing if pool.name == "prefill" else decode_sizing)(view, now)
        return replace(sizing, why=sizing.why + f" (latency model not ready: {n} samples; thresholds)"), st
    return (prefill_sizing if pool.name == "prefill" else decode_sizing)(view, now)
