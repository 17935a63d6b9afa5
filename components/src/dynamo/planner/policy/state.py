"""The policy's names and its state between decisions: what each pool remembers (windows, actions)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, TypeVar

PoolName = Literal["prefill", "decode"]
POOLS: tuple[PoolName, PoolName] = ("prefill", "decode")
Action = Literal["scale_up", "scale_down", "hold"]
Want = Literal["up", "down", "idle", "steady", "hold"]
SampleValue = TypeVar("SampleValue")  # a windowed sample's value: demand (float) or replicas (int)


def other(pool: PoolName) -> PoolName:
    return "decode" if pool == "prefill" else "prefill"


@dataclass(frozen=True, slots=True)
class InFlight:
    target: int
    previous: int
    since: float


@dataclass(frozen=True, slots=True)
class PoolState:
    # Since when no engine has had work scheduled or queued (``robust.robust_verdict``); None while busy.
    idle_since: float | None = None
    mismatch_since: float | None = None
    last_action_at: float | None = None
    in_flight: InFlight | None = None
    # Decode with the forecast: (time, demand) samples inside ``forecast.window_s``. Prefill: the previous
    # decision's (time, queued prompt tokens).
    trend: tuple[tuple[float, float], ...] = ()
    # Prefill: tokens/s one saturated engine processes (EWMA of its passes); None until seen.
    engine_rate: float | None = None
    # Seconds from a scale-up to the new replica's first record (EWMA); None until measured.
    startup_s: float | None = None
    # A scale-up whose first new record is awaited: (asked at, replicas running or starting before it).
    startup_probe: tuple[float, int] | None = None
    # (time, replicas the sizing asked for) inside the scale-down stabilization window.
    needs: tuple[tuple[float, int], ...] = ()
    # When the pool's first decision recorded the fleet it found as a need (``rule_first_look``); None before.
    first_look_at: float | None = None
    first_look_replicas: int | None = None  # the replicas it found then
    # The forecast, with arrivals: (time, requests per second the frontend admitted) inside its window;
    # and (time, requests the engines hold or queue) while every engine has been saturated
    # (``forecast._throughput_bound``).
    arrival_trend: tuple[tuple[float, float], ...] = ()
    saturated_requests: tuple[tuple[float, float], ...] = ()
    # (time, demand in engines at full load) inside ``demand_window_s``: the variance-aware sizing's samples.
    demand_window: tuple[tuple[float, float], ...] = ()


@dataclass(frozen=True, slots=True)
class PolicyState:
    prefill: PoolState = PoolState()
    decode: PoolState = PoolState()

    def pool(self, name: PoolName) -> PoolState:
        return self.prefill if name == "prefill" else self.decode

    def with_pool(self, name: PoolName, st: PoolState) -> PolicyState:
        return replace(self, prefill=st) if name == "prefill" else replace(self, decode=st)
