"""The worker <-> engine-process environment contract (``dynamo.vllm.fpm_env``): one writer, one reader, one
strict flag parser for both sides."""

from __future__ import annotations

import argparse

import pytest
from dynamo.vllm import fpm_env
from dynamo.vllm.fpm_env import FpmSettings


def test_what_the_worker_writes_the_scheduler_reads_back() -> None:
    written = FpmSettings(
        enabled=False,
        namespace="ns",
        component="prefill",
        endpoint="gen",
        worker_id="7",
        nats_url="nats://h:1",
        stats_file="/d/fpm-stats-{dp_rank}.json",
        gate_file="/d/registered",
        zmq_port=20380,
    )
    assert FpmSettings.from_env(written.worker_env()) == written


def test_the_worker_writes_identity_and_wiring_only() -> None:
    env = FpmSettings(worker_id="7").worker_env()
    assert set(env) == {
        fpm_env.ENV_NAMESPACE,
        fpm_env.ENV_COMPONENT,
        fpm_env.ENV_ENDPOINT,
        fpm_env.ENV_ENABLED,
        fpm_env.ENV_WORKER_ID,
    }  # unset optional fields and the operator's tunables are left to the inherited environment
    assert fpm_env.stats_file_in("/d") == "/d/" + fpm_env.STATS_FILE_NAME


@pytest.mark.parametrize("raw", ["1", "TRUE", " yes ", "On"])
def test_flag_true(raw: str) -> None:
    assert fpm_env.flag({"X": raw}, "X", False) is True


@pytest.mark.parametrize("raw", ["0", "false", "No", "OFF"])
def test_flag_false(raw: str) -> None:
    assert fpm_env.flag({"X": raw}, "X", True) is False


def test_flag_is_strict_and_names_the_variable() -> None:
    assert fpm_env.flag({}, "X", True) is True and fpm_env.flag({"X": " "}, "X", False) is False
    with pytest.raises(ValueError, match="DYN_FPM_ENABLED='ture'"):
        FpmSettings.from_env({"DYN_FPM_ENABLED": "ture"})


@pytest.mark.parametrize("name", ["DYN_FPM_ENABLED", "DYN_VLLM_STANDBY"])
def test_the_worker_command_line_reads_flags_with_the_same_strict_parser(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: the worker read ``DYN_FPM_ENABLED=ture`` as off while the engine process refused it."""
    from dynamo.vllm.args import EXIT_BAD_ARGS, add_worker_arguments

    monkeypatch.setenv(name, "ture")
    with pytest.raises(SystemExit) as exited:
        add_worker_arguments(argparse.ArgumentParser())
    assert exited.value.code == EXIT_BAD_ARGS
    assert f"{name}='ture'" in capsys.readouterr().err
    monkeypatch.setenv(name, "off")
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    assert parser.parse_args([]).fpm_enabled is (name != "DYN_FPM_ENABLED")
