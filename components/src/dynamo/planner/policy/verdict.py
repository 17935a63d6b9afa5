"""The verdict every threshold sizing ends in: up, down or steady, from the loads and the projected demand."""

from __future__ import annotations

import math
from dataclasses import replace

from .decision import Signals, Sizing, summarise
from .state import Want
from .view import PoolView, consolidated_load, needed_replicas, per_worker


def verdict(
    view: PoolView,
    loads: list[float],
    demand: float | None,
    projected: float | None,
    slope: float,
    up: float,
    down: float,
    target: float,
    sig: Signals,
    sustained: bool = False,
    late: bool = False,
    rising: bool = False,
    busy: float | None = None,
) -> Sizing:
    """Up / down / steady from per-engine loads and (when known) the projected demand.

    ``busy``: engines' worth of work the measured arrivals bring (prefill); spread over the engines left
    after a scale-down it is a load too (times ``up``), so a busy pool without a queue is not consolidated.
    """
    pool = view.pool
    note = ""
    name = pool.name
    mx = max(loads)
    cons, silent, remaining = consolidated_load(loads, pool, up)
    by_arrivals = False
    if busy is not None:
        spread_busy = busy / remaining * up if remaining > 0 else math.inf
        if spread_busy > cons:
            cons, by_arrivals = spread_busy, True
    sig = replace(
        sig,
        loads=summarise(loads),
        up=up,
        down=down,
        target=target,
        consolidated=round(cons, 4) if math.isfinite(cons) else None,
    )
    silent_busy = max(silent - view.starting * per_worker(pool), 0.0)
    if demand is not None and projected is not None and silent_busy:
        # Replicas that should publish and do not count as loaded at ``up`` (never as idle).
        demand, projected = demand + silent_busy * up, projected + silent_busy * up
    needed: int | None = None
    needed_now: int | None = None
    if projected is not None and demand is not None:
        # Today's demand triggers a scale-up; the trend only says how many to add at once.
        needed_now = needed_replicas(demand / target, pool)
        needed = max(needed_replicas(projected / target, pool), needed_now)
        sig = replace(sig, needed=needed)

    def sizing(want: Want, why: str, n: int | None = needed) -> Sizing:
        return Sizing(
            want,
            why,
            load_max=mx,
            demand=None if demand is None else round(demand, 4),
            projected=None if projected is None else round(projected, 4),
            needed=n,
            consolidated=cons if math.isfinite(cons) else None,
            slope=round(slope, 6),
            signals=sig,
        )

    # Starting replicas will take their share: the load of the busiest engine once they serve.
    spread = mx * pool.workers / max(pool.workers + view.starting, 1)
    over = spread >= up if name == "prefill" else spread > up
    # With a sizing model, today's demand triggers; without one (no rate measured yet), an engine over ``up``.
    trigger = over
    if needed_now is not None and needed is not None and demand is not None:
        # The trend triggers only on a load that is already a real share of the pool (a quarter of what its
        # replicas carry at the target): a warm-up's few requests rise "consistently" too.
        ahead = (
            sustained
            and needed > view.replicas
            and demand >= 0.25 * target * view.replicas * per_worker(pool)
        )
        trigger = needed_now > view.replicas or ahead or late
    if trigger:
        n = needed if needed is not None else view.replicas + 1
        if late:
            n = max(n, view.replicas + 1)
        why = f"{name} load {mx:.2f} over {up:g}" if over else f"{name} load {mx:.2f}"
        if projected is not None and demand is not None:
            why += f"; demand {demand:.2f} engines, {projected:.2f} expected in {view.lead_s:.0f}s"
            why += f" -> {n} replicas at {target:g}"
        return sizing("up", why + note, n)
    if silent_busy:
        note += f" ({silent_busy:g} silent engines counted at {up:g})"
    if mx < down:
        limit = up * view.cfg.consolidation_headroom
        if slope > 0 and needed is not None and needed >= view.replicas:
            why = f"{name} load {mx:.2f} under {down:g} but rising: {needed} replicas needed within a startup"
            return sizing("steady", why + note)
        if rising:
            # A consistent rise near a trough accelerates (a wave's upswing): a straight line through the
            # window under-projects it, and a replica released now is missed one cold start later.
            why = f"{name} load {mx:.2f} under {down:g} but rising steadily (r2 {sig.trend_r2})"
            return sizing("steady", why + note)
        if cons < limit:
            return sizing(
                "down",
                f"{name} load {mx:.2f} under {down:g}; "
                f"on {remaining:g} engines {cons:.2f} < {limit:.2f}{note}",
            )
        if remaining <= 0:
            why = f"{name} load {mx:.2f} under {down:g}; a single replica, nothing to consolidate"
        elif by_arrivals:
            why = (
                f"{name} load {mx:.2f} under {down:g}, but the arrivals keep {busy:.2f} engines busy: "
                f"on {remaining:g} engines {cons / up:.2f} each >= {view.cfg.consolidation_headroom:g}"
            )
        else:
            why = (
                f"{name} load {mx:.2f} under {down:g} "
                f"but on {remaining:g} engines it would be {cons:.2f} >= {limit:.2f}"
            )
        return sizing("steady", why + note)
    if over and demand is not None:
        # The busiest engine is over ``up`` (a backlog round-robin routing leaves where it is), but the
        # pool's demand fits the replicas it has (and has asked for) at the target.
        why = (
            f"{name} load {mx:.2f} over {up:g} on its busiest engine, but a demand of {demand:.2f} engines "
            f"fits {view.replicas} replicas at {target:g}"
        )
        return sizing("steady", why + note)
    return sizing("steady", f"{name} load {mx:.2f} within [{down:g}, {up:g}]{note}")
