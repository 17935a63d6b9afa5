"""Run upstream Dynamo 1.6.1's planner on the fleet simulator from our own environment.

No upstream imports here: ``run_upstream`` starts ``run.py`` with the isolated interpreter that
``make upstream-planner-env`` builds (``.cache/upstream-planner/venv``) and returns the JSON object
it prints last. Load-based scaling does not use aisimulate; that venv has import-only stand-ins for
it, so say so wherever a comparison made with this is shown.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
ENV_DIR = REPO_ROOT / ".cache" / "upstream-planner" / "venv"
ENV_PYTHON = ENV_DIR / "bin" / "python"
RUN_PY = Path(__file__).resolve().with_name("run.py")
REQUIREMENTS = Path(__file__).resolve().with_name("requirements.txt")

_MAKE_HINT = "run `make upstream-planner-env`"


def _stamp() -> Path:
    """The stamp the Makefile writes: the first 12 hex digits of sha1(requirements.txt)."""
    digest = hashlib.sha1(REQUIREMENTS.read_bytes()).hexdigest()[:12]
    return ENV_DIR / f".installed-{digest}"


def available() -> str | None:
    """None when the upstream-planner environment is ready, else a one-line reason."""
    if not ENV_PYTHON.exists():
        return f"upstream planner environment missing ({ENV_PYTHON}); {_MAKE_HINT}"
    if not _stamp().exists():
        return f"upstream planner environment incomplete or out of date; {_MAKE_HINT}"
    return None


def _fleet(initial: tuple[int, int]) -> str:
    p, d = initial
    return f"{int(p)},{int(d)}"


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def run_upstream(
    traces: Sequence[str | os.PathLike[str]],
    prefill_engine_args: Mapping[str, Any],
    decode_engine_args: Mapping[str, Any],
    *,
    startup_time_s: float,
    sla_ttft_ms: float,
    sla_itl_ms: float,
    initial: tuple[int, int] = (1, 1),
    planner_config: Mapping[str, Any] | None = None,
    timeout_s: float = 900,
) -> dict[str, Any]:
    """Replay ``traces`` (replayed together) under upstream's load-based planner; the run.py --json record.

    Raises RuntimeError (with the tail of run.py's stderr) when the environment is missing, the run
    fails or times out, or its last stdout line is not a JSON object.
    """
    reason = available()
    if reason is not None:
        raise RuntimeError(reason)
    if not traces:
        raise ValueError("run_upstream: at least one trace is needed")
    cmd: list[str] = [str(ENV_PYTHON), "-I", str(RUN_PY)]
    for t in traces:
        cmd += ["--trace", str(Path(t).resolve())]
    cmd += [
        "--prefill-engine-args",
        json.dumps(dict(prefill_engine_args)),
        "--decode-engine-args",
        json.dumps(dict(decode_engine_args)),
        "--startup-time",
        repr(float(startup_time_s)),
        "--sla-ttft-ms",
        repr(float(sla_ttft_ms)),
        "--sla-itl-ms",
        repr(float(sla_itl_ms)),
        "--initial",
        _fleet(initial),
        "--json",
        "--quiet",
    ]
    if planner_config:
        cmd += ["--planner-config", json.dumps(dict(planner_config))]
    # Nothing of our environment may leak in: our venv has packages named like upstream's.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=str(REPO_ROOT), check=False
        )
    except subprocess.TimeoutExpired as exc:
        # Captured output of a timed-out run is bytes even with text=True (subprocess.TimeoutExpired).
        stderr = exc.stderr.decode(errors="replace") if exc.stderr else ""
        raise RuntimeError(f"upstream planner run timed out after {timeout_s:g} s\n{_tail(stderr)}") from None
    if proc.returncode != 0:
        raise RuntimeError(f"upstream planner run failed (exit {proc.returncode})\n{_tail(proc.stderr)}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    try:
        record = json.loads(lines[-1]) if lines else None
    except ValueError:
        record = None
    if not isinstance(record, dict):
        raise RuntimeError(
            "upstream planner run printed no JSON result\nstdout: "
            f"{_tail(proc.stdout, 3)}\n{_tail(proc.stderr)}"
        )
    return record
