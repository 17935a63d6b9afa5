"""The shortened real demo, end to end: tiny model, nats-server, Dynamo's frontend, a prefill and a decode
vLLM worker with NIXL KV transfer on CPU, the planner with its local connector, the decode-heavy load.

Asserted from the planner's own decision log: the decode pool scaled up during the burst, the prefill pool
never scaled up, both pools ended at their minimum; from the connector's events: the scale-up promoted the
warm decode standby; from the FPM records (the verdict): the added replica scheduled work and carried a share
of the burst's decode tokens; and no process of the demo is left afterwards.
Takes about 3-7 minutes on 2 cores (171 s measured on a quiet machine; two workers start in 25-110 s, a third
one when decode scales up).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dynamo_fpm_testing.demo_support import LAUNCH

# isort: split
from demo_lib.supervisor import pids_with_marker
from dynamo.planner.decision_log import read_entry

UUID = "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"  # the frontend's request id

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.runtime]

DEMO_TIMEOUT_S = 465  # the whole shortened demo, start to clean-up; the test's budget is 8 minutes


@pytest.mark.timeout(DEMO_TIMEOUT_S + 15)
def test_shortened_demo_scales_decode_not_prefill_and_cleans_up(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_id = f"e2e-{os.getpid()}-{time.monotonic_ns()}"
    argv = [
        sys.executable, str(LAUNCH / "demo.py"),
        "--duration", "140", "--intensity", "1.0",
        "--run-dir", str(run_dir), "--run-id", run_id, "--no-live",
        "--planner-interval", "2", "--scale-down-window", "12",
        "--startup-timeout", "240", "--settle-timeout", "150",
    ]  # fmt: skip
    started = time.monotonic()
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=DEMO_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # the demo's own clean-up path
        out, _ = proc.communicate(timeout=60)
        pytest.fail(f"the demo did not finish within {DEMO_TIMEOUT_S} s:\n{out[-4000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    elapsed = time.monotonic() - started
    print(f"shortened demo took {elapsed:.0f} s")
    assert proc.returncode == 0, f"demo exited {proc.returncode}:\n{out[-4000:]}"
    # The user's console: progress and the verdict, not one log line per load request.
    assert "HTTP Request:" not in out, out[-2000:]

    # No process of the demo is left (the marker is inherited by everything it started, grandchildren too).
    time.sleep(0.5)
    assert pids_with_marker(run_id) == [], "processes of the demo are still running"

    verdict = json.loads((run_dir / "verdict.json").read_text())
    burst_start, burst_end = verdict["burst"]
    decisions = [
        d
        for d in (read_entry(line) for line in (run_dir / "decisions.jsonl").read_text().splitlines())
        if d is not None
    ]
    assert decisions, "the planner logged no decision"
    actions = [d for d in decisions if d.is_action]
    summary = "\n".join(
        f"+{d.ts - burst_start:.0f}s {d.pool} {d.current}->{d.desired} {d.reason}" for d in actions
    )

    decode_ups = [d for d in actions if d.pool == "decode" and d.direction > 0]
    assert decode_ups, f"decode never scaled up:\n{summary}\n{out[-3000:]}"
    assert burst_start <= decode_ups[0].ts <= burst_end + 30, (
        f"decode scaled up outside the burst:\n{summary}"
    )
    assert not [d for d in actions if d.pool == "prefill" and d.direction > 0], (
        f"prefill scaled up:\n{summary}"
    )

    # The default stack is really disaggregated (nixl is installed here: no aggregated fallback), and the
    # decode workers read every prompt's KV from the prefill worker: a read that stalls ends in a lease expiry
    # instead. A request its client cancelled between the two (the load generator's requests in flight when
    # a phase ends) is never started on a decode worker, so its KV is released at the lease's end as well:
    # vLLM's design for an abandoned hand-off, not a stalled read.
    logs = run_dir / "logs"
    assert not (logs / "worker-agg.log").exists(), out[-3000:]
    prefill_logs = "".join(p.read_text(errors="replace") for p in logs.glob("*prefill*.log"))
    decode_logs = "".join(p.read_text(errors="replace") for p in logs.glob("*decode*.log"))
    assert "request received" in prefill_logs
    expired = set(re.findall(rf"Releasing expired KV blocks for request ({UUID})", prefill_logs))
    cancelled = set(
        re.findall(rf"request ({UUID})\S* cancelled by the client before it started", decode_logs)
    )
    assert expired <= cancelled, f"a decode worker never read the prefill KV of {sorted(expired - cancelled)}"
    last = {d.pool: d for d in decisions}
    assert last["decode"].desired == 1 and last["prefill"].desired == 1, f"not back at minimum:\n{summary}"
    assert any(d.pool == "decode" and d.direction < 0 and d.ts > burst_end - 5 for d in actions), summary

    # The scale-up promoted the standby the planner kept warm (no model load after the decision).
    events = [json.loads(line) for line in (logs / "local-connector-events.jsonl").read_text().splitlines()]
    promoted = [e for e in events if e["event"] == "promoted" and e["pool"] == "decode"]
    assert promoted and promoted[0]["warm"], events
    assert promoted[0]["t"] - decode_ups[0].ts < 5.0, (promoted[0], decode_ups[0])
    # ... and that replica took load: it scheduled decode work and carried a share of the decode tokens.
    lines = "\n".join(verdict["lines"])
    print(lines)
    assert verdict["scaled_replica_first_work_s"] is not None, lines
    assert verdict["scaled_replica_decode_share"] > 0, lines
    assert any(line.startswith("Scaled replica took load:") for line in verdict["lines"])
    html = (run_dir / "report" / "report.html").read_text()
    assert html.count('src="data:image/png;base64,') == 1 and "Scaled replica took load" in html
    assert [p.name for p in (run_dir / "report").glob("*.png")] == ["timeline.png"]
    assert verdict["latency"]["burst"]["requests"] > 0
    for name in ("frontend", "worker-prefill", "worker-decode", "planner", "nats"):
        assert (run_dir / "logs" / f"{name}.log").exists()
