"""FPM records from the runtime's ``FpmEventSubscriber``: how our tracker reads the ZMQ event plane.

On ZMQ the plane's publishers (each worker's ``FpmEventRelay``, or a runtime ``FpmDirectPublisher``) are
found through Dynamo discovery, which only the runtime can read, so the tracker takes records from the
runtime's subscriber rather than from a socket of its own: one ``FpmEventSubscriber`` per component
(the subscriber is scoped to one namespace and component), in recv mode. ``recv()`` blocks and releases
the GIL, so each runs in a daemon thread that hands every payload to the event loop, where the tracker
applies it with the same validation and rejection accounting as a NATS message.

What the runtime's subscriber does not hand over: the event-plane envelope (publisher id, sequence, time
stamp) and the endpoint (the subscription is per component). Records therefore carry no publisher id
(restarts are seen from ``counter_id`` going back) and their time stamp is the receive time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)

# (component, payload) -> None, called on the event loop.
PayloadSink = Callable[[str, bytes], None]

JOIN_TIMEOUT_S = 2.0


class RuntimeFpmSource:
    """Runs one recv thread per component; ``sink`` gets each payload on ``loop``.

    ``pending_limit`` bounds the payloads handed to the loop and not yet applied; beyond it payloads
    are dropped and counted in ``dropped`` (the tracker reports them as ``slow_consumer``).
    """

    def __init__(
        self,
        runtime: Any,
        namespace: str,
        components: Sequence[str],
        endpoint: str,
        sink: PayloadSink,
        *,
        pending_limit: int = 262_144,
        on_stream_end: Callable[[str], None] | None = None,
    ) -> None:
        self.runtime = runtime
        self.namespace = namespace
        self.components = tuple(components)
        self.endpoint = endpoint
        self.sink = sink
        self.pending_limit = pending_limit
        self.on_stream_end = on_stream_end
        # Per component: handed to the loop (written by its thread only) and applied (by the loop only),
        # so that no counter is written by two threads.
        self._handed = dict.fromkeys(self.components, 0)
        self._applied = dict.fromkeys(self.components, 0)
        self._dropped = dict.fromkeys(self.components, 0)
        self._subs: list[Any] = []
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def dropped(self) -> int:
        return sum(self._dropped.values())

    @property
    def running(self) -> bool:
        return bool(self._threads) and all(t.is_alive() for t in self._threads)

    def start(self) -> None:
        """Create the subscribers and their threads (call on the event loop's thread)."""
        from dynamo.llm import FpmEventSubscriber

        self._loop = asyncio.get_running_loop()
        for component in self.components:
            endpoint = self.runtime.endpoint(f"{self.namespace}.{component}.{self.endpoint}")
            sub = FpmEventSubscriber(endpoint)
            self._subs.append(sub)
            thread = threading.Thread(
                target=self._recv_loop, args=(sub, component), name=f"fpm-recv-{component}", daemon=True
            )
            self._threads.append(thread)
            thread.start()

    def _recv_loop(self, sub: Any, component: str) -> None:
        loop = self._loop
        assert loop is not None
        while not self._stopping:
            try:
                payload = sub.recv()  # blocks with the GIL released
            except Exception as exc:
                if not self._stopping:
                    logger.warning("FPM subscriber of %s failed: %r", component, exc)
                break
            if payload is None:  # the stream ended (shutdown, or the runtime went away)
                break
            if self._handed[component] - self._applied[component] >= self.pending_limit:
                self._dropped[component] += 1
                continue
            self._handed[component] += 1
            try:
                loop.call_soon_threadsafe(self._deliver, component, bytes(payload))
            except RuntimeError:  # the loop is closed
                break
        if not self._stopping and self.on_stream_end is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self.on_stream_end, component)

    def _deliver(self, component: str, payload: bytes) -> None:
        self._applied[component] += 1
        self.sink(component, payload)

    async def stop(self) -> None:
        """Shut the subscribers down and wait (briefly) for their threads."""
        self._stopping = True
        for sub in self._subs:
            with contextlib.suppress(Exception):
                sub.shutdown()
        threads, self._threads, self._subs = self._threads, [], []
        for thread in threads:
            await asyncio.to_thread(thread.join, JOIN_TIMEOUT_S)
            if thread.is_alive():
                logger.debug("FPM subscriber thread %s still blocked in recv()", thread.name)
