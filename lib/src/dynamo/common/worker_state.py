"""The worker state file: how a worker tells whoever started it what it is doing (no Dynamo, no vLLM).

A worker started with ``DYN_WORKER_STATE_FILE=PATH`` writes one small JSON object there (atomically, by
rename) each time its state changes::

    {"state": "standby", "pid": 1234, "worker_id": "7587...", "since": 1764580000.123}

States, in order: ``loading`` (signal handlers installed, engine loading; the register signal is safe from
now on), ``standby`` (loaded, warm, not registered: invisible to routing and publishing no FPM),
``serving`` (registered), ``draining`` (unregistered, finishing in-flight requests). A standby worker
registers on ``PROMOTE_SIGNAL``; a serving standby-capable worker drains and goes back to standby on
``PARK_SIGNAL``. ``since`` is the wall-clock time of the change.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

ENV_STATE_FILE = "DYN_WORKER_STATE_FILE"
ENV_STANDBY = "DYN_VLLM_STANDBY"

PROMOTE_SIGNAL = signal.SIGUSR1
PARK_SIGNAL = signal.SIGHUP

LOADING, STANDBY, SERVING, DRAINING = "loading", "standby", "serving", "draining"
STATES = (LOADING, STANDBY, SERVING, DRAINING)


@dataclass(frozen=True, slots=True)
class WorkerState:
    state: str
    pid: int
    worker_id: str = ""
    since: float = 0.0


def write_state(path: str | Path, state: str, *, worker_id: str = "", now: float | None = None) -> None:
    """Replace the state file's content atomically; never raises (the worker must keep serving)."""
    if state not in STATES:
        raise ValueError(f"unknown worker state {state!r}")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    body = {"state": state, "pid": os.getpid(), "worker_id": worker_id, "since": now or time.time()}
    try:
        tmp.write_text(json.dumps(body), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()


def read_state(path: str | Path) -> WorkerState | None:
    """The last state written, or None (no file yet, or not a state file)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("state") not in STATES:
        return None
    try:
        return WorkerState(
            str(data["state"]),
            int(data.get("pid", 0)),
            str(data.get("worker_id", "")),
            float(data.get("since", 0)),
        )
    except (TypeError, ValueError):
        return None
