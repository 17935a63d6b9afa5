"""Register on command: a standby worker loads its engine, stays unregistered, and registers on SIGUSR1.

``--standby`` (``DYN_VLLM_STANDBY=1``): after the engine is loaded the worker writes state ``standby`` and
waits, invisible to routing (no model card, no endpoint instance) and publishing no FPM (the engine's
publisher holds its heartbeats until the gate file exists). ``SIGUSR1`` registers it (well under a second);
``SIGHUP`` parks a serving standby-capable worker: it unregisters, drains, and stands by again. Without
``--standby`` SIGUSR1 is ignored (logged) and SIGHUP keeps its default meaning.

The state file (``--state-file`` / ``DYN_WORKER_STATE_FILE``, see ``dynamo.common.worker_state``) tells a
supervisor what the worker is doing. It is written ``loading`` as soon as the signal handlers are
installed, before vLLM is imported, so a supervisor never signals a process that would die of SIGUSR1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path

from dynamo.common import worker_state as ws
from dynamo.vllm.fpm_env import flag

log = logging.getLogger(__name__)

# The publisher in the engine process holds heartbeats while this file (in the FPM stats folder) is missing.
GATE_FILE_NAME = "registered"


def early_options(argv: Sequence[str], env: Mapping[str, str]) -> tuple[bool, str | None]:
    """``--standby`` and ``--state-file`` read before argparse (which runs after vLLM's ~10 s import)."""
    standby = flag(env, ws.ENV_STANDBY, False)
    state_file = env.get(ws.ENV_STATE_FILE, "").strip() or None
    for i, arg in enumerate(argv):
        if arg == "--standby":
            standby = True
        elif arg == "--no-standby":
            standby = False
        elif arg == "--state-file" and i + 1 < len(argv):
            state_file = argv[i + 1]
        elif arg.startswith("--state-file="):
            state_file = arg.split("=", 1)[1]
    return standby, state_file


class StandbyControl:
    """The register/park switch of one worker and its state file."""

    def __init__(self, standby: bool, state_file: str | None) -> None:
        self.standby = standby
        self.state_file = state_file
        self.worker_id = ""
        self.gate_file: Path | None = None
        self._promote_flag = False
        self._park_flag = False
        self._promote: asyncio.Event | None = None
        self._park: asyncio.Event | None = None

    # ---- signals -------------------------------------------------------------------------------------
    def install_early(self) -> None:
        """Plain signal handlers (no event loop yet), then the state ``loading``."""
        signal.signal(ws.PROMOTE_SIGNAL, lambda *_: self._flag_promote())
        if self.standby:
            signal.signal(ws.PARK_SIGNAL, lambda *_: self._flag_park())
        self.write(ws.LOADING)

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Move the handlers onto the event loop; a signal that came while loading is kept."""
        self._promote = asyncio.Event()
        self._park = asyncio.Event()
        if self._promote_flag:
            self._promote.set()
        loop.add_signal_handler(ws.PROMOTE_SIGNAL, self.request_promote)
        if self.standby:
            loop.add_signal_handler(ws.PARK_SIGNAL, self.request_park)

    def _flag_promote(self) -> None:
        self._promote_flag = True

    def _flag_park(self) -> None:
        self._park_flag = True

    def request_promote(self) -> None:
        if not self.standby:
            log.info("SIGUSR1 ignored: this worker is not a standby (start it with --standby)")
            return
        log.info("SIGUSR1: registering")
        if self._promote is not None:
            self._promote.set()

    def request_park(self) -> None:
        log.info("SIGHUP: parking (unregister, drain, stand by)")
        if self._park is not None:
            self._park.set()

    async def promoted(self) -> None:
        assert self._promote is not None
        await self._promote.wait()
        self._promote.clear()

    async def parked(self) -> None:
        assert self._park is not None
        await self._park.wait()
        self._park.clear()

    # ---- state ---------------------------------------------------------------------------------------
    def write(self, state: str) -> None:
        if self.state_file:
            ws.write_state(self.state_file, state, worker_id=self.worker_id)

    def open_gate(self) -> None:
        if self.gate_file is not None:
            with contextlib.suppress(OSError):
                self.gate_file.touch()

    def close_gate(self) -> None:
        if self.gate_file is not None:
            with contextlib.suppress(OSError):
                self.gate_file.unlink()


def gate_path(stats_dir: str) -> Path:
    return Path(os.path.join(stats_dir, GATE_FILE_NAME))
