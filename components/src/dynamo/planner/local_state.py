"""What the ``local`` connector writes into its log folder, so a restarted planner (and the demo) can read it.

``local-connector.json``: the workers this connector runs (pid + start time, pool, index, role), rewritten
atomically on every change; a planner that starts finds its predecessor's workers there.
``local-connector-events.jsonl``: one line per event (started, promoted, serving, stopping, exited, ...)
with the per-pool counts after it, for reports.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

STATE_FILE = "local-connector.json"
EVENTS_FILE = "local-connector-events.jsonl"
FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """One worker as the state file keeps it. ``role``: member, standby, parking or stopping."""

    pool: str
    index: int
    pid: int
    started: float  # process start time (psutil create_time), guards against pid reuse
    role: str
    log_path: str
    state_path: str
    standby_capable: bool = False  # started with DYN_VLLM_STANDBY=1: can be promoted and parked


def save(path: Path, namespace: str, workers: list[WorkerRecord], next_index: dict[str, int]) -> None:
    body = {
        "version": FORMAT_VERSION,
        "namespace": namespace,
        "planner_pid": os.getpid(),
        "written_at": time.time(),
        "next_index": next_index,
        "workers": [asdict(w) for w in workers],
    }
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(body, indent=1), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning("could not write the connector state %s: %s", path, exc)


def load(path: Path, namespace: str) -> tuple[list[WorkerRecord], dict[str, int]]:
    """The workers a previous planner recorded (none if the file is missing, unreadable or for another
    namespace)."""
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return [], {}
    except (OSError, ValueError) as exc:
        logger.warning("ignoring the unreadable connector state %s: %s", path, exc)
        return [], {}
    if not isinstance(body, dict) or body.get("version") != FORMAT_VERSION:
        logger.warning("ignoring the connector state %s: unknown format", path)
        return [], {}
    if body.get("namespace") != namespace:
        logger.warning(
            "the connector state %s belongs to namespace %r, not %r: ignored",
            path,
            body.get("namespace"),
            namespace,
        )
        return [], {}
    workers = []
    for item in body.get("workers", []):
        try:
            workers.append(WorkerRecord(**item))
        except TypeError:
            logger.warning("ignoring a malformed worker entry in %s: %r", path, item)
    raw_next = body.get("next_index", {})
    next_index = (
        {k: int(v) for k, v in raw_next.items() if isinstance(v, int)} if isinstance(raw_next, dict) else {}
    )
    return workers, next_index


class EventLog:
    """Appends one JSON line per connector event; never raises."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, event: str, **fields: Any) -> None:
        line = json.dumps({"t": time.time(), "event": event, **fields}, separators=(",", ":"))
        with contextlib.suppress(OSError), open(self.path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
