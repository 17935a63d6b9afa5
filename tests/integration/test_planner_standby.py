"""The ``local`` connector's standbys, graceful stops and adoption, against real processes that speak the
worker state protocol (``dynamo.common.worker_state``): promote, refill, park, stop, a standby that dies,
and a planner that died and was restarted."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from dynamo.common import worker_state as ws
from dynamo.planner import connector_local
from dynamo.planner.connector_base import PoolStatus
from dynamo.planner.connector_local import LocalConnector
from dynamo.planner.local_process import same_process_alive, start_time
from dynamo_fpm_testing.stall_meter import running_s
from dynamo_fpm_testing.worker_support import until

pytestmark = pytest.mark.timeout(90)

# A worker in miniature: loads for LOAD_S, then stands by (DYN_VLLM_STANDBY=1) or serves; SIGUSR1 registers,
# SIGHUP parks, SIGTERM drains for 0.3 s. Its child sleeps in the same process group (like vLLM's engine).
WORKER = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    from dynamo.common.worker_state import write_state
    path = os.environ["DYN_WORKER_STATE_FILE"]
    standby = os.environ.get("DYN_VLLM_STANDBY") == "1"
    load_s = float(sys.argv[1])
    flags = {"promote": False, "park": False, "stop": False}
    signal.signal(signal.SIGUSR1, lambda *_: flags.__setitem__("promote", True))
    signal.signal(signal.SIGHUP, lambda *_: flags.__setitem__("park", True))
    signal.signal(signal.SIGTERM, lambda *_: flags.__setitem__("stop", True))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("child", child.pid, flush=True)
    write_state(path, "loading")
    time.sleep(load_s)
    state = "standby" if standby and not flags["promote"] else "serving"
    write_state(path, state)
    print(state, flush=True)
    while True:
        if flags["stop"]:
            write_state(path, "draining")
            time.sleep(0.3)
            print("drained", flush=True)
            sys.exit(0)  # the child is left behind, as a crashed engine process would be
        if state == "standby" and flags["promote"]:
            flags["promote"] = False
            state = "serving"
            write_state(path, state)
            print("registered", flush=True)
        if state == "serving" and flags["park"]:
            flags["park"] = False
            write_state(path, "draining")
            time.sleep(0.2)
            state = "standby"
            print("parked", flush=True)  # before the state file says so: the test reads the log then
            write_state(path, state)
        time.sleep(0.02)
    """
)


@pytest.fixture()
def worker(tmp_path: Path) -> Path:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    return script


async def _until(cond: Any, what: str, timeout: float = 20.0) -> None:
    await until(cond, what, timeout)


def _connector(tmp_path: Path, worker: Path, load_s: float = 0.3, **kw: Any) -> LocalConnector:
    template = f"python {worker} {load_s}"
    kw.setdefault("stop_timeout_s", 10.0)
    return LocalConnector(
        prefill_command=template, decode_command=template, log_dir=tmp_path / "logs", namespace="sb", **kw
    )


def _events(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "logs" / "local-connector-events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


async def _warm(c: LocalConnector, pool: str, n: int) -> None:
    async def check() -> bool:
        st = await c.status()
        counts = st.breakdown(pool)
        return counts is not None and counts.standby == n

    deadline = time.monotonic() + 20
    while not await check():
        assert time.monotonic() < deadline, f"{pool} never had {n} warm standby(s)"
        await asyncio.sleep(0.05)


async def test_standby_is_promoted_refilled_parked_and_stopped(tmp_path: Path, worker: Path) -> None:
    c = _connector(tmp_path, worker, standby_decode=1)
    await c.start()
    try:
        st = await c.status()
        assert (st.prefill, st.decode) == (0, 0)  # a standby is not a replica
        await _warm(c, "decode", 1)
        standby = c.standbys("decode")[0]
        assert "standby" in standby.log_path.read_text()

        # Scale-up: the warm standby registers at once, a new standby starts behind it.
        t0 = time.monotonic()
        await c.apply(None, 1)
        st = await c.status()
        assert st.decode == 1
        assert [wp.index for wp in c.running("decode")] == [standby.index]
        await _until(lambda: c.running("decode")[0].serving, "the promoted standby never served")
        assert running_s(t0, time.monotonic()) < 2.0  # the machine's stalls left out, as every timing bound
        # The worker writes its state before it logs the line: wait for the line, do not race it.
        await _until(
            lambda: "registered" in standby.log_path.read_text(), "the promoted standby never logged it"
        )
        await _warm(c, "decode", 1)
        refill = c.standbys("decode")[0]
        assert refill.index != standby.index
        st = await c.status()
        assert st.decode_pool == PoolStatus(starting=0, draining=0, standby=1)

        # Scale-up with no warm standby left but one loading: grow by a fresh worker or the loading one.
        await c.apply(None, 2)
        assert len(c.running("decode")) == 2
        await _until(lambda: all(wp.serving for wp in c.running("decode")), "second member never served")

        # Scale-down with N standbys warm: the member is stopped (SIGTERM to the worker alone, it drains).
        await _warm(c, "decode", 1)
        newest = max(c.running("decode"), key=lambda w: w.index)
        await c.apply(None, 1)
        assert (await c.status()).settled is False
        await _until(lambda: c.draining() == 0, "the stopped worker never exited")
        assert "drained" in newest.log_path.read_text()
        assert ("decode", newest.index, 0) in c.exited

        # With the standby gone, a scale-down parks the serving member instead of stopping it.
        spare = c.standbys("decode")[0]
        spare.handle.signal(signal.SIGKILL)
        await _until(lambda: not c.standbys("decode"), "the killed standby was not reaped")
        member = c.running("decode")[0]
        await c.apply(None, 0)
        assert member.role == "parking"
        await _until(lambda: c.poll() or member.warm, "the member was never parked")
        assert "parked" in member.log_path.read_text()
        assert (await c.status()).decode == 0
        # And it is the next one promoted.
        await c.apply(None, 1)
        assert c.running("decode") == [member]
        await _until(lambda: c.poll() or member.serving, "the parked worker never served again")
        kinds = [e["event"] for e in _events(tmp_path)]
        assert {"started", "promoted", "state", "stopping", "exited", "parking", "parked"} <= set(kinds)
    finally:
        await c.close()
    assert all(not wp.alive for procs in c.procs.values() for wp in procs)


async def test_no_standby_is_kept_beyond_the_pools_maximum(tmp_path: Path, worker: Path) -> None:
    """A pool at its maximum could never promote a standby: none loads, and a scale-down parks instead."""
    c = _connector(tmp_path, worker, standby_decode=1, max_decode=2, initial_decode=1)
    await c.start()
    try:
        await _warm(c, "decode", 1)
        first = c.standbys("decode")[0]
        await c.apply(None, 2)  # the external worker + the promoted standby = the maximum
        await _until(lambda: c.running("decode")[0].serving, "never served")
        await asyncio.sleep(0.5)
        st = await c.status()
        assert st.decode == 2 and c.standbys("decode") == [] and st.decode_pool == PoolStatus(0, 0, 0)
        await c.apply(None, 1)
        assert first.role == "parking"  # room again: parked, not stopped
        await _warm(c, "decode", 1)
        assert c.standbys("decode") == [first] and c.exited == []
    finally:
        await c.close()


async def test_a_standby_that_dies_is_replaced_after_a_pause(
    tmp_path: Path, worker: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(connector_local, "STANDBY_RETRY_S", 0.5)
    c = _connector(tmp_path, worker, standby_prefill=1)
    await c.start()
    try:
        await _warm(c, "prefill", 1)
        first = c.standbys("prefill")[0]
        first.handle.signal(signal.SIGKILL)
        await _until(
            lambda: c.poll() or ("prefill", first.index, -9) in c.exited, "the dead standby was not reaped"
        )
        st = await c.status()
        assert st.prefill == 0 and st.prefill_pool == PoolStatus(0, 0, 0)
        assert not c.standbys("prefill")  # not at once: a crashing command must not spin
        await asyncio.sleep(0.6)
        await _warm(c, "prefill", 1)
        assert c.standbys("prefill")[0].index == first.index + 1
    finally:
        await c.close()


async def test_promoting_a_standby_that_is_still_loading(tmp_path: Path, worker: Path) -> None:
    c = _connector(tmp_path, worker, load_s=1.5, standby_decode=1)
    await c.start()
    try:
        await _until(lambda: c.standbys("decode")[0].state is not None, "no state file")
        await c.apply(None, 1)
        st = await c.status()
        assert st.decode == 1 and st.decode_pool is not None and st.decode_pool.starting == 1
        member = c.running("decode")[0]
        await _until(
            lambda: c.poll() or member.serving, "the loading standby never served"
        )  # registered right after loading
    finally:
        await c.close()


async def test_stop_signals_the_worker_alone_and_sweeps_its_group_after(tmp_path: Path, worker: Path) -> None:
    c = _connector(tmp_path, worker)
    await c.start()
    await c.apply(None, 1)
    wp = c.running("decode")[0]
    await _until(lambda: "child" in wp.log_path.read_text(), "no child")
    child = int(wp.log_path.read_text().split("child")[1].split()[0])
    await _until(lambda: c.poll() or wp.serving, "never served")
    await c.apply(None, 0)
    child_started = start_time(child) or 0.0
    await _until(lambda: c.draining() == 0, "never exited")
    assert "drained" in wp.log_path.read_text()
    assert same_process_alive(child, child_started)  # SIGTERM went to the worker alone, not its group
    # What the worker left in its group is swept a few seconds after it exited.
    await _until(lambda: c.poll() or not same_process_alive(child, child_started), "the child lingers", 15)
    await c.close()


async def test_a_stopped_worker_is_killed_and_its_standby_promoted(tmp_path: Path, worker: Path) -> None:
    """SIGSTOP to a member's process group: alive but silent. After ``hung_after_s`` the connector kills the
    group (the engine child too) and reaps it like a crash; the pool's next scale-up promotes the standby."""
    c = _connector(tmp_path, worker, standby_prefill=1, hung_after_s=0.6)
    await c.start()
    try:
        await c.apply(1, None)
        hung = c.running("prefill")[0]
        await _until(lambda: c.poll() or hung.serving, "never served")
        await _until(lambda: "child" in hung.log_path.read_text(), "no child")
        child = int(hung.log_path.read_text().split("child")[1].split()[0])
        child_started = start_time(child) or 0.0
        await _warm(c, "prefill", 1)
        standby = c.standbys("prefill")[0]
        # A worker that runs again before the bound is left alone: the clock restarts.
        os.killpg(hung.pid, signal.SIGSTOP)
        await _until(lambda: c.poll() or hung.stopped_since is not None, "the stop was never seen")
        os.killpg(hung.pid, signal.SIGCONT)
        await _until(lambda: c.poll() or hung.stopped_since is None, "the resume was never seen")
        await asyncio.sleep(0.7)
        assert (await c.status()).prefill == 1 and hung.alive
        stopped_at = time.monotonic()
        os.killpg(hung.pid, signal.SIGSTOP)
        await _until(lambda: c.poll() or ("prefill", hung.index, -9) in c.exited, "the hung worker lives on")
        assert running_s(stopped_at, time.monotonic()) >= 0.6
        assert not same_process_alive(child, child_started)  # its group went with it
        st = await c.status()
        assert st.prefill == 0 and c.standbys("prefill") == [standby]
        (event,) = [e for e in _events(tmp_path) if e["event"] == "hung"]
        assert event["index"] == hung.index and "stopped by a signal (state T)" in event["reason"]
        await c.apply(1, None)  # what the planner does for a pool below its minimum
        assert c.running("prefill") == [standby]
        await _until(lambda: c.poll() or standby.serving, "the promoted standby never served")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(hung.pid, signal.SIGCONT)
        await c.close()


async def test_a_restarted_planner_adopts_its_predecessors_workers(tmp_path: Path, worker: Path) -> None:
    first = _connector(tmp_path, worker, standby_decode=1)
    second = _connector(tmp_path, worker, standby_decode=1)
    try:
        await first.start()
        await _warm(first, "decode", 1)
        await first.apply(None, 1)
        await _until(lambda: first.running("decode")[0].serving, "never served")
        await _warm(first, "decode", 1)
        pids = sorted(wp.pid for wp in first.procs["decode"])
        # The planner dies without closing its connector (SIGKILL): a new one starts on the same folder.
        await second.start()
        st = await second.status()
        assert st.decode == 1 and st.decode_pool == PoolStatus(0, 0, 1)
        assert sorted(wp.pid for wp in second.procs["decode"]) == pids  # nothing new was started
        assert all(wp.handle.adopted for wp in second.procs["decode"])
        assert "adopted" in [e["event"] for e in _events(tmp_path)]
        # The adopted standby is promoted like any other.
        await second.apply(None, 2)
        await _until(
            lambda: all(wp.serving for wp in second.running("decode")), "adopted standby never served"
        )
        await second.close()
        assert not any(same_process_alive(p, start_time(p) or 0) for p in pids)
        # The state file of a cleanly closed connector lists nobody.
        state = json.loads((tmp_path / "logs" / "local-connector.json").read_text())
        assert state["workers"] == []
    finally:
        await second.close()
        await first.close()


async def test_adoption_is_refused_for_a_reused_pid_and_can_stop_instead(
    tmp_path: Path, worker: Path
) -> None:
    first = _connector(tmp_path, worker)
    second = _connector(tmp_path, worker)
    third = _connector(tmp_path, worker, adopt=False)
    try:
        await first.start()
        await first.apply(None, 1)
        wp = first.running("decode")[0]
        await _until(lambda: first.poll() or wp.serving, "never served")
        path = tmp_path / "logs" / "local-connector.json"
        body = json.loads(path.read_text())
        body["workers"][0]["started"] -= 100.0  # same pid, another start time: another process
        path.write_text(json.dumps(body))
        await second.start()
        assert (await second.status()).decode == 0
        body["workers"][0]["started"] += 100.0
        path.write_text(json.dumps(body))
        await third.start()
        assert (await third.status()).decode == 0  # recorded, alive, but stopped rather than adopted
        await _until(lambda: third.draining() == 0, "the predecessor's worker was not stopped")
        assert not same_process_alive(wp.pid, wp.handle.started)
        assert "drained" in wp.log_path.read_text()
    finally:
        await third.close()
        await second.close()
        await first.close()


def test_state_file_protocol_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "w.state.json"
    assert ws.read_state(path) is None
    ws.write_state(path, ws.STANDBY, worker_id="42", now=5.0)
    assert ws.read_state(path) == ws.WorkerState("standby", os.getpid(), "42", 5.0)
    path.write_text("{not json")
    assert ws.read_state(path) is None
    with pytest.raises(ValueError):
        ws.write_state(path, "asleep")


def test_standby_options_are_validated() -> None:
    from dynamo.planner.config import ConfigError, config_from_mapping

    base: dict[str, Any] = {"connector": "local", "local": {"prefill_command": "p", "decode_command": "d"}}
    cfg = config_from_mapping({**base, "local": {**base["local"], "standby_decode": 1, "adopt": False}})
    assert (cfg.local.standby_prefill, cfg.local.standby_decode, cfg.local.adopt) == (0, 1, False)
    with pytest.raises(ConfigError, match=r"local\.standby_decode: must be >= 0"):
        config_from_mapping({**base, "local": {**base["local"], "standby_decode": -1}})
    with pytest.raises(ConfigError, match=r"local\.standby_prefill: the prefill pool has max_replicas 0"):
        config_from_mapping(
            {
                **base,
                "prefill": {"min_replicas": 0, "max_replicas": 0},
                "local": {**base["local"], "standby_prefill": 1},
            }
        )
    assert cfg.local.hung_after_s == 30.0
    off = config_from_mapping({**base, "local": {**base["local"], "hung_after_s": 0}})
    assert off.local.hung_after_s == 0
    with pytest.raises(ConfigError, match=r"local\.hung_after_s: must be >= 0"):
        config_from_mapping({**base, "local": {**base["local"], "hung_after_s": -1}})
