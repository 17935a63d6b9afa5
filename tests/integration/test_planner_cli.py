"""The command line: dry run against real NATS, the decision log, config errors, replay of a stream
recorded by the real watch CLI, metrics, and the loop's handling of a failing connector."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from dynamo.common.fpm_publisher import FpmDirectPublisher
from dynamo.common.ports import free_port
from dynamo.planner.connector_base import ConnectorStatus
from dynamo.planner.loop import Planner
from dynamo.planner.metrics import PlannerMetrics
from dynamo.planner.replay import run_replay
from dynamo_fpm_testing import REPO
from dynamo_fpm_testing.planner_support import config, rec

pytestmark = pytest.mark.timeout(120)

CFG = json.dumps(
    {
        "use_model_cards": False,
        "capacity": {"context_length": 1000, "kv_tokens": 10000},
        "scale_down_stabilization_s": 2,
        "demand_window_s": 2,
    }
)


def _env(nats_url: str) -> dict[str, str]:
    env = dict(os.environ)
    env["NATS_SERVER"] = nats_url
    return env


def _publish_for(seconds: float, ns: str, url: str, decode_record: Any, prefill_record: Any) -> None:
    pubs = [
        FpmDirectPublisher(namespace=ns, component="backend", worker_id="d0", nats_url=url),
        FpmDirectPublisher(namespace=ns, component="prefill", worker_id="p0", nats_url=url),
    ]
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pubs[0].publish(decode_record)
            pubs[1].publish(prefill_record)
            time.sleep(0.1)
    finally:
        for p in pubs:
            p.close()


BACKLOG = rec("d0", wall=0.02, s_decode=4, s_decode_kv=2500, q_decode=30, q_decode_kv=9000)
PREFILL = rec("p0", wall=0.02, s_prefill=1, s_prefill_tokens=128, q_prefill=1, q_prefill_tokens=300)


def test_dry_run_cli_decides_logs_and_never_acts(tmp_path: Path, nats_server: Any) -> None:
    log = tmp_path / "decisions.jsonl"
    ns = "clidry"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dynamo.planner",
            "--namespace",
            ns,
            "--dry-run",
            "--interval",
            "0.5",
            "--max-ticks",
            "8",
            "--json",
            "--decision-log",
            str(log),
            "--nats-url",
            nats_server.url,
            "--config",
            CFG,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(nats_server.url),
        start_new_session=True,
    )
    try:
        _publish_for(5.0, ns, nats_server.url, BACKLOG, PREFILL)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-2000:]
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 16 and {r["pool"] for r in rows} == {"prefill", "decode"}
    assert all(r["dry_run"] and not r["applied"] for r in rows)
    # On a busy machine the first tick may come before the first records: judge from the first
    # tick that saw both workers on.
    seen = next(r["tick"] for r in rows if r["pool"] == "decode" and r["signals"]["workers"] == 1)
    rows_on = [r for r in rows if r["tick"] >= seen]
    ups = [r for r in rows_on if r["pool"] == "decode" and r["action"] == "scale_up"]
    assert ups and ups[0]["tick"] == seen and ups[0]["current"] == 1 and ups[0]["desired"] == 2
    assert ups[0]["code"] == "load_up" and ups[0]["signals"]["queued_decode_kv_tokens"] == 9000
    assert all(
        r["desired"] == r["current"] == 1
        for r in rows_on
        if r["pool"] == "prefill" and r["signals"]["workers"]
    )
    assert [json.loads(line) for line in log.read_text().splitlines()] == rows
    assert set(rows[0]) >= {"time", "ts", "tick", "pool", "current", "desired", "action", "reason", "signals"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--config", '{"decode": {"min_replicas": -1}}'], "decode.min_replicas: must be >= 0"),
        (["--config", "prefill:\n  maxreplicas: 3\n"], "prefill.maxreplicas: unknown option"),
        (["--connector", "kubernetes"], "kubernetes.deployment: the DynamoGraphDeployment name is required"),
        (["--connector", "local"], "local.prefill_command"),
        (["--config", "/no/such/file.yaml"], "neither a readable file nor inline"),
    ],
)
def test_config_errors_exit_2_naming_the_key(args: list[str], message: str) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "dynamo.planner", *args], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_config_from_file_and_flags(tmp_path: Path) -> None:
    f = tmp_path / "planner.yaml"
    f.write_text("target: latency\ngpu_budget: 6\ndecode:\n  max_replicas: 5\n")
    r = subprocess.run(
        [sys.executable, "-m", "dynamo.planner", "config", "--config", str(f), "--gpu-budget", "8"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    cfg = json.loads(r.stdout)
    assert (cfg["target"], cfg["gpu_budget"], cfg["decode"]["max_replicas"]) == ("latency", 8, 5)


def test_unreachable_nats_exits_3(tmp_path: Path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dynamo.planner",
            "--dry-run",
            "--nats-url",
            f"nats://127.0.0.1:{free_port()}",
            "--config",
            CFG,
            "--max-ticks",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 3 and "cannot reach NATS" in r.stderr, r.stderr


def test_replay_of_a_stream_recorded_by_the_watch_cli(tmp_path: Path, nats_server: Any) -> None:
    ns = "clireplay"
    rec_file = tmp_path / "fpm.jsonl"
    with rec_file.open("w") as out:
        watch = subprocess.Popen(
            [sys.executable, "-m", "dynamo.common.recv_forward_pass_metrics", "--namespace", ns, "--json"],
            stdout=out,
            stderr=subprocess.DEVNULL,
            env=_env(nats_server.url),
            start_new_session=True,
        )
        try:
            time.sleep(3.0)  # the watcher subscribes
            _publish_for(4.0, ns, nats_server.url, BACKLOG, PREFILL)
            time.sleep(2.5)  # idle heartbeats
        finally:
            os.killpg(watch.pid, signal.SIGINT)
            watch.wait(10)
    lines = rec_file.read_text().splitlines()
    assert len(lines) > 20, lines[:3]
    first = json.loads(lines[0])
    assert {"subject", "component", "endpoint", "worker_id", "scheduled_requests", "queued_requests"} <= set(
        first
    )

    r = subprocess.run(
        [sys.executable, "-m", "dynamo.planner", "replay", str(rec_file), "--interval", "1", "--config", CFG],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "decode scale_up: decode demand 1.15 engines" in r.stdout, r.stdout
    assert "prefill scale" not in r.stdout
    assert "0 unreadable lines" in r.stdout

    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dynamo.planner",
            "replay",
            str(rec_file),
            "--interval",
            "1",
            "--json",
            "--config",
            CFG,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert any(x["pool"] == "decode" and x["action"] == "scale_up" for x in rows)
    assert rows[0]["time"].startswith(time.strftime("%Y-", time.gmtime()))


def test_replay_tolerates_bad_lines_and_missing_time_stamps(tmp_path: Path) -> None:
    import io

    good = json.dumps({"component": "backend", "endpoint": "generate", **_as_dict(BACKLOG)})
    stream = [
        "not json",
        '{"component": "backend"}',
        good,
        good.replace('"version": 1', '"version": 2'),
        "",
    ] + [good] * 30
    out = io.StringIO()
    res = run_replay(stream, config(interval_s=1.0), out, step=0.1)
    assert res.bad_lines == 3 and res.records == 31
    assert any(d.decode.action == "scale_up" for d in res.decisions)


def _as_dict(r: Any) -> dict[str, Any]:
    import msgspec

    return msgspec.to_builtins(r)


def test_metrics_are_served(tmp_path: Path) -> None:
    m = PlannerMetrics()
    port = free_port()
    m.serve(port, addr="127.0.0.1")
    from dynamo.planner.observations import WorkerBook
    from dynamo.planner.policy import PolicyState, decide

    cfg = config()
    book = WorkerBook(cfg)
    book.ingest("decode", BACKLOG, 0.0)
    book.ingest("prefill", PREFILL, 0.0)
    d, _ = decide(book.observe(0.1), PolicyState(), cfg)
    m.observe(d, 3, 0.0001)
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'dynamo_planner_desired_replicas{pool="decode"} 2.0' in body
    assert 'dynamo_planner_decisions_total{action="scale_up",pool="decode"} 1.0' in body
    assert "dynamo_planner_gpus_desired 3.0" in body
    # The startup sized for: expected_startup_s until a scale-up has been timed.
    assert f'dynamo_planner_startup_seconds{{pool="decode"}} {cfg.expected_startup_s}' in body
    assert 'dynamo_planner_startup_measured{pool="decode"} 0.0' in body


class FlakyConnector:
    """Edge case on top of the real loop: apply fails once, then works."""

    name = "flaky"

    def __init__(self) -> None:
        self.calls: list[tuple[int | None, int | None]] = []
        self.fail = True

    async def start(self) -> None: ...

    async def status(self) -> ConnectorStatus:
        return ConnectorStatus(None, None, True)

    async def apply(self, prefill: int | None, decode: int | None) -> None:
        self.calls.append((prefill, decode))
        if self.fail:
            self.fail = False
            raise RuntimeError("API down")

    async def close(self) -> None: ...


async def test_failed_apply_is_retried_next_interval() -> None:
    t = [0.0]
    cfg = config(interval_s=1.0)
    metrics = PlannerMetrics()
    conn = FlakyConnector()
    planner = Planner(cfg, conn, clock=lambda: t[0], metrics=metrics)
    planner.book.ingest("decode", BACKLOG, 0.0)
    planner.book.ingest("prefill", PREFILL, 0.0)
    d1 = await planner.tick()
    assert d1.decode.action == "scale_up" and planner.state.decode.in_flight is None
    t[0] = 1.0
    planner.book.ingest(
        "decode", rec("d0", counter=2, s_decode=4, s_decode_kv=2500, q_decode=30, q_decode_kv=9000), 1.0
    )
    planner.book.ingest("prefill", rec("p0", counter=2, q_prefill=1, q_prefill_tokens=300), 1.0)
    d2 = await planner.tick()
    assert d2.decode.action == "scale_up" and planner.state.decode.in_flight is not None
    assert conn.calls == [(1, 2), (1, 2)]
    assert metrics.apply_errors._value.get() == 1
    await asyncio.sleep(0)


def test_example_config_is_valid() -> None:
    from dynamo.planner.config import config_from_mapping, load_config_arg

    path = REPO / "components/src/dynamo/planner/examples/planner.yaml"
    cfg = config_from_mapping(load_config_arg(str(path)))
    assert (cfg.connector, cfg.kubernetes.deployment, cfg.gpu_budget) == ("kubernetes", "llm-disagg", 8)


class CardSource:
    """Stand-in for the runtime's model card view (edge case: a worker leaves discovery)."""

    def __init__(self, caps: dict[str, Any]) -> None:
        self.caps = caps

    def poll(self, default_block_size: int | None = None) -> dict[str, Any]:
        return dict(self.caps)


async def test_cards_give_capacity_and_a_worker_that_left_discovery_is_dropped() -> None:
    from dynamo.planner.connector_base import DryRunConnector
    from dynamo.planner.observations import Capacity

    t = [0.0]
    cards = CardSource(
        {"d0": Capacity(kv_tokens=5000, source="card"), "d1": Capacity(kv_tokens=5000, source="card")}
    )
    planner = Planner(
        config(capacity={"context_length": 1000}),
        DryRunConnector(),
        clock=lambda: t[0],
        cards={"decode": cards},
    )
    for wid in ("d0", "d1"):
        planner.book.ingest("decode", rec(wid, s_decode=2, s_decode_kv=4000), 0.0)
    planner.book.ingest("prefill", PREFILL, 0.0)
    d = await planner.tick()
    loads = d.decode.signals.loads
    assert loads is not None and loads.max == 0.8  # 4000 / 5000 from the card, not 10000 from config
    del cards.caps["d1"]
    t[0] = 1.0
    d = await planner.tick()
    assert d.decode.signals.workers == 1  # dropped at once, not after stale_after_s


def test_tui_render() -> None:
    from dynamo.planner.observations import WorkerBook
    from dynamo.planner.policy import PolicyState, decide
    from dynamo.planner.tui import render

    cfg = config()
    book = WorkerBook(cfg)
    book.ingest("decode", BACKLOG, 0.0)
    book.ingest("prefill", PREFILL, 0.0)
    d, _ = decide(book.observe(0.1), PolicyState(), cfg)
    screen = render(d, ConnectorStatus(settled=True), book.stats, connector="virtual", tick=7)
    assert "tick 7" in screen and "decode: decode demand 1.15 engines" in screen
    assert screen.count("\n") < 20


def test_upstream_planner_series_are_served_too() -> None:
    """The names upstream's planner dashboards read, filled from the same decision and records."""
    m = PlannerMetrics()
    m.set_sla_targets(2000.0, 50.0)
    from dynamo.planner.observations import WorkerBook
    from dynamo.planner.policy import PolicyState, decide

    cfg = config()
    book = WorkerBook(cfg)
    book.ingest("decode", BACKLOG, 0.0)
    book.ingest("prefill", PREFILL, 0.0)
    obs = book.observe(0.1)
    d, _ = decide(obs, PolicyState(), cfg)
    m.observe(d, 3, 0.0001)
    m.observe_engines(obs)
    m.observe_gpus_running(2, 0.0)
    m.observe_gpus_running(2, 1800.0)  # two GPUs for half an hour
    from prometheus_client import generate_latest

    body = generate_latest(m.registry).decode()
    values = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line[:1] != "#"
    }
    assert values["dynamo_planner_num_decode_replicas"] == d.decode.current
    assert values["dynamo_planner_predicted_num_decode_replicas"] == d.decode.desired == 2
    assert values["dynamo_planner_gpu_hours"] == pytest.approx(1.0)
    assert (values["dynamo_planner_sla_target_ttft_ms"], values["dynamo_planner_sla_target_itl_ms"]) == (
        2000,
        50,
    )
    key = f'{{dp_rank="{BACKLOG.dp_rank}",worker_id="{BACKLOG.worker_id}"}}'
    assert values[f"dynamo_planner_engine_queued_decode_kv_tokens{key}"] == 9000
    # An engine that left the book leaves the series.
    m.observe_engines(WorkerBook(cfg).observe(0.2))
    assert "dynamo_planner_engine_queued_decode_kv_tokens{" not in generate_latest(m.registry).decode()
