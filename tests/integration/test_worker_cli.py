"""`python -m dynamo.vllm` / `python -m dynamo.frontend` as processes: bad arguments fail fast.

A bad model path or bad flag must exit non-zero with one line saying why, before any runtime or
engine starts (so no discovery entry is written and no EngineCore process appears).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from dynamo_fpm_testing.worker_support import ENGINE_FLAGS, base_env

pytestmark = pytest.mark.vllm


def _run(
    module: str, args: list[str], tmp_path: Path, timeout: float = 120, **env: str
) -> subprocess.CompletedProcess[str]:
    kv = tmp_path / "kv"
    kv.mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        env=base_env(kv, **env),
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=True,
    )


def _error_lines(proc: subprocess.CompletedProcess[str], prog: str) -> list[str]:
    return [line for line in (proc.stderr + proc.stdout).splitlines() if line.startswith(f"{prog}: error:")]


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["--model", "/no/such/model"], "model path '/no/such/model' does not exist"),
        (
            ["--model", "{model}", "--max-num-seqs", "many"],
            "--max-num-seqs: invalid int value",
        ),
        (["--model", "{model}", "--disaggregation-mode", "decode"], "needs --kv-transfer-config"),
        (["--model", "{model}", "--disaggregation-mode", "sideways"], "invalid choice: 'sideways'"),
        (["--model", "{model}", "--max-model-len", "999999"], "max_model_len"),
    ],
)
def test_worker_bad_arguments_exit_2_with_one_line(
    args: list[str], reason: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    argv = [a.replace("{model}", str(tiny_model_dir)) for a in args]
    proc = _run("dynamo.vllm", [*argv, *ENGINE_FLAGS[:2]], tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = _error_lines(proc, "dynamo.vllm")
    assert len(errors) == 1, proc.stderr[-2000:]
    assert reason in errors[0]
    assert "Traceback" not in proc.stderr
    assert not any((tmp_path / "kv").iterdir()), "nothing may be registered"


def test_worker_bad_engine_wait_setting_exits_2_naming_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    proc = _run(
        "dynamo.vllm",
        ["--model", str(tiny_model_dir), *ENGINE_FLAGS[:2]],
        tmp_path,
        DYN_VLLM_SHM_WAIT_SLEEP_US="fast",
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = _error_lines(proc, "dynamo.vllm")
    assert len(errors) == 1 and "DYN_VLLM_SHM_WAIT_SLEEP_US='fast'" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_worker_bad_transport_health_setting_exits_2_naming_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    proc = _run(
        "dynamo.vllm",
        ["--model", str(tiny_model_dir), *ENGINE_FLAGS[:2]],
        tmp_path,
        DYN_FPM_TRANSPORT_HEALTH="strict",
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = _error_lines(proc, "dynamo.vllm")
    assert len(errors) == 1 and "DYN_FPM_TRANSPORT_HEALTH='strict'" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_worker_help_documents_our_flags_and_vllms(tmp_path: Path) -> None:
    proc = _run("dynamo.vllm", ["--help"], tmp_path)
    assert proc.returncode == 0
    for flag in (
        "--disaggregation-mode",
        "--namespace",
        "--drain-timeout",
        "--metrics-port",
        "--fpm",
        "--discovery-backend",
        "--kv-transfer-config",
        "--max-num-seqs",
    ):
        assert flag in proc.stdout
    assert "DYN_DRAIN_TIMEOUT_S" in proc.stdout


def test_frontend_bad_flag_exits_2(tmp_path: Path) -> None:
    proc = _run("dynamo.frontend", ["--http-port", "notaport"], tmp_path)
    assert proc.returncode == 2
    assert len(_error_lines(proc, "dynamo.frontend")) == 1
