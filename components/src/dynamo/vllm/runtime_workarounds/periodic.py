"""A named daemon thread that runs a pass every ``interval_s`` until stopped: the shape both file-discovery
workarounds share (the keep-alive and the dead-peer reaper), so each keeps only its own pass."""

from __future__ import annotations

import threading
from typing import Self


class PeriodicThread:
    """Subclasses implement ``_run`` (normally ``while not self._stop.wait(self.interval_s): ...``)."""

    def __init__(self, name: str, interval_s: float) -> None:
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop after the pass under way (waits up to 5 s for it)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        raise NotImplementedError
