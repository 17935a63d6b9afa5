"""Fake stand-ins for the demo's processes (tests only): a tiny OpenAI-style streaming server and a
fake planner that writes a decision log. They run as real processes so the supervisor sees real pids."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path

from dynamo_fpm_testing import REPO

LAUNCH = REPO / "launch"

FAKE_OPENAI_SERVER = r"""
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PORT = int(sys.argv[1]); TOKEN_S = float(sys.argv[2]) if len(sys.argv) > 2 else 0.002

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def _send(self, code, body=b"{}"):
        self.send_response(code); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        if self.path in ("/health", "/live") or self.path.endswith("/ready"):
            self._send(200)
        else:
            self._send(404)
    def do_POST(self):
        try:
            self._post()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away (the load driver cancels requests at a phase's end)
    def _post(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body.get("model") != "tiny":
            return self._send(404, b'{"error":"no such model"}')
        self.send_response(200); self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked"); self.end_headers()
        def frame(obj):
            data = ("data: " + (obj if isinstance(obj, str) else json.dumps(obj)) + "\n\n").encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data)); self.wfile.flush()
        n = int(body.get("max_tokens", 4))
        for i in range(n):
            time.sleep(TOKEN_S)
            frame({"choices": [{"index": 0, "text": " w%d" % i, "finish_reason": None}]})
        frame({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        frame("[DONE]")
        self.wfile.write(b"0\r\n\r\n"); self.wfile.flush()

ThreadingHTTPServer(("127.0.0.1", PORT), H).serve_forever()
"""

# argv: DECISION_LOG UP_AFTER DOWN_AFTER - writes a decode scale-up after UP_AFTER s, a scale-down DOWN_AFTER
# s later, holds in between; like the real planner's local connector it reports a warm decode standby
# (connector events in RUN/logs/) and, like the FPM recorder, the decode workers' records (RUN/fpm.jsonl): the
# promoted standby "w2" works from 0.3 s after the scale-up on.
FAKE_PLANNER = r"""
import json, os, sys, threading, time
path = sys.argv[1]
run = os.path.dirname(path)
os.makedirs(os.path.join(run, "logs"), exist_ok=True)
def log(pool, cur, des, reason):  # a line in the real decision log's format (dynamo.planner.decision_log)
    action = "scale_up" if des > cur else "scale_down" if des < cur else "hold"
    with open(path, "a") as fh:
        fh.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "ts": time.time(),
                             "tick": 0, "pool": pool, "current": cur, "desired": des, "action": action,
                             "reason": reason, "signals": {}, "applied": True, "dry_run": False}) + "\n")
def event(name, role, state, worker, members, standby):
    with open(os.path.join(run, "logs", "local-connector-events.jsonl"), "a") as fh:
        fh.write(json.dumps({"t": time.time(), "event": name, "pool": "decode", "index": 0,
                             "pid": os.getpid(), "role": role, "state": state, "worker_id": worker,
                             "counts": {"decode": {"members": members, "serving": members - 1, "starting": 0,
                                                   "standby": standby, "standby_loading": 0, "draining": 0}}})
                 + "\n")
promoted = []
# The FPM lines are the watch CLI's --json lines (what the demo's FPM recorder writes).
SUBJECT = "namespace.demo.component.backend.endpoint.generate.forward-pass-metrics"
def fpm():
    n = 0
    while True:
        n += 1
        workers = ["w1"] + (["w2"] if promoted and time.time() > promoted[0] + 0.3 else [])
        with open(os.path.join(run, "fpm.jsonl"), "a") as fh:
            for w in workers:
                fh.write(json.dumps({"subject": SUBJECT, "component": "backend", "endpoint": "generate",
                                     "published_at_ms": int(time.time() * 1000), "version": 1,
                                     "worker_id": w, "dp_rank": 0, "counter_id": n, "wall_time": 0.02,
                                     "scheduled_requests": {"num_decode_requests": 2},
                                     "queued_requests": {}}) + "\n")
        time.sleep(0.1)
event("state", "standby", "standby", "w2", 1, 1)
threading.Thread(target=fpm, daemon=True).start()
log("decode", 1, 1, "hold: warming up")
time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 1.0)
log("decode", 1, 2, "decode KV load 1.4 > 1.0")
promoted.append(time.time())
event("promoted", "member", "", "", 2, 0)
event("state", "member", "serving", "w2", 2, 0)
log("prefill", 1, 1, "hold: prefill queue empty")
time.sleep(float(sys.argv[3]) if len(sys.argv) > 3 else 2.0)
log("decode", 2, 1, "idle for 15 s")
while True:
    time.sleep(1)
"""


def write_script(tmp: Path, name: str, text: str) -> Path:
    path = tmp / name
    path.write_text(text)
    return path


# ---- entry points and their flags (for the launch-script and compose-file tests) -------------------
ENTRY_POINTS = (
    "dynamo.frontend",
    "dynamo.vllm",
    "dynamo.planner",
    "dynamo_fpm_testing.tiny_model",
    "dynamo_fpm_testing.nats_server",
    "dynamo.common.recv_forward_pass_metrics",
)

# Entry points with subcommands: the commands we start must name one explicitly.
SUBCOMMANDS = {"dynamo.planner": ("run", "replay", "config")}


@functools.cache
def entry_point_flags(module: str) -> frozenset[str]:
    """Every ``--flag`` that ``python -m module --help`` documents (runs it once per session)."""
    out = subprocess.run(
        [sys.executable, "-m", *module.split(), "--help"], capture_output=True, text=True, timeout=180,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert out.returncode == 0, f"python -m {module} --help failed:\n{out.stderr[-2000:]}"
    return frozenset(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", out.stdout))


def check_command(argv: list[str]) -> list[str]:
    """Problems with a ``python -m <entry point> flags...`` command line (empty list: fine)."""
    if "-m" not in argv:
        return [f"not a python -m command: {argv}"]
    module = argv[argv.index("-m") + 1]
    if module not in ENTRY_POINTS:
        return [f"{module} is not an entry point of this project"]
    rest = argv[argv.index("-m") + 2 :]
    if module in SUBCOMMANDS:
        if not rest or rest[0] not in SUBCOMMANDS[module]:
            return [f"{module} needs one of the subcommands {SUBCOMMANDS[module]}, got {rest[:1]}"]
        module, rest = f"{module} {rest[0]}", rest[1:]
    flags = entry_point_flags(module)
    problems = []
    for arg in rest:
        if arg.startswith("--"):
            flag = arg.split("=", 1)[0]
            if flag not in flags:
                problems.append(f"{module} has no flag {flag}")
    return problems


_DEFAULT = re.compile(r"\$\{([A-Z0-9_]+)(?::?-([^}]*))?\}")


def compose_defaults(value: str) -> str:
    """Compose/shell-style ``${VAR:-default}`` -> default (``${VAR}`` -> empty)."""
    return _DEFAULT.sub(lambda m: m.group(2) or "", value)


# ---- a whole demo run on fake components (real supervisor, real nats-server, fake model/workers/planner) --
SLEEPER = "import time\nwhile True: time.sleep(1)\n"
FAILING_WORKER = (
    "import sys, time\nprint('loading model ...', flush=True)\ntime.sleep(1.5)\n"
    "print('fatal: KV cache does not fit', flush=True)\nsys.exit(7)\n"
)


def fake_stack(monkeypatch_setattr, tmp: Path, *, failing_worker: bool = False) -> None:
    """Point the demo's stack commands at fake processes (``monkeypatch_setattr`` = monkeypatch.setattr)."""
    from demo_lib import load, stack

    py = sys.executable
    server = write_script(tmp, "fake_openai.py", FAKE_OPENAI_SERVER)
    planner = write_script(tmp, "fake_planner.py", FAKE_PLANNER)
    sleeper = write_script(tmp, "sleeper.py", SLEEPER)
    failing = write_script(tmp, "failing.py", FAILING_WORKER)
    monkeypatch_setattr(
        stack, "model_argv", lambda cfg: [py, "-c", f"import os; os.makedirs({str(cfg.model_dir)!r})"]
    )
    monkeypatch_setattr(stack, "watch_argv", lambda cfg: [py, str(sleeper)])
    monkeypatch_setattr(stack, "frontend_argv", lambda cfg: [py, str(server), str(cfg.http_port), "0.001"])
    monkeypatch_setattr(
        stack, "worker_argv",
        lambda cfg, mode: [py, str(failing if failing_worker and mode == "decode" else sleeper), mode],
    )  # fmt: skip
    monkeypatch_setattr(
        stack, "planner_argv", lambda cfg: [py, str(planner), str(cfg.decision_path), "2.5", "3.5"]
    )
    monkeypatch_setattr(
        stack, "load_phases",
        lambda d, i: [load.Phase("warmup", 0.5, 1, max_tokens=4), load.Phase("burst", 3.0, 4, max_tokens=8),
                      load.Phase("idle", 1.0, 0)],
    )  # fmt: skip
