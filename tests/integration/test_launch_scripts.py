"""The GPU launch scripts: what they would start (DRY_RUN=1) names real entry points and flags, one GPU
per worker and distinct NIXL ports; and, run for real with a fake interpreter, they stop every process
they started on Ctrl-C/SIGTERM and when one component dies."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
from dynamo_fpm_testing.demo_support import REPO, check_command
from dynamo_fpm_testing.stall_meter import Deadline

# isort: split

LAUNCH = REPO / "launch"
SCRIPTS = ("agg.sh", "disagg.sh", "disagg_planner.sh")


def dry_run(script: str, **env: str) -> list[tuple[str, dict[str, str], list[str]]]:
    """(name, env assignments, argv) of every component the script would start."""
    out = subprocess.run(
        ["bash", str(LAUNCH / script)], capture_output=True, text=True, timeout=60, check=True,
        env={**os.environ, "DRY_RUN": "1", "PYTHON": "python", "START_NATS": "1", **env},
    )  # fmt: skip
    started = []
    for line in out.stdout.splitlines():
        if not line.startswith("[launch] ") or " pid " in line:
            continue
        words = shlex.split(line[len("[launch] ") :])
        name, rest = words[0], words[1:]
        assigns = {}
        while (
            rest and "=" in rest[0] and not rest[0].startswith(("-", "/")) and rest[0].split("=")[0].isupper()
        ):
            k, v = rest.pop(0).split("=", 1)
            assigns[k] = v
        started.append((name, assigns, rest))
    return started


def _python_part(argv: list[str]) -> list[str]:
    return argv[argv.index("python") :]


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_start_real_entry_points_with_real_flags(script: str) -> None:
    started = dry_run(script)
    names = [s[0] for s in started]
    assert names[:2] == ["nats", "frontend"]
    problems = []
    for name, _, argv in started:
        problems += [f"{script}/{name}: {p}" for p in check_command(_python_part(argv))]
    assert not problems, "\n".join(problems)


def test_disagg_uses_one_gpu_per_worker_and_nixl() -> None:
    started = {name: (env, argv) for name, env, argv in dry_run("disagg.sh", MODEL="org/model-x")}
    pre_env, pre = started["worker-prefill"]
    dec_env, dec = started["worker-decode"]
    assert pre_env["CUDA_VISIBLE_DEVICES"] != dec_env["CUDA_VISIBLE_DEVICES"]
    assert pre_env["VLLM_NIXL_SIDE_CHANNEL_PORT"] != dec_env["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    for argv, mode in ((pre, "prefill"), (dec, "decode")):
        assert argv[argv.index("--model") + 1] == "org/model-x"
        assert argv[argv.index("--disaggregation-mode") + 1] == mode
        assert json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector"] == "NixlConnector"


def test_settings_come_from_the_environment() -> None:
    started = {n: (e, a) for n, e, a in dry_run("agg.sh", NAMESPACE="ns1", HTTP_PORT="9123", AGG_GPUS="3")}
    _, front = started["frontend"]
    assert front[front.index("--http-port") + 1] == "9123" and front[front.index("--namespace") + 1] == "ns1"
    env, worker = started["worker-agg"]
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and "--kv-transfer-config" not in worker
    assert "nats" not in {n for n, _, _ in dry_run("agg.sh", START_NATS="0")}


def test_planner_script_gives_the_planner_worker_templates_on_free_gpus() -> None:
    started = {n: (e, a) for n, e, a in dry_run("disagg_planner.sh", GPU_POOL="4,5,6", DECODE_MAX="3")}
    _, planner = started["planner"]
    config = json.loads(planner[planner.index("--config") + 1])
    assert config["connector"] == "local" and config["decode"]["max_replicas"] == 3
    for pool in ("prefill", "decode"):
        # The planner fills {placeholders} with str.format; literal braces come doubled.
        cmd = shlex.split(
            config["local"][f"{pool}_command"].format(pool=pool, index=0, port=1, namespace="n", log_dir="l")
        )
        assert cmd[0].endswith("worker_exec.sh")
        assert cmd[cmd.index("--disaggregation-mode") + 1] == pool
        assert not check_command(cmd[1:])
        assert json.loads(cmd[cmd.index("--kv-transfer-config") + 1])["kv_connector"] == "NixlConnector"
    env, argv = started["worker-decode"]
    assert env["GPU_POOL"] == "4,5,6" and argv[0].endswith("worker_exec.sh")


def test_worker_exec_takes_a_free_gpu_per_worker(tmp_path: Path) -> None:
    env = {**os.environ, "GPU_POOL": "0,1", "GPU_LOCK_DIR": str(tmp_path)}
    show = ["sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES $VLLM_NIXL_SIDE_CHANNEL_PORT"; exec sleep 30']
    first = subprocess.Popen(
        [str(LAUNCH / "worker_exec.sh"), *show], env=env, stdout=subprocess.PIPE, text=True
    )
    second = subprocess.Popen(
        [str(LAUNCH / "worker_exec.sh"), *show], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert first.stdout is not None and second.stdout is not None
        a, b = first.stdout.readline().split(), second.stdout.readline().split()
        assert {a[0], b[0]} == {"0", "1"} and a[1] != b[1]
        third = subprocess.run(
            [str(LAUNCH / "worker_exec.sh"), "true"], env=env, capture_output=True, text=True
        )
        assert third.returncode == 75 and "no free GPU" in third.stderr
    finally:
        first.kill()
        second.kill()
        first.wait()
        second.wait()
    # The locks die with their workers: a GPU is free again.
    again = subprocess.run([str(LAUNCH / "worker_exec.sh"), "true"], env=env, timeout=10)
    assert again.returncode == 0


# ---- real runs with a fake interpreter ---------------------------------------------------------------
FAKE_PYTHON = """#!/usr/bin/env bash
# Stands in for python: records its pid, fails if asked to, else sleeps like a server.
echo "$$ $*" >> "$FAKE_PIDS"
if [[ -n "${FAKE_FAIL:-}" && "$*" == *"$FAKE_FAIL"* ]]; then echo "fatal: fake failure"; exit 3; fi
exec sleep 300
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie waiting for its parent counts as gone.
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0] != "Z"


def _fake_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    return {**os.environ, "PYTHON": str(fake), "FAKE_PIDS": str(tmp_path / "pids"), "START_NATS": "0",
            "LOG_DIR": str(tmp_path / "logs"), "STOP_TIMEOUT": "5", **extra}  # fmt: skip


def _pids(tmp_path: Path, n: int, timeout: float = 10.0) -> list[int]:
    deadline = Deadline(timeout)
    while not deadline.expired():
        if (tmp_path / "pids").exists():
            lines = (tmp_path / "pids").read_text().splitlines()
            if len(lines) >= n:
                return [int(line.split()[0]) for line in lines]
        time.sleep(0.05)
    raise AssertionError(f"expected {n} started processes")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_script_stops_everything_on_signal(tmp_path: Path, sig: int) -> None:
    proc = subprocess.Popen(["bash", str(LAUNCH / "disagg.sh")], env=_fake_env(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    pids = _pids(tmp_path, 3)  # frontend, prefill, decode
    assert all(_alive(p) for p in pids)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=30)
    assert "all stopped" in out
    assert not [p for p in pids if _alive(p)]
    assert (tmp_path / "logs" / "worker-decode.log").exists()


def test_script_stops_the_rest_when_a_component_dies(tmp_path: Path) -> None:
    env = _fake_env(tmp_path, FAKE_FAIL="--disaggregation-mode decode")
    out = subprocess.run(
        ["bash", str(LAUNCH / "disagg.sh")], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode != 0
    assert "worker-decode exited with code 3" in out.stderr and "fake failure" in out.stderr
    pids = _pids(tmp_path, 3)
    assert not [p for p in pids if _alive(p)]
    assert "fake failure" in (tmp_path / "logs" / "worker-decode.log").read_text()
