"""The worker's side of FPM on the ZMQ event plane: the engine's PUB port, and one relay per dp rank.

On NATS the engine process publishes directly (no hop). On ZMQ it binds a loopback PUB at
``DYN_FORWARDPASS_METRIC_PORT + dp_rank`` (``dynamo.common.fpm_zmq_publisher``) and this process, which
holds the runtime, runs the runtime's ``FpmEventRelay`` per rank: it registers the worker's FPM stream
in discovery and republishes each record on the event plane, as upstream 1.6.1's worker does.

Port: the user's ``DYN_FORWARDPASS_METRIC_PORT`` when set (upstream's name; upstream defaults to 20380,
which two workers on one host cannot share); otherwise a free port chosen for this worker below the
kernel's ephemeral range (``dynamo.common.ports``, which leaves 64 ports above it for the ranks).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from dynamo.common.event_plane import ENV_FPM_PORT, fpm_port_from_env, zmq_fpm_endpoint
from dynamo.common.ports import stable_free_port

log = logging.getLogger(__name__)


def fpm_zmq_port(event_plane: str, fpm_enabled: bool, env: Mapping[str, str]) -> int | None:
    """The base port the engine binds (``None``: NATS, or FPM off). ``ValueError`` on a bad variable."""
    if not fpm_enabled or event_plane != "zmq":
        return None
    return fpm_port_from_env(env) or stable_free_port()


def start_relays(endpoint: Any, base_port: int, dp_ranks: range) -> list[Any]:
    """One runtime ``FpmEventRelay`` per local dp rank (its records go out under ``endpoint``'s component)."""
    from dynamo.llm import FpmEventRelay

    relays = []
    for rank in dp_ranks:
        address = zmq_fpm_endpoint(base_port, rank)
        relays.append(FpmEventRelay(endpoint, address))
        log.info("FPM relay for dp_rank=%d: %s -> the ZMQ event plane", rank, address)
    return relays


def stop_relays(relays: list[Any]) -> None:
    for relay in relays:
        try:
            relay.shutdown()
        except Exception:
            log.debug("FPM relay shutdown", exc_info=True)


__all__ = ["ENV_FPM_PORT", "fpm_zmq_port", "start_relays", "stop_relays"]
