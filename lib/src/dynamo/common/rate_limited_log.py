"""Per-message warnings, rate-limited: one line per interval, with what was suppressed meanwhile.

A flood of bad messages must not flood the log (700 malformed messages once gave 555 warnings), yet the
operator must learn that they keep coming. ``RateLimitedWarning.warn(reason)`` logs the first
occurrence at once, then at most one line per ``interval_s``; each line carries the count of the
warnings suppressed since the previous line, by reason. Reasons should come from a small fixed set
(they are dictionary keys until the next line is written).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

DEFAULT_INTERVAL_S = 10.0
MAX_REASONS = 32  # distinct reasons kept between two lines; beyond that they are lumped as "other"


class RateLimitedWarning:
    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.what = what
        self.interval_s = interval_s
        self.clock = clock
        self._last: float | None = None
        self._suppressed: dict[str, int] = {}
        self.lines = 0  # lines written (for tests and metrics)
        self.total = 0  # warnings asked for

    def warn(self, reason: str) -> bool:
        """Count one occurrence; returns whether a line was written now."""
        self.total += 1
        now = self.clock()
        if self._last is not None and now - self._last < self.interval_s:
            key = reason if reason in self._suppressed or len(self._suppressed) < MAX_REASONS else "other"
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        self._emit(reason, now)
        return True

    def _emit(self, reason: str, now: float) -> None:
        suppressed, self._suppressed = self._suppressed, {}
        since = 0.0 if self._last is None else now - self._last
        self._last = now
        self.lines += 1
        if suppressed:
            detail = ", ".join(f"{n} {r}" for r, n in sorted(suppressed.items(), key=lambda kv: -kv[1]))
            self.logger.warning(
                "%s: %s (and %d more suppressed in the last %.0f s: %s; at most one line per %g s)",
                self.what,
                reason,
                sum(suppressed.values()),
                since,
                detail,
                self.interval_s,
            )
        else:
            self.logger.warning(
                "%s: %s (further ones: at most one line per %g s, with counts)",
                self.what,
                reason,
                self.interval_s,
            )

    def flush(self) -> None:
        """Write the suppressed counts now, if any (at shutdown)."""
        if not self._suppressed:
            return
        suppressed, self._suppressed = self._suppressed, {}
        now = self.clock()
        since = 0.0 if self._last is None else now - self._last
        self._last = now
        self.lines += 1
        detail = ", ".join(f"{n} {r}" for r, n in sorted(suppressed.items(), key=lambda kv: -kv[1]))
        self.logger.warning(
            "%s: %d more suppressed in the last %.0f s: %s",
            self.what,
            sum(suppressed.values()),
            since,
            detail,
        )
