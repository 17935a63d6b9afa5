"""Which Dynamo event plane carries FPM records, by the runtime's own name and rule.

The runtime's variable is ``DYN_EVENT_PLANE`` (``nats`` or ``zmq``; components also take ``--event-plane``).
Upstream 1.6.1 defaults to ``zmq``; we default to ``nats`` when ``NATS_SERVER`` is set and to ``zmq``
otherwise, because every deployment of ours so far (demo, compose, launch scripts, tests) runs a NATS
server and NATS is the one plane where the engine process publishes without a relay hop
(docs/fpm-core.md#event-planes). One rule, here, for the worker, the planner, the frontend and the watch
CLI, so that producers and consumers of one deployment agree.

On ZMQ the engine process cannot reach the event plane itself (it has no runtime): it binds a ZMQ PUB on
loopback at ``DYN_FORWARDPASS_METRIC_PORT + dp_rank`` (upstream's name and layout) and the worker's main
process relays those frames with the runtime's ``FpmEventRelay``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

EVENT_PLANES = ("nats", "zmq")
ENV_EVENT_PLANE = "DYN_EVENT_PLANE"
# Upstream's variable: the engine process's ZMQ PUB port for dp rank 0 (rank r binds port + r).
ENV_FPM_PORT = "DYN_FORWARDPASS_METRIC_PORT"
UPSTREAM_DEFAULT_FPM_PORT = 20380
ZMQ_HOST = "127.0.0.1"


def default_event_plane(env: Mapping[str, str] | None = None) -> str:
    """``nats`` when a NATS server is configured, otherwise ``zmq`` (no server needed)."""
    env = os.environ if env is None else env
    return "nats" if env.get("NATS_SERVER", "").strip() else "zmq"


def resolve_event_plane(explicit: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """The flag's value, else ``DYN_EVENT_PLANE``, else :func:`default_event_plane`.

    Raises ``ValueError`` naming the flag or variable for a value other than ``nats`` / ``zmq``.
    """
    env = os.environ if env is None else env
    if explicit:
        value, where = explicit.strip().lower(), "--event-plane"
    else:
        value, where = env.get(ENV_EVENT_PLANE, "").strip().lower(), ENV_EVENT_PLANE
    if not value:
        return default_event_plane(env)
    if value not in EVENT_PLANES:
        raise ValueError(f"{where}={value!r}: expected one of {', '.join(EVENT_PLANES)}")
    return value


def fpm_port_from_env(env: Mapping[str, str] | None = None) -> int | None:
    """``DYN_FORWARDPASS_METRIC_PORT`` as a port, ``None`` when unset; ``ValueError`` naming it otherwise."""
    env = os.environ if env is None else env
    raw = env.get(ENV_FPM_PORT, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or not 1 <= int(raw) <= 65535:
        raise ValueError(f"{ENV_FPM_PORT}={raw!r}: expected a TCP port (1-65535)")
    return int(raw)


def zmq_fpm_endpoint(base_port: int, dp_rank: int = 0) -> str:
    """Where the engine process of ``dp_rank`` binds its PUB and the relay connects (loopback only)."""
    return f"tcp://{ZMQ_HOST}:{base_port + dp_rank}"
