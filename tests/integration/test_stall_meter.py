"""The stall meter the timing bounds rely on: a stopped process is measured, the test's own GIL is not."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator

import pytest
from dynamo_fpm_testing.stall_meter import Deadline, StallMeter, overlap_s, running_s
from dynamo_fpm_testing.worker_support import wait_until


def test_overlap_counts_only_the_window() -> None:
    stalls = [(10.0, 12.0), (20.0, 25.0)]
    assert overlap_s(stalls, 0.0, 100.0) == 7.0
    assert overlap_s(stalls, 11.0, 21.0) == 2.0  # 1 s of the first, 1 s of the second
    assert overlap_s(stalls, 12.0, 20.0) == 0.0
    assert overlap_s(stalls, 21.0, 22.0) == 1.0  # inside one stall
    assert overlap_s([], 0.0, 1.0) == 0.0


@pytest.fixture()
def meter() -> Iterator[StallMeter]:
    own = StallMeter().start()
    time.sleep(0.3)  # the child is ticking
    yield own
    own.stop()


def _stop_for(pid: int, seconds: float) -> None:
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_stopped_process_is_measured_and_extends_deadlines(meter: StallMeter) -> None:
    """SIGSTOP on the measuring child is what the machine's stalls do to every ordinary process."""
    assert meter.pid is not None
    before = list(meter.stalls())
    deadline = Deadline(0.5, meter)
    started = time.monotonic()
    _stop_for(meter.pid, 1.0)
    wait_until(lambda: len(meter.stalls()) > len(before), timeout=3)
    new = [s for s in meter.stalls() if s not in before]
    assert any(0.8 <= end - start <= 1.6 for start, end in new), new
    assert not deadline.expired()  # 0.5 s plus the ~1 s stall have not passed yet
    assert running_s(started, time.monotonic(), meter) < 0.7
    time.sleep(deadline.left_s() + 0.05)
    assert deadline.expired()
    assert "machine stalled" in deadline.describe()


def test_the_test_process_holding_its_gil_is_not_a_stall(meter: StallMeter) -> None:
    """A thread in this process would count this process's own busy time; the child does not."""
    before = len(meter.stalls())
    old = sys.getswitchinterval()
    sys.setswitchinterval(5.0)  # no other thread of this process runs while the loop below spins
    try:
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            pass
    finally:
        sys.setswitchinterval(old)
    time.sleep(0.3)
    assert len(meter.stalls()) == before, meter.stalls()
