"""The fault probe of a disaggregated stack, in the suite: the real frontend, and a prefill and a decode
``python -m dynamo.vllm`` worker started and replaced by the real planner (``local`` connector), on CPU.

1. The only prefill worker is killed (SIGKILL to its process group) under load: the decode worker serves the
   requests that arrive afterwards end to end (local prefill, ``--local-prefill``) until the planner's new
   prefill worker (its warm standby, promoted) registers, and the stack is disaggregated again without a
   restart. The planner asks for the prefill replica (``below min_replicas``) and never for a second decode
   worker.
2. The prefill worker hangs (SIGSTOP to its process group) under load: every request in flight ends within
   a bound (the request plane's acknowledgement timeout, the frontend's stream timeout), the decode worker
   serves alone once the frontend dropped the hung worker, the planner holds the prefill pool for its mismatch
   grace (a replica that publishes nothing) and asks for no decode replica; the planner's connector kills the
   stopped worker after ``local.hung_after_s`` and the planner promotes its warm standby, which serves.
3. The decode worker is stopped mid-transfer (SIGSTOP: the prompts' KV is computed and held on the
   prefill side, never read) and then killed: the prefill worker's FPM records carry the held KV from the
   record of the pass that computed it, and its release when the KV lease (``LEASE_S``) ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from dynamo.common.ports import free_port
from dynamo_fpm_testing.local_stack import kv_transfer_config
from dynamo_fpm_testing.nats_server import EmbeddedNatsServer
from dynamo_fpm_testing.stall_meter import running_s
from dynamo_fpm_testing.worker_support import (
    ENGINE_FLAGS,
    Proc,
    base_env,
    http_json,
    start_frontend,
    wait_until,
)

pytest.importorskip("nixl")
pytestmark = [pytest.mark.vllm, pytest.mark.runtime, pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "tiny"
PROMPT = " ".join(["hello there how are you"] * 8)  # 40 tokens: two KV blocks of 32
# The prefill side's KV lease: short, so the release is seen within the test; long enough for a first pull of
# a new pair on this machine kind (up to ~20 s: docs/disaggregation.md, "Hosts that stall").
LEASE_S = 20
# A warm prefill standby (loaded, unregistered) replaces the killed prefill worker within a planner tick: a
# cold start took 192 s of this machine's running time under load. The connector keeps a standby only while
# the pool can still grow (max_replicas 2); the light load never makes the planner use it before the kill.
# Seconds after the prefill worker's kill whose requests are counted: about what a cold replacement takes on a
# GPU host (the probe: 26 s), so the share is what clients see until a new prefill worker registers.
# What fails is the first 0.2-0.6 s, until the decode worker's reaper removed the dead worker from discovery.
WINDOW_S = 30
# A SIGSTOP-hung prefill worker. A request it has not acknowledged fails after the request plane's
# DYN_TCP_REQUEST_TIMEOUT (upstream's default, 5 s: HTTP 504); one it acknowledged before the stop would wait
# for its answer forever unless the frontend's DYN_HTTP_BACKEND_STREAM_TIMEOUT_SECS (unset upstream) ends it
# (504, the worker quarantined): the test's frontend runs with STREAM_TIMEOUT_S, above the slowest first pull
# of a new pair on these hosts (docs/disaggregation.md, "Hosts that stall"). Every request in flight ends
# within HUNG_BOUND_S; the load is kept on for HUNG_SERVED_S after the frontend dropped the worker (its
# discovery lease ran out: decode-only serving).
TCP_REQUEST_TIMEOUT_S = 5
STREAM_TIMEOUT_S = 30
HUNG_BOUND_S = STREAM_TIMEOUT_S + 5
HUNG_SERVED_S = 6
# The planner's connector kills a worker seen stopped for HUNG_AFTER_S (``local.hung_after_s``; it looks
# at every tick, INTERVAL_S): the kill comes HUNG_AFTER_S to HUNG_AFTER_S + 2 ticks after the stop, past the
# frontend dropping the worker (10-12 s) and the planner's mismatch_grace decisions, and the promoted warm
# standby serves within REPLACED_BOUND_S of the stop.
INTERVAL_S = 2
HUNG_AFTER_S = 20
KILLED_BOUND_S = HUNG_AFTER_S + 2 * INTERVAL_S + 3
REPLACED_BOUND_S = HUNG_AFTER_S + 20
PLANNER_CONFIG = {
    "prefill": {"min_replicas": 1, "max_replicas": 2},
    "decode": {"min_replicas": 1, "max_replicas": 2},
    "local": {"standby_prefill": 1, "hung_after_s": HUNG_AFTER_S},
}


def _worker_command(model_dir: Path, mode: str) -> str:
    # The planner fills {placeholders} with str.format: the JSON's braces are doubled.
    kv = json.dumps(kv_transfer_config("kv_both", lease_s=LEASE_S)).replace("{", "{{").replace("}", "}}")
    argv = [
        sys.executable, "-m", "dynamo.vllm", "--model", str(model_dir), *ENGINE_FLAGS,
        "--served-model-name", MODEL, "--namespace", "{namespace}", "--disaggregation-mode", mode,
        "--kv-transfer-config", kv,
    ]  # fmt: skip
    return shlex.join(argv)


@dataclass
class Load:
    """Open-loop clients: a short completion every ``period_s`` whatever the answers (a failing stack gets
    no more requests than a healthy one): (sent, done, HTTP status) per request."""

    base_url: str
    period_s: float = 0.2
    timeout_s: float = 60.0
    sent: list[float] = field(default_factory=list)
    results: list[tuple[float, float, int]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Load:
        dispatcher = threading.Thread(target=self._run, daemon=True)
        dispatcher.start()
        self.threads.append(dispatcher)
        return self

    def _one(self) -> None:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        sent = time.monotonic()
        self.sent.append(sent)
        try:
            status, _ = http_json(f"{self.base_url}/v1/completions", body, timeout=self.timeout_s)
        except OSError:  # no answer within timeout_s: still in flight
            return
        self.results.append((sent, time.monotonic(), status))

    def _run(self) -> None:
        while not self.stop.wait(self.period_s):
            thread = threading.Thread(target=self._one, daemon=True)
            thread.start()
            self.threads.append(thread)

    def finish(self) -> list[tuple[float, float, int]]:
        self.stop.set()
        for thread in list(self.threads):
            thread.join(timeout=self.timeout_s + 30)
        return list(self.results)


def _workers(log_dir: Path) -> list[dict[str, Any]]:
    try:
        return list(json.loads((log_dir / "local-connector.json").read_text())["workers"])
    except (OSError, ValueError, KeyError):
        return []


def _serving(log_dir: Path, pool: str, state: str = "serving") -> list[dict[str, Any]]:
    """The planner's workers of ``pool`` whose worker state file says ``state``."""
    out = []
    for worker in _workers(log_dir):
        if worker["pool"] != pool:
            continue
        with contextlib.suppress(OSError, ValueError):
            if json.loads(Path(worker["state_path"]).read_text()).get("state") == state:
                out.append(worker)
    return out


def _present(base_url: str) -> list[str]:
    """The worker types the frontend sees for the model (sorted; none while it is not ready)."""
    status, ready = http_json(f"{base_url}/v1/models/{MODEL}/ready", timeout=5)
    return sorted(ready["namespaces"]["dynamo"]["present"]) if status == 200 else []


def _kill_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


def _events(log_dir: Path, event: str) -> list[dict[str, Any]]:
    """The ``local`` connector's events of one kind (``local-connector-events.jsonl``)."""
    lines = (log_dir / "local-connector-events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == event]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _decisions(planner: Proc) -> list[dict[str, Any]]:
    out = []
    for line in planner.log().splitlines():
        if line.startswith("{") and '"pool"' in line:
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


class PrefillRecords:
    """The prefill pool's FPM records from NATS, with the monotonic time each arrived."""

    def __init__(self, nats_url: str) -> None:
        self.nats_url = nats_url
        self.records: list[tuple[float, Any]] = []
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> PrefillRecords:
        import nats
        from dynamo.common import forward_pass_metrics as fpm
        from dynamo.common.fpm_subjects import decode_envelope, fpm_subscription, parse_fpm_subject

        self._nc = await nats.connect(self.nats_url)

        async def on_msg(msg: Any) -> None:
            subject = parse_fpm_subject(msg.subject)
            record = fpm.decode(decode_envelope(msg.data).payload)
            if subject is not None and record is not None and subject.component == "prefill":
                self.records.append((time.monotonic(), record))

        await self._nc.subscribe(fpm_subscription("dynamo"), cb=on_msg)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._nc.close()


async def test_prefill_and_decode_worker_faults(
    tmp_path: Path, tiny_model_dir: Path, nats_server: EmbeddedNatsServer
) -> None:
    started = time.monotonic()
    file_kv = tmp_path / "discovery"
    file_kv.mkdir()
    log_dir = tmp_path / "planner-logs"
    env = base_env(file_kv, nats_server.url)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    frontend_env = {**env, "DYN_HTTP_BACKEND_STREAM_TIMEOUT_SECS": str(STREAM_TIMEOUT_S)}
    frontend = start_frontend(port, frontend_env, tmp_path / "frontend.log")
    planner = Proc(
        [
            sys.executable, "-m", "dynamo.planner", "--connector", "local", "--namespace", "dynamo",
            "--interval", str(INTERVAL_S), "--json", "--log-dir", str(log_dir),
            "--prefill-command", _worker_command(tiny_model_dir, "prefill"),
            "--decode-command", _worker_command(tiny_model_dir, "decode"),
            "--config", json.dumps(PLANNER_CONFIG),
        ],
        env,
        tmp_path / "planner.log",
    )  # fmt: skip
    procs = [frontend, planner]
    try:
        wait_until(
            lambda: (
                _present(base_url) == ["decode", "prefill"]
                and _serving(log_dir, "prefill")
                and _serving(log_dir, "decode")
                and _serving(log_dir, "prefill", "standby")
            ),
            timeout=420,
            procs=procs,
        )
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        assert http_json(f"{base_url}/v1/completions", body, timeout=120)[0] == 200  # the pair's first pull
        ready_s = running_s(started, time.monotonic())

        # ---- 1. the only prefill worker dies under load --------------------------------------------------
        (prefill,) = _serving(log_dir, "prefill")  # the only prefill worker (its standby is unregistered)
        load = Load(base_url).start()
        wait_until(lambda: len(load.results) >= 4, timeout=60, procs=procs)
        killed_at = time.monotonic()
        _kill_group(prefill["pid"], signal.SIGKILL)
        # The planner's replacement registers and serves prefill (its log shows a routed request).
        wait_until(
            lambda: any(
                w["index"] != prefill["index"] and "request received" in Path(w["log_path"]).read_text()
                for w in _serving(log_dir, "prefill")
            ),
            timeout=420,
            procs=procs,
        )
        back_at = time.monotonic()
        # Every request sent after the kill, over at least WINDOW_S: degraded mode, then disaggregated again.
        wait_until(lambda: running_s(killed_at, time.monotonic()) >= WINDOW_S, timeout=WINDOW_S + 5)
        until = time.monotonic()
        results = load.finish()
        after = [status for sent, _, status in results if killed_at <= sent <= until]
        ok = sum(status == 200 for status in after)
        window_s, back_s = running_s(killed_at, until), running_s(killed_at, back_at)
        print(
            f"prefill worker killed: {ok}/{len(after)} requests sent in the {window_s:.1f} s after the kill "
            f"served; the new prefill worker served {back_s:.1f} s after the kill; "
            f"stack ready in {ready_s:.0f} s; failed (s after the kill, status): "
            f"{[(round(t - killed_at, 2), c) for t, _, c in results if killed_at <= t <= until and c != 200]}"
        )
        assert len(after) >= 30, results
        assert ok >= 0.95 * len(after), [
            (round(s - killed_at, 2), st) for s, _, st in results if s >= killed_at
        ]
        decisions = _decisions(planner)
        assert any(
            d["pool"] == "prefill" and d["desired"] >= 1 and "below min_replicas" in d["reason"]
            for d in decisions
            if d["current"] == 0
        ), decisions[-6:]
        # Degraded mode is prefill work on the decode worker, not phantom decode load: no second decode.
        assert not [d for d in decisions if d["pool"] == "decode" and d["desired"] > 1]
        assert _present(base_url) == ["decode", "prefill"]

        # ---- 2. the prefill worker hangs (SIGSTOP to its process group) under load -------------------------
        (hung,) = _serving(log_dir, "prefill")
        # The standby started when phase 1 promoted the last one is warm: the replacement's bound holds.
        wait_until(lambda: _serving(log_dir, "prefill", "standby"), timeout=420, procs=procs)
        (standby,) = _serving(log_dir, "prefill", "standby")
        load_started = time.monotonic()
        load = Load(base_url, timeout_s=HUNG_BOUND_S + 30).start()
        wait_until(lambda: len(load.results) >= 3, timeout=60, procs=procs)
        hung_at, hung_wall = time.monotonic(), time.time()
        _kill_group(hung["pid"], signal.SIGSTOP)
        # The frontend drops the hung worker when its discovery lease runs out: decode-only serving.
        wait_until(lambda: _present(base_url) == ["decode"], timeout=60, procs=procs)
        dropped_at = time.monotonic()
        wait_until(lambda: running_s(dropped_at, time.monotonic()) >= HUNG_SERVED_S, HUNG_SERVED_S + 5)
        load.stop.set()
        # The planner's connector kills it (its process group) after hung_after_s; nobody here does.
        wait_until(lambda: not _alive(hung["pid"]), timeout=KILLED_BOUND_S + 30, procs=procs)
        killed_s = running_s(hung_at, time.monotonic())
        # ... and the planner promotes the warm standby, which serves prefill again.
        wait_until(
            lambda: (
                [w["index"] for w in _serving(log_dir, "prefill")] == [standby["index"]]
                and _present(base_url) == ["decode", "prefill"]
            ),
            timeout=60,
            procs=procs,
        )
        replaced_s = running_s(hung_at, time.monotonic())
        results = load.finish()
        assert http_json(f"{base_url}/v1/completions", body, timeout=120)[0] == 200
        assert "request received" in Path(standby["log_path"]).read_text()
        since_stop = [d for d in _decisions(planner) if d["ts"] >= hung_wall]
        ended = [(round(t - hung_at, 2), round(running_s(t, e), 2), c) for t, e, c in results if t >= hung_at]
        dropped_s = running_s(hung_at, dropped_at)
        (hung_event,) = [e for e in _events(log_dir, "hung") if e["index"] == hung["index"]]
        print(
            f"prefill worker hung: dropped by the frontend {dropped_s:.1f} s after the SIGSTOP; killed by "
            f"the planner's connector {hung_event['t'] - hung_wall:.1f} s after it (seen {killed_s:.1f} s), "
            f"its standby serving {replaced_s:.1f} s after it; {len(ended)} requests sent after the stop; "
            f"(sent s, took s, status): {ended}"
        )
        print(
            "planner since the stop:",
            [(d["pool"], d["current"], d["desired"], d["code"]) for d in since_stop],
        )
        # No request stays in flight: each ends (answered or refused) within the bound ...
        assert len(ended) == len([t for t in load.sent if t >= hung_at]), (len(load.sent), ended)
        assert max(took for _, took, _ in ended) <= HUNG_BOUND_S, ended
        # ... the first ones, routed to the hung worker, by the request plane's acknowledgement timeout ...
        assert any(st == 504 and took >= TCP_REQUEST_TIMEOUT_S - 0.5 for _, took, st in ended), ended
        # ... and once the frontend dropped it, the decode worker serves alone.
        late = [st for s, _, st in results if s >= dropped_at + 1.0]
        assert len(late) >= 3 and all(st == 200 for st in late), ended
        # The planner: while the stopped worker's process lived, its connector counted the replica; its
        # records stopped, so the prefill pool held ("1 replicas but 0 workers publishing") for the mismatch
        # grace. Its connector killed the worker no sooner than hung_after_s and within two ticks after
        # (running time), the pool was short and its standby was promoted; no decode replica was asked for.
        assert any(d["pool"] == "prefill" and d["code"] == "mismatch_grace" for d in since_stop), since_stop
        assert "stopped by a signal (state T)" in hung_event["reason"], hung_event
        assert hung_event["t"] - hung_wall >= HUNG_AFTER_S - 0.5 and killed_s <= KILLED_BOUND_S, killed_s
        assert replaced_s <= REPLACED_BOUND_S, replaced_s
        assert any(
            d["pool"] == "prefill" and d["current"] == 0 and d["desired"] >= 1 and d["ts"] >= hung_event["t"]
            for d in since_stop
        ), since_stop[-6:]
        assert not [d for d in _decisions(planner) if d["pool"] == "decode" and d["desired"] > 1]
        print(f"the hung-worker phase took {running_s(load_started, time.monotonic()):.0f} s of running time")

        # ---- 3. the decode worker dies mid-transfer --------------------------------------------------------
        (decode,) = _serving(log_dir, "decode")
        async with PrefillRecords(nats_server.url) as seen:
            await asyncio.sleep(1.0)  # subscribed
            # Nothing held before: every prefill engine's latest record says so.
            subscribed_at = time.monotonic()

            def nothing_held() -> bool:
                latest = {(r.worker_id, r.dp_rank): r for t, r in list(seen.records) if t > subscribed_at}
                return bool(latest) and all(r.num_held_kv_requests == 0 for r in latest.values())

            await asyncio.to_thread(wait_until, nothing_held, LEASE_S + 15)
            _kill_group(decode["pid"], signal.SIGSTOP)  # alive and listed: the frontend still routes to it
            stopped_at = time.monotonic()
            for _ in range(3):  # each fails once the decode worker is gone
                threading.Thread(
                    target=http_json, args=(f"{base_url}/v1/completions", body, 90), daemon=True
                ).start()
            await asyncio.to_thread(
                wait_until, lambda: any((r.num_held_kv_requests or 0) > 0 for _, r in seen.records), 60
            )
            _kill_group(decode["pid"], signal.SIGKILL)
            _kill_group(decode["pid"], signal.SIGCONT)
            records = [(t, r) for t, r in seen.records if t >= stopped_at]
            first_pass = next(
                i for i, (_, r) in enumerate(records) if r.scheduled_requests.num_prefill_requests
            )
            # Within one record: the pass that computed the prompt, or the next record, shows its KV held.
            assert any((r.num_held_kv_requests or 0) > 0 for _, r in records[first_pass : first_pass + 2])
            held_at = next(t for t, r in records if (r.num_held_kv_requests or 0) > 0)
            held = max((r for _, r in records), key=lambda r: r.num_held_kv_requests or 0)
            assert held.sum_held_kv_tokens and held.sum_held_kv_tokens >= 30 * (
                held.num_held_kv_requests or 0
            )

            def released() -> bool:
                return any(t > held_at and r.num_held_kv_requests == 0 for t, r in list(seen.records))

            await asyncio.to_thread(wait_until, released, LEASE_S + 30)
            released_at = next(t for t, r in seen.records if t > held_at and r.num_held_kv_requests == 0)
            aged = [r.max_held_kv_age or 0.0 for t, r in seen.records if held_at <= t < released_at]
        held_s = running_s(held_at, released_at)
        print(
            f"decode worker killed mid-transfer: {held.num_held_kv_requests} request(s), "
            f"{held.sum_held_kv_tokens} KV tokens held for {held_s:.1f} s (lease {LEASE_S} s), "
            f"oldest seen at {max(aged):.1f} s"
        )
        # Released by the lease, not by a read: no sooner than the lease, and the age grew towards it.
        assert released_at - held_at >= LEASE_S - 2 and held_s <= LEASE_S + 15, held_s
        assert max(aged) >= LEASE_S - 5, aged
        assert "Releasing expired KV blocks" in Path(_serving(log_dir, "prefill")[0]["log_path"]).read_text()
        print(f"test ran {running_s(started, time.monotonic()):.0f} s of running time")
    finally:
        planner.signal(signal.SIGTERM)  # the planner stops its workers
        with contextlib.suppress(Exception):
            planner.wait(timeout=60)
        for worker in _workers(log_dir):
            _kill_group(worker["pid"], signal.SIGKILL)
            _kill_group(worker["pid"], signal.SIGCONT)
        for proc in procs:
            proc.stop()
