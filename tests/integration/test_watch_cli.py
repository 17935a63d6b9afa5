"""The watch CLI as a real subprocess: JSON lines, the live table, Ctrl-C, unreachable NATS."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

import msgspec
from dynamo.common.forward_pass_metrics import ForwardPassMetrics, decode, encode
from dynamo.common.fpm_publisher import FpmDirectPublisher
from dynamo.common.fpm_subjects import fpm_subject
from dynamo.common.fpm_tracker import TrackedWorker, WorkerKey
from dynamo.common.ports import free_port
from dynamo.common.recv_forward_pass_metrics import table
from dynamo_fpm_testing.fpm_support import full_record
from dynamo_fpm_testing.nats_server import EmbeddedNatsServer

NS = "watch"
MODULE = "dynamo.common.recv_forward_pass_metrics"


def spawn(url: str, *args: str, tmp: Path) -> tuple[subprocess.Popen[str], Path]:
    env = {**os.environ, "NATS_SERVER": url, "PYTHONUNBUFFERED": "1"}
    err = tmp / "stderr.txt"
    proc = subprocess.Popen(
        [sys.executable, "-m", MODULE, "--namespace", NS, *args],
        stdout=subprocess.PIPE,
        stderr=err.open("w"),
        text=True,
        env=env,
        start_new_session=True,
    )
    return proc, err


class LineReader:
    """Collects the child's stdout lines on a thread, so the test can poll without blocking."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._run, args=(proc.stdout,), daemon=True)
        self._thread.start()

    def _run(self, stream: TextIO) -> None:
        for line in stream:
            self.lines.append(line.rstrip("\n"))

    def join(self) -> list[str]:
        self._thread.join(10)
        return self.lines


def test_json_lines_every_field(nats_server: EmbeddedNatsServer, tmp_path: Path) -> None:
    proc, err = spawn(nats_server.url, "--json", tmp=tmp_path)
    reader = LineReader(proc)
    pub = FpmDirectPublisher(
        namespace=NS, component="prefill", worker_id="cli-1", dp_rank=1, nats_url=nats_server.url
    )
    sent = full_record("cli-1", 1, seed=3)
    try:
        # Publish until the CLI (which starts in ~1 s) has printed a few; then Ctrl-C.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(reader.lines) < 3:
            pub.publish(sent)
            time.sleep(0.2)
        assert len(reader.lines) >= 3, f"no JSON lines; stderr: {err.read_text()}"
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(10)
    finally:
        pub.close()
        if proc.poll() is None:
            proc.kill()
    assert code == 0, err.read_text()
    objs = [json.loads(ln) for ln in reader.join() if ln]
    first = objs[0]
    assert first["subject"] == fpm_subject(NS, "prefill")
    assert (first["component"], first["endpoint"]) == ("prefill", "generate")
    # Every FPM field, nested as in the schema: rebuilding the record from the JSON gives it back.
    fields = {
        k: v for k, v in first.items() if k not in ("subject", "component", "endpoint", "published_at_ms")
    }
    rebuilt = msgspec.convert(fields, ForwardPassMetrics)
    assert rebuilt == msgspec.structs.replace(sent, counter_id=rebuilt.counter_id)
    assert decode(encode(rebuilt)) == rebuilt
    assert [o["counter_id"] for o in objs] == sorted(o["counter_id"] for o in objs)
    assert "Traceback" not in err.read_text()


def test_live_table_and_ctrl_c(nats_server: EmbeddedNatsServer, tmp_path: Path) -> None:
    proc, err = spawn(nats_server.url, "--component", "backend", "--interval", "0.3", tmp=tmp_path)
    pub = FpmDirectPublisher(namespace=NS, component="backend", worker_id="table-w", nats_url=nats_server.url)
    other = FpmDirectPublisher(
        namespace=NS, component="prefill", worker_id="filtered", nats_url=nats_server.url
    )
    reader = LineReader(proc)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and sum("table-w" in ln for ln in reader.lines) < 3:
            pub.publish(full_record("table-w", seed=2))
            other.publish(full_record("filtered"))
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(10)
    finally:
        pub.close()
        other.close()
        if proc.poll() is None:
            proc.kill()
    out = "\n".join(reader.join())
    assert code == 0, err.read_text()
    assert "\x1b[" not in out  # not a terminal: no screen clearing codes
    frames = [f for f in out.split("\n\n") if f.strip()]
    assert len(frames) >= 3  # refreshed periodically
    last = frames[-1]
    assert "table-w" in last and "filtered" not in last
    assert f"namespace.{NS}.component.backend" in last and " up " in last
    row = next(ln for ln in last.splitlines() if "table-w" in ln)
    assert " 600 " in row and " 800 " in row  # scheduled prefill tokens / queued prefill tokens (seed 2)
    assert "Traceback" not in err.read_text()


def test_unreachable_nats_clear_error_nonzero(tmp_path: Path) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    proc, err = spawn(url, "--connect-timeout", "2", tmp=tmp_path)
    proc.communicate(timeout=40)
    assert time.monotonic() - t0 < 30  # 2 s timeout + interpreter start on a loaded machine
    assert proc.returncode == 2
    msg = err.read_text().strip()
    assert msg.startswith("error: cannot reach NATS at") and url in msg
    assert len(msg.splitlines()) == 1 and "Traceback" not in msg


def test_table_shows_extensions_stale_and_empty() -> None:
    assert "(no records yet)" in table([], 0.0)
    rec = full_record("w1")
    w = TrackedWorker(
        key=WorkerKey("backend", "generate", "w1", 0),
        record=rec,
        received_at=10.0,
        published_at_ms=0,
        last_timing_record=rec,
        stale=True,
    )
    text = table([w], 17.0)
    row = text.splitlines()[1]
    assert row.split()[:4] == ["backend", "generate", "w1", "0"]
    assert "7.0!" in row and "12.5" in row  # age (stale marker) and wall time in ms
    upstream_like = msgspec.structs.replace(
        rec, queued_requests=msgspec.structs.replace(rec.queued_requests, num_decode_kv_ready_requests=None)
    )
    w.record = upstream_like
    assert " -" in table([w], 17.0).splitlines()[1]  # absent extension shows as '-'
