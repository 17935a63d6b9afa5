"""The ``virtual`` connector: Dynamo's own planner protocol, so external orchestrators work unchanged.

Decisions go out through the runtime's ``VirtualConnectorCoordinator`` (state in the runtime's etcd
under the namespace); an orchestrator reads them with ``VirtualConnectorClient.get()``, scales, and
calls ``complete()``. ``settled`` is the coordinator's ``is_scaling_ready()``. Replicas are the last
acknowledged targets; before the first acknowledgement, the workers seen publishing.
"""

from __future__ import annotations

import logging
from typing import Any

from .connector_base import ConnectorStatus

logger = logging.getLogger(__name__)


class VirtualConnector:
    name = "virtual"

    def __init__(
        self, runtime: Any, namespace: str, *, check_interval_s: int = 1, max_wait_time_s: int = 1800
    ) -> None:
        coordinator_cls = import_coordinator()
        self.runtime = runtime
        self.namespace = namespace
        retries = max(1, max_wait_time_s // max(1, check_interval_s))
        self.coord = coordinator_cls(runtime, namespace, check_interval_s, max_wait_time_s, retries)

    async def start(self) -> None:
        await self.coord.async_init()

    def targets(self) -> tuple[int, int, int]:
        """(prefill, decode, decision_id) as last published; -1 = never set."""
        s = self.coord.read_state()
        return s.num_prefill_workers, s.num_decode_workers, s.decision_id

    async def status(self) -> ConnectorStatus:
        """Replicas = the last *acknowledged* targets; before any (or while one is pending), unknown.

        Unknown makes the loop use the workers seen publishing. Known acknowledged targets keep a
        NATS outage (every worker silent) from reading as "zero replicas, below minimum".
        """
        p, d, decision = self.targets()
        ready = bool(await self.coord.is_scaling_ready())
        known = ready and decision >= 0
        return ConnectorStatus(
            p if known and p >= 0 else None,
            d if known and d >= 0 else None,
            ready,
            f"decision {decision}: prefill {p}, decode {d}",
        )

    async def apply(self, prefill: int | None, decode: int | None) -> None:
        await self.coord.update_scaling_decision(prefill, decode)

    async def close(self) -> None:
        return None


def import_coordinator() -> Any:
    """``dynamo.llm`` re-exports it in some builds; ``dynamo._core`` always has it."""
    import dynamo.llm

    cls = getattr(dynamo.llm, "VirtualConnectorCoordinator", None)
    if cls is None:
        from dynamo._core import VirtualConnectorCoordinator as cls
    return cls
