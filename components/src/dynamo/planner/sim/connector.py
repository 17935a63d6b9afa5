"""The ``simulator`` connector: the fleet simulator's pools as a connector the planner loop acts through.

The harness hands it each tick's snapshot; ``status()`` reports it the way the Kubernetes connector
reports a deployment (replicas asked for and not draining, with the starting ones broken out), and
``apply()`` keeps the targets the harness returns to the simulator. Capacity comes from the engine args
through :class:`SimCardSource`, in the shape the live planner reads model cards.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..connector_base import ConnectorStatus, PoolStatus
from ..observations import Capacity
from ..policy import POOLS
from .records import worker_id


class SimulatorConnector:
    name = "simulator"

    def __init__(self) -> None:
        self.snapshot: Mapping[str, Any] = {}
        self.targets: dict[str, int | None] = {"prefill": None, "decode": None}

    async def start(self) -> None:
        return None

    def counts(self, pool: str) -> tuple[int, int, int]:
        """(active, starting, draining) of one pool in the current snapshot."""
        s = self.snapshot
        return (
            int(s.get(f"active_{pool}_count", 0)),
            int(s.get(f"starting_{pool}_count", 0)),
            int(s.get(f"draining_{pool}_count", 0)),
        )

    async def status(self) -> ConnectorStatus:
        parts: dict[str, PoolStatus] = {}
        replicas: dict[str, int] = {}
        for pool in POOLS:
            active, starting, draining = self.counts(pool)
            replicas[pool] = active + starting
            parts[pool] = PoolStatus(starting=starting, draining=draining)
        busy = any(p.starting or p.draining for p in parts.values())
        return ConnectorStatus(
            replicas["prefill"],
            replicas["decode"],
            settled=not busy,
            detail="; ".join(
                f"{p}: {parts[p].starting} starting, {parts[p].draining} draining" for p in POOLS
            ),
            prefill_pool=parts["prefill"],
            decode_pool=parts["decode"],
        )

    async def apply(self, prefill: int | None, decode: int | None) -> None:
        self.targets = {"prefill": prefill, "decode": decode}

    def take_targets(self) -> dict[str, int | None]:
        out, self.targets = self.targets, {"prefill": None, "decode": None}
        return out

    async def close(self) -> None:
        return None


def engine_capacity(engine_args: Mapping[str, Any]) -> Capacity:
    """What a live worker's model card would state, from the mocker's normalized engine config."""
    eng = engine_args["engine"]
    return Capacity(
        context_length=int(eng["max_model_len"]),
        kv_tokens=int(eng["num_gpu_blocks"]) * int(eng["block_size"]),
        max_num_batched_tokens=int(eng["max_num_batched_tokens"]),
        max_num_seqs=int(eng["max_num_seqs"]),
        source="card",
    )


class SimCardSource:
    """Model cards of one simulated pool: every active worker states the engine args' capacity."""

    def __init__(self, connector: SimulatorConnector, pool: str, capacity: Capacity) -> None:
        self.connector = connector
        self.pool = pool
        self.capacity = capacity

    def poll(self, default_block_size: int | None = None) -> dict[str, Capacity]:
        del default_block_size
        ids = self.connector.snapshot.get(f"active_{self.pool}_ids", [])
        return {worker_id(i): self.capacity for i in ids}

    def close(self) -> None:
        return None
