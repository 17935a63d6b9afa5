"""One scenario of the suite (or one workload) run as a row: what the outcome benchmarks print and
``acceptance.check`` judges.

A row is ``{"scenario", "startup_s", "policy", **summary}``. The benchmarks run these in worker processes, so
the functions take plain values (a trace path, a config mapping) that pickle.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import config_from_mapping
from .baselines import cheapest_static_pools, static_summary
from .harness import SimSpec, simulate, trace_spec
from .inputs import check_trace, engine_args
from .prefixes import BLOCK_TOKENS
from .scenarios import SCENARIOS
from .workloads import LONG_CONTEXT, SLA_ITL_MS, SLA_TTFT_MS, WORKLOADS

# Fleet limits for every policy on the suite: room for the fleet scale's 32-64 engines per pool.
SUITE_FLEET_LIMITS: dict[str, Any] = {"prefill": {"max_replicas": 64}, "decode": {"max_replicas": 64}}


def planner_row(
    name: str,
    startup_s: float,
    trace: str | Path,
    config: dict[str, Any],
    sla_ttft_ms: float = 2000.0,
    sla_itl_ms: float = 50.0,
    router: str = "round-robin",
) -> dict[str, Any]:
    """Our planner (``config``: a mapping, as ``--config`` takes it) on scenario ``name``'s trace."""
    spec = trace_spec(Path(trace), SCENARIOS[name].initial, startup_s, sla_ttft_ms, sla_itl_ms, router)
    summary = simulate(spec, config_from_mapping(config))["summary"]
    return {"scenario": name, "startup_s": startup_s, "policy": "ours", **summary}


def static_row(
    name: str, trace: str | Path, n: int, sla_ttft_ms: float = 2000.0, sla_itl_ms: float = 50.0
) -> dict[str, Any]:
    """A static N+N fleet on scenario ``name``'s trace (ready from the start: no cold start)."""
    spec = trace_spec(Path(trace), SCENARIOS[name].initial, 0.0, sla_ttft_ms, sla_itl_ms)
    return {"scenario": name, "startup_s": None, "policy": f"static {n}+{n}", **static_summary(spec, n)}


def workload_spec(
    trace: str | Path,
    initial: tuple[int, int],
    startup_s: float,
    router: str = "round-robin",
    block_size: int = BLOCK_TOKENS,
) -> SimSpec:
    """A workload's trace on the long-context engines at a cold start, with its SLA and router;
    ``block_size``: prompt tokens per hash id of the trace."""
    return SimSpec(
        traces=(str(trace),),
        prefill_engine_args=engine_args(LONG_CONTEXT["prefill"], "prefill", startup_s),
        decode_engine_args=engine_args(LONG_CONTEXT["decode"], "decode", startup_s),
        sla_ttft_ms=SLA_TTFT_MS,
        sla_itl_ms=SLA_ITL_MS,
        initial=initial,
        trace_duration_s=check_trace(str(trace), block_size),
        router=router,
        trace_block_size=block_size,
    )


def workload_static(
    name: str, trace: str | Path, router: str, target_pct: float = 95.0, block_size: int = BLOCK_TOKENS
) -> tuple[tuple[int, int], dict[str, Any]] | None:
    """The cheapest static P+D fleet reaching ``target_pct`` on a workload's trace, each pool searched (from
    the workload's starting fleet, which skips the slow overloaded small fleets; from 1+1 for a trace that
    is no named workload)."""
    initial = WORKLOADS[name].initial if name in WORKLOADS else (1, 1)
    spec = workload_spec(trace, initial, 0.0, router, block_size)
    return cheapest_static_pools(spec, target_pct=target_pct, start=max(initial))


def workload_row(
    name: str,
    trace: str | Path,
    router: str,
    startup_s: float,
    initial: tuple[int, int],
    config: dict[str, Any],
    block_size: int = BLOCK_TOKENS,
) -> dict[str, Any]:
    """Our planner (``config``: a mapping, as ``--config`` takes it) on a workload from ``initial``."""
    spec = workload_spec(trace, initial, startup_s, router, block_size)
    summary = simulate(spec, config_from_mapping(config))["summary"]
    return {"scenario": name, "startup_s": startup_s, "policy": "ours", **summary}
