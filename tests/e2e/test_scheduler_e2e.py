"""End to end: a real vLLM engine (tiny CPU model) started with the InstrumentedScheduler as
``scheduler_cls`` serves concurrent requests; its records arrive over a real NATS server and their
scheduled token sums match what the engine processed.

Processed tokens per request: every prompt token once (no prefix caching), then one per generated
token after the first (the last generated token is never fed back). So over all records
``sum(sum_prefill_tokens) == sum(prompt lengths)`` and ``sum(num_decode_requests) == sum(generated - 1)``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from dynamo.common.fpm_subjects import fpm_subject
from dynamo_fpm_testing.scheduler_support import (
    E2E_MAX_TOKENS,
    E2E_PROMPT_LENS,
    NatsRecords,
    fpm_env,
    run_llm,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def check_records(sub: NatsRecords, processed: dict[str, Any], worker_id: str) -> None:
    assert processed["prompt_tokens"] == list(E2E_PROMPT_LENS)
    assert processed["generated_tokens"] == list(E2E_MAX_TOKENS)
    expect_prefill = sum(processed["prompt_tokens"])
    expect_decode = sum(g - 1 for g in processed["generated_tokens"])

    def passes() -> list[Any]:
        return [r for r in sub.snapshot() if r.wall_time > 0.0]

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        recs = passes()
        if (
            sum(r.scheduled_requests.sum_prefill_tokens for r in recs) >= expect_prefill
            and sum(r.scheduled_requests.num_decode_requests for r in recs) >= expect_decode
        ):
            break
        time.sleep(0.1)
    recs = passes()
    assert recs, "no forward-pass record arrived over NATS"
    assert all(r.worker_id == worker_id and r.dp_rank == 0 for r in sub.snapshot())
    assert sum(r.scheduled_requests.sum_prefill_tokens for r in recs) == expect_prefill
    assert sum(r.scheduled_requests.num_prefill_requests for r in recs) >= len(E2E_PROMPT_LENS)
    assert sum(r.scheduled_requests.num_decode_requests for r in recs) == expect_decode
    assert max(r.scheduled_requests.num_decode_requests for r in recs) > 1  # requests ran concurrently
    counters = [r.counter_id for r in sub.snapshot()]
    assert counters == sorted(counters) and len(set(counters)) == len(counters)


def test_in_process_engine_publishes_matching_records(nats_server: Any, tiny_model_dir: Path) -> None:
    ns = f"e2e{uuid.uuid4().hex[:8]}"
    sub = NatsRecords(nats_server.url, fpm_subject(ns, "backend")).start()
    try:
        with fpm_env(
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            NATS_SERVER=nats_server.url,
            DYN_NAMESPACE=ns,
            DYN_FPM_WORKER_ID="e2e-inproc",
        ):
            processed = run_llm(str(tiny_model_dir))
        check_records(sub, processed, "e2e-inproc")
    finally:
        sub.close()


def test_multiprocess_engine_core_child_publishes(
    nats_server: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    ns = f"e2e{uuid.uuid4().hex[:8]}"
    sub = NatsRecords(nats_server.url, fpm_subject(ns, "backend")).start()
    out = tmp_path / "processed.json"
    env = dict(os.environ)
    env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="1",
        NATS_SERVER=nats_server.url,
        DYN_NAMESPACE=ns,
        DYN_FPM_WORKER_ID="e2e-mp",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "dynamo_fpm_testing.scheduler_support", str(tiny_model_dir), str(out)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, log.decode(errors="replace")[-3000:]
        check_records(sub, json.loads(out.read_text()), "e2e-mp")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
        sub.close()
