"""Helpers for the worker/frontend tests: process groups, waiting for HTTP, vLLM reference outputs.

Every process is started in its own session (process group) and killed as a group in teardown, so
vLLM's EngineCore children never outlive a test.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dynamo.common.ports import low_free_port  # noqa: F401 - the tests import it from here
from dynamo.common.process_group import kill_group_and_reap, start_in_own_session

from dynamo_fpm_testing import REPO
from dynamo_fpm_testing.local_stack import LOOPBACK_ENV, OFFLINE_ENV, file_discovery_env, kv_transfer_config
from dynamo_fpm_testing.stall_meter import Deadline

REPO_ROOT = REPO

# The KV lease the disaggregated worker tests give vLLM's NixlConnector (its default is 30 s): the prefill
# side frees blocks no decode worker read within it. This machine kind stalls every process for up to 33 s at
# a time, and a lease that runs out during a stall frees KV a decode worker then reads anyway ("Potentially
# invalid KV blocks"). A read that really hangs fails the tests' time bound (30 s of the machine's time) long
# before.
E2E_KV_LEASE_S = 120

ENGINE_FLAGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048", "--block-size", "32"]


def kv_transfer_config_json(role: str) -> str:
    """A worker's ``--kv-transfer-config``: NixlConnector with the CPU layer and :data:`E2E_KV_LEASE_S`."""
    return json.dumps(kv_transfer_config(role, lease_s=E2E_KV_LEASE_S))


def base_env(file_kv: Path, nats_url: str | None = None, **extra: str) -> dict[str, str]:
    """Environment for a frontend or worker process: loopback, offline, file discovery in ``file_kv``."""
    env = dict(os.environ)
    env.pop("DYN_SYSTEM_HOST", None)  # the ports' default binding (loopback) unless a test opens them
    env.update({**OFFLINE_ENV, **LOOPBACK_ENV, **file_discovery_env(file_kv), "PYTHONUNBUFFERED": "1"})
    if nats_url:
        env["NATS_SERVER"] = nats_url
    else:
        env.pop("NATS_SERVER", None)
    env.update(extra)
    return env


class Proc:
    """A child process in its own process group, output to a log file."""

    def __init__(self, args: Sequence[str], env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.popen = start_in_own_session(
            args, env=env, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO_ROOT
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        """Signal the main process only (as Kubernetes does with a container's PID 1)."""
        if self.popen.poll() is None:
            os.kill(self.popen.pid, sig)

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout=timeout)

    def stop(self) -> None:
        """Kill the whole process group (worker + EngineCore) and reap."""
        kill_group_and_reap(self.popen, timeout=10)
        self._log.close()


def start_frontend(port: int, env: dict[str, str], log_path: Path, *extra: str) -> Proc:
    args = [
        sys.executable,
        "-m",
        "dynamo.frontend",
        "--http-host",
        "127.0.0.1",
        "--http-port",
        str(port),
        *extra,
    ]
    return Proc(args, env, log_path)


def start_worker(model_dir: Path, env: dict[str, str], log_path: Path, *extra: str) -> Proc:
    args = [sys.executable, "-m", "dynamo.vllm", "--model", str(model_dir), *ENGINE_FLAGS, *extra]
    return Proc(args, env, log_path)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, grandchildren...); none if ``pid`` is gone."""
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def listening_addresses(pid: int, port: int) -> set[str]:
    """Addresses the process tree of ``pid`` listens on at ``port``."""
    import psutil

    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    out = set()
    for p in procs:
        for c in p.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port:
                out.add(c.laddr.ip)
    return out


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 60.0) -> tuple[int, Any]:
    """GET (or POST ``body``) and decode JSON; returns (status, payload or text)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read().decode()
            status = resp.status
    except urllib.error.HTTPError as exc:
        raw = exc.read().decode(errors="replace")
        status = exc.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def http_text(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def wait_until(predicate: Any, timeout: float, interval: float = 0.2, procs: Sequence[Proc] = ()) -> Any:
    """Poll ``predicate`` until truthy; fail early with the log of any process that died. The timeout counts
    only the time the machine ran (see :mod:`stall_meter`)."""
    deadline = Deadline(timeout)
    last_exc: Exception | None = None
    while not deadline.expired():
        for proc in procs:
            if proc.popen.poll() is not None:
                raise AssertionError(
                    f"process exited with {proc.popen.returncode}; log tail:\n{proc.log()[-4000:]}"
                )
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:
            last_exc = exc
        time.sleep(interval)
    tails = "\n".join(p.log()[-3000:] for p in procs)
    raise AssertionError(f"timed out after {deadline.describe()} (last error: {last_exc!r})\n{tails}")


async def until(predicate: Any, what: str, timeout: float, interval: float = 0.05) -> None:
    """``wait_until`` for async tests: poll without blocking the event loop; machine stalls left out."""
    import asyncio

    deadline = Deadline(timeout)
    while not predicate():
        assert not deadline.expired(), f"{what} ({deadline.describe()})"
        await asyncio.sleep(interval)


def sse_chunks(lines: Any) -> Any:
    """The JSON chunks of an OpenAI server-sent-events stream (``response.iter_lines()``), ``[DONE]`` left
    out."""
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def discovery_diagnostics(file_kv: Path, *procs: Proc) -> str:
    """What a failed request needs explained: the discovery entries with their age, and each process's
    discovery, expiry and error lines (HTTP access lines left out)."""
    now = time.time()
    lines = ["discovery entries (age in s):"]
    for path in sorted(p for p in file_kv.rglob("*") if p.is_file()):
        with contextlib.suppress(OSError):
            lines.append(f"  {now - path.stat().st_mtime:6.1f}  {path.relative_to(file_kv)}")
    keys = (
        "worker set",
        "emov",
        "Expired",
        "keep_alive",
        "prefill router",
        "nstance",
        "ERROR",
        "Error",
        "Traceback",
    )
    for proc in procs:
        picked = [
            line[:300]
            for line in proc.log().splitlines()
            if any(k in line for k in keys) and "http response sent" not in line and "on_failure" not in line
        ]
        lines.append(f"{proc.log_path.name} (last {min(len(picked), 25)} of {len(picked)} picked lines):")
        lines.extend(f"  {line}" for line in picked[-25:])
    return "\n".join(lines)


# The worker's WARNING when it wrote back a discovery entry another process deleted.
RESTORED_MARK = "wrote it back"


def complete(
    base_url: str, body: dict[str, Any], file_kv: Path, procs: Sequence[Proc], timeout: float = 120
) -> dict[str, Any]:
    """POST a completion and return its JSON; any other answer fails with :func:`discovery_diagnostics`.

    One case is retried, once: a 503 or 504 while a worker writes back a discovery entry that another process
    expired (the worker logs :data:`RESTORED_MARK`; the frontend routes to it again within about 2 s). That is
    what a machine stall longer than discovery's 10 s expiry does: the frontend drops the workers, and the
    requests in flight with them (504), the moment the machine runs again, milliseconds before the workers
    write their entries back. That path is the worker's self-healing and has its own test; any other failure
    is reported as it is.
    """
    url = f"{base_url}/v1/completions"
    restored_before = _restored(procs)
    status, out = http_json(url, body, timeout)
    if status in (503, 504) and _within(5, lambda: _restored(procs) > restored_before):
        print(f"HTTP {status} while a worker wrote back its discovery entry; retrying once")
        _within(15, lambda: model_ready(base_url, str(body["model"])), procs)
        status, out = http_json(url, body, timeout)
    if status != 200:
        raise AssertionError(f"HTTP {status}: {out}\n{discovery_diagnostics(file_kv, *procs)}")
    return dict(out)


def _restored(procs: Sequence[Proc]) -> int:
    """How many discovery entries the processes have written back so far (:data:`RESTORED_MARK` lines)."""
    return sum(proc.log().count(RESTORED_MARK) for proc in procs)


def _within(timeout: float, predicate: Any, procs: Sequence[Proc] = ()) -> bool:
    """:func:`wait_until` as a yes/no answer: whether ``predicate`` came true within ``timeout``."""
    try:
        wait_until(predicate, timeout=timeout, procs=procs)
    except AssertionError:
        return False
    return True


def model_ready(base_url: str, model: str, present: tuple[str, ...] = ()) -> bool:
    """The frontend serves ``model`` and, when ``present`` names components, lists each of them.

    A decode worker with local prefill makes a disaggregated model ready on its own: a test of the pair must
    also wait for the prefill component (``present=("decode", "prefill")``)."""
    status, body = http_json(f"{base_url}/v1/models/{model}/ready", timeout=5)
    if status != 200:
        return False
    if not present:
        return True
    if not isinstance(body, dict):
        return False
    listed = {c for ns in body.get("namespaces", {}).values() for c in ns.get("present", [])}
    return set(present) <= listed


_REFERENCE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams

    def main():
        spec = json.load(open(sys.argv[1]))
        llm = LLM(
            spec["model"], dtype="float32", enforce_eager=True, max_model_len=2048, block_size=32, seed=0
        )
        tok = llm.get_tokenizer()
        out = []
        for item in spec["requests"]:
            params = SamplingParams(**item["params"])
            if "messages" in item:
                ids = tok.apply_chat_template(item["messages"], add_generation_prompt=True, tokenize=True)
                if hasattr(ids, "keys"):
                    ids = ids["input_ids"]
                prompt = {"prompt_token_ids": list(ids)}
            else:
                prompt = item["prompt"]
            res = llm.generate([prompt], params, use_tqdm=False)[0]
            comp = res.outputs[0]
            out.append({"text": comp.text, "token_ids": list(comp.token_ids),
                        "prompt_len": len(res.prompt_token_ids), "finish_reason": comp.finish_reason})
        json.dump(out, open(sys.argv[2], "w"))

    if __name__ == "__main__":
        main()
    """
)


def vllm_reference(model_dir: Path, requests: list[dict[str, Any]], workdir: Path) -> list[dict[str, Any]]:
    """Run vLLM directly (in-process engine, in a child process) on ``requests``; returns its outputs."""
    script = workdir / "vllm_reference.py"
    script.write_text(_REFERENCE_SCRIPT)
    spec = workdir / "reference_in.json"
    result = workdir / "reference_out.json"
    spec.write_text(json.dumps({"model": str(model_dir), "requests": requests}))
    env = base_env(workdir, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run(
        [sys.executable, str(script), str(spec), str(result)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,
    )
    if proc.returncode != 0:
        raise AssertionError(f"vLLM reference run failed:\n{proc.stderr[-4000:]}")
    return json.loads(result.read_text())


def scrape(url: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (good enough for assertions)."""
    values: dict[str, float] = {}
    for line in http_text(url).splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            values[name] = float(value)
        except ValueError:
            continue
    return values


def metric(values: dict[str, float], name: str) -> float | None:
    """The value of the first series whose name (before labels) is ``name``."""
    for key, value in values.items():
        if key.split("{", 1)[0] == name:
            return value
    return None
