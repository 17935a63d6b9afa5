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

Only an entry it has read can be written back. The runtime writes the endpoint instance (``v1/instances``)
from the serving task, concurrently with the model card (``v1/mdc``) that registration awaits, so the first
pass may come before the instance exists; until each of the worker's folders (``expect``) holds an entry of
its own, the keep-alive passes every ``LEARN_INTERVAL_S`` instead of ``interval_s`` (for ``LEARN_FOR_S`` at
most), and it logs each entry it keeps (:data:`KEEPING_MARK`). Every pass checks every known entry on its own:
an error on one is logged and the others are still written back.
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
# A serving worker's folders: its endpoint instance and its model card.
WORKER_FOLDERS = (os.path.join("v1", "instances"), os.path.join("v1", "mdc"))
LEARN_INTERVAL_S = 0.05  # passes this often while an expected folder has no entry of ours yet
LEARN_FOR_S = 10.0  # then back to ``interval_s`` (with a warning): the runtime's expiry
# Logged (INFO) once per entry, when the keep-alive first reads it: from then on it can write it back.
KEEPING_MARK = "file discovery keep-alive: keeping"


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

    ``expect``: folders under ``root`` (``v1/mdc``...) each of which will hold an entry of this connection;
    until they do, passes come every ``LEARN_INTERVAL_S``, so an entry is known (and can be written back)
    moments after the runtime writes it. ``stop()`` comes before the worker unregisters, so nothing races the
    runtime's deletion."""

    def __init__(
        self,
        root: Path,
        connection_id: int,
        interval_s: float = DEFAULT_INTERVAL_S,
        expect: tuple[str, ...] = (),
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        super().__init__("file-discovery-keepalive", interval_s)
        self.root = root
        self.connection_id = connection_id
        self.expect = expect
        self.restored = 0  # entries written back since start
        self._content: dict[Path, bytes] = {}  # each entry seen, with its latest content

    def known(self) -> list[Path]:
        """The entries this keep-alive has read, and so can write back."""
        return sorted(self._content)

    def unknown_folders(self) -> list[str]:
        """The expected folders that hold no entry known to this keep-alive yet."""
        have = {os.path.relpath(path.parent, self.root) for path in list(self._content)}
        return [folder for folder in self.expect if os.path.normpath(folder) not in have]

    def _name(self, path: Path) -> str:
        return str(path.relative_to(self.root)) if path.is_relative_to(self.root) else str(path)

    def run_once(self) -> None:
        """One pass: touch our entries, remember their content, write back each known one that vanished.

        Each entry is handled on its own: one that cannot be written back is logged and left for the next
        pass, and the others are still handled."""
        present = set(touch_owned_files(self.root, self.connection_id))
        for path in sorted(present):
            try:
                content = path.read_bytes()
            except OSError:  # removed since it was touched: written back below or on the next pass
                continue
            if path not in self._content:
                log.info("%s %s alive", KEEPING_MARK, self._name(path))
            self._content[path] = content
        missing = sorted(set(self._content) - present)
        rewritten: list[str] = []
        for path in missing:
            if self._stop.is_set():
                return
            try:
                restored = restore_entry(path, self._content[path])
            except FileNotFoundError as exc:  # its folder is gone: the discovery store itself was removed
                log.debug("file discovery keep-alive: cannot write back %s: %s", self._name(path), exc)
                continue
            except OSError as exc:
                log.warning(
                    "file discovery keep-alive: cannot write back %s (next pass tries again): %s",
                    self._name(path),
                    exc,
                )
                continue
            if restored:
                self.restored += 1
                rewritten.append(self._name(path))
                log.warning(
                    "file discovery: entry %s was deleted by another process while this worker serves "
                    "(expired?); wrote it back",
                    self._name(path),
                )
        log.debug(
            "file discovery keep-alive pass: %d present, missing %s, rewritten %s, no entry yet in %s",
            len(present),
            [self._name(path) for path in missing],
            rewritten,
            self.unknown_folders(),
        )

    def _run(self) -> None:
        started = previous = time.monotonic()
        learning = bool(self.expect)
        self._pass()  # at once: the entries were just registered, their content is known from now on
        while True:
            if learning and not self.unknown_folders():
                learning = False
            elif learning and time.monotonic() - started > LEARN_FOR_S:
                learning = False
                log.warning(
                    "file discovery keep-alive: no entry of this worker in %s after %.0f s; they cannot be "
                    "written back until a pass (every %.1f s) finds them",
                    ", ".join(self.unknown_folders()),
                    LEARN_FOR_S,
                    self.interval_s,
                )
            if self._stop.wait(LEARN_INTERVAL_S if learning else self.interval_s):
                return
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
        except Exception:  # never the end of the thread: the next pass tries again
            log.warning("file discovery keep-alive: pass failed", exc_info=True)


def start_for_worker(discovery_backend: str, connection_id: int) -> FileDiscoveryKeepAlive | None:
    """Start the keep-alive when the worker uses file discovery with a known folder (``DYN_FILE_KV``)."""
    folder = os.environ.get("DYN_FILE_KV", "").strip()
    if discovery_backend != "file" or not folder:
        return None
    return FileDiscoveryKeepAlive(Path(folder), connection_id, expect=WORKER_FOLDERS).start()
