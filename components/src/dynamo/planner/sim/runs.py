"""One scenario of the suite run as a row: what the outcome benchmarks print and ``acceptance.check`` judges.

A row is ``{"scenario", "startup_s", "policy", **summary}``. The benchmarks run these in worker processes, so
the functions take plain values (a trace path, a config mapping) that pickle.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import config_from_mapping
from .baselines import static_summary
from .harness import simulate, trace_spec
from .scenarios import SCENARIOS

# Fleet limits for every policy on the suite: room for the fleet scale's 32-64 engines per pool.
SUITE_FLEET_LIMITS: dict[str, Any] = {"prefill": {"max_replicas": 64}, "decode": {"max_replicas": 64}}


def planner_row(
    name: str,
    startup_s: float,
    trace: str | Path,
    config: dict[str, Any],
    sla_ttft_ms: float = 2000.0,
    sla_itl_ms: float = 50.0,
) -> dict[str, Any]:
    """Our planner (``config``: a mapping, as ``--config`` takes it) on scenario ``name``'s trace."""
    spec = trace_spec(Path(trace), SCENARIOS[name].initial, startup_s, sla_ttft_ms, sla_itl_ms)
    summary = simulate(spec, config_from_mapping(config))["summary"]
    return {"scenario": name, "startup_s": startup_s, "policy": "ours", **summary}


def static_row(
    name: str, trace: str | Path, n: int, sla_ttft_ms: float = 2000.0, sla_itl_ms: float = 50.0
) -> dict[str, Any]:
    """A static N+N fleet on scenario ``name``'s trace (ready from the start: no cold start)."""
    spec = trace_spec(Path(trace), SCENARIOS[name].initial, 0.0, sla_ttft_ms, sla_itl_ms)
    return {"scenario": name, "startup_s": None, "policy": f"static {n}+{n}", **static_summary(spec, n)}
