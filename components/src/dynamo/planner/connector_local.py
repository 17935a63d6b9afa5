"""The ``local`` connector: starts and stops worker processes on this machine.

Each pool has a command template (e.g. ``python -m dynamo.vllm --model M --mode decode``) with
placeholders ``{pool}``, ``{index}``, ``{port}`` (a free loopback port), ``{namespace}`` and
``{log_dir}``. Every process runs in its own process group with its output in
``{log_dir}/{pool}-{index}.log``. Scale-down stops the newest process with SIGTERM (Dynamo workers
drain in-flight requests on it) and escalates to SIGKILL of the group after ``stop_timeout_s``.
Replicas = our live processes not being stopped (+ ``initial_*`` ones started by someone else);
``settled`` = no process still draining.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from dynamo.common.nats_server import free_port

from .connector_base import ConnectorStatus

logger = logging.getLogger(__name__)


@dataclass
class WorkerProcess:
    pool: str
    index: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    log: IO[bytes]
    started_at: float
    stop_deadline: float | None = None
    argv: list[str] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


def render(template: str, **values: object) -> list[str]:
    """The argv of one worker: placeholders filled, then split like a shell would (no shell runs)."""
    try:
        text = template.format(**values)
    except KeyError as exc:
        raise ValueError(f"unknown placeholder {exc} in worker command {template!r}") from exc
    argv = shlex.split(text)
    if argv and argv[0] in ("python", "python3"):
        argv[0] = sys.executable  # the planner's interpreter: same venv as the planner
    return argv


class LocalConnector:
    name = "local"

    def __init__(
        self,
        *,
        prefill_command: str,
        decode_command: str,
        log_dir: str | Path = "planner-logs",
        namespace: str = "dynamo",
        stop_timeout_s: float = 30.0,
        initial_prefill: int = 0,
        initial_decode: int = 0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.commands = {"prefill": prefill_command, "decode": decode_command}
        self.log_dir = Path(log_dir)
        self.namespace = namespace
        self.stop_timeout_s = stop_timeout_s
        self.external = {"prefill": initial_prefill, "decode": initial_decode}
        self.env = env
        self.procs: dict[str, list[WorkerProcess]] = {"prefill": [], "decode": []}
        self.exited: list[tuple[str, int, int]] = []  # (pool, index, returncode)
        self._next_index = {"prefill": 0, "decode": 0}

    async def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ bookkeeping
    def _reap(self) -> None:
        now = time.monotonic()
        for pool, procs in self.procs.items():
            for wp in list(procs):
                if not wp.alive:
                    rc = wp.proc.returncode
                    self.exited.append((pool, wp.index, rc))
                    if wp.stop_deadline is None:
                        logger.warning(
                            "%s worker %d exited unexpectedly with %s (log %s)",
                            pool,
                            wp.index,
                            rc,
                            wp.log_path,
                        )
                    wp.log.close()
                    procs.remove(wp)
                elif wp.stop_deadline is not None and now > wp.stop_deadline:
                    logger.warning(
                        "%s worker %d did not drain in %.0fs: SIGKILL", pool, wp.index, self.stop_timeout_s
                    )
                    _signal_group(wp.proc, signal.SIGKILL)
                    wp.stop_deadline = now + 3600  # killed: just wait for the reap

    def running(self, pool: str) -> list[WorkerProcess]:
        self._reap()
        return [wp for wp in self.procs[pool] if wp.stop_deadline is None]

    def draining(self) -> int:
        self._reap()
        return sum(1 for procs in self.procs.values() for wp in procs if wp.stop_deadline is not None)

    # ------------------------------------------------------------------ connector API
    async def status(self) -> ConnectorStatus:
        p = len(self.running("prefill")) + self.external["prefill"]
        d = len(self.running("decode")) + self.external["decode"]
        drain = self.draining()
        return ConnectorStatus(p, d, drain == 0, f"{drain} draining" if drain else "")

    async def apply(self, prefill: int | None, decode: int | None) -> None:
        for pool, want in (("prefill", prefill), ("decode", decode)):
            if want is None:
                continue
            have = self.running(pool)
            ours_wanted = max(want - self.external[pool], 0)
            if want < self.external[pool]:
                logger.warning(
                    "%s: %d processes were not started by the planner; cannot go below them",
                    pool,
                    self.external[pool],
                )
            for _ in range(ours_wanted - len(have)):
                self._spawn(pool)
            for wp in sorted(have, key=lambda w: w.index, reverse=True)[: max(len(have) - ours_wanted, 0)]:
                self._stop(wp)

    def _spawn(self, pool: str) -> WorkerProcess:
        index = self._next_index[pool]
        self._next_index[pool] += 1
        argv = render(
            self.commands[pool],
            pool=pool,
            index=index,
            port=free_port(),
            namespace=self.namespace,
            log_dir=str(self.log_dir),
        )
        log_path = self.log_dir / f"{pool}-{index}.log"
        log = open(log_path, "ab")  # noqa: SIM115 - lives as long as the process
        env = dict(os.environ if self.env is None else self.env)
        env.update(DYN_PLANNER_POOL=pool, DYN_PLANNER_INDEX=str(index))
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        wp = WorkerProcess(pool, index, proc, log_path, log, time.monotonic(), argv=argv)
        self.procs[pool].append(wp)
        logger.info("started %s worker %d (pid %d): %s", pool, index, proc.pid, shlex.join(argv))
        return wp

    def _stop(self, wp: WorkerProcess) -> None:
        logger.info("stopping %s worker %d (pid %d) with SIGTERM", wp.pool, wp.index, wp.proc.pid)
        wp.stop_deadline = time.monotonic() + self.stop_timeout_s
        _signal_group(wp.proc, signal.SIGTERM)

    async def close(self) -> None:
        """Stop every process we started (SIGTERM, then SIGKILL after the timeout)."""
        for procs in self.procs.values():
            for wp in procs:
                if wp.stop_deadline is None:
                    self._stop(wp)
        deadline = time.monotonic() + self.stop_timeout_s
        for procs in self.procs.values():
            for wp in procs:
                try:
                    wp.proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _signal_group(wp.proc, signal.SIGKILL)
                    wp.proc.wait()
        self._reap()


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
