"""What a pool's sizing reads besides its records, and the arithmetic every sizing shares."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import PlannerConfig
from ..observations import Arrivals, PoolObs
from .decision import Sizing
from .state import PoolState


@dataclass(frozen=True, slots=True)
class PoolView:
    """What the load rules need besides the observation: the state and the pool's lead time."""

    pool: PoolObs
    state: PoolState
    cfg: PlannerConfig
    replicas: int  # capacity counted: running + asked-for replicas still starting
    lead_s: float  # how long until a replica asked for now would serve
    starting: int = 0  # of ``replicas``, still starting (not publishing yet, not silent)
    arrivals: Arrivals | None = None  # the frontend's arrival rate, when a source is configured


def per_worker(pool: PoolObs) -> float:
    return len(pool.engines) / max(pool.workers, 1)


def consolidated_load(loads: list[float], pool: PoolObs, up: float) -> tuple[float, float, float]:
    """(load spread over the engines left after removing one replica, silent engines, engines left)."""
    n = len(loads)
    each = per_worker(pool)
    expected = max(float(n), each * pool.replicas)
    silent = expected - n
    remaining = expected - each
    value = (sum(loads) + silent * up) / remaining if remaining > 0 else math.inf
    return value, silent, remaining


def needed_replicas(engines_needed: float, pool: PoolObs) -> int:
    """Engines' worth of work -> whole replicas (a replica brings all its dp ranks)."""
    return max(1, math.ceil(engines_needed / per_worker(pool) - 1e-9))


def capacity_unknown(pool: PoolObs, field: str) -> Sizing | None:
    """Hold, naming the first engine whose capacity does not say ``field`` (no guessing at load)."""
    missing = next((e.worker_id for e in pool.engines if not getattr(e.capacity, field)), None)
    return None if missing is None else Sizing("hold", f"capacity unknown ({field}) for worker {missing}")
