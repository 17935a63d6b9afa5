"""Process groups, written once: start a child in a session of its own, signal or kill its whole group,
stop it with a grace period. Used by the planner's ``local`` connector, the demo's supervisor and the tests'
process helpers.

A child started with :func:`start_in_own_session` leads a process group that its own children (vLLM's engine
processes) join, so one ``killpg`` reaches all of them, and a Ctrl-C on the terminal reaches none of them.
A group id stays taken while any member lives, so signalling a group whose leader already exited cannot
reach anybody else's processes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

# What the callers pass for a child's stdin, stdout and stderr: a constant of subprocess, a file, or None.
Redirect = int | IO[bytes] | None


def start_in_own_session(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    stdin: Redirect = None,
    stdout: Redirect = None,
    stderr: Redirect = None,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` as the leader of a new session and process group (its pid is the group id)."""
    return subprocess.Popen(
        list(argv), env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr, start_new_session=True
    )


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to every process of the group ``pgid``; False if the group is gone (or not ours)."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def signal_process(pid: int, sig: int) -> bool:
    """Send ``sig`` to the process ``pid`` alone; False if it is gone (or not ours)."""
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def kill_group(pgid: int) -> None:
    """SIGKILL every process of the group ``pgid`` (none left: nothing happens)."""
    signal_group(pgid, signal.SIGKILL)


def group_alive(pgid: int) -> bool:
    """Whether any process of the group is left (signal 0 probes without harm)."""
    return signal_group(pgid, 0)


def kill_group_and_reap(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """SIGKILL the group ``proc`` leads and reap ``proc`` (waiting at most ``timeout`` s)."""
    kill_group(proc.pid)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout)


def terminate_group(
    proc: subprocess.Popen[bytes], grace_s: float, *, kill_wait_s: float | None = 5.0
) -> int | None:
    """SIGTERM to the group ``proc`` leads, SIGKILL to it if ``proc`` has not exited after ``grace_s``, then
    SIGKILL to whatever is left of the group (stragglers of a leader that exited). Returns the exit code.

    ``kill_wait_s`` bounds the wait after the SIGKILL (None: until it exits; a timeout raises, as a process
    that survives SIGKILL is a kernel problem worth seeing).
    """
    if proc.poll() is None:
        signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            proc.wait(kill_wait_s)
    kill_group(proc.pid)
    return proc.returncode
