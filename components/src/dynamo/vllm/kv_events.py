"""KV cache events for Dynamo's KV-aware router (``--router-mode kv``), as upstream 1.6.1's worker does it.

vLLM's engine publishes its prefix cache's block events (stored, removed, all cleared) on a ZMQ PUB socket
when ``--kv-events-config`` enables them and prefix caching is on; each data-parallel rank binds the
configured port plus its rank. The worker subscribes with the runtime's own ``KvEventPublisher`` (one per
local rank, block size from the engine), which puts the events on the runtime's event plane (NATS or ZMQ)
under the worker's id, where the frontend's KV router indexes them. Nothing here parses an event: the
runtime relays vLLM's messages unchanged.

The decision (which ranks, which addresses, or why none) is pure and apart from the runtime objects, so it is
tested without an engine. One addition to upstream's worker: an event socket where nothing listens once the
engine is up is one WARNING line, and the worker serves anyway (the router then sees none of its blocks).
vLLM binds only a wildcard endpoint (``tcp://*:PORT``, ``ipc://``); ``tcp://127.0.0.1:PORT`` makes its
publisher *connect*, so nothing listens there: the usual way to get this line.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
# How long, after the engine is up, the worker looks for the engine's PUB socket before it says it is missing.
LISTEN_WAIT_S = 5.0


@dataclass(frozen=True)
class KvEventSource:
    """One data-parallel rank's vLLM KV event socket, as the worker's subscriber connects to it."""

    dp_rank: int
    zmq_endpoint: str


@dataclass(frozen=True)
class KvEventPlan:
    """The publishers to create (none: ``reason`` says why, logged once at start)."""

    sources: tuple[KvEventSource, ...]
    reason: str


def rank_endpoint(endpoint: str, dp_rank: int) -> str:
    """Where rank ``dp_rank`` binds: vLLM's own offset rule (port + rank), with ``*`` read as loopback."""
    from vllm.distributed.kv_events import ZmqEventPublisher

    offset = ZmqEventPublisher.offset_endpoint_port(endpoint, data_parallel_rank=dp_rank)
    return str(offset).replace("*", LOOPBACK)


def plan(
    kv_events_config: Any,
    prefix_caching: bool,
    dp_start: int,
    dp_size: int,
    endpoint_for_rank: Callable[[str, int], str] = rank_endpoint,
) -> KvEventPlan:
    """Upstream's conditions: prefix caching on, ``--kv-events-config`` given with ``enable_kv_cache_events``
    and vLLM's ZMQ publisher; then one source per local rank."""
    if not prefix_caching:
        return KvEventPlan((), "prefix caching is off (--no-enable-prefix-caching)")
    if kv_events_config is None:
        return KvEventPlan((), "no --kv-events-config")
    if not getattr(kv_events_config, "enable_kv_cache_events", False):
        return KvEventPlan((), "--kv-events-config has enable_kv_cache_events false")
    publisher = getattr(kv_events_config, "publisher", "zmq")
    if publisher != "zmq":
        return KvEventPlan((), f"--kv-events-config publisher is {publisher!r}, not 'zmq'")
    endpoint = str(kv_events_config.endpoint)
    sources = tuple(
        KvEventSource(rank, endpoint_for_rank(endpoint, rank)) for rank in range(dp_start, dp_start + dp_size)
    )
    return KvEventPlan(sources, "")


def is_listening(zmq_endpoint: str, timeout_s: float = 0.5) -> bool:
    """Whether a TCP socket accepts at ``zmq_endpoint`` (``tcp://host:port``); other transports: True."""
    parts = urlsplit(zmq_endpoint)
    if parts.scheme != "tcp" or parts.port is None:
        return True  # ipc:// and inproc:// cannot be probed this way; the subscriber waits for them
    try:
        with socket.create_connection((parts.hostname or LOOPBACK, parts.port), timeout_s):
            return True
    except OSError:
        return False


def missing_sources(
    sources: tuple[KvEventSource, ...],
    wait_s: float = LISTEN_WAIT_S,
    probe: Callable[[str], bool] = is_listening,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> list[KvEventSource]:
    """The sources whose socket still does not accept after ``wait_s`` (the engine binds it at start)."""
    deadline = clock() + wait_s
    pending = list(sources)
    while pending:
        pending = [source for source in pending if not probe(source.zmq_endpoint)]
        if not pending or clock() >= deadline:
            break
        sleep(0.2)
    return pending


def start_publishers(endpoint: Any, sources: tuple[KvEventSource, ...], block_size: int) -> list[Any]:
    """One runtime ``KvEventPublisher`` per source, subscribed to vLLM's socket (the runtime relays)."""
    from dynamo.llm import KvEventPublisher

    publishers = []
    for source in sources:
        publishers.append(
            KvEventPublisher(
                endpoint=endpoint,
                kv_block_size=block_size,
                zmq_endpoint=source.zmq_endpoint,
                zmq_topic="",
                dp_rank=source.dp_rank,
                # Upstream's default: the worker keeps an index of its own blocks, which a router that
                # started late or missed events queries to recover (without it: "live-only", no recovery).
                enable_local_indexer=True,
            )
        )
        log.info(
            "KV events for dp_rank=%d: %s -> the event plane (block size %d)",
            source.dp_rank,
            source.zmq_endpoint,
            block_size,
        )
    return publishers


def stop_publishers(publishers: list[Any]) -> None:
    """Shut the publishers down; a failure to stop one is not the worker's exit reason."""
    if publishers:
        log.info("KV events stopped for %d dp rank(s)", len(publishers))
    for publisher in publishers:
        try:
            publisher.shutdown()
        except Exception:
            log.debug("KV event publisher shutdown", exc_info=True)
    publishers.clear()


def report_missing(missing: list[KvEventSource]) -> None:
    """One WARNING line for the sockets that never came up; the worker keeps serving."""
    if missing:
        where = ", ".join(f"dp_rank={s.dp_rank} {s.zmq_endpoint}" for s in missing)
        log.warning(
            "KV events: nothing listens at vLLM's KV event socket (%s, waited %.0f s; vLLM binds only a "
            "wildcard endpoint such as tcp://*:PORT); serving without KV events: the KV router sees none of "
            "this worker's cached blocks",
            where,
            LISTEN_WAIT_S,
        )
