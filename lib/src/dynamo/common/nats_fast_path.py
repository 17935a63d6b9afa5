"""The one place that writes to nats-py's private internals: a batch of pre-built PUB frames in one write.

Why: ``nc.publish()`` per record costs an event-loop turn through nats-py's flusher task each time; the
publisher instead builds every record's ``PUB <subject> <size>\\r\\n<envelope>\\r\\n`` itself and hands the
whole batch over at once (docs/fpm-core.md). Three ways, the first that applies:

* ``direct``: a plain TCP connection (nats-py's ``TcpTransport``): the bytes go to ``nc._transport``;
  ``drain()`` waits only when the socket buffer is full;
* ``pending``: TLS or another transport: ``nc._send_command`` + ``nc._flush_pending`` (nats-py's own
  buffer and flusher);
* ``plain``: ``nc.publish()`` per record, the public API. Used when the installed nats-py is outside the
  versions these internals were checked against (:data:`TESTED`), when an attribute is missing, or when
  :data:`PLAIN_ONLY` is set (the tests run the publisher's suite that way too).

Only the publisher's sender thread calls this, on its own event loop.
"""

from __future__ import annotations

import logging
from importlib import metadata
from typing import Any

logger = logging.getLogger(__name__)

# nats-py versions whose private internals (_transport, TcpTransport, _send_command, _flush_pending) were
# read and tested here: from TESTED[0] (inclusive) to TESTED[1] (exclusive). Outside: the public API.
TESTED = ((2, 9), (2, 17))
PLAIN_ONLY = False  # True: always the public API (tests)


def nats_py_version() -> tuple[int, int] | None:
    """(major, minor) of the installed nats-py, ``None`` if unknown."""
    try:
        text = metadata.version("nats-py")
    except metadata.PackageNotFoundError:
        return None
    parts = text.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def _fast_path_allowed() -> bool:
    version = nats_py_version()
    return not PLAIN_ONLY and version is not None and TESTED[0] <= version < TESTED[1]


class FrameWriter:
    """Writes lists of PUB frames (4 parts per message: head, size line, envelope, CRLF) to one client."""

    def __init__(self, nc: Any, subject: str) -> None:
        self.nc = nc
        self.subject = subject
        self.mode = "plain"
        if _fast_path_allowed():
            if type(getattr(nc, "_transport", None)).__name__ == "TcpTransport":
                self.mode = "direct"
            elif callable(getattr(nc, "_send_command", None)) and callable(
                getattr(nc, "_flush_pending", None)
            ):
                self.mode = "pending"
        logger.debug("FPM publisher writes to NATS in %s mode", self.mode)

    @property
    def needs_flusher_turn(self) -> bool:
        """Whether nats-py's flusher task must run (an event-loop turn) before the bytes leave."""
        return self.mode != "direct"

    async def write(self, frames: list[bytes]) -> None:
        """Raises on a lost connection (the caller counts the records as lost)."""
        nc = self.nc
        if not nc.is_connected:
            raise ConnectionError("not connected")
        if self.mode == "direct":
            transport = nc._transport
            transport.write(b"".join(frames))
            await transport.drain()
        elif self.mode == "pending":
            await nc._send_command(b"".join(frames))
            await nc._flush_pending()
        else:
            for envelope in frames[2::4]:
                await nc.publish(self.subject, envelope)
