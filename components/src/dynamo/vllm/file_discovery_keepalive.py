"""Keeps this worker's own entries in Dynamo's ``file`` discovery alive.

The runtime's file store expires an entry whose file was not touched for 10 s, and every process using
the folder (frontend, planner, other workers) deletes expired entries; the owner touches its files every
~3.3 s from a thread of its own. Measured with ai-dynamo-runtime 1.6.1 on a loaded 2-core host: in 2 of 4
demo runs a worker's fresh registration was never touched by its owner and the planner's file store deleted
it 10-11.5 s after it was written (log: ``Expired path=.../v1/mdc/...`` with the creation time as
``last_modified``; the owner then logs ``FileStore::keep_alive failed opening owned file``). The frontend
then lost the prefill or decode pool and answered every request 404/503 for the rest of the run.

This module touches, every ``interval_s``, the files under the discovery folder that belong to this worker
(their names end in ``%2F`` + the worker's connection id in hex). It never creates or deletes a file: an
entry the worker unregisters is gone for good, a missing file is skipped.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 2.0  # well inside the runtime's 10 s expiry, also when the process is briefly starved


def owned_suffix(connection_id: int) -> str:
    """How the runtime ends the file name of an entry registered by this connection."""
    return f"%2F{connection_id:x}"


def touch_owned_files(root: Path, connection_id: int) -> int:
    """Refresh the modification time of this connection's files under ``root``; returns how many."""
    suffix = owned_suffix(connection_id)
    touched = 0
    for folder, _dirs, files in os.walk(root):
        for name in files:
            if name.endswith(suffix) and not name.startswith("."):
                try:
                    os.utime(os.path.join(folder, name))
                except OSError:  # unregistered meanwhile: never recreate it
                    continue
                touched += 1
    return touched


class FileDiscoveryKeepAlive:
    """A daemon thread that calls :func:`touch_owned_files` every ``interval_s`` until stopped."""

    def __init__(self, root: Path, connection_id: int, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self.root = root
        self.connection_id = connection_id
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="file-discovery-keepalive", daemon=True)

    def start(self) -> FileDiscoveryKeepAlive:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop touching (before unregistering, so nothing races the runtime's own deletion)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                touch_owned_files(self.root, self.connection_id)
            except OSError as exc:  # the folder itself is gone: nothing of ours to keep
                log.debug("file discovery keep-alive: %s", exc)


def start_for_worker(discovery_backend: str, connection_id: int) -> FileDiscoveryKeepAlive | None:
    """Start the keep-alive when the worker uses file discovery with a known folder (``DYN_FILE_KV``)."""
    folder = os.environ.get("DYN_FILE_KV", "").strip()
    if discovery_backend != "file" or not folder:
        return None
    return FileDiscoveryKeepAlive(Path(folder), connection_id).start()
