"""Removes the ``file`` discovery entries of a worker whose process is gone, in about a second instead of the
runtime's 10 s expiry.

Why: a crashed worker (SIGKILL, OOM) stays listed until its entries expire. With ai-dynamo-runtime 1.6.1 the
frontend keeps routing to it meanwhile: a dead prefill worker fails every new request with HTTP 503 ("Remote
prefill failed", also with ``--migration-limit``: the retry finds the instance down, not gone, and does not
fall back to decode-only routing), and a dead decode worker makes the prefill worker compute prompts whose KV
nobody reads (held until the KV lease ends). Measured here: 8 s of 503s after a prefill worker's SIGKILL.

How: every ``interval_s`` the reaper reads the endpoint instances under the discovery folder and opens a TCP
connection to each one's request-plane address. An address that refuses the connection (nothing listens: the
process is gone) ``refusals`` times in a row (``confirm_s`` apart) has that instance's entries removed
(every file whose name ends in ``%2F`` + its connection id in hex), the way the runtime itself removes
expired entries; the frontend drops the instance at once. A timeout or any other error is not a refusal (a
stopped or far process keeps its entries until they expire as before). A live worker whose entries were
removed by mistake writes them back (``file_discovery_keepalive``). It never touches this worker's own
entries.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
from pathlib import Path

from dynamo.vllm.fpm_env import number
from dynamo.vllm.runtime_workarounds.periodic import PeriodicThread

log = logging.getLogger(__name__)

ENV_INTERVAL = "DYN_FILE_DISCOVERY_REAP_INTERVAL_S"
DEFAULT_INTERVAL_S = 0.25
DEFAULT_REFUSALS = 2  # probes in a row: one refused connect is not taken as a death
CONFIRM_AFTER_S = 0.05  # a refused probe is repeated this much later, in the same pass
PROBE_TIMEOUT_S = 0.25
INSTANCES_DIR = ("v1", "instances")
SEPARATOR = "%2F"  # the runtime's encoded "/" before the connection id in an entry's file name


def interval_from(env: dict[str, str] | os._Environ[str]) -> float:
    """``DYN_FILE_DISCOVERY_REAP_INTERVAL_S`` (seconds, ``0`` = off); ValueError names a bad value."""
    return number(env, ENV_INTERVAL, DEFAULT_INTERVAL_S, what="a number of seconds (0 = off)")


def instance_addresses(root: Path) -> dict[str, tuple[str, int]]:
    """Connection id (hex, as in the file names) -> request-plane (host, port) of every listed instance."""
    found: dict[str, tuple[str, int]] = {}
    folder = root.joinpath(*INSTANCES_DIR)
    try:
        names = os.listdir(folder)
    except OSError:
        return found
    for name in names:
        if name.startswith(".") or SEPARATOR not in name:
            continue
        try:
            entry = json.loads((folder / name).read_bytes())
            address = str(entry["transport"]["tcp"]).split("/", 1)[0]
            host, port = address.rsplit(":", 1)
            found[name.rsplit(SEPARATOR, 1)[1]] = (host.strip("[]"), int(port))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written, removed meanwhile, or not a TCP instance: not ours to judge
    return found


def refuses(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """True only when the address actively refuses a TCP connection (nothing listens there)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError as exc:
        return exc.errno == errno.ECONNREFUSED


def remove_entries(root: Path, connection_hex: str) -> list[Path]:
    """Remove every discovery file of one connection; returns those removed."""
    suffix = SEPARATOR + connection_hex
    removed: list[Path] = []
    for folder, _dirs, files in os.walk(root):
        for name in files:
            if name.endswith(suffix) and not name.startswith("."):
                path = Path(folder, name)
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    removed.append(path)
    return removed


class DeadPeerReaper(PeriodicThread):
    """A daemon thread removing the entries of listed instances whose address refuses connections."""

    def __init__(
        self,
        root: Path,
        own_connection_id: int,
        interval_s: float = DEFAULT_INTERVAL_S,
        refusals: int = DEFAULT_REFUSALS,
        confirm_s: float = CONFIRM_AFTER_S,
    ) -> None:
        if interval_s <= 0 or refusals < 1 or confirm_s < 0:
            raise ValueError("interval_s must be > 0, refusals >= 1 and confirm_s >= 0")
        super().__init__("file-discovery-reaper", interval_s)
        self.root = root
        self.own = f"{own_connection_id:x}"
        self.refusals = refusals
        self.confirm_s = confirm_s
        self.reaped: list[str] = []  # connection ids (hex) whose entries this reaper removed

    def run_once(self) -> None:
        """One pass: probe every listed instance but this worker's, remove those refused often enough."""
        listed = instance_addresses(self.root)
        for connection, (host, port) in listed.items():
            if connection == self.own or self._stop.is_set():
                continue
            count = 0
            while refuses(host, port):
                count += 1
                if count >= self.refusals or self._stop.wait(self.confirm_s):
                    break
            if count < self.refusals:
                continue
            removed = remove_entries(self.root, connection)
            if removed:
                self.reaped.append(connection)
                log.warning(
                    "file discovery: instance %s at %s:%d refuses connections (its process is gone): "
                    "removed its %d entr%s so the frontend stops routing to it",
                    connection,
                    host,
                    port,
                    len(removed),
                    "y" if len(removed) == 1 else "ies",
                )

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.run_once()
            except OSError as exc:  # the folder itself is gone
                log.debug("file discovery reaper: %s", exc)


def start_for_worker(discovery_backend: str, connection_id: int) -> DeadPeerReaper | None:
    """Start the reaper when the worker uses file discovery with a known folder, unless switched off."""
    folder = os.environ.get("DYN_FILE_KV", "").strip()
    interval = interval_from(os.environ)
    if discovery_backend != "file" or not folder or interval == 0:
        return None
    return DeadPeerReaper(Path(folder), connection_id, interval).start()
