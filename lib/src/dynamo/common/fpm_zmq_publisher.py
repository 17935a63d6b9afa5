"""FPM publisher for the ZMQ event plane: engine process -> loopback ZMQ PUB -> the runtime's relay.

On ZMQ the engine process cannot publish on the event plane itself: the plane's publishers are found
through Dynamo discovery, which only the worker's main process (it holds the runtime) can register in.
So, as upstream 1.6.1's vLLM scheduler does, the engine process binds a ZMQ PUB on
``tcp://127.0.0.1:{port + dp_rank}`` and the worker's main process runs the runtime's
``dynamo.llm.FpmEventRelay(endpoint, that address)``, which registers with discovery and republishes each
record on the event plane under the worker's component.

Wire, as upstream's ``_FpmPublisherThread`` writes it and the runtime's relay reads it: one multipart
message per record, ``[b"" (topic), sequence (8 bytes, big-endian), payload (the encoded record)]``. The
relay checks for exactly three frames and forwards the third; it adds the event-plane envelope itself.

Everything else is :class:`~dynamo.common.fpm_publisher.FpmDirectPublisher`'s: the same ``publish()``
hand-off (a ``deque.append``), drop-oldest queue, ``counter_id`` stamping with gaps for drops, idle
heartbeats, gate file and stats file. Differences that follow from ZMQ: a PUB socket never waits for a
peer, so ``connected`` means "bound"; records sent while no relay is connected, or beyond the socket's
high-water mark, are dropped by ZMQ without a trace here and show as ``counter_id`` gaps downstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from typing import Any

from dynamo.common.fpm_publisher import BACKOFF_MAX, BACKOFF_MIN, FpmDirectPublisher

logger = logging.getLogger(__name__)

SEND_HWM = 10_000  # messages ZMQ buffers per connected relay before it drops (its default is 1,000)
CLOSE_LINGER_MS = 200  # at close, how long ZMQ may still push queued frames to the relay


class FpmZmqPublisher(FpmDirectPublisher):
    """Publishes one engine's FPM records as ZMQ PUB frames for the runtime's ``FpmEventRelay``.

    ``zmq_endpoint`` is the address to bind (``tcp://127.0.0.1:PORT``); the other arguments are
    :class:`FpmDirectPublisher`'s (``nats_url`` is not used).
    """

    def __init__(self, *, zmq_endpoint: str, **kwargs: Any) -> None:
        self.zmq_endpoint = zmq_endpoint  # before the base starts the sender thread
        kwargs.pop("nats_url", None)
        super().__init__(**kwargs)
        self._direct = True  # no flusher task to yield to: frames leave in send_multipart()

    def _new_connection(self) -> _ZmqBinding:
        return _ZmqBinding(self)

    def _peer(self) -> str:
        return self.zmq_endpoint

    async def _send_batch(self, nc: Any, payloads: list[bytes]) -> int:
        """One multipart message per record; a full socket (``zmq.Again``) drops the rest of the batch."""
        import zmq

        send = nc.send_multipart
        seq = self._sequence
        sent = 0
        try:
            for payload in payloads:
                send((b"", seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK, copy=True)
                seq += 1
                sent += 1
        except zmq.Again:
            self._last_error = "ZMQ send buffer full: records dropped"
        except Exception as exc:  # socket closed under us: the records are gone (counted by the caller)
            self._last_error = f"publish failed: {exc!r}"[:300]
        self._sequence = seq
        return sent


class _BoundSocket:
    """The PUB socket as the sender loop sees a connection (``is_connected``, ``send_multipart``)."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.send_multipart = sock.send_multipart
        self.is_connected = True


class _ZmqBinding:
    """Binds the PUB socket in the sender thread (ZMQ sockets stay in the thread that made them)."""

    def __init__(self, owner: FpmZmqPublisher) -> None:
        self.owner = owner
        self.nc: _BoundSocket | None = None
        self._ctx: Any = None

    async def run(self) -> None:
        import zmq

        owner = self.owner
        self._ctx = zmq.Context()
        backoff = BACKOFF_MIN
        while not owner._closing:
            sock = self._ctx.socket(zmq.PUB)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
            try:
                sock.bind(owner.zmq_endpoint)
            except Exception as exc:  # port taken (another process): retry, never raise into the engine
                sock.close(linger=0)
                owner._last_error = f"bind {owner.zmq_endpoint} failed: {exc!r}"[:300]
                owner._transport.down(repr(exc)[:200], "records stay queued until the bind succeeds")
                await asyncio.sleep(backoff * random.uniform(0.8, 1.2))
                backoff = min(BACKOFF_MAX, backoff * 2)
                continue
            self.nc = _BoundSocket(sock)
            owner._connected = True
            owner._transport.up("bound; the worker's FpmEventRelay connects here")
            try:
                while not owner._closing:
                    await asyncio.sleep(3600)  # cancelled by the sender at close
            finally:
                await self.flush_and_close(0.0)  # a no-op after the sender's own flush_and_close
            return

    async def flush_and_close(self, timeout: float) -> None:
        bound, self.nc = self.nc, None
        self.owner._connected = False
        if bound is not None:
            bound.is_connected = False
            with contextlib.suppress(Exception):
                bound.sock.close(linger=max(0, min(CLOSE_LINGER_MS, int(timeout * 1000))))
        if self._ctx is not None:
            with contextlib.suppress(Exception):
                self._ctx.term()
            self._ctx = None
