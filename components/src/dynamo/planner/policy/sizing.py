"""A pool's sizing: idle, the SLA models, or the thresholds' prefill or decode sizing."""

from __future__ import annotations

from dataclasses import replace

from .decision import Sizing
from .decode import decode_sizing
from .prefill import prefill_sizing
from .sla import sla_sizing
from .state import PoolState
from .view import PoolView


def pool_sizing(view: PoolView, now: float) -> tuple[Sizing, PoolState]:
    pool = view.pool
    if not pool.engines:
        return Sizing("idle", f"{pool.name}: no engines publishing"), view.state
    cfg = view.cfg
    if cfg.target == "sla":
        fit = pool.latency
        if fit is not None and fit.samples >= cfg.sla.min_samples:
            return sla_sizing(view), view.state
        n = 0 if fit is None else fit.samples
        sizing, st = (prefill_sizing if pool.name == "prefill" else decode_sizing)(view, now)
        return replace(sizing, why=sizing.why + f" (latency model not ready: {n} samples; thresholds)"), st
    return (prefill_sizing if pool.name == "prefill" else decode_sizing)(view, now)
