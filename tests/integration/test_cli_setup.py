"""Every entry point: ``--version`` (ours and what it runs on), and one logging setup (the runtime's
``configure_dynamo_logging``, level from ``DYN_LOG``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any

import pytest
from dynamo.common.cli_setup import version_text
from dynamo_fpm_testing import REPO

ENTRY_POINTS = [
    ["-m", "dynamo.vllm"],
    ["-m", "dynamo.planner"],
    ["-m", "dynamo.frontend"],
    ["-m", "dynamo.common.recv_forward_pass_metrics"],
    ["-m", "dynamo_fpm_testing.nats_server"],
    ["-m", "dynamo_fpm_testing.tiny_model"],
    [str(REPO / "launch" / "demo.py")],
]
# The runtime's line: ISO-8601 UTC time stamp, level, target, message (colour codes stripped).
RUNTIME_LINE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z +INFO \S+: ")
ANSI = re.compile(r"\x1b\[[0-9;]*m")

pytestmark = pytest.mark.timeout(120)


def test_version_text_names_ours_the_runtime_and_vllm() -> None:
    text = version_text("x")
    assert re.fullmatch(r"x dynamo-fpm \S+ \(ai-dynamo-runtime \S+, vllm \S+\)", text), text


@pytest.mark.parametrize("argv", ENTRY_POINTS, ids=[a[-1].rsplit("/", 1)[-1] for a in ENTRY_POINTS])
def test_every_entry_point_has_version(argv: list[str]) -> None:
    r = subprocess.run([sys.executable, *argv, "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines() == [version_text(r.stdout.split()[0])]


def _planner(nats_url: str, **env: str) -> subprocess.CompletedProcess[str]:
    cfg = {"use_model_cards": False, "capacity": {"context_length": 1000, "kv_tokens": 10000}}
    return subprocess.run(
        [sys.executable, "-m", "dynamo.planner", "--dry-run", "--max-ticks", "1", "--interval", "0.2",
         "--nats-url", nats_url, "--no-tui", "--config", json.dumps(cfg)],
        capture_output=True, text=True, timeout=60, env={**os.environ, **env},
    )  # fmt: skip


def test_planner_logs_in_the_runtimes_format_at_dyn_log(nats_server: Any) -> None:
    r = _planner(nats_server.url, DYN_LOG="info")
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [ANSI.sub("", line) for line in r.stderr.splitlines() if "planner on namespace dynamo" in line]
    assert len(lines) == 1 and RUNTIME_LINE.match(lines[0]), r.stderr[-2000:]
    quiet = _planner(nats_server.url, DYN_LOG="warn")
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert "planner on namespace" not in quiet.stderr
