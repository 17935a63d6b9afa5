"""What every connector offers the planner loop. Connectors act; they never decide.

``status()`` reports what the deployment runs per pool (``None`` = the connector cannot tell; the
loop then uses the workers seen publishing) and whether the last action is done (``settled``).
``apply()`` asks for replica counts (``None`` = leave that pool alone) and returns without waiting.
A connector that can tell more says, per pool, how many of those replicas are still starting (asked
for, not yet serving), draining, and how many warm standbys it keeps outside the pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class PoolStatus:
    """One pool's breakdown: ``starting`` replicas count in the pool's replicas, standbys do not."""

    starting: int = 0
    draining: int = 0
    standby: int = 0


@dataclass(frozen=True, slots=True)
class ConnectorStatus:
    prefill: int | None = None
    decode: int | None = None
    settled: bool = True
    detail: str = ""
    # None = the connector cannot tell the breakdown.
    prefill_pool: PoolStatus | None = None
    decode_pool: PoolStatus | None = None

    def replicas(self, pool: str) -> int | None:
        return self.prefill if pool == "prefill" else self.decode

    def breakdown(self, pool: str) -> PoolStatus | None:
        return self.prefill_pool if pool == "prefill" else self.decode_pool


class Connector(Protocol):
    name: str

    async def start(self) -> None: ...

    async def status(self) -> ConnectorStatus: ...

    async def apply(self, prefill: int | None, decode: int | None) -> None: ...

    async def close(self) -> None: ...


class DryRunConnector:
    """``--dry-run``: decides and logs, never acts. Reports nothing, so replicas = workers seen."""

    name = "dry-run"

    def __init__(self) -> None:
        self.requests: list[tuple[int | None, int | None]] = []

    async def start(self) -> None:
        return None

    async def status(self) -> ConnectorStatus:
        return ConnectorStatus(detail="dry run")

    async def apply(self, prefill: int | None, decode: int | None) -> None:
        self.requests.append((prefill, decode))

    async def close(self) -> None:
        return None
