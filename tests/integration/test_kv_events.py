"""The worker's KV event plan (``dynamo.vllm.kv_events``): upstream 1.6.1's conditions, one source per local
dp rank at vLLM's own port offsets, and the one WARNING for an event socket where nothing listens (probed on
real loopback sockets)."""

from __future__ import annotations

import logging
import socket
from types import SimpleNamespace

import pytest
from dynamo.vllm import kv_events, registration
from dynamo.vllm.engine import EngineCapacity

pytestmark = [pytest.mark.vllm, pytest.mark.runtime]


def _config(**overrides: object) -> SimpleNamespace:
    values: dict[str, object] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5557",
    }
    values.update(overrides)
    return SimpleNamespace(**values)


def test_one_source_per_local_rank_at_vllms_offsets() -> None:
    plan = kv_events.plan(_config(), True, dp_start=2, dp_size=2)
    assert plan.sources == (
        kv_events.KvEventSource(2, "tcp://127.0.0.1:5559"),
        kv_events.KvEventSource(3, "tcp://127.0.0.1:5560"),
    )
    assert kv_events.plan(_config(), True, 0, 1).sources == (
        kv_events.KvEventSource(0, "tcp://127.0.0.1:5557"),
    )


def test_the_vllm_config_a_worker_builds_from_the_flag_plans_the_same() -> None:
    from vllm.config.kv_events import KVEventsConfig

    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:6001")
    assert config.publisher == "zmq"
    assert kv_events.plan(config, True, 0, 1).sources == (kv_events.KvEventSource(0, "tcp://127.0.0.1:6001"),)


@pytest.mark.parametrize(
    ("config", "prefix_caching", "reason"),
    [
        (_config(), False, "prefix caching is off"),
        (None, True, "no --kv-events-config"),
        (_config(enable_kv_cache_events=False), True, "enable_kv_cache_events false"),
        (_config(publisher="null"), True, "publisher is 'null'"),
    ],
)
def test_no_source_says_why(config: object, prefix_caching: bool, reason: str) -> None:
    plan = kv_events.plan(config, prefix_caching, 0, 1)
    assert plan.sources == ()
    assert reason in plan.reason


def test_a_listening_socket_is_found_and_a_closed_port_is_reported_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))  # bound, never listening: a connection is refused
        up = kv_events.KvEventSource(0, f"tcp://127.0.0.1:{listening.getsockname()[1]}")
        down = kv_events.KvEventSource(1, f"tcp://127.0.0.1:{closed.getsockname()[1]}")
        missing = kv_events.missing_sources((up, down), wait_s=0.5)
    assert missing == [down]
    with caplog.at_level(logging.WARNING, logger=kv_events.__name__):
        kv_events.report_missing(missing)
        kv_events.report_missing([])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert f"dp_rank=1 {down.zmq_endpoint}" in lines[0] and "serving without KV events" in lines[0]


def test_a_source_that_comes_up_while_waiting_is_not_missing() -> None:
    answers = iter([False, False, True])
    now = iter([0.0, 0.1, 0.2, 0.3, 0.4])
    missing = kv_events.missing_sources(
        (kv_events.KvEventSource(0, "tcp://127.0.0.1:1"),),
        wait_s=5.0,
        probe=lambda _: next(answers),
        clock=lambda: next(now),
        sleep=lambda _: None,
    )
    assert missing == []


def test_ipc_endpoints_are_not_probed() -> None:
    assert kv_events.is_listening("ipc:///tmp/no-such-socket")


def test_registration_says_whether_the_worker_publishes() -> None:
    capacity = EngineCapacity(2048, 100, 32, 8, 2048, 1, 0)
    on = registration.runtime_config(capacity, kv_events=True)
    off = registration.runtime_config(capacity)
    assert (on.kv_event_publishing_enabled, on.enable_local_indexer) == (True, True)
    assert (off.kv_event_publishing_enabled, off.enable_local_indexer) == (False, False)
