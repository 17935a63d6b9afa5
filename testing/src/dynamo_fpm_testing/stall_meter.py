"""How long the machine kept ordinary processes from running: the yardstick for the tests' timing bounds.

On this project's 2-core CI machines ordinary processes are now and then kept from running for seconds, 2-33 s
measured (a worker's keep-alive logged one pass 32.7 s late): once with both cores taken by two engine
processes' busy waits, once with the CPUs idle (docs/disaggregation.md, "Hosts that stall"). A timing bound in
a test means "this long while the machine lets the processes run", so the tests subtract what this meter saw:
a request that took 35 s during a 33 s stall took 2 s of the machine's time, and a transfer that really hangs
still fails, because the meter sees no stall then.

The meter is a small child process (not a thread: a thread would also count the test process holding its own
GIL) that sleeps :data:`TICK_S` at a time and reports every wake-up that came more than :data:`MIN_STALL_S`
late as one stall, ``(from, to)`` in ``time.monotonic()`` seconds, which is the same clock in every process
of the machine.
"""

from __future__ import annotations

import atexit
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

TICK_S = 0.05
MIN_STALL_S = 0.2

_CHILD = """
import os, sys, time
tick, least, parent = float(sys.argv[1]), float(sys.argv[2]), os.getppid()
expected = time.monotonic() + tick
while os.getppid() == parent:
    time.sleep(tick)
    now = time.monotonic()
    if now - expected > least:
        print(f"{expected!r} {now!r}", flush=True)
    expected = now + tick
"""


def overlap_s(stalls: Sequence[tuple[float, float]], since: float, until: float) -> float:
    """Seconds of ``[since, until]`` covered by the stalls (which never overlap each other)."""
    return sum(max(0.0, min(end, until) - max(start, since)) for start, end in stalls)


class StallMeter:
    """Collects the stalls its child process reports; started once, stopped when the test session exits."""

    def __init__(self, tick_s: float = TICK_S, min_stall_s: float = MIN_STALL_S) -> None:
        self._args = [sys.executable, "-c", _CHILD, repr(tick_s), repr(min_stall_s)]
        self._stalls: list[tuple[float, float]] = []
        self._lock = threading.Lock()
        self._child: subprocess.Popen[str] | None = None

    def start(self) -> StallMeter:
        with self._lock:
            if self._child is None:
                self._child = subprocess.Popen(self._args, stdout=subprocess.PIPE, text=True)
                threading.Thread(
                    target=self._read, args=(self._child,), name="stall-meter", daemon=True
                ).start()
                atexit.register(self.stop)
        return self

    @property
    def pid(self) -> int | None:
        """The measuring child's pid (None until started)."""
        return None if self._child is None else self._child.pid

    def stop(self) -> None:
        with self._lock:
            child, self._child = self._child, None
        if child is not None:
            child.kill()
            child.wait()

    def _read(self, child: subprocess.Popen[str]) -> None:
        assert child.stdout is not None
        for line in child.stdout:
            start, end = (float(x) for x in line.split())
            with self._lock:
                self._stalls.append((start, end))

    def stalls(self) -> list[tuple[float, float]]:
        with self._lock:
            return list(self._stalls)

    def stalled_s(self, since: float, until: float | None = None) -> float:
        """How much of ``[since, until]`` (``until`` defaults to now) the machine was stalled."""
        return overlap_s(self.stalls(), since, time.monotonic() if until is None else until)


MACHINE = StallMeter()


class Deadline:
    """A timeout that counts only the time the machine ran: each stall measured meanwhile extends it."""

    def __init__(self, timeout_s: float, meter: StallMeter = MACHINE) -> None:
        self.timeout_s = timeout_s
        self.meter = meter.start()
        self.started = time.monotonic()

    def stalled_s(self) -> float:
        return self.meter.stalled_s(self.started)

    def left_s(self) -> float:
        return self.started + self.timeout_s + self.stalled_s() - time.monotonic()

    def expired(self) -> bool:
        return self.left_s() <= 0

    def describe(self) -> str:
        """For failure messages: the timeout and the stall that extended it."""
        return f"{self.timeout_s} s (plus {self.stalled_s():.1f} s the machine stalled meanwhile)"


def running_s(started: float, ended: float, meter: StallMeter = MACHINE) -> float:
    """Seconds of ``[started, ended]`` in which the machine ran (the stalls the meter saw taken out)."""
    return ended - started - meter.stalled_s(started, ended)
