"""Forward-pass metrics of a decode engine during real NIXL transfers (about 40 s).

The decode engine runs ``InstrumentedScheduler`` and publishes to a real nats-server. The prefill engine
is stopped (SIGSTOP) before the decode engine's first pull from it, so the pulls cannot finish (the
decode side's handshake waits for the prefill side's answer) and the requests stay parked in
``WAITING_FOR_REMOTE_KVS`` until the prefill engine is continued (SIGCONT), shorter than the
handshake's 5 s receive timeout. Records must show them as queued decode, with their KV length and
as in flight, within a second of parking and for as long as they wait, then as scheduled decode.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")

import nats
from disagg_support import EngineProcess, EngineSpec, prompt_ids, start_engines, wait_for_state
from dynamo.common.forward_pass_metrics import ForwardPassMetrics, decode
from dynamo.common.fpm_subjects import DECODE_COMPONENT, decode_envelope, fpm_subject
from dynamo.common.nats_server import EmbeddedNatsServer, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NAMESPACE = "disaggfpm"
WORKER_ID = "decode-fpm-test"
PROMPT_LENGTHS = (40, 100, 200)
HOLD_S = 2.5  # below the NIXL handshake's 5 s receive timeout
GEN_TOKENS = 8


@pytest.fixture(scope="module")
def engines(
    tiny_model_dir: Path, nats_server: EmbeddedNatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[EngineProcess, EngineProcess]]:
    log_dir = tmp_path_factory.mktemp("disagg-fpm")
    fpm_env = {
        "NATS_SERVER": nats_server.url,
        "DYN_NAMESPACE": NAMESPACE,
        "DYN_FPM_COMPONENT": DECODE_COMPONENT,
        "DYN_FPM_WORKER_ID": WORKER_ID,
    }
    prefill, decode_engine = start_engines(
        [
            EngineSpec("prefill", tiny_model_dir, "kv_producer", free_port()),
            EngineSpec(
                "decode-fpm",
                tiny_model_dir,
                "kv_consumer",
                free_port(),
                scheduler_cls="dynamo.vllm.instrumented_scheduler.InstrumentedScheduler",
                env=fpm_env,
            ),
        ],
        log_dir,
    )
    try:
        yield prefill, decode_engine
    finally:
        prefill.close()
        decode_engine.close()


async def test_requests_waiting_for_real_transfers_are_queued_decode_then_scheduled(
    engines: tuple[EngineProcess, EngineProcess], nats_server: EmbeddedNatsServer
) -> None:
    prefill, decode_engine = engines
    records: list[tuple[float, ForwardPassMetrics]] = []

    async def on_msg(msg: Any) -> None:
        record = decode(decode_envelope(msg.data).payload)
        if record is not None and record.worker_id == WORKER_ID:
            records.append((time.monotonic(), record))

    nc = await nats.connect(nats_server.url)
    try:
        await nc.subscribe(fpm_subject(NAMESPACE, DECODE_COMPONENT), cb=on_msg)
        await nc.flush()
        prompts = {n: prompt_ids(n, seed=500 + n) for n in PROMPT_LENGTHS}
        params = {}
        for n, ids in prompts.items():
            out = await asyncio.to_thread(
                prefill.generate, f"pre-{n}", ids, 1, kv_transfer_params={"do_remote_decode": True}
            )
            params[n] = out["kv_transfer_params"]
        kv_total = sum(PROMPT_LENGTHS)  # the whole prompt's KV comes from the prefill engine

        os.kill(prefill.pid, signal.SIGSTOP)
        try:
            t_submit = time.monotonic()
            for n, ids in prompts.items():
                decode_engine.submit(f"dec-{n}", ids, GEN_TOKENS, kv_transfer_params=params[n])
            state = await asyncio.to_thread(
                wait_for_state,
                decode_engine,
                lambda s: sum(v == "WAITING_FOR_REMOTE_KVS" for v in s["waiting"].values()) == 3,
            )
            assert len(state["waiting"]) == 3
            await asyncio.sleep(max(0.0, t_submit + HOLD_S - time.monotonic()))
            state = await asyncio.to_thread(decode_engine.call, "state")
            assert sum(v == "WAITING_FOR_REMOTE_KVS" for v in state["waiting"].values()) == 3, state
        finally:
            t_resume = time.monotonic()
            os.kill(prefill.pid, signal.SIGCONT)
        results = [await asyncio.to_thread(decode_engine.result, f"dec-{n}") for n in PROMPT_LENGTHS]
        assert all(r["finish_reason"] == "length" for r in results), results
        await asyncio.sleep(1.0)  # the last records
    finally:
        await nc.close()

    def parked(rec: ForwardPassMetrics) -> bool:
        q = rec.queued_requests
        return (
            q.num_decode_requests == 3
            and q.sum_decode_kv_tokens == kv_total
            and q.num_decode_kv_transfer_requests == 3
            and q.sum_decode_kv_transfer_tokens == kv_total
            and q.num_prefill_requests == 0
        )

    window = [(t, r) for t, r in records if t_submit <= t <= t_resume]
    assert window, f"no records while the requests waited ({len(records)} in all)"
    first_parked = next((t for t, r in window if parked(r)), None)
    assert first_parked is not None, [r.queued_requests for _, r in window]
    assert first_parked - t_submit < 1.0, (
        f"first queued-decode record {first_parked - t_submit:.2f}s after submit"
    )
    # For as long as they wait: every record says so, and records keep coming (no silent second).
    steady = [(t, r) for t, r in window if t >= first_parked]
    assert all(parked(r) for _, r in steady), [r.queued_requests for _, r in steady if not parked(r)]
    times = [first_parked] + [t for t, _ in steady] + [t_resume]
    assert max(b - a for a, b in itertools.pairwise(times)) < 1.0
    # Once the KV arrived: scheduled as decode, nothing queued.
    after = [r for t, r in records if t > t_resume]
    promoted = [r for r in after if r.scheduled_requests.num_decode_requests == 3]
    assert promoted, [r.scheduled_requests for r in after]
    assert promoted[0].queued_requests.num_decode_requests == 0
    assert promoted[0].scheduled_requests.num_prefill_requests == 0
