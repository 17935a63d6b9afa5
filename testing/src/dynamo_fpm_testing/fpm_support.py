"""Shared helpers for the FPM core tests: a raw nats-py collector, sample records, polling waits."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import pytest
from dynamo.common.forward_pass_metrics import (
    ForwardPassMetrics,
    QueuedRequestMetrics,
    ScheduledRequestMetrics,
    decode,
)
from dynamo.common.fpm_subjects import EventEnvelope, decode_envelope
from nats.aio.msg import Msg

from dynamo_fpm_testing.stall_meter import Deadline


def full_record(worker_id: str = "worker-1", dp_rank: int = 0, seed: int = 1) -> ForwardPassMetrics:
    """A record with every field set to a distinct non-default value (extensions included)."""
    s = seed
    return ForwardPassMetrics(
        worker_id=worker_id,
        dp_rank=dp_rank,
        counter_id=0,
        wall_time=0.0125 * s,
        scheduled_requests=ScheduledRequestMetrics(
            num_prefill_requests=2 * s,
            sum_prefill_tokens=300 * s,
            var_prefill_length=12.5 * s,
            sum_prefill_kv_tokens=64 * s,
            num_decode_requests=5 * s,
            sum_decode_kv_tokens=900 * s,
            var_decode_kv_tokens=33.0 * s,
        ),
        queued_requests=QueuedRequestMetrics(
            num_prefill_requests=4 * s,
            sum_prefill_tokens=400 * s,
            var_prefill_length=1.5 * s,
            num_decode_requests=6 * s,
            sum_decode_kv_tokens=345 * s,
            var_decode_kv_tokens=2.25 * s,
            num_decode_kv_transfer_requests=3 * s,
            sum_decode_kv_transfer_tokens=200 * s,
            num_decode_kv_ready_requests=3 * s,
            sum_decode_kv_ready_tokens=145 * s,
        ),
    )


@dataclass
class Received:
    subject: str
    envelope: EventEnvelope
    record: ForwardPassMetrics | None
    at: float  # perf_counter at receipt


@dataclass
class Collector:
    """A plain nats-py subscriber that decodes envelope and record of every message."""

    url: str
    subject: str
    items: list[Received] = field(default_factory=list)
    nc: nats.NATS | None = None

    async def start(self) -> Collector:
        self.nc = await nats.connect(self.url)

        async def on_msg(msg: Msg) -> None:
            env = decode_envelope(msg.data)
            self.items.append(Received(msg.subject, env, decode(env.payload), time.perf_counter()))

        await self.nc.subscribe(self.subject, cb=on_msg, pending_msgs_limit=1_000_000)
        await self.nc.flush()
        return self

    async def stop(self) -> None:
        if self.nc is not None:
            await self.nc.close()

    def records(self, *, heartbeats: bool = True) -> list[ForwardPassMetrics]:
        out = [r.record for r in self.items if r.record is not None]
        return out if heartbeats else [r for r in out if r.wall_time > 0]


async def wait_until(pred: Callable[[], bool], timeout: float = 5.0, interval: float = 0.01) -> bool:
    deadline = Deadline(timeout)
    while not deadline.expired():
        if pred():
            return True
        await asyncio.sleep(interval)
    return pred()


class CustomNatsServer:
    """A nats-server with extra flags (auth, TLS) on a free loopback port; a context manager."""

    def __init__(self, *flags: str) -> None:
        from dynamo.common.ports import free_port

        from dynamo_fpm_testing.nats_server import find_nats_server

        self.port = free_port()
        self.cmd = [find_nats_server(), "-a", "127.0.0.1", "-p", str(self.port), *flags]
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> CustomNatsServer:
        self.proc = subprocess.Popen(
            self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        deadline = Deadline(10)
        while not deadline.expired():
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.02)
        self.__exit__()
        raise TimeoutError("nats-server did not start")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (its own CA) and its key, made with openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = directory / "server.pem", directory / "server.key"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-keyout", str(key), "-out", str(cert),
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


class RuntimeReceiver:
    """The runtime's ``FpmEventSubscriber`` in recv mode, on a thread (recv releases the GIL)."""

    def __init__(self, runtime: Any, namespace: str) -> None:
        from dynamo.llm import FpmEventSubscriber

        self.sub = FpmEventSubscriber(runtime.endpoint(f"{namespace}.backend.generate"))
        self.records: list[ForwardPassMetrics] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (data := self.sub.recv()) is not None:
            record = decode(data)
            if record is not None:
                self.records.append(record)

    def stop(self) -> None:
        self.sub.shutdown()
        self.thread.join(5)
