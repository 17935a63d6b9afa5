"""One worker process of the ``local`` connector, whether we started it or adopted it from a previous planner.

A process is named by its pid *and* its start time (psutil's ``create_time``), so a pid the kernel reused
for another program is never signalled. Signals go to the worker process alone (it drains on SIGTERM);
only SIGKILL goes to its whole process group (the worker's vLLM children included).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

import psutil
from dynamo.common import process_group

from .local_hung import stat_state

# Two readings of one process's start time agree to psutil's clock-tick resolution.
START_TIME_TOLERANCE_S = 0.05


def start_time(pid: int) -> float | None:
    """The process's start time (seconds since the epoch), None if there is no such process."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


def same_process_alive(pid: int, started: float) -> bool:
    """True while the process ``pid`` that started at ``started`` runs (a zombie counts as gone)."""
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - started) > START_TIME_TOLERANCE_S:
            return False
        return proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, OSError):
        return False


class ProcessHandle:
    """Poll and signal one process; ``popen`` is None for a process adopted from a previous planner."""

    def __init__(self, pid: int, started: float, popen: subprocess.Popen[bytes] | None = None) -> None:
        self.pid = pid
        self.started = started
        self.popen = popen
        self._returncode: int | None = None
        self._gone = False

    @classmethod
    def spawned(cls, popen: subprocess.Popen[bytes]) -> ProcessHandle:
        return cls(popen.pid, start_time(popen.pid) or 0.0, popen)

    @property
    def adopted(self) -> bool:
        return self.popen is None

    def poll(self) -> bool:
        """True while the process runs; afterwards ``returncode`` says how it ended (None: not our child)."""
        if self._gone:
            return False
        if self.popen is not None:
            rc = self.popen.poll()
            if rc is None:
                return True
            self._returncode = rc
        elif same_process_alive(self.pid, self.started):
            return True
        self._gone = True
        return False

    @property
    def returncode(self) -> int | None:
        return self._returncode

    def run_state(self) -> str | None:
        """The process's state letter from ``/proc/<pid>/stat`` (``R``, ``S``, ``T``...); None if unknown."""
        if not self.poll():
            return None
        try:
            with open(f"/proc/{self.pid}/stat") as stat:
                return stat_state(stat.read())
        except OSError:  # gone meanwhile, or no procfs (not Linux)
            return None

    def signal(self, sig: int) -> bool:
        """Send ``sig`` to the process alone; False if it is gone."""
        if not self.poll():
            return False
        try:
            if self.popen is not None:
                self.popen.send_signal(sig)
            else:
                os.kill(self.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def kill_group(self) -> None:
        """SIGKILL the process group the worker leads (its engine processes), and the worker itself.

        Also right after the worker exited: a group id stays taken while any member lives, so the
        number cannot name anybody else's group.
        """
        alive = self.poll()
        if alive and self.adopted:
            with contextlib.suppress(OSError):
                if os.getpgid(self.pid) != self.pid:  # not a group leader: the worker alone
                    process_group.signal_process(self.pid, signal.SIGKILL)
                    return
        process_group.kill_group(self.pid)

    def group_alive(self) -> bool:
        """Whether any process of the worker's group is left (signal 0 probes without harm)."""
        return process_group.group_alive(self.pid)

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the process to end; True if it did."""
        if self.popen is not None:
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                return False
            return not self.poll()
        try:
            psutil.Process(self.pid).wait(timeout)
        except psutil.TimeoutExpired:
            return not self.poll()
        except (psutil.Error, OSError, ChildProcessError):
            pass
        return not self.poll()
