"""Direct NATS publisher for FPM records, made for the vLLM scheduler thread.

``publish()`` is a ``deque.append``, one stored counter and one flag test: no lock, never a GIL
release, never a wait on the network. A wake-up that releases the GIL (a pipe write,
``queue.Queue.put``'s notify, a Rust call with ``allow_threads``) can cost the caller a whole 5 ms switch
interval when a busy thread runs beside it, so the hand-off avoids it:

* a background thread (owning an asyncio loop on a ``select`` selector and the nats-py connection)
  drains the queue in one batch whenever it runs: every record is encoded into one buffer written to
  the socket at once (``nats_fast_path``);
* between batches it *parks* on a lock (GIL released, no CPU); a ``publish()`` that finds it parked
  wakes it with ``Lock.release()``, which does not release the caller's GIL (a futex wake, and only
  when the sender is parked: in a flood it is busy and the calls cost nothing more). While records
  flow the park ends at least every 5 ms for an event-loop turn (nats-py's reads, PINGs); idle, every
  0.1 s. This replaced a 0.15 ms poll, whose average 75 µs wait made our publish-to-receive latency
  1.2-1.4x the runtime's at the median (docs/fpm-core.md has the figures).

Overflow policy: the queue keeps the newest ``max_queue`` records and drops the oldest. The sender
counts the drops from the arrival counter (arrivals = sent + dropped + queued) and leaves matching
gaps in ``counter_id``: consumers see lost records as gaps, and ``stats().dropped`` counts them.
While NATS is down nothing is sent; the queue keeps the newest records and they go out (oldest
first) once a connection is back. The sender reconnects forever with exponential backoff.

Idle heartbeat: when nothing was sent for ``heartbeat_interval`` seconds the sender repeats the
idle record (identity only, or a snapshot the caller handed over with ``set_idle_record``);
``set_idle_record(None)`` suspends heartbeats (the scheduler does this while it has requests).
With ``gate_file`` set, heartbeats are held while that file is missing: a standby worker (loaded, not
registered) stays out of every tracker until it registers and creates the file.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import logging
import os
import random
import selectors
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import msgspec
from dynamo.common.forward_pass_metrics import ForwardPassMetrics
from dynamo.common.fpm_subjects import (
    DEFAULT_ENDPOINT,
    FPM_TOPIC,
    EventEnvelope,
    fpm_subject,
)
from dynamo.common.nats_fast_path import FrameWriter
from dynamo.common.nats_options import (
    nats_connect_options_from_env,
    nats_servers,
    nats_url_from_env,
    redact_url,
)
from dynamo.common.rate_limited_log import RateLimitedWarning
from dynamo.common.transport_state import TransportState

logger = logging.getLogger(__name__)

# Sender timing (seconds). Between batches the sender parks until publish() wakes it or a timer is due.
POLL_ACTIVE = 0.00015  # while closing (draining the queue before the deadline)
PARK_AFTER = 1.0  # after this long without records the parks last up to PARK_MAX ...
PARK_MAX = 0.1  # ... the longest the sender leaves its event loop (nats-py's I/O) unattended when idle
POLL_IDLE = 0.01  # while NATS is down
LOOP_EVERY = 0.005  # while records flow: an event-loop turn at least this often
BATCH_MAX = 8192  # one turn can send a whole default-size queue
BACKLOG = 64  # this many queued after a drain: drain again at once, no park
STATS_FILE_INTERVAL = 1.0
CONNECT_TIMEOUT = 2
BACKOFF_MIN, BACKOFF_MAX = 0.05, 2.0


@dataclass(frozen=True)
class PublisherStats:
    """Counters of one publisher.

    ``published``: records from ``publish()`` handed to NATS; ``heartbeats``: idle heartbeats sent
    (not in ``published``); ``dropped``: records lost before NATS (queue overflow, NATS down at
    close, unencodable); ``reconnects``: successful connections after the first; ``queued``: waiting;
    ``outages``: times an established connection was lost; ``down_s``: how long the current outage
    (or the wait for the first connection) has lasted, 0 while connected.
    """

    published: int
    dropped: int
    heartbeats: int
    reconnects: int
    queued: int
    connected: bool
    last_error: str | None
    outages: int = 0
    down_s: float = 0.0


def _reduce_timer_slack() -> None:
    """Let this thread's short sleeps end on time (Linux adds up to 50 µs of timer slack by default)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None).prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, 1 µs, this thread only
    except Exception:
        logger.debug("could not set the timer slack", exc_info=True)


def _new_publisher_id() -> int:
    # The runtime uses a random u64 that must also fit a signed msgpack int for other decoders.
    return random.SystemRandom().getrandbits(63)


class FpmDirectPublisher:
    """Publishes one engine's (worker_id, dp_rank) FPM records to NATS. See the module docstring."""

    def __init__(
        self,
        *,
        namespace: str,
        component: str,
        endpoint: str = DEFAULT_ENDPOINT,
        worker_id: str,
        dp_rank: int = 0,
        nats_url: str | None = None,
        max_queue: int = 8192,
        heartbeat_interval: float = 1.0,
        stats_file: str | None = None,
        gate_file: str | None = None,
        start: bool = True,
    ) -> None:
        if max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        self.subject = fpm_subject(namespace, component, endpoint)
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self.nats_url = nats_url or nats_url_from_env()
        self.max_queue = max_queue
        self.heartbeat_interval = heartbeat_interval
        self.stats_file = stats_file
        # Figures of the engine's own, written into the stats file beside the publisher's counters.
        self.extra_stats: dict[str, Any] = {}
        # Heartbeats wait while this file is missing (a standby worker is not registered yet).
        self.gate_file = gate_file
        self.publisher_id = _new_publisher_id()
        self._pub_head = f"PUB {self.subject} ".encode()
        self._writer: FrameWriter | None = None  # set per connection (nats_fast_path)
        self._direct = False  # set per connection: no flusher task to yield to after a write
        # Hot path state: publish() touches only the queue, the arrival counter and the park flag.
        self._q: collections.deque[Any] = collections.deque(maxlen=max_queue)
        self._arrivals = itertools.count(1)  # next() once per publish(), after the append ...
        self._arrived_n = 0  # ... whose value publish() stores here: the records handed over so far
        self._idle_record: ForwardPassMetrics | None = ForwardPassMetrics(
            worker_id=worker_id, dp_rank=dp_rank, wall_time=0.0
        )
        # Sender-thread state.
        # Accounting: arrivals = taken (popped) + overflow (dropped by the full queue) + queued.
        # counter_id of a record = its arrival index + heartbeats sent before it, so every drop
        # leaves a gap.
        self._taken = 0
        self._overflow = 0
        self._heartbeat_ids = 0
        self._lost = 0  # unencodable records, failed writes, records left at close
        self._sequence = 0
        self._published = 0
        self._heartbeats = 0
        self._reconnects = 0
        self._connected = False
        self._transport = TransportState(logger, f"FPM publisher {worker_id}/{dp_rank}", self._peer())
        self._last_error: str | None = None
        self._warn = RateLimitedWarning(logger, f"FPM publisher {worker_id}/{dp_rank} dropped a record")
        self._closing = False
        self._parked = False
        self._wake = threading.Lock()  # held by the sender's side; publish() releases it to unpark
        self._wake.acquire()
        # wait_sent(): callers waiting for the sender to take the records handed over so far.
        self._sent = threading.Condition(threading.Lock())
        self._sent_waiters = 0
        self._handled = 0  # arrivals the sender has taken or counted as dropped
        self._close_deadline = 0.0
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pid = os.getpid()
        if start:
            self.start()

    # ----------------------------------------------------------------- caller side (hot path)
    def publish(self, record: ForwardPassMetrics) -> None:
        """Hand a record over; never raises, never blocks (drop-oldest when the queue is full)."""
        self._q.append(record)
        self._arrived_n = next(self._arrivals)
        if self._parked:  # only the first record after an idle spell wakes the sender
            self._unpark()

    def wait_sent(self, timeout: float) -> bool:
        """Block (GIL released) until the sender has taken every record handed over so far.

        Not for the hot path: for a caller about to spin without releasing the GIL, e.g. an engine
        loop stepping requests that wait for remote KV. Such a loop can keep the sender from the GIL for
        hundreds of milliseconds after each record (docs/fpm-core.md); waiting here hands it over.
        False after ``timeout`` (NATS down, sender busy), never an exception.
        """
        target = self._arrived_n
        if self._handled >= target or not self._connected:
            return self._handled >= target
        deadline = time.monotonic() + timeout
        with self._sent:
            self._sent_waiters += 1
            try:
                while self._handled < target:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._sent.wait(left)
            finally:
                self._sent_waiters -= 1
        return True

    def set_idle_record(self, record: ForwardPassMetrics | None) -> None:
        """What the idle heartbeat repeats; ``None`` suspends heartbeats."""
        self._idle_record = record

    # ----------------------------------------------------------------- control
    def start(self) -> None:
        """Start the sender thread (idempotent). Call in the process that publishes."""
        if self._thread is not None and self._thread.is_alive() and self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self._closing = False
        self._thread = threading.Thread(target=self._thread_main, name="fpm-publisher", daemon=True)
        self._thread.start()

    def stats(self) -> PublisherStats:
        transport = self._transport.snapshot()
        return PublisherStats(
            published=self._published,
            dropped=self._lost + self._overflow + self._unnoticed_drops(),
            heartbeats=self._heartbeats,
            reconnects=self._reconnects,
            queued=len(self._q),
            connected=self._connected,
            last_error=self._last_error,
            outages=transport.outages,
            down_s=round(transport.down_s, 3),
        )

    def close(self, timeout: float = 2.0) -> None:
        """Send what can be sent within ``timeout``, then stop the thread. Idempotent."""
        thread = self._thread
        if thread is None:
            return
        if not self._closing:
            self._close_deadline = time.monotonic() + max(0.0, timeout)
            self._closing = True
            self._unpark()
        thread.join(timeout + 1.0)
        if not thread.is_alive():
            self._thread = None

    def __enter__(self) -> FpmDirectPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- sender thread
    def _arrived(self) -> int:
        """How many records publish() has handed over.

        ``next()`` on the counter is atomic under the GIL and its value is stored after the append, so the
        figure never runs ahead of the queue. With several threads calling ``publish()`` an older value may
        be stored after a newer one: the figure can then only be low (drops undercounted, never invented).
        """
        return self._arrived_n

    def _overflow_now(self) -> int:
        """Drops by the full queue so far. Read in this order, a publish() in flight can only make
        the figure low (never a phantom drop); it is exact once the caller pauses."""
        arrived = self._arrived()
        taken = self._taken
        return max(self._overflow, arrived - taken - len(self._q))

    def _unnoticed_drops(self) -> int:
        """Queue drops the sender has not accounted for yet."""
        return self._overflow_now() - self._overflow

    def _thread_main(self) -> None:
        _reduce_timer_slack()
        # select() honours sub-millisecond timeouts (epoll rounds up to 1 ms).
        loop = asyncio.SelectorEventLoop(selectors.SelectSelector())
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        except Exception as exc:  # the sender must never take the engine down
            self._last_error = f"sender crashed: {exc!r}"
            logger.exception("FPM publisher sender thread crashed")
        finally:
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()
                self._connected = False

    async def _main(self) -> None:
        conn = self._new_connection()
        conn_task = asyncio.ensure_future(conn.run())
        next_stats = 0.0
        last_sent = last_record = last_io = time.monotonic()
        try:
            while True:
                now = time.monotonic()
                nc = conn.nc if self._connected else None
                if nc is not None and not nc.is_connected:
                    nc = None  # going down: keep the records queued for the next connection
                if nc is not None and self._q:
                    await self._drain(nc)
                    if not self._direct:
                        await asyncio.sleep(0)  # let nats-py's flusher write the batch
                    self._notify_sent()
                    last_sent = last_record = now
                elif (
                    nc is not None
                    and self._idle_record is not None
                    and now - last_sent >= self.heartbeat_interval
                ):
                    if self.gate_file is None or os.path.exists(self.gate_file):
                        await self._send_heartbeat(nc)
                    last_sent = now
                if self.stats_file and now >= next_stats:
                    self._write_stats_file()
                    next_stats = now + STATS_FILE_INTERVAL
                if self._closing and (not self._q or now >= self._close_deadline or nc is None):
                    if nc is None and now < self._close_deadline and self._q:
                        await asyncio.sleep(0.01)  # still connecting: wait for it until the deadline
                        continue
                    break
                if nc is not None and len(self._q) >= BACKLOG:
                    continue  # a backlog: drain again at once (every sleep hands a flood the GIL)
                quiet = now - last_record
                if nc is None or self._closing:
                    await asyncio.sleep(POLL_ACTIVE if self._closing else POLL_IDLE)
                    continue
                # Park this thread (GIL released, no CPU) until publish() wakes it or the next timer is
                # due: heartbeat, stats file, and nats-py's own I/O (PINGs, errors): at least every
                # LOOP_EVERY while records flow, every PARK_MAX when idle.
                due = LOOP_EVERY - (now - last_io) if quiet < PARK_AFTER else PARK_MAX
                if self._idle_record is not None:
                    due = min(due, last_sent + self.heartbeat_interval - now)
                if self.stats_file:
                    due = min(due, next_stats - now)
                self._park(due)
                if time.monotonic() - last_io >= LOOP_EVERY or quiet >= PARK_AFTER:
                    await asyncio.sleep(0)  # socket events that arrived while parked
                    last_io = time.monotonic()
            await conn.flush_and_close(max(0.05, self._close_deadline - time.monotonic()))
        finally:
            conn_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await conn_task
            # Whatever could not be sent is lost: count it.
            self._overflow = self._overflow_now()
            left = len(self._q)
            self._taken += left
            self._lost += left
            for _ in range(left):
                self._q.popleft()
            if self.stats_file:
                self._write_stats_file()

    def _new_connection(self) -> Any:
        """The transport's connection keeper (``run``, ``nc``, ``flush_and_close``): NATS here."""
        return _Connection(self)

    def _peer(self) -> str:
        """The transport's address as it appears in log lines."""
        return redact_url(self.nats_url)

    def _park(self, timeout: float) -> None:
        """Block the sender until ``publish()`` unparks it or ``timeout`` passes."""
        if timeout <= 0:
            return
        self._parked = True
        if self._q or self._closing:  # a record (or close) slipped in before the flag was seen
            self._parked = False
            return
        self._wake.acquire(timeout=timeout)
        self._parked = False

    def _unpark(self) -> None:
        # Lock.release() wakes the sender without releasing the caller's GIL (no 5 ms hand-off).
        self._parked = False
        with contextlib.suppress(RuntimeError):  # already released by another caller
            self._wake.release()

    def _notify_sent(self) -> None:
        """Wake wait_sent() callers whose records are all taken (sent, or counted as lost)."""
        self._handled = self._taken + self._overflow
        if self._sent_waiters:
            with self._sent:
                self._sent.notify_all()

    async def _drain(self, nc: Any) -> None:
        """Publish up to BATCH_MAX queued records as one batch (``_send_batch``: one write on NATS).

        Per record this is a struct replace, two msgspec encodes and one bytes format: about 2 µs,
        so a sender that gets the GIL only between a flooding caller's switch intervals still
        delivers well over 100k records/s.
        """
        q = self._q
        popleft = q.popleft
        replace = msgspec.structs.replace
        encode = _record_encoder.encode
        self._overflow = self._overflow_now()
        counter = self._taken + self._overflow + self._heartbeat_ids  # id of the next record popped
        n = min(len(q), BATCH_MAX)
        self._taken += n  # before popping: a concurrent stats() may undercount drops, never invent one
        lost = 0
        payloads: list[bytes] = []
        add = payloads.append
        for _ in range(n):
            record = popleft()
            try:
                add(encode(replace(record, counter_id=counter)))
            except Exception as exc:
                lost += 1
                self._last_error = f"unencodable record: {exc!r}"[:300]
                self._warn.warn("unencodable record")
            counter += 1
        self._lost += lost
        if not payloads:
            return
        delivered = await self._send_batch(nc, payloads)
        self._published += delivered
        self._lost += len(payloads) - delivered  # counters keep advancing: consumers see the gap

    async def _send_batch(self, nc: Any, payloads: list[bytes]) -> int:
        """Send encoded records (sequence numbers from ``self._sequence``); returns how many went out.

        NATS: every envelope and its PUB line built into one buffer, written at once (all or none).
        """
        encode_env = _envelope_encoder.encode
        head = self._pub_head
        sizes = _SIZE_SUFFIX
        pid = self.publisher_id
        now_ms = time.time_ns() // 1_000_000
        seq = self._sequence
        frames: list[bytes] = []
        frame = frames.append
        for payload in payloads:
            env = encode_env(EventEnvelope(pid, seq, now_ms, FPM_TOPIC, payload))
            n = len(env)
            frame(head)
            frame(sizes[n] if n < _SIZE_CACHE else b"%d\r\n" % n)
            frame(env)
            frame(b"\r\n")
            seq += 1
        if not await self._write(nc, frames):
            return 0
        self._sequence = seq
        return len(payloads)

    async def _write(self, nc: Any, frames: list[bytes]) -> bool:
        """Write pre-built PUB frames (4 parts per message) in one go (``nats_fast_path``)."""
        writer = self._writer
        try:
            if writer is None or writer.nc is not nc:
                writer = self._writer = FrameWriter(nc, self.subject)
            await writer.write(frames)
        except Exception as exc:  # connection lost: these records are gone (counted by the caller)
            self._last_error = f"publish failed: {exc!r}"[:300]
            return False
        return True

    async def _send_heartbeat(self, nc: Any) -> None:
        record = self._idle_record
        if record is None:
            return
        try:
            counter = self._taken + self._overflow_now() + self._heartbeat_ids
            payload = _record_encoder.encode(msgspec.structs.replace(record, counter_id=counter))
        except Exception as exc:
            self._last_error = f"heartbeat failed: {exc!r}"[:300]
            return
        if not await self._send_batch(nc, [payload]):
            return
        self._heartbeat_ids += 1
        self._heartbeats += 1

    def _write_stats_file(self) -> None:
        path = self.stats_file
        if not path:
            return
        data = asdict(self.stats())
        data.update(self.extra_stats)
        data.update(worker_id=self.worker_id, dp_rank=self.dp_rank, subject=self.subject, time=time.time())
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump(data, f)
            os.replace(tmp, path)
        except OSError as exc:
            self._last_error = f"stats file: {exc!r}"[:300]


_record_encoder = msgspec.msgpack.Encoder()
_envelope_encoder = msgspec.msgpack.Encoder()  # same wire as fpm_subjects.encode_envelope, minus a call
_SIZE_CACHE = 4096
_SIZE_SUFFIX = [b"%d\r\n" % n for n in range(_SIZE_CACHE)]  # the PUB line's "<size>\r\n"


class _Connection:
    """Owns the nats-py client: connect, notice loss, reconnect forever with exponential backoff."""

    def __init__(self, owner: FpmDirectPublisher) -> None:
        self.owner = owner
        self.nc: Any = None
        self._lost = asyncio.Event()
        self._dropped_at_loss = 0

    def _say_down(self, reason: str) -> None:
        """Log the loss (once per outage: TransportState) and remember the drops so far."""
        owner = self.owner
        if owner._transport.connected:
            self._dropped_at_loss = owner.stats().dropped
        owner._transport.down(
            reason,
            f"keeping the newest {owner.max_queue} records to send when it is back",
        )

    async def run(self) -> None:
        import nats  # deferred: keeps `import fpm_publisher` cheap in the engine process

        owner = self.owner
        backoff = BACKOFF_MIN
        first = True
        try:
            options = nats_connect_options_from_env()
        except ValueError as exc:
            owner._last_error = f"bad NATS environment: {exc}"
            logger.error("FPM publisher: %s", owner._last_error)
            return
        while not owner._closing:
            self._lost.clear()
            try:
                nc = await nats.connect(
                    nats_servers(owner.nats_url),
                    name=f"fpm-publisher-{owner.worker_id}-{owner.dp_rank}",
                    connect_timeout=CONNECT_TIMEOUT,
                    allow_reconnect=False,
                    max_reconnect_attempts=0,
                    skip_subject_validation=True,
                    error_cb=self._on_error,
                    disconnected_cb=self._on_lost,
                    closed_cb=self._on_lost,
                    **options,
                )
            except Exception as exc:
                owner._last_error = f"connect to {redact_url(owner.nats_url)} failed: {exc!r}"[:300]
                if not owner._closing:
                    self._say_down(repr(exc)[:200])
                await asyncio.sleep(backoff * random.uniform(0.8, 1.2))
                backoff = min(BACKOFF_MAX, backoff * 2)
                continue
            self.nc = nc
            owner._writer = FrameWriter(nc, owner.subject)
            owner._direct = not owner._writer.needs_flusher_turn
            owner._connected = True
            dropped = owner.stats().dropped - self._dropped_at_loss
            owner._transport.up(f"{dropped} records dropped meanwhile" if dropped else "no record dropped")
            if not first:
                owner._reconnects += 1
            first = False
            backoff = BACKOFF_MIN
            await self._lost.wait()
            owner._connected = False
            if not owner._closing:
                self._say_down((owner._last_error or "")[:200])
            self.nc = None
            with contextlib.suppress(Exception):
                await nc.close()

    async def _on_error(self, exc: Exception) -> None:
        self.owner._last_error = f"nats: {exc!r}"[:300]
        if not self.owner._connected and not self.owner._closing:
            self._say_down(repr(exc)[:200])  # nats-py retries inside connect(): say it once

    async def _on_lost(self) -> None:
        self.owner._connected = False
        self._lost.set()

    async def flush_and_close(self, timeout: float) -> None:
        nc = self.nc
        if nc is None:
            return
        try:
            await asyncio.wait_for(nc.flush(), timeout)
        except Exception as exc:
            self.owner._last_error = f"final flush: {exc!r}"[:300]
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.close(), 1.0)
        self.owner._connected = False
        self.nc = None
