"""Time this process's garbage collections over a window, for a timing test's failure message.

A full suite holds many objects by its end (vLLM, torch, upstream's modules, hypothesis), so one full
collection can stop a test's event loop long enough to matter to a receiver-side timing. Reporting the
pauses tells that apart from a slow engine.
"""

from __future__ import annotations

import gc
import time
from typing import Any


class GcPauses:
    """Collections (generation, seconds) between ``start()`` and ``stop()``."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._began: float | None = None

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.pauses.append((int(info.get("generation", -1)), time.perf_counter() - self._began))
            self._began = None

    def start(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def stop(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def summary(self) -> str:
        """``"3 collections, 0.012 s in all, longest 0.010 s (generation 2)"``, or ``"none"``."""
        if not self.pauses:
            return "none"
        gen, longest = max(self.pauses, key=lambda p: p[1])
        total = sum(p for _, p in self.pauses)
        n = len(self.pauses)
        return f"{n} collections, {total:.3f} s in all, longest {longest:.3f} s (generation {gen})"
