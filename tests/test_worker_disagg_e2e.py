"""Disaggregated end to end: frontend + prefill worker + decode worker on the tiny model, on CPU.

The frontend runs prefill on the prefill worker (component ``prefill``), hands vLLM's KV transfer
parameters to the decode worker (component ``backend``), whose NixlConnector (with our CPU layer,
``dynamo.vllm.nixl_cpu``) pulls the prompt's KV. Greedy output must equal vLLM run directly, and each
pool's FPM records must arrive under its own worker's connection id.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from dynamo.common.nats_server import EmbeddedNatsServer, free_port
from worker_support import (
    base_env,
    http_json,
    model_ready,
    scrape,
    start_frontend,
    start_worker,
    vllm_reference,
    wait_until,
)

pytest.importorskip("nixl")
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.runtime,
    pytest.mark.slow,
    # Known bug (issue 5, open): through the worker's multi-process engine, NIXL reads on CPU complete only with
    # DYN_NIXL_CPU_PROGRESS_DELAY_US=0, and then two engines busy-poll both cores of a 2-core machine: on a quiet
    # machine this module's prefill+decode pair did not become ready in time (fixture error in the fresh-clone
    # run). tests/test_disagg_e2e.py (strict xfail) turns red as soon as the default configuration transfers KV;
    # re-enable this module then.
    pytest.mark.skip(reason="CPU NIXL transfers through the multi-process worker stall (issue 5, open)"),
]

MODEL = "tiny"
PROMPT = " ".join(["hello there how are you"] * 14)  # 70 tokens: more than two KV blocks of 32
KV = {
    "kv_connector": "NixlConnector",
    "kv_role": "kv_both",
    "kv_buffer_device": "cpu",
    "kv_connector_module_path": "dynamo.vllm.nixl_cpu",
    # The prefill side keeps a request's blocks until decode read them or this lease (s) expires; on a
    # loaded 2-core host the first pull (NIXL handshake) can take many seconds.
    "kv_connector_extra_config": {"kv_lease_duration": 90},
}


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
    # Measured here: with the CPU layer's 2 ms progress-thread delay, the decode side's NIXL read never
    # completes in a multi-process engine (the prefill side releases the blocks at lease expiry, 30 s);
    # nixl's own busy poll (0) works. Reported to the CPU layer's owner; remove once fixed there.
    env = base_env(file_kv, nats_server.url, DYN_NIXL_CPU_PROGRESS_DELAY_US="0")
    http_port, prefill_metrics, decode_metrics = free_port(), free_port(), free_port()
    common = ["--served-model-name", MODEL, "--kv-transfer-config", json.dumps(KV)]
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
        wait_until(lambda: model_ready(base_url, MODEL), timeout=300, procs=procs)
        # Warm-up: the first pull between a new pair runs the NIXL handshake, which on a loaded 2-core host
        # can fail or time out in vLLM's multi-process engines (see the module's report); not asserted.
        warm = {"model": MODEL, "prompt": "hello there", "max_tokens": 2, "temperature": 0}
        for _ in range(2):
            status, _ = http_json(f"{base_url}/v1/completions", warm, timeout=150)
            if status == 200 and "Releasing expired KV blocks" not in prefill.log():
                break
        expired_before = prefill.log().count("Releasing expired KV blocks")
        ids = {
            "prefill": _worker_id(f"http://127.0.0.1:{prefill_metrics}/metrics"),
            "backend": _worker_id(f"http://127.0.0.1:{decode_metrics}/metrics"),
        }
        yield base_url, reference[0], ids, nats_server.url, procs, expired_before
    finally:
        for proc in procs:
            proc.stop()


def test_disaggregated_greedy_matches_vllm(disagg: Any) -> None:
    base_url, ref, _ids, _nats, procs, expired_before = disagg
    status, ready = http_json(f"{base_url}/v1/models/{MODEL}/ready")
    assert status == 200
    assert sorted(ready["namespaces"]["dynamo"]["present"]) == ["decode", "prefill"]
    status, out = http_json(
        f"{base_url}/v1/completions",
        {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0},
        timeout=120,
    )
    assert status == 200, out
    assert out["choices"][0]["text"].split() == ref["text"].split()
    assert out["usage"]["prompt_tokens"] == ref["prompt_len"]
    _, prefill, decode = procs
    assert "cancelled" not in prefill.log() and "cancelled" not in decode.log()
    expired = prefill.log().count("Releasing expired KV blocks") - expired_before
    assert expired == 0, "decode never read the prefill KV"


async def test_each_pool_publishes_under_its_worker_id(disagg: Any) -> None:
    import nats
    from dynamo.common import forward_pass_metrics as fpm
    from dynamo.common.fpm_subjects import decode_envelope, fpm_subscription, parse_fpm_subject

    base_url, _ref, ids, nats_url, _procs, _expired = disagg
    seen: dict[str, set[str]] = {"prefill": set(), "backend": set()}
    timed: dict[str, int] = {"prefill": 0, "backend": 0}
    nc = await nats.connect(nats_url)
    try:
        sub = await nc.subscribe(fpm_subscription("dynamo"))
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        status, _ = await asyncio.to_thread(http_json, f"{base_url}/v1/completions", body, 120)
        assert status == 200
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not all(timed.values()):
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
    assert seen == {"prefill": {ids["prefill"]}, "backend": {ids["backend"]}}
    assert all(timed.values()), timed
