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
    down_since: float | None = None
    idle_since: float | None = None
    mismatch_since: float | None = None
    last_action_at: float | None = None
    in_flight: InFlight | None = None
    # (time, demand) samples inside the trend window; demand in the pool's own unit (see Sizing).
    trend: tuple[tuple[float, float], ...] = ()
    # Prefill: tokens/s one saturated engine processes (EWMA of its passes); None until seen.
    engine_rate: float | None = None
    # Seconds from a scale-up to the new replica's first record (EWMA); None until measured.
    startup_s: float | None = None
    # A scale-up whose first new record is awaited: (asked at, replicas running or starting before it).
    startup_probe: tuple[float, int] | None = None
    # (time, replicas the sizing asked for) inside the scale-down stabilization window.
    needs: tuple[tuple[float, int], ...] = ()
    # Decode with ``decode_trend: held``: (time, what the engines hold) samples inside the trend window.
    held_trend: tuple[tuple[float, float], ...] = ()
    # The last scale-up's landing, for ``rule_late_landing``: (landed at, replicas before the ask).
    landed: tuple[float, int] | None = None
    # When the pool's first decision recorded the fleet it found as a need (``rule_first_look``); None before.
    first_look_at: float | None = None
    first_look_replicas: int | None = None  # the replicas it found then
    # Prefill: (engines publishing, engines saturated) at the previous sizing, the fleet the queue's
    # latest change was made on.
    prefill_engines: tuple[int, int] | None = None
    # Decode, with arrivals: (time, requests per second the frontend admitted) inside the trend window,
    # since the arrivals last resumed from none; and (time, requests the engines hold or queue) while
    # every engine has been saturated (``_throughput_bound``).
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
