"""FPM subscriber: the latest record per engine of one namespace, with gaps, restarts and staleness.

What the planner and the watch CLI read, on either event plane. ``handle_message`` (a NATS message:
subject and envelope) and ``handle_record`` (a bare record, as the runtime's subscriber hands it over on
ZMQ) are the pure part (no I/O, testable without NATS), with one validation and rejection accounting;
``start``/``stop`` wrap them in a nats-py subscription on
``namespace.{ns}.component.{c|*}.endpoint.{e|*}.forward-pass-metrics`` that reconnects forever, or on
ZMQ in the runtime's ``FpmEventSubscriber`` per component (``fpm_runtime_source``).

Per engine key (component, endpoint, worker_id, dp_rank) it keeps the latest record, its receive
time and the latest *timing* record (``wall_time > 0``; heartbeats and queue snapshots are not
timing samples). ``counter_id`` is monotonic per publisher: a jump counts the missing records as
gaps; a decrease, or a new envelope ``publisher_id`` with a lower counter, counts as a restart.
Nothing on the wire can raise out of ``handle_message``: every rejection is counted by reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import msgspec
from dynamo.common.forward_pass_metrics import FPM_VERSION, ForwardPassMetrics
from dynamo.common.fpm_runtime_source import RuntimeFpmSource
from dynamo.common.fpm_subjects import (
    DECODE_COMPONENT,
    DEFAULT_ENDPOINT,
    FPM_TOPIC,
    PREFILL_COMPONENT,
    decode_envelope,
    fpm_subject,
    fpm_subscription,
    parse_fpm_subject,
)
from dynamo.common.fpm_validate import record_problem, subject_problem
from dynamo.common.nats_options import (
    nats_connect_options_from_env,
    nats_servers,
    nats_url_from_env,
    redact_url,
)
from dynamo.common.rate_limited_log import DEFAULT_INTERVAL_S, RateLimitedWarning
from dynamo.common.transport_state import TransportSnapshot, TransportState

logger = logging.getLogger(__name__)


class WorkerKey(NamedTuple):
    component: str
    endpoint: str
    worker_id: str
    dp_rank: int


@dataclass
class TrackedWorker:
    key: WorkerKey
    record: ForwardPassMetrics
    received_at: float  # tracker clock (monotonic) at receipt
    published_at_ms: int  # envelope time stamp (publisher's epoch ms)
    last_timing_record: ForwardPassMetrics | None  # latest with wall_time > 0
    records: int = 0
    gaps: int = 0  # records missing according to counter_id
    restarts: int = 0  # counter went backwards or a new publisher took over
    stale: bool = False
    publisher_id: int = 0
    duplicates: int = 0


@dataclass
class TrackerStats:
    received: int = 0  # messages seen on the subscription
    accepted: int = 0  # records applied to a worker
    malformed_envelope: int = 0
    malformed_record: int = 0
    wrong_version: int = 0
    wrong_subject: int = 0  # not an FPM subject of our namespace / filters
    wrong_topic: int = 0
    missing_worker_id: int = 0  # empty worker_id: never tracked (it would shadow every worker)
    invalid_record: int = 0  # outside the bounds of fpm_validate (reasons in invalid_reasons)
    invalid_reasons: dict[str, int] = field(default_factory=dict)
    evicted: int = 0  # engines dropped because max_engines were tracked (the stalest first)
    duplicates: int = 0  # same publisher and counter_id again
    gaps: int = 0
    restarts: int = 0
    listener_errors: int = 0
    reconnects: int = 0
    slow_consumer: int = 0  # nats-py dropped messages because we fell behind

    def rejected(self) -> int:
        return (
            self.malformed_envelope
            + self.malformed_record
            + self.wrong_version
            + self.wrong_subject
            + self.wrong_topic
            + self.missing_worker_id
            + self.invalid_record
        )


class _VersionOnly(msgspec.Struct):
    version: int = -1


_record_decoder = msgspec.msgpack.Decoder(ForwardPassMetrics)
_version_decoder = msgspec.msgpack.Decoder(_VersionOnly)

Listener = Callable[[TrackedWorker, str], None]


class FpmTracker:
    """Tracks the FPM records of one namespace (optionally one component / endpoint)."""

    def __init__(
        self,
        namespace: str,
        *,
        component: str | None = None,
        endpoint: str | None = None,
        nats_url: str | None = None,
        stale_after: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        warn_interval: float = DEFAULT_INTERVAL_S,
        max_engines: int = 10_000,
        pending_msgs_limit: int = 262_144,
        pending_bytes_limit: int = 64 * 1024 * 1024,
        event_plane: str = "nats",
        runtime: Any = None,
        components: Sequence[str] | None = None,
    ) -> None:
        self.namespace = namespace
        self.component = component
        self.endpoint = endpoint
        self.subscription = fpm_subscription(namespace, component, endpoint)  # validates the tokens
        if event_plane not in ("nats", "zmq"):
            raise ValueError(f"event_plane {event_plane!r}: expected nats or zmq")
        # ZMQ: the runtime's subscriber, one per component (it cannot subscribe to "any component").
        self.event_plane = event_plane
        self.runtime = runtime
        if component is not None:
            components = (component,)
        self.components = tuple(components or (PREFILL_COMPONENT, DECODE_COMPONENT))
        for comp in self.components:
            fpm_subscription(namespace, comp, endpoint)  # validates the tokens
        self._source: RuntimeFpmSource | None = None
        self.nats_url = nats_url
        self.stale_after = stale_after
        self.clock = clock
        if max_engines < 1:
            raise ValueError("max_engines must be >= 1")
        self.max_engines = max_engines
        # nats-py's buffer of messages not yet handled: beyond it messages are dropped (slow_consumer).
        self.pending_msgs_limit = pending_msgs_limit
        self.pending_bytes_limit = pending_bytes_limit
        # Least recently updated first: the stalest is evicted when max_engines are tracked.
        self._workers: OrderedDict[WorkerKey, TrackedWorker] = OrderedDict()
        self._listeners: list[Listener] = []
        self._stats = TrackerStats()
        self._nc: Any = None
        self._sub: Any = None
        self._transport: TransportState | None = None
        self._warn = RateLimitedWarning(
            logger, f"FPM tracker ({namespace}) rejected a message", interval_s=warn_interval
        )

    # ----------------------------------------------------------------- pure part
    def handle_message(self, subject: str, data: bytes) -> None:
        """Apply one NATS message; never raises (rejections are counted in ``stats()``)."""
        st = self._stats
        st.received += 1
        parsed = parse_fpm_subject(subject)
        if (
            parsed is None
            or parsed.namespace != self.namespace
            or (self.component is not None and parsed.component != self.component)
            or (self.endpoint is not None and parsed.endpoint != self.endpoint)
        ):
            st.wrong_subject += 1
            self._warn.warn("wrong_subject")
            return
        try:
            env = decode_envelope(data)
        except Exception:
            st.malformed_envelope += 1
            self._warn.warn("malformed_envelope")
            return
        if env.topic != FPM_TOPIC:
            st.wrong_topic += 1
            self._warn.warn("wrong_topic")
            return
        self._handle_payload(
            parsed.component, parsed.endpoint, env.payload, env.publisher_id, env.published_at, subject
        )

    def handle_record(self, component: str, endpoint: str, payload: bytes, received_at_ms: int = 0) -> None:
        """Apply one record that came without an envelope (the runtime's subscriber on the ZMQ plane).

        Same validation and rejection accounting as :meth:`handle_message`; the record has no publisher
        id (0) and its time stamp is ``received_at_ms`` (the receive time). Never raises.
        """
        st = self._stats
        st.received += 1
        try:
            subject = fpm_subject(self.namespace, component, endpoint)
        except ValueError:
            subject = ""
        if (
            not subject
            or (self.component is not None and component != self.component)
            or (self.endpoint is not None and endpoint != self.endpoint)
        ):
            st.wrong_subject += 1
            self._warn.warn("wrong_subject")
            return
        self._handle_payload(component, endpoint, payload, 0, received_at_ms, subject)

    def _handle_payload(
        self,
        component: str,
        endpoint: str,
        payload: bytes,
        publisher_id: int,
        published_at: int,
        subject: str,
    ) -> None:
        st = self._stats
        try:
            record = _record_decoder.decode(payload)
        except Exception:
            try:
                version = _version_decoder.decode(payload).version
            except Exception:
                version = FPM_VERSION
            if version != FPM_VERSION:
                st.wrong_version += 1
                self._warn.warn("wrong_version")
            else:
                st.malformed_record += 1
                self._warn.warn("malformed_record")
            return
        if record.version != FPM_VERSION:
            st.wrong_version += 1
            self._warn.warn("wrong_version")
            return
        if not record.worker_id:
            st.missing_worker_id += 1
            self._warn.warn("missing_worker_id")
            return
        problem = record_problem(record) or subject_problem(component, endpoint)
        if problem is not None:
            st.invalid_record += 1
            st.invalid_reasons[problem] = st.invalid_reasons.get(problem, 0) + 1
            self._warn.warn(problem)
            return
        key = WorkerKey(component, endpoint, record.worker_id, record.dp_rank)
        worker = self._apply(key, record, publisher_id, published_at)
        if worker is None:
            return
        st.accepted += 1
        for fn in list(self._listeners):
            try:
                fn(worker, subject)
            except Exception:
                st.listener_errors += 1
                if st.listener_errors == 1:
                    logger.exception("FPM tracker listener failed; further failures are only counted")

    def _apply(
        self, key: WorkerKey, record: ForwardPassMetrics, publisher_id: int, published_at: int
    ) -> TrackedWorker | None:
        now = self.clock()
        timing = record if record.wall_time > 0 else None
        worker = self._workers.get(key)
        if worker is None:
            while len(self._workers) >= self.max_engines:
                self._workers.popitem(last=False)
                self._stats.evicted += 1
            worker = TrackedWorker(
                key=key,
                record=record,
                received_at=now,
                published_at_ms=published_at,
                last_timing_record=timing,
                records=1,
                publisher_id=publisher_id,
            )
            self._workers[key] = worker
            return worker
        last = worker.record.counter_id
        counter = record.counter_id
        if publisher_id == worker.publisher_id and counter == last:
            worker.duplicates += 1
            self._stats.duplicates += 1
            return None
        if counter < last or (publisher_id != worker.publisher_id and counter != last + 1):
            worker.restarts += 1
            self._stats.restarts += 1
        elif counter > last + 1:
            missing = counter - last - 1
            worker.gaps += missing
            self._stats.gaps += missing
        self._workers.move_to_end(key)
        worker.record = record
        worker.received_at = now
        worker.published_at_ms = published_at
        worker.publisher_id = publisher_id
        worker.records += 1
        worker.stale = False
        if timing is not None:
            worker.last_timing_record = timing
        return worker

    def workers(self, *, include_stale: bool = False) -> list[TrackedWorker]:
        """Copies of the tracked workers, sorted by key; ``stale`` is evaluated now."""
        now = self.clock()
        out = []
        for key in sorted(self._workers):
            w = self._workers[key]
            w.stale = now - w.received_at > self.stale_after
            if include_stale or not w.stale:
                out.append(replace(w))
        return out

    def get(self, key: WorkerKey) -> TrackedWorker | None:
        w = self._workers.get(key)
        if w is None:
            return None
        w.stale = self.clock() - w.received_at > self.stale_after
        return replace(w)

    def add_listener(self, fn: Listener) -> None:
        """``fn(worker, subject)`` is called for every accepted record (exceptions are counted)."""
        self._listeners.append(fn)

    def forget(self, key: WorkerKey) -> None:
        self._workers.pop(key, None)

    def stats(self) -> TrackerStats:
        dropped = self._source.dropped if self._source is not None else 0
        return replace(
            self._stats,
            invalid_reasons=dict(self._stats.invalid_reasons),
            slow_consumer=self._stats.slow_consumer + dropped,
        )

    def __len__(self) -> int:
        """Engines tracked now (at most ``max_engines``)."""
        return len(self._workers)

    # ----------------------------------------------------------------- NATS
    @property
    def connected(self) -> bool:
        if self._source is not None:
            return self._source.running
        return self._nc is not None and self._nc.is_connected

    def describe(self) -> str:
        """What is watched, for headers and logs: the NATS subscription or the ZMQ components."""
        if self.event_plane == "zmq":
            return f"zmq {self.namespace}.{{{','.join(self.components)}}}.{self.endpoint or DEFAULT_ENDPOINT}"
        return self.subscription

    def transport(self) -> TransportSnapshot:
        """Connected or not, outages so far, and how long the current one has lasted."""
        if self._transport is None:
            return TransportSnapshot(False, 0, 0.0)
        return self._transport.snapshot()

    async def start(self, timeout: float = 5.0) -> None:
        """Connect (env auth/TLS options) and subscribe.

        Raises ``ConnectionError`` when NATS cannot be reached within ``timeout`` seconds; once
        connected, nats-py reconnects forever and restores the subscription. On the ZMQ plane the
        runtime's subscribers start instead (``fpm_runtime_source``); they need ``runtime``.
        """
        if self.event_plane == "zmq":
            self._start_zmq()
            return
        import nats

        url = self.nats_url or nats_url_from_env()
        nc = nats.NATS()
        transport = TransportState(logger, f"FPM tracker ({self.namespace})", redact_url(url))

        async def on_error(exc: Exception) -> None:
            if isinstance(exc, nats.errors.SlowConsumerError):
                self._stats.slow_consumer += 1
            else:
                logger.debug("FPM tracker NATS error: %r", exc)

        async def on_reconnect() -> None:
            self._stats.reconnects += 1
            transport.up("subscription restored")

        async def on_disconnect() -> None:
            if self._nc is not None:  # not our own stop()
                transport.down(detail="records stop until it is back; engines age towards stale meanwhile")

        try:
            await asyncio.wait_for(
                nc.connect(
                    nats_servers(url),
                    name=f"fpm-tracker-{self.namespace}",
                    connect_timeout=max(1, int(timeout)),
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5,
                    error_cb=on_error,
                    reconnected_cb=on_reconnect,
                    disconnected_cb=on_disconnect,
                    **nats_connect_options_from_env(),
                ),
                timeout,
            )
        except (TimeoutError, Exception) as exc:
            try:
                await nc.close()
            except Exception:
                logger.debug("closing the failed NATS client", exc_info=True)
            raise ConnectionError(
                f"cannot reach NATS at {redact_url(url)} within {timeout:g} s ({exc!r})"
            ) from exc

        async def on_msg(msg: Any) -> None:
            self.handle_message(msg.subject, msg.data)

        transport.up()
        self._transport = transport
        self._nc = nc
        self._sub = await nc.subscribe(
            self.subscription,
            cb=on_msg,
            pending_msgs_limit=self.pending_msgs_limit,
            pending_bytes_limit=self.pending_bytes_limit,
        )
        await nc.flush()

    def _start_zmq(self) -> None:
        if self.runtime is None:
            raise ConnectionError("the ZMQ event plane needs the Dynamo runtime (none was given)")
        transport = TransportState(logger, f"FPM tracker ({self.namespace})", "the ZMQ event plane")
        endpoint = self.endpoint or DEFAULT_ENDPOINT

        def sink(component: str, payload: bytes) -> None:
            self.handle_record(component, endpoint, payload, time.time_ns() // 1_000_000)

        def ended(component: str) -> None:
            transport.down(f"the runtime's subscriber of {component} stopped", "no records from it")

        source = RuntimeFpmSource(
            self.runtime,
            self.namespace,
            self.components,
            endpoint,
            sink,
            pending_limit=self.pending_msgs_limit,
            on_stream_end=ended,
        )
        try:
            source.start()
        except Exception as exc:
            raise ConnectionError(f"cannot subscribe on the ZMQ event plane ({exc!r})") from exc
        transport.up()
        self._transport = transport
        self._source = source

    async def stop(self) -> None:
        source, self._source = self._source, None
        if source is not None:
            await source.stop()
        nc, self._nc, self._sub = self._nc, None, None
        self._warn.flush()
        if nc is None:
            return
        try:
            await nc.close()
        except Exception:
            logger.debug("closing NATS", exc_info=True)

    async def __aenter__(self) -> FpmTracker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def record_to_dict(record: ForwardPassMetrics) -> dict[str, Any]:
    """Every field, nested as in the schema (extension fields included, None when absent)."""
    return msgspec.to_builtins(record)


__all__ = [
    "FpmTracker",
    "TrackedWorker",
    "TrackerStats",
    "WorkerKey",
    "record_to_dict",
]
