"""The demo's orchestration on fake components: a normal run reports and cleans up; a component that dies
is named with the end of its log and everything is stopped; Ctrl-C stops everything too."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from dynamo_fpm_testing.demo_support import fake_stack

# isort: split
from demo_lib.runner import DemoRun, make_config
from demo_lib.supervisor import pids_with_marker


def _run_id() -> str:
    return f"t-{os.getpid()}-{time.monotonic_ns()}"


class _Out(io.StringIO):
    """The demo's terminal, captured."""

    @property
    def text(self) -> str:
        return self.getvalue()

    def isatty(self) -> bool:
        return False


def test_normal_run_reports_and_stops_everything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_stack(monkeypatch.setattr, tmp_path)
    run_id, out = _run_id(), _Out()
    cfg = make_config(tmp_path / "run", duration_s=30)
    demo = DemoRun(cfg, run_id=run_id, out=out, live=False, startup_timeout_s=30, settle_timeout_s=10)
    assert demo.run() == 0, out.text
    assert pids_with_marker(run_id) == []
    verdict = json.loads((cfg.run_dir / "verdict.json").read_text())
    assert verdict["passed"], verdict["lines"]
    assert "Right pool: YES" in out.text and "report:" in out.text
    assert (cfg.run_dir / "report" / "report.html").exists()
    requests = [json.loads(line) for line in (cfg.run_dir / "requests.jsonl").read_text().splitlines()]
    assert {r["phase"] for r in requests} == {"warmup", "burst"} and any(r["ok"] for r in requests)
    procs = json.loads((cfg.run_dir / "processes.json").read_text())
    assert [p["name"] for p in procs["processes"]] == [
        "nats", "fpm-watch", "frontend", "worker-prefill", "worker-decode", "planner",
    ]  # fmt: skip


def test_a_dying_component_is_named_and_everything_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_stack(monkeypatch.setattr, tmp_path, failing_worker=True)
    run_id, out = _run_id(), _Out()
    cfg = make_config(tmp_path / "run", duration_s=30)
    demo = DemoRun(cfg, run_id=run_id, out=out, live=False, startup_timeout_s=30)
    started = time.monotonic()
    assert demo.run() == 1
    assert time.monotonic() - started < 25
    assert "FAILED: component 'worker-decode' exited with code 7" in out.text
    assert "fatal: KV cache does not fit" in out.text  # the end of its log, on screen
    assert pids_with_marker(run_id) == []


@pytest.mark.parametrize("keep_running", [False, True], ids=["during-load", "keep-running"])
def test_ctrl_c_stops_everything(tmp_path: Path, keep_running: bool) -> None:
    """Ctrl-C during the load, or while ``--keep-running`` holds the stack up after the report."""
    run_id = _run_id()
    wait_for = "the stack keeps running" if keep_running else "load:"
    burst = "1.0, 2, max_tokens=4" if keep_running else "60.0, 2, max_tokens=100000"
    script = tmp_path / "run_demo.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            from pathlib import Path
            import pytest
            from dynamo_fpm_testing.demo_support import fake_stack
            from demo_lib import stack
            from demo_lib.runner import DemoRun, make_config
            mp = pytest.MonkeyPatch()
            fake_stack(mp.setattr, Path({str(tmp_path)!r}))
            mp.setattr(stack, "load_phases", lambda d, i: [stack.Phase("burst", {burst})])
            cfg = make_config(Path({str(tmp_path / "run")!r}))
            demo = DemoRun(cfg, run_id={run_id!r}, live=False, startup_timeout_s=30, settle_timeout_s=1,
                           keep_running={keep_running!r})
            sys.exit(demo.run())
            """
        )
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 40
        log = tmp_path / "run" / "demo.log"
        while time.monotonic() < deadline and not (log.exists() and wait_for in log.read_text()):
            time.sleep(0.2)
        time.sleep(1.0)
        assert len(pids_with_marker(run_id)) >= 5
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out
    assert "interrupted: stopping every process" in out and "all processes stopped" in out
    if keep_running:
        assert "report:" in out and "curl -s http://127.0.0.1:" in out
    assert pids_with_marker(run_id) == []


def test_compare_runs_the_same_load_with_the_planner_off_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_stack(monkeypatch.setattr, tmp_path)
    from demo_lib import cli as demo

    run_id = _run_id()
    run = tmp_path / "run"
    argv = ["--compare", "--duration", "30", "--run-dir", str(run), "--run-id", run_id, "--no-live"]
    assert demo.main([*argv, "--startup-timeout", "30", "--settle-timeout", "10"]) == 0
    out = (run / "planner-off" / "demo.log").read_text() + (run / "demo.log").read_text()
    assert pids_with_marker(run_id) == []
    off = json.loads((run / "planner-off" / "verdict.json").read_text())
    assert off["planner"] is False and off["passed"] is None
    assert not (run / "planner-off" / "decisions.jsonl").exists()  # no planner ran
    on = json.loads((run / "verdict.json").read_text())
    assert on["passed"], on
    assert on["compare"]["planner_off"]["latency"] == off["latency"]
    assert on["scaled_replica_first_work_s"] is not None and on["scaled_replica_decode_share"] > 0
    assert "OFF (baseline run" in out and "compare (same load):" in out and "planner off: burst" in out
    assert "planner off" in (run / "report" / "report.html").read_text()
