"""The vLLM plugin that makes the engine processes' ring-buffer waits sleep instead of yield (CPU hosts)."""

from __future__ import annotations

import logging
import time
import types
from importlib.metadata import entry_points

import pytest
from dynamo.vllm import engine as eng
from dynamo.vllm.cpu_host import shm_wait

pytest.importorskip("vllm")
from vllm.distributed.device_communicators import shm_broadcast


@pytest.mark.parametrize(
    ("raw", "expected"), [("", 0), ("  ", 0), ("0", 0), ("100", 100), (" 250 ", 250), ("1.5", 1)]
)
def test_sleep_from_environment(raw: str, expected: int) -> None:
    assert shm_wait.sleep_us_from({shm_wait.ENV: raw}) == expected
    assert shm_wait.sleep_us_from({}) == 0


@pytest.mark.parametrize("raw", ["fast", "-1", "1e"])
def test_a_bad_value_names_the_variable(raw: str) -> None:
    with pytest.raises(ValueError, match=shm_wait.ENV):
        shm_wait.sleep_us_from({shm_wait.ENV: raw})


def test_disaggregated_cpu_workers_get_the_default_unless_told() -> None:
    env = eng.disaggregation_environment("decode", {}, 5601, cpu_platform=True)
    assert env[shm_wait.ENV] == str(shm_wait.DEFAULT_SLEEP_US)
    assert shm_wait.ENV not in eng.disaggregation_environment(
        "prefill", {shm_wait.ENV: "0"}, 5601, cpu_platform=True
    )
    assert shm_wait.ENV not in eng.disaggregation_environment("decode", {}, 5601, cpu_platform=False)
    assert (
        eng.disaggregation_environment("agg", {}, 5601, cpu_platform=True) == {}
    )  # one engine: vLLM's yield


def test_vllm_finds_the_plugin() -> None:
    """vLLM's own plugin loader (run in each of its processes) lists it."""
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    assert DEFAULT_PLUGINS_GROUP == "vllm.general_plugins"
    assert "dynamo_shm_wait" in {e.name for e in entry_points(group=DEFAULT_PLUGINS_GROUP)}
    assert load_plugins_by_group(DEFAULT_PLUGINS_GROUP)["dynamo_shm_wait"] is shm_wait.register


def test_register_replaces_the_ring_buffers_yield_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    original = shm_broadcast.sched_yield
    monkeypatch.setattr(shm_broadcast, "sched_yield", original)  # restored after the test
    monkeypatch.delenv(shm_wait.ENV, raising=False)
    shm_wait.register()
    assert shm_broadcast.sched_yield is original
    monkeypatch.setenv(shm_wait.ENV, "0")
    shm_wait.register()
    assert shm_broadcast.sched_yield is original

    monkeypatch.setenv(shm_wait.ENV, "2000")
    shm_wait.register()
    nap = shm_broadcast.sched_yield
    assert nap is not original
    shm_wait.register()  # vLLM may load plugins more than once per process
    assert shm_broadcast.sched_yield is nap
    started = time.perf_counter()
    nap()
    assert time.perf_counter() - started >= 0.0019  # it sleeps: the core is free meanwhile


def test_a_vllm_without_the_hook_is_left_alone(caplog: pytest.LogCaptureFixture) -> None:
    bare = types.ModuleType("shm_broadcast")
    with caplog.at_level(logging.WARNING):
        assert shm_wait.apply(bare, 100) is False
    assert shm_wait.ENV in caplog.text and not hasattr(bare, "sched_yield")
