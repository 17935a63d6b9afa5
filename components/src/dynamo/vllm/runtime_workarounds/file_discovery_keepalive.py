"""Keeps this worker's own entries in Dynamo's ``file`` discovery alive, and puts back any that vanish.

Why: with ai-dynamo-runtime 1.6.1 on a loaded host a worker's fresh registration was sometimes never touched
by the runtime's own keep-alive and another process expired it, after which the frontend lost that pool
(docs/workarounds.md#file-discovery-keep-alive).

Every ``interval_s`` this module touches the files under the discovery folder that belong to this worker
(their names end in ``%2F`` + the worker's connection id in hex) and remembers their content. A file of ours
that disappears while the worker still serves (another process expired it, or someone removed it) is written
back with the content it had, create-if-absent, the way the runtime publishes entries: watchers see a new
entry and route to the worker again. It never deletes a file, and :meth:`FileDiscoveryKeepAlive.stop` is
called before the worker unregisters, so an entry the worker removes stays removed.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path

from dynamo.vllm.runtime_workarounds.periodic import PeriodicThread

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 2.0  # well inside the runtime's 10 s expiry, also when the process is briefly starved
LATE_WARNING_S = 5.0  # a pass this long after the previous one means the entries came near expiry
TEMP_PREFIX = ".tmp_"  # the runtime's own prefix: its watchers ignore files named so


def owned_suffix(connection_id: int) -> str:
    """How the runtime ends the file name of an entry registered by this connection."""
    return f"%2F{connection_id:x}"


def touch_owned_files(root: Path, connection_id: int) -> list[Path]:
    """Refresh the modification time of this connection's files under ``root``; returns those touched."""
    suffix = owned_suffix(connection_id)
    touched: list[Path] = []
    for folder, _dirs, files in os.walk(root):
        for name in files:
            if name.endswith(suffix) and not name.startswith("."):
                path = Path(folder, name)
                try:
                    os.utime(path)
                except OSError:  # removed meanwhile: the caller decides whether to put it back
                    continue
                touched.append(path)
    return touched


def restore_entry(path: Path, content: bytes) -> bool:
    """Write ``content`` to ``path`` unless it exists (a temporary file hard-linked into place, so no
    watcher ever reads a partial entry and a concurrent re-registration is never overwritten)."""
    temp = path.with_name(f"{TEMP_PREFIX}{uuid.uuid4().hex[:16]}")
    try:
        temp.write_bytes(content)
        os.link(temp, path)
    except FileExistsError:
        return False
    finally:
        temp.unlink(missing_ok=True)
    return True


class FileDiscoveryKeepAlive(PeriodicThread):
    """A daemon thread that keeps this connection's discovery entries fresh and present until stopped.

    ``stop()`` comes before the worker unregisters, so nothing races the runtime's deletion."""

    def __init__(self, root: Path, connection_id: int, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        super().__init__("file-discovery-keepalive", interval_s)
        self.root = root
        self.connection_id = connection_id
        self.restored = 0  # entries written back since start
        self._content: dict[Path, bytes] = {}  # each entry seen, with its latest content

    def run_once(self) -> None:
        """One pass: touch our entries, remember their content, write back the ones that vanished."""
        present = set(touch_owned_files(self.root, self.connection_id))
        for path in present:
            try:
                self._content[path] = path.read_bytes()
            except OSError:
                continue
        for path in sorted(set(self._content) - present):
            if self._stop.is_set():
                return
            try:
                restored = restore_entry(path, self._content[path])
            except OSError as exc:  # its folder is gone: the discovery store itself was removed
                log.debug("file discovery keep-alive: cannot restore %s: %s", path, exc)
                continue
            if restored:
                self.restored += 1
                log.warning(
                    "file discovery: entry %s was deleted by another process while this worker serves "
                    "(expired?); wrote it back",
                    path.relative_to(self.root) if path.is_relative_to(self.root) else path,
                )

    def _run(self) -> None:
        previous = time.monotonic()
        self._pass()  # at once: the entries were just registered, their content is known from now on
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            if now - previous > LATE_WARNING_S:
                log.warning(
                    "file discovery keep-alive ran %.1f s after its previous pass (interval %.1f s): "
                    "this process is starved; entries expire after 10 s",
                    now - previous,
                    self.interval_s,
                )
            previous = now
            self._pass()

    def _pass(self) -> None:
        try:
            self.run_once()
        except OSError as exc:  # the folder itself is gone: nothing of ours to keep
            log.debug("file discovery keep-alive: %s", exc)


def start_for_worker(discovery_backend: str, connection_id: int) -> FileDiscoveryKeepAlive | None:
    """Start the keep-alive when the worker uses file discovery with a known folder (``DYN_FILE_KV``)."""
    folder = os.environ.get("DYN_FILE_KV", "").strip()
    if discovery_backend != "file" or not folder:
        return None
    return FileDiscoveryKeepAlive(Path(folder), connection_id).start()
