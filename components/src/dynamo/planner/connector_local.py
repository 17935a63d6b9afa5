"""The ``local`` connector: starts and stops worker processes on this machine, with optional warm standbys.

Each pool has a command template (e.g. ``python -m dynamo.vllm --model M --mode decode``) with
placeholders ``{pool}``, ``{index}``, ``{port}`` (a free loopback port outside the kernel's ephemeral
range: a worker binds it only after loading its model, ``dynamo.common.ports``), ``{namespace}`` and
``{log_dir}``. Every process runs in its own process group with its output in
``{log_dir}/{pool}-{index}.log`` and its state (``dynamo.common.worker_state``) in
``{log_dir}/{pool}-{index}.state.json``.

Standbys (``standby_prefill`` / ``standby_decode``): that many extra workers per pool are started with
``DYN_VLLM_STANDBY=1``: loaded and warm, but not registered (no routing, no FPM) and not counted in the
pool. A scale-up promotes one (``SIGUSR1``: it registers in well under a second) and starts a new standby
in the background (never more standbys than the pool can still grow by, given ``max_*``); a scale-down parks a
serving worker as a standby (``SIGHUP``: it drains and unregisters) when fewer than N are warm, else stops it.
With standbys on, every worker is started that way (a new member is promoted as soon as it installed its
signal handlers), so any of them can be parked.

Stopping: SIGTERM to the worker process alone (it unregisters and drains; its vLLM processes must not
get the signal), SIGKILL to its process group only after ``stop_timeout_s``.

Hung workers (``hung_after_s``, 0 = off): a member or standby whose process is stopped (Linux
state ``T``/``t``: SIGSTOP, a tracer) at every look for that long is killed (SIGKILL to its process
group) and reaped like a crashed worker: the pool is short by one, so the planner's next decision
promotes a standby or starts one.

Replicas = our pool members not being stopped (+ ``initial_*`` ones started by someone else);
``settled`` = no process still draining. The workers are recorded in ``{log_dir}/local-connector.json``
(pid and start time): a planner started later adopts them (``adopt``) or stops them.
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
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from dynamo.common import process_group
from dynamo.common import worker_state as ws
from dynamo.common.ports import stable_free_port

from . import local_state
from .connector_base import ConnectorStatus, PoolStatus
from .local_hung import check_stopped
from .local_process import ProcessHandle, same_process_alive

logger = logging.getLogger(__name__)

POOLS = ("prefill", "decode")
MEMBER, STANDBY, PARKING, STOPPING = "member", "standby", "parking", "stopping"
# After a worker exited, the rest of its process group gets this long before SIGKILL.
LEFTOVER_GRACE_S = 5.0
# A standby that died is replaced after this long, doubling per failure up to the maximum.
STANDBY_RETRY_S = 5.0
STANDBY_RETRY_MAX_S = 120.0


@dataclass
class WorkerProcess:
    pool: str
    index: int
    handle: ProcessHandle
    log_path: Path
    state_path: Path
    role: str
    started_at: float  # monotonic
    standby_capable: bool = False
    log: IO[bytes] | None = None
    promote_pending: bool = False  # promoted before its signal handler was installed
    stop_deadline: float | None = None  # monotonic; stopping, or parking
    killed: bool = False
    stopped_since: float | None = None  # monotonic; first seen stopped (SIGSTOP), for ``hung_after_s``
    state: ws.WorkerState | None = None
    argv: tuple[str, ...] = ()

    @property
    def pid(self) -> int:
        return self.handle.pid

    @property
    def alive(self) -> bool:
        return self.handle.poll()

    @property
    def serving(self) -> bool:
        return self.state is not None and self.state.state == ws.SERVING

    @property
    def warm(self) -> bool:
        return self.role == STANDBY and self.state is not None and self.state.state == ws.STANDBY

    def record(self) -> local_state.WorkerRecord:
        return local_state.WorkerRecord(
            self.pool,
            self.index,
            self.handle.pid,
            self.handle.started,
            self.role,
            str(self.log_path),
            str(self.state_path),
            self.standby_capable,
        )


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


def describe(counts: dict[str, dict[str, int]]) -> str:
    """``decode: 1 starting, 1 standby`` - what is not plainly serving, per pool ("" when nothing is)."""
    parts = []
    for pool, c in counts.items():
        items = [
            f"{c[k]} {k.replace('_', ' ')}"
            for k in ("starting", "standby", "standby_loading", "draining")
            if c[k]
        ]
        if items:
            parts.append(f"{pool}: " + ", ".join(items))
    return "; ".join(parts)


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
        hung_after_s: float = 0.0,
        initial_prefill: int = 0,
        initial_decode: int = 0,
        standby_prefill: int = 0,
        standby_decode: int = 0,
        max_prefill: int | None = None,
        max_decode: int | None = None,
        adopt: bool = True,
        env: dict[str, str] | None = None,
    ) -> None:
        self.commands = {"prefill": prefill_command, "decode": decode_command}
        self.log_dir = Path(log_dir)
        self.namespace = namespace
        self.stop_timeout_s = stop_timeout_s
        self.hung_after_s = hung_after_s
        self.external = {"prefill": initial_prefill, "decode": initial_decode}
        self.standby = {"prefill": standby_prefill, "decode": standby_decode}
        # A pool at its maximum cannot promote a standby: no more are kept than it can still grow by.
        self.maximum = {"prefill": max_prefill, "decode": max_decode}
        self.adopt = adopt
        self.env = env
        self.procs: dict[str, list[WorkerProcess]] = {p: [] for p in POOLS}
        self.exited: list[tuple[str, int, int | None]] = []  # (pool, index, returncode; None: not our child)
        self._next_index = {p: 0 for p in POOLS}
        self._leftovers: list[tuple[ProcessHandle, float]] = []
        self._retry_at = {p: 0.0 for p in POOLS}
        self._retry_s = {p: STANDBY_RETRY_S for p in POOLS}
        self._dirty = False
        self.state_path = self.log_dir / local_state.STATE_FILE
        self.events = local_state.EventLog(self.log_dir / local_state.EVENTS_FILE)

    async def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._adopt_previous()
        for pool in POOLS:
            self._refill(pool)
        self._save()

    # ------------------------------------------------------------------ views
    def poll(self) -> None:
        """Bring the book up to date now (exits, worker states, pending signals); ``status()`` does it too."""
        self._maintain()

    def running(self, pool: str) -> list[WorkerProcess]:
        """The pool's members (starting or serving), not the standbys nor the ones being stopped."""
        self._maintain()
        return [wp for wp in self.procs[pool] if wp.role == MEMBER]

    def standbys(self, pool: str) -> list[WorkerProcess]:
        self._maintain()
        return [wp for wp in self.procs[pool] if wp.role == STANDBY]

    def draining(self) -> int:
        self._maintain()
        return sum(1 for procs in self.procs.values() for wp in procs if wp.role in (STOPPING, PARKING))

    def pool_status(self, pool: str) -> PoolStatus:
        procs = self.procs[pool]
        return PoolStatus(
            starting=sum(1 for wp in procs if wp.role == MEMBER and not wp.serving),
            draining=sum(1 for wp in procs if wp.role in (STOPPING, PARKING)),
            standby=sum(1 for wp in procs if wp.warm),
        )

    def counts(self) -> dict[str, dict[str, int]]:
        """Per pool: members, serving, starting, warm standbys, loading standbys, draining (for the event
        log)."""
        out = {}
        for pool, procs in self.procs.items():
            members = [wp for wp in procs if wp.role == MEMBER]
            out[pool] = {
                "members": len(members) + self.external[pool],
                "serving": sum(1 for wp in members if wp.serving),
                "starting": sum(1 for wp in members if not wp.serving),
                "standby": sum(1 for wp in procs if wp.warm),
                "standby_loading": sum(1 for wp in procs if wp.role == STANDBY and not wp.warm),
                "draining": sum(1 for wp in procs if wp.role in (STOPPING, PARKING)),
            }
        return out

    # ------------------------------------------------------------------ connector API
    async def status(self) -> ConnectorStatus:
        self._maintain()
        for pool in POOLS:
            self._refill(pool)
        self._save()
        counts = self.counts()
        drain = sum(c["draining"] for c in counts.values())
        return ConnectorStatus(
            counts["prefill"]["members"],
            counts["decode"]["members"],
            drain == 0,
            describe(counts),
            prefill_pool=self.pool_status("prefill"),
            decode_pool=self.pool_status("decode"),
        )

    async def apply(self, prefill: int | None, decode: int | None) -> None:
        self._maintain()
        for pool, want in (("prefill", prefill), ("decode", decode)):
            if want is None:
                continue
            members = [wp for wp in self.procs[pool] if wp.role == MEMBER]
            ours_wanted = max(want - self.external[pool], 0)
            if want < self.external[pool]:
                logger.warning(
                    "%s: %d processes were not started by the planner; cannot go below them",
                    pool,
                    self.external[pool],
                )
            while len(members) < ours_wanted:
                wp = self._take_standby(pool)
                if wp is not None:
                    self._promote(wp)
                else:
                    wp = self._spawn(pool, MEMBER)
                members.append(wp)
            # Stop the least useful first: still starting, then the newest.
            excess = sorted(members, key=lambda w: (w.serving, -w.index))[
                : max(len(members) - ours_wanted, 0)
            ]
            for wp in excess:
                if self._should_park(wp):
                    self._park(wp)
                else:
                    self._stop(wp)
            self._refill(pool)
        self._save()

    async def close(self) -> None:
        """Stop every process we run (SIGTERM to each worker, SIGKILL of the group after the timeout)."""
        self._maintain()
        for procs in self.procs.values():
            for wp in procs:
                if wp.role != STOPPING:
                    self._stop(wp)
        deadline = time.monotonic() + self.stop_timeout_s
        for procs in self.procs.values():
            for wp in procs:
                if not wp.handle.wait(max(0.0, deadline - time.monotonic())):
                    logger.warning("%s worker %d did not stop in time: SIGKILL", wp.pool, wp.index)
                    wp.handle.kill_group()
                    wp.handle.wait(5.0)
        self._maintain()
        for handle, _ in self._leftovers:
            if handle.group_alive():
                handle.kill_group()
        self._leftovers.clear()
        self._save(force=True)

    # ------------------------------------------------------------------ bookkeeping
    def _maintain(self) -> None:
        """Reap exits, read worker states, send pending promotions, kill overdue stops and leftovers."""
        now = time.monotonic()
        for pool, procs in self.procs.items():
            for wp in list(procs):
                if not wp.handle.poll() or self._killed_hung(wp, now):
                    self._on_exit(wp, now)
                    procs.remove(wp)
                    continue
                self._read_state(wp)
                if wp.promote_pending and wp.state is not None:
                    self._send_promote(wp)
                if wp.role == PARKING and wp.state is not None and wp.state.state == ws.STANDBY:
                    wp.role, wp.stop_deadline = STANDBY, None
                    self._event("parked", wp)
                elif wp.stop_deadline is not None and now > wp.stop_deadline and not wp.killed:
                    if wp.role == PARKING:
                        logger.warning(
                            "%s worker %d did not park in %.0fs: stopping it",
                            pool,
                            wp.index,
                            self.stop_timeout_s,
                        )
                        self._stop(wp)
                        continue
                    logger.warning(
                        "%s worker %d did not drain in %.0fs: SIGKILL", pool, wp.index, self.stop_timeout_s
                    )
                    wp.handle.kill_group()
                    wp.killed = True
                    self._event("killed", wp)
        keep = []
        for handle, deadline in self._leftovers:
            if not handle.group_alive():
                continue
            if now > deadline:
                logger.info("worker %d exited but left processes in its group: SIGKILL", handle.pid)
                handle.kill_group()
            else:
                keep.append((handle, deadline))
        self._leftovers = keep

    def _killed_hung(self, wp: WorkerProcess, now: float) -> bool:
        """Kill a member or standby stopped for ``hung_after_s`` (its group: the engine processes too);
        True once it is gone. A worker being stopped or parked has its own deadline."""
        if self.hung_after_s <= 0 or wp.role not in (MEMBER, STANDBY) or wp.killed:
            return False
        check = check_stopped(wp.handle.run_state(), wp.stopped_since, now, self.hung_after_s)
        wp.stopped_since = check.stopped_since
        if check.reason is None:
            return False
        logger.warning(
            "%s %s %d (pid %d) is hung: %s; SIGKILL to its process group, replaced like a crashed one",
            wp.pool,
            "standby" if wp.role == STANDBY else "worker",
            wp.index,
            wp.pid,
            check.reason,
        )
        wp.handle.kill_group()
        wp.killed = True
        self._event("hung", wp, reason=check.reason)
        return wp.handle.wait(2.0)  # a stopped process dies on SIGKILL at once; else reaped next time

    def _on_exit(self, wp: WorkerProcess, now: float) -> None:
        rc = wp.handle.returncode
        self.exited.append((wp.pool, wp.index, rc))
        if wp.role != STOPPING:
            logger.warning(
                "%s %s %d exited unexpectedly with %s (log %s)",
                wp.pool,
                "standby" if wp.role == STANDBY else "worker",
                wp.index,
                rc,
                wp.log_path,
            )
            if wp.role == STANDBY:
                self._retry_at[wp.pool] = now + self._retry_s[wp.pool]
                self._retry_s[wp.pool] = min(STANDBY_RETRY_MAX_S, 2 * self._retry_s[wp.pool])
        if wp.log is not None:
            wp.log.close()
        self._leftovers.append((wp.handle, now + LEFTOVER_GRACE_S))
        self._dirty = True
        self._event("exited", wp, returncode=rc, expected=wp.role == STOPPING)

    def _read_state(self, wp: WorkerProcess) -> None:
        state = ws.read_state(wp.state_path)
        if state is None or state.pid != wp.pid or state == wp.state:
            return
        previous = wp.state.state if wp.state is not None else None
        wp.state = state
        if state.state != previous:
            if state.state == ws.STANDBY and wp.role == STANDBY:
                self._retry_s[wp.pool] = STANDBY_RETRY_S  # a standby came up: failures are behind us
            self._event("state", wp, state=state.state, since=state.since, worker_id=state.worker_id)

    def _take_standby(self, pool: str) -> WorkerProcess | None:
        """A standby to promote: a warm one first, else the one that has been loading longest."""
        candidates = [wp for wp in self.procs[pool] if wp.role == STANDBY]
        if not candidates:
            return None
        return min(candidates, key=lambda w: (not w.warm, w.started_at))

    def _promote(self, wp: WorkerProcess) -> None:
        wp.role = MEMBER
        self._dirty = True
        if wp.state is not None:
            self._send_promote(wp)
        else:
            wp.promote_pending = True  # its signal handler is not installed yet: signal on its first state
        logger.info(
            "promoting %s standby %d (pid %d, %s)",
            wp.pool,
            wp.index,
            wp.pid,
            "warm" if wp.state is not None and wp.state.state == ws.STANDBY else "still loading",
        )
        self._event("promoted", wp, warm=wp.state is not None and wp.state.state == ws.STANDBY)

    def _send_promote(self, wp: WorkerProcess) -> None:
        wp.promote_pending = False
        if not wp.handle.signal(ws.PROMOTE_SIGNAL):
            logger.warning("%s worker %d is gone; could not promote it", wp.pool, wp.index)

    def standby_target(self, pool: str) -> int:
        """Standbys to keep now: N, but never more than the pool can still grow by."""
        want = self.standby[pool]
        top = self.maximum[pool]
        if top is None:
            return want
        members = sum(1 for wp in self.procs[pool] if wp.role == MEMBER) + self.external[pool]
        return max(0, min(want, top - members))

    def _should_park(self, wp: WorkerProcess) -> bool:
        if not (wp.standby_capable and wp.serving):
            return False
        warm = sum(1 for w in self.procs[wp.pool] if w.warm or w.role == PARKING)
        # ``wp`` leaves the pool: the room it frees counts.
        return warm < min(self.standby[wp.pool], self.standby_target(wp.pool) + 1)

    def _park(self, wp: WorkerProcess) -> None:
        logger.info("parking %s worker %d (pid %d) as a standby", wp.pool, wp.index, wp.pid)
        wp.role = PARKING
        wp.stop_deadline = time.monotonic() + self.stop_timeout_s
        self._dirty = True
        wp.handle.signal(ws.PARK_SIGNAL)
        self._event("parking", wp)

    def _refill(self, pool: str) -> None:
        """Keep ``standby_target`` standbys (warm, loading or parking); surplus loading ones are stopped
        first."""
        want = self.standby_target(pool)
        spare = [wp for wp in self.procs[pool] if wp.role in (STANDBY, PARKING)]
        if len(spare) > want:
            surplus = sorted(
                (wp for wp in spare if wp.role == STANDBY), key=lambda w: (w.warm, -w.started_at)
            )[: len(spare) - want]
            for wp in surplus:
                self._stop(wp)
            return
        if len(spare) < want and time.monotonic() >= self._retry_at[pool]:
            for _ in range(want - len(spare)):
                self._spawn(pool, STANDBY)

    def _spawn(self, pool: str, role: str) -> WorkerProcess:
        index = self._next_index[pool]
        self._next_index[pool] += 1
        argv = render(
            self.commands[pool],
            pool=pool,
            index=index,
            port=stable_free_port(),  # bound after the model loads: outside the ephemeral range
            namespace=self.namespace,
            log_dir=str(self.log_dir),
        )
        log_path = self.log_dir / f"{pool}-{index}.log"
        state_path = self.log_dir / f"{pool}-{index}.state.json"
        with contextlib.suppress(FileNotFoundError):
            state_path.unlink()
        capable = self.standby[pool] > 0
        log = open(log_path, "ab")  # noqa: SIM115 - lives as long as the process
        env = dict(os.environ if self.env is None else self.env)
        env.update(DYN_PLANNER_POOL=pool, DYN_PLANNER_INDEX=str(index))
        env[ws.ENV_STATE_FILE] = str(state_path)
        if capable:
            env[ws.ENV_STANDBY] = "1"
        else:
            env.pop(ws.ENV_STANDBY, None)
        proc = process_group.start_in_own_session(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )
        wp = WorkerProcess(
            pool,
            index,
            ProcessHandle.spawned(proc),
            log_path,
            state_path,
            role,
            time.monotonic(),
            standby_capable=capable,
            log=log,
            promote_pending=capable and role == MEMBER,
            argv=tuple(argv),
        )
        self.procs[pool].append(wp)
        self._dirty = True
        logger.info(
            "started %s %s %d (pid %d): %s",
            pool,
            "standby" if role == STANDBY else "worker",
            index,
            proc.pid,
            shlex.join(argv),
        )
        self._event("started", wp)
        return wp

    def _stop(self, wp: WorkerProcess) -> None:
        logger.info("stopping %s worker %d (pid %d) with SIGTERM to the worker", wp.pool, wp.index, wp.pid)
        wp.role = STOPPING
        wp.promote_pending = False
        wp.stop_deadline = time.monotonic() + self.stop_timeout_s
        self._dirty = True
        wp.handle.signal(signal.SIGTERM)
        self._event("stopping", wp)

    # ------------------------------------------------------------------ persistence
    def _adopt_previous(self) -> None:
        records, next_index = local_state.load(self.state_path, self.namespace)
        for pool in POOLS:
            self._next_index[pool] = max(self._next_index[pool], next_index.get(pool, 0))
        now = time.monotonic()
        for rec in records:
            if rec.pool not in POOLS:
                continue
            self._next_index[rec.pool] = max(self._next_index[rec.pool], rec.index + 1)
            if not same_process_alive(rec.pid, rec.started):
                logger.info(
                    "%s worker %d (pid %d) of a previous planner is gone", rec.pool, rec.index, rec.pid
                )
                continue
            wp = WorkerProcess(
                rec.pool,
                rec.index,
                ProcessHandle(rec.pid, rec.started),
                Path(rec.log_path),
                Path(rec.state_path),
                rec.role,
                now,
                standby_capable=rec.standby_capable,
            )
            self._read_state(wp)
            # A member promoted just before its predecessor died may still wait for the signal.
            wp.promote_pending = rec.role == MEMBER and rec.standby_capable and not wp.serving
            self.procs[rec.pool].append(wp)
            self._dirty = True
            if not self.adopt or rec.role == STOPPING:
                logger.info(
                    "stopping %s worker %d (pid %d) of a previous planner", rec.pool, rec.index, rec.pid
                )
                self._stop(wp)
                continue
            if rec.role == PARKING:
                wp.stop_deadline = now + self.stop_timeout_s
            logger.info(
                "adopted %s %s %d (pid %d) of a previous planner", rec.pool, rec.role, rec.index, rec.pid
            )
            self._event("adopted", wp)

    def _save(self, *, force: bool = False) -> None:
        if not (self._dirty or force):
            return
        self._dirty = False
        workers = [wp.record() for procs in self.procs.values() for wp in procs if wp.handle.poll()]
        local_state.save(self.state_path, self.namespace, workers, dict(self._next_index))

    def _event(self, event: str, wp: WorkerProcess, **fields: object) -> None:
        self.events.write(
            event, pool=wp.pool, index=wp.index, pid=wp.pid, role=wp.role, counts=self.counts(), **fields
        )
