"""Start, watch and stop the demo's processes; every log goes into one run folder.

Each child runs in its own session (process group) and carries a marker variable in its environment
(``DEMO_RUN_ID``). Children inherit it, so grandchildren (workers a planner starts) are found and
stopped too, even after their parent died: cleanup scans the process table (``psutil``) for the marker.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from dynamo.common.process_group import (
    kill_group,
    signal_group,
    signal_process,
    start_in_own_session,
    terminate_group,
)

RUN_MARKER = "DEMO_RUN_ID"


@dataclass
class Managed:
    """One supervised process; ``critical`` ones end the demo when they exit on their own."""

    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes]
    critical: bool = True
    stopping: bool = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exited(self) -> int | None:
        return self.proc.poll()


@dataclass(frozen=True)
class Failure:
    """A critical process that exited although nobody asked it to."""

    name: str
    returncode: int
    log_path: Path
    tail: str

    def describe(self) -> str:
        return (
            f"component '{self.name}' exited with code {self.returncode}; last lines of {self.log_path}:\n"
            + self.tail
        )


def tail_lines(path: Path, n: int = 20) -> str:
    """The last ``n`` lines of a text file (empty if it does not exist)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 64 * 1024))
            data = fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-n:])


def _alive(proc: psutil.Process) -> bool:
    """Whether the process still runs (not gone, not a zombie)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def pids_with_marker(marker_value: str) -> list[int]:
    """Live processes of a run: those whose environment holds ``DEMO_RUN_ID=<marker_value>``, plus their
    descendants and the other members of their sessions.

    The environment alone is not enough: vLLM renames its engine processes (``VLLM::EngineCore``) by
    rewriting the memory that ``/proc/<pid>/environ`` shows, so the marker disappears from them.
    """
    procs: dict[int, tuple[int, int]] = {}  # pid -> (ppid, sid), live ones only
    marked: set[int] = set()
    for proc in psutil.process_iter(["ppid", "status"]):
        if proc.info["status"] in (None, psutil.STATUS_ZOMBIE):
            continue
        try:
            procs[proc.pid] = (int(proc.info["ppid"]), os.getsid(proc.pid))
        except (OSError, TypeError):
            continue
        try:
            if proc.environ().get(RUN_MARKER) == marker_value:
                marked.add(proc.pid)
        except psutil.Error:
            continue
    own_sid = os.getsid(0)
    sessions = {procs[p][1] for p in marked if procs[p][1] != own_sid}
    found = set(marked) | {p for p, (_, sid) in procs.items() if sid in sessions}
    grew = True
    while grew:  # descendants (a child may have started a session of its own)
        new = {p for p, (ppid, _) in procs.items() if ppid in found and p not in found}
        found |= new
        grew = bool(new)
    found.discard(os.getpid())
    return sorted(found)


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline()).strip()[:300]
    except psutil.Error:
        return "?"


def _start_time(pid: int) -> float | None:
    """When the process started: with the pid it names one process even if the pid is reused later. None if it
    is gone (or a zombie)."""
    try:
        proc = psutil.Process(pid)
        return proc.create_time() if _alive(proc) else None
    except psutil.Error:
        return None


@dataclass
class Supervisor:
    """Owns every process of one demo run. Use as a context manager so cleanup always runs."""

    run_dir: Path
    run_id: str
    base_env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    procs: list[Managed] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.log_dir = self.run_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(self.base_env)
        env.update(extra or {})
        env[RUN_MARKER] = self.run_id
        return env

    def start(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        critical: bool = True,
        stdout_path: Path | None = None,
        cwd: Path | None = None,
    ) -> Managed:
        """Start ``argv`` in its own process group; stdout+stderr go to ``logs/<name>.log``.

        With ``stdout_path``, stdout goes there and only stderr to the log (for JSON-line producers).
        """
        log_path = self.log_dir / f"{name}.log"
        log = open(log_path, "ab")  # noqa: SIM115 - the child keeps its own copy
        out = open(stdout_path, "ab") if stdout_path else log  # noqa: SIM115
        try:
            log.write(f"# {' '.join(argv)}\n".encode())
            log.flush()
            proc = start_in_own_session(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=log, env=self.env(env), cwd=cwd
            )
        finally:
            log.close()
            if out is not log:
                out.close()
        managed = Managed(name=name, argv=list(argv), log_path=log_path, proc=proc, critical=critical)
        self.procs.append(managed)
        return managed

    def get(self, name: str) -> Managed | None:
        return next((m for m in reversed(self.procs) if m.name == name), None)

    def check(self) -> Failure | None:
        """The first critical process that exited on its own, if any."""
        for m in self.procs:
            rc = m.exited()
            if rc is not None and m.critical and not m.stopping:
                return Failure(m.name, rc, m.log_path, tail_lines(m.log_path, 25))
        return None

    def stop(self, managed: Managed, timeout: float = 20.0) -> int | None:
        """SIGTERM to the process group (workers drain), SIGKILL after ``timeout``."""
        managed.stopping = True
        return terminate_group(managed.proc, timeout)

    def stop_all(self, timeout: float = 20.0) -> list[str]:
        """Stop everything in reverse start order, then kill any process still carrying the run marker.

        Returns the pids that had to be killed by the marker scan (should be empty).
        """
        for m in self.procs:
            m.stopping = True
        # The run's processes, listed before anything is signalled: a child in a session of its own whose
        # environment lost the marker is found only through its parent, and stopping the parent orphans it.
        members = {pid: _start_time(pid) for pid in pids_with_marker(self.run_id)}
        pending = [m for m in reversed(self.procs) if m.exited() is None]
        for m in pending:
            signal_group(m.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for m in pending:
            with contextlib.suppress(subprocess.TimeoutExpired):
                m.proc.wait(max(0.1, deadline - time.monotonic()))
        for m in self.procs:
            kill_group(m.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                m.proc.wait(5)
        return self.kill_marked(grace=5.0, members=members)

    def _left(self, members: Mapping[int, float | None]) -> list[int]:
        """Live processes of the run: the marker scan, plus listed members that are still the same process."""
        me = os.getpid()
        listed = {
            pid for pid, started in members.items() if started is not None and _start_time(pid) == started
        }
        return sorted((set(pids_with_marker(self.run_id)) | listed) - {me})

    def kill_marked(self, grace: float = 5.0, members: Mapping[int, float | None] | None = None) -> list[str]:
        """SIGTERM, then SIGKILL, every live process with this run's marker and every listed member still
        alive (pid -> start time, from before the stop; never ourselves).

        Returns ``"pid command"`` of each process found (should be none after a clean stop).
        """
        members = members or {}
        stragglers = self._left(members)
        found = [f"{p} {_cmdline(p)}" for p in stragglers]
        for pid in stragglers:
            signal_process(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and self._left(members):
            time.sleep(0.2)
        for pid in self._left(members):
            signal_process(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0  # SIGKILL is asynchronous: wait until they are gone
        while time.monotonic() < deadline and self._left(members):
            time.sleep(0.05)
        return found

    def alive(self) -> Iterator[Managed]:
        return (m for m in self.procs if m.exited() is None)

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()
