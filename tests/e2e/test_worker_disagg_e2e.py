"""Disaggregated end to end: frontend + prefill worker + decode worker on the tiny model, on CPU.

The frontend runs prefill on the prefill worker (component ``prefill``), hands vLLM's KV transfer
parameters to the decode worker (component ``backend``), whose NixlConnector (with our CPU layer,
``dynamo.vllm.cpu_host.nixl_connector``) pulls the prompt's KV. Greedy output must equal vLLM run directly,
and each pool's FPM records must arrive under its own worker's connection id.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from dynamo.common.ports import free_port
from dynamo.vllm.runtime_workarounds.file_discovery_keepalive import KEEPING_MARK, restore_entry
from dynamo_fpm_testing.disagg_support import process_cpu_seconds
from dynamo_fpm_testing.nats_server import EmbeddedNatsServer
from dynamo_fpm_testing.stall_meter import Deadline, running_s
from dynamo_fpm_testing.worker_support import (
    RESTORED_MARK,
    Proc,
    base_env,
    complete,
    descendants,
    http_json,
    kv_transfer_config_json,
    model_ready,
    scrape,
    start_frontend,
    start_worker,
    vllm_reference,
    wait_until,
)

pytest.importorskip("nixl")
pytestmark = [pytest.mark.vllm, pytest.mark.runtime, pytest.mark.slow]

MODEL = "tiny"
PROMPT = " ".join(["hello there how are you"] * 14)  # 70 tokens: more than two KV blocks of 32
# The first request of a new pair (NIXL handshake and UCX connection included), in the machine's running time.
FIRST_REQUEST_BOUND_S = 30
PREFILL_DRAIN_S = 8  # the prefill worker's grace period (the drain test waits through it)


@dataclass(frozen=True)
class Stack:
    """The running frontend + prefill + decode workers, and what the tests compare against."""

    base_url: str
    reference: dict[str, Any]
    ids: dict[str, str]
    nats_url: str
    procs: list[Proc]
    file_kv: Path

    def complete(self, body: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
        return complete(self.base_url, body, self.file_kv, self.procs, timeout)


def _worker_id(metrics_url: str) -> str:
    key = next(k for k in scrape(metrics_url) if k.startswith("dynamo_worker_ready{"))
    return key.split('worker_id="')[1].split('"')[0]


@pytest.fixture(scope="module")
def disagg(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, nats_server: EmbeddedNatsServer
) -> Any:
    work = tmp_path_factory.mktemp("worker-disagg")
    reference = vllm_reference(
        tiny_model_dir, [{"prompt": PROMPT, "params": {"temperature": 0.0, "max_tokens": 12}}], work
    )
    file_kv = work / "discovery"
    file_kv.mkdir()
    env = base_env(file_kv, nats_server.url)  # the worker's and the CPU layer's defaults, nothing tuned
    http_port, prefill_metrics, decode_metrics = free_port(), free_port(), free_port()
    common = ["--served-model-name", MODEL, "--kv-transfer-config", kv_transfer_config_json("kv_both")]
    frontend = start_frontend(http_port, env, work / "frontend.log")
    prefill = start_worker(
        tiny_model_dir,
        env,
        work / "prefill.log",
        *common,
        "--disaggregation-mode",
        "prefill",
        "--metrics-port",
        str(prefill_metrics),
        "--drain-timeout",
        str(PREFILL_DRAIN_S),
    )
    decode = start_worker(
        tiny_model_dir,
        env,
        work / "decode.log",
        *common,
        "--disaggregation-mode",
        "decode",
        "--metrics-port",
        str(decode_metrics),
    )
    procs = [frontend, prefill, decode]
    try:
        base_url = f"http://127.0.0.1:{http_port}"
        wait_until(lambda: model_ready(base_url, MODEL, ("decode", "prefill")), timeout=300, procs=procs)
        ids = {
            "prefill": _worker_id(f"http://127.0.0.1:{prefill_metrics}/metrics"),
            "backend": _worker_id(f"http://127.0.0.1:{decode_metrics}/metrics"),
        }
        yield Stack(base_url, reference[0], ids, nats_server.url, procs, file_kv)
    finally:
        for proc in procs:
            proc.stop()


def test_disaggregated_greedy_matches_vllm(disagg: Stack) -> None:
    status, ready = http_json(f"{disagg.base_url}/v1/models/{MODEL}/ready")
    assert status == 200
    assert sorted(ready["namespaces"]["dynamo"]["present"]) == ["decode", "prefill"]
    started = time.monotonic()
    out = disagg.complete({"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0})
    took_s = running_s(started, time.monotonic())
    ref = disagg.reference
    assert out["choices"][0]["text"].split() == ref["text"].split()
    assert out["usage"]["prompt_tokens"] == ref["prompt_len"]
    _, prefill, decode = disagg.procs
    if RESTORED_MARK not in prefill.log() + decode.log():  # else the frontend dropped the pair mid-request
        assert "cancelled" not in prefill.log() and "cancelled" not in decode.log()
    # The first request of a new pair must read the KV for real: a read that fails is logged by decode (which
    # then recomputes: same text), one that hangs fails the time bound and ends in an expired lease. The bound
    # leaves out the machine's stalls (``dynamo_fpm_testing.stall_meter``); the lease outlasts them
    # (E2E_KV_LEASE_S).
    assert "NIXL transfer failure" not in decode.log()
    assert "Releasing expired KV blocks" not in prefill.log(), "decode never read the prefill KV"
    assert took_s < FIRST_REQUEST_BOUND_S, took_s


def test_client_min_tokens_passes_through_prefill(disagg: Stack) -> None:
    """The frontend sends the client's min_tokens to the prefill worker too (with max_tokens=1)."""
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 8, "min_tokens": 6, "temperature": 0}
    out = disagg.complete(body, timeout=60)
    assert out["usage"]["completion_tokens"] >= 6


def test_no_worker_thread_is_confined_to_one_core(disagg: Stack) -> None:
    """The worker runs vLLM's CPU engine unbound (VLLM_CPU_OMP_THREADS_BIND=nobind), so neither the model
    thread nor NIXL's threads share one pinned core (the cause of 20-220 s stalled reads)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs at least 2 usable cores")
    for proc in disagg.procs[1:]:
        workers = [
            pid
            for pid in descendants(proc.pid)
            if Path(f"/proc/{pid}/comm").read_text().strip() == "VLLM::Worker"
        ]
        assert workers, proc.log()[-2000:]
        for pid in workers:
            narrow = {
                tid: os.sched_getaffinity(int(tid))
                for tid in os.listdir(f"/proc/{pid}/task")
                if len(os.sched_getaffinity(int(tid))) < len(os.sched_getaffinity(0))
            }
            assert not narrow, narrow


def test_engine_processes_rest_between_requests(disagg: Stack) -> None:
    """On CPU a prefill or decode worker makes vLLM's ring-buffer waits sleep
    (``dynamo.vllm.cpu_host.shm_wait``): right after each message vLLM's engine processes used to call
    sched_yield in a loop for 1 s, a core each, and a prefill and a decode worker took both cores of this
    machine from everything else."""
    engine = [
        pid
        for proc in disagg.procs[1:]
        for pid in descendants(proc.pid)
        if Path(f"/proc/{pid}/comm").read_text().strip() in ("VLLM::Worker", "VLLM::EngineCor")
    ]
    assert len(engine) >= 4, engine
    disagg.complete({"model": MODEL, "prompt": "hello there", "max_tokens": 2, "temperature": 0})
    before = {pid: process_cpu_seconds(pid) for pid in engine}
    time.sleep(0.6)  # inside vLLM's 1 s busy period after the last message
    used = {pid: round(process_cpu_seconds(pid) - before[pid], 3) for pid in engine}
    assert max(used.values()) < 0.2, used
    assert all("DYN_VLLM_SHM_WAIT_SLEEP_US=100" in proc.log() for proc in disagg.procs[1:])


async def test_each_pool_publishes_under_its_worker_id(disagg: Stack) -> None:
    import nats
    from dynamo.common import forward_pass_metrics as fpm
    from dynamo.common.fpm_subjects import decode_envelope, fpm_subscription, parse_fpm_subject

    seen: dict[str, set[str]] = {"prefill": set(), "backend": set()}
    timed: dict[str, int] = {"prefill": 0, "backend": 0}
    nc = await nats.connect(disagg.nats_url)
    try:
        sub = await nc.subscribe(fpm_subscription("dynamo"))
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        await asyncio.to_thread(disagg.complete, body)
        deadline = Deadline(15)
        while not deadline.expired() and not all(timed.values()):
            try:
                msg = await sub.next_msg(timeout=1)
            except Exception:
                continue
            subject = parse_fpm_subject(msg.subject)
            record = fpm.decode(decode_envelope(msg.data).payload)
            if subject is None or record is None or subject.component not in seen:
                continue
            seen[subject.component].add(record.worker_id)
            timed[subject.component] += record.wall_time > 0
    finally:
        await nc.close()
    assert seen == {"prefill": {disagg.ids["prefill"]}, "backend": {disagg.ids["backend"]}}
    assert all(timed.values()), timed


def test_a_deleted_registration_comes_back(disagg: Stack) -> None:
    """Another process deleting the prefill worker's discovery entries (what the runtime's expiry does to an
    entry its owner failed to touch) costs the frontend the prefill pool; the worker writes them back within
    its keep-alive interval and disaggregated requests are served again. Runs last but one: it disturbs the
    stack."""
    prefill_entries = [p for p in disagg.file_kv.rglob("*") if p.is_file() and "%2Fprefill%2F" in p.name]
    assert len(prefill_entries) == 2, prefill_entries  # instances/ and mdc/
    frontend, prefill = disagg.procs[0], disagg.procs[1]
    # The keep-alive can only write back what it has read: the module's first tests can end within its 2 s
    # interval of registration, and the runtime writes the instance concurrently with the model card.
    kept = [f"{KEEPING_MARK} {path.relative_to(disagg.file_kv)} alive" for path in prefill_entries]
    wait_until(lambda: all(line in prefill.log() for line in kept), timeout=10, procs=disagg.procs)
    removals = frontend.log().count("Removed worker set")
    # A stall earlier in the module may already have made the worker write its entries back.
    restored = prefill.log().count(RESTORED_MARK)
    content = {path: path.read_bytes() for path in prefill_entries}
    try:
        for path in prefill_entries:
            path.unlink()
        wait_until(
            lambda: frontend.log().count("Removed worker set") > removals, timeout=10, procs=disagg.procs
        )
        wait_until(lambda: model_ready(disagg.base_url, MODEL, ("prefill",)), timeout=15, procs=disagg.procs)
        assert all(path.exists() for path in prefill_entries)
        assert prefill.log().count(RESTORED_MARK) - restored == 2
        out = disagg.complete({"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
        assert out["choices"][0]["text"].split() == disagg.reference["text"].split()[:4]
    finally:  # on a failure too, the next test gets a registered prefill worker (create-if-absent)
        for path, data in content.items():
            restore_entry(path, data)


async def test_a_prefill_drain_waits_for_kv_no_decode_worker_read(
    disagg: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs last: ends the prefill worker. A prompt prefilled for a decode worker that never reads it (sent to
    the prefill worker alone) holds its KV blocks in the prefill engine; a drain waits for them through its
    grace period (PREFILL_DRAIN_S here, 30 s by default) and counts the hand-off it gave up, instead of
    stopping the engine under them at once and reporting a clean exit."""
    from dynamo.runtime import DistributedRuntime

    frontend, prefill = disagg.procs[0], disagg.procs[1]
    monkeypatch.setenv("DYN_FILE_KV", str(disagg.file_kv))
    runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp", event_plane="zmq")
    try:
        client = await runtime.endpoint("dynamo.prefill.generate").client()
        await asyncio.wait_for(client.wait_for_instances(), 10)
        request = {
            "token_ids": list(range(5, 75)),
            "stop_conditions": {"max_tokens": 1},
            "sampling_options": {"temperature": 0.0},
            "output_options": {},
            "eos_token_ids": [2],
        }
        frames = []
        async for item in await client.round_robin(request):
            data = item.data() if callable(getattr(item, "data", None)) else item
            frames.append(data)
        assert frames and frames[-1]["disaggregated_params"]["kv_transfer_params"], frames
    finally:
        runtime.shutdown()
    started = time.monotonic()
    prefill.signal(15)
    code = await asyncio.to_thread(prefill.wait, 90)
    log = prefill.log()
    assert "1 KV hand-off(s) given up" in log, log[-3000:]
    assert code == 3, log[-3000:]
    assert time.monotonic() - started >= PREFILL_DRAIN_S - 1  # it waited through the grace period
    assert frontend.popen.poll() is None
