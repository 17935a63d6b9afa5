"""The state of one NATS connection, with loss and recovery logged once each per outage.

Publisher and tracker share it, so an outage reads the same everywhere: one WARNING line when the
connection is lost (or cannot be made at start), one WARNING line when it is back (with how long it
was down), nothing in between however many messages or reconnect attempts there are. Both lines are
warnings so that they show in processes that print warnings only (vLLM's engine process).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class TransportSnapshot:
    """``connected``; ``outages``: losses of an established connection; ``down_s``: how long the
    current outage (or the first connection attempt) has lasted, 0 while connected."""

    connected: bool
    outages: int
    down_s: float


class TransportState:
    def __init__(
        self,
        logger: logging.Logger,
        who: str,
        url: str,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.who = who
        self.url = url  # already redacted
        self.clock = clock
        self.connected = False
        self.outages = 0
        self._ever = False
        self._down_since: float | None = clock()
        self._logged_down = False

    def up(self, detail: str = "") -> None:
        """A connection is established (first or again)."""
        if self.connected:
            return
        now = self.clock()
        if self._logged_down:
            down = now - (self._down_since or now)
            self.logger.warning(
                "%s: NATS connection to %s is back after %.1f s%s",
                self.who,
                self.url,
                down,
                f"; {detail}" if detail else "",
            )
        self.connected = True
        self._ever = True
        self._down_since = None
        self._logged_down = False

    def down(self, reason: str = "", detail: str = "") -> None:
        """The connection was lost, or an attempt to make the first one failed."""
        if not self.connected and self._logged_down:
            return  # the same outage: already said
        now = self.clock()
        if self.connected:
            self.outages += 1
            self._down_since = now
            what = "lost its NATS connection to"
        else:
            what = "cannot reach NATS at"
            if self._down_since is None:
                self._down_since = now
        self.connected = False
        self._logged_down = True
        self.logger.warning(
            "%s %s %s%s%s; logging again only when it is back",
            self.who,
            what,
            self.url,
            f" ({reason})" if reason else "",
            f"; {detail}" if detail else "",
        )

    def snapshot(self) -> TransportSnapshot:
        down = 0.0 if self.connected or self._down_since is None else self.clock() - self._down_since
        return TransportSnapshot(self.connected, self.outages, max(0.0, down))
