"""Real CPU vLLM engines in child processes, driven over a local pipe: the test harness for disaggregation.

Each child runs one in-process vLLM engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, tiny model) with
vLLM's ``NixlConnector`` through ``dynamo.vllm.cpu_host.nixl_connector`` and a CPU KV buffer, and an engine
loop that accepts requests while it steps, so requests can wait for remote KV while others run. The parent
talks to it with ``multiprocessing.connection`` (pickled dicts); the child also answers questions about its
scheduler (free blocks, parked requests) and can overwrite KV blocks (the negative control).

Run as a module this file *is* the child: ``python -m dynamo_fpm_testing.disagg_support --connect HOST:PORT``.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

from dynamo.common.process_group import kill_group_and_reap, start_in_own_session

from dynamo_fpm_testing.local_stack import kv_transfer_config
from dynamo_fpm_testing.stall_meter import Deadline

BLOCK_SIZE = 32
MAX_MODEL_LEN = 1024
KV_LEASE_S = 30
POLL_EVERY_S = 0.02


@dataclass
class EngineSpec:
    """How to start one engine child."""

    name: str
    model_dir: Path
    kv_role: str | None  # None: no connector (plain aggregated engine)
    side_channel_port: int = 0
    use_layer: bool = True
    scheduler_cls: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    max_num_seqs: int = 16
    lease_s: int = KV_LEASE_S


class EngineProcess:
    """Parent-side handle of one engine child process (its own process group, always killed on close)."""

    def __init__(self, spec: EngineSpec, log_dir: Path) -> None:
        self.spec = spec
        self._authkey = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=self._authkey)
        host, port = self._listener.address
        env = dict(os.environ)
        env.update(
            {
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(spec.side_channel_port),
                "HF_HUB_OFFLINE": "1",
                "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                "DISAGG_CHILD_AUTHKEY": self._authkey.hex(),
                "DISAGG_CHILD_SPEC": json.dumps(
                    {
                        "model": str(spec.model_dir),
                        "kv_transfer_config": None
                        if spec.kv_role is None
                        else kv_transfer_config(spec.kv_role, lease_s=spec.lease_s, use_layer=spec.use_layer),
                        "scheduler_cls": spec.scheduler_cls,
                        "max_num_seqs": spec.max_num_seqs,
                    }
                ),
            }
        )
        env.update(spec.env)
        self.log_path = log_dir / f"{spec.name}.log"
        self._log = self.log_path.open("wb")
        self.proc = start_in_own_session(
            [sys.executable, "-m", "dynamo_fpm_testing.disagg_support", "--connect", f"{host}:{port}"],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.conn: Connection | None = None
        self.ready: dict[str, Any] = {}
        self._pending: dict[str, dict[str, Any]] = {}
        self._replies: list[dict[str, Any]] = []

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float = 180.0) -> dict[str, Any]:
        """Accept the child's connection and wait for its engine to be built."""
        deadline = Deadline(timeout)
        # multiprocessing's Listener has no accept timeout: set it on its private socket.
        self._listener._listener._socket.settimeout(max(1.0, timeout))  # type: ignore[attr-defined]
        try:
            self.conn = self._listener.accept()
        except OSError as exc:
            raise RuntimeError(f"{self.spec.name} never connected; log:\n{self.tail_log()}") from exc
        msg = self._recv(deadline)
        if msg.get("op") != "ready":
            raise RuntimeError(f"{self.spec.name} failed to start: {msg}; log:\n{self.tail_log()}")
        self.ready = msg
        return msg

    def tail_log(self, n: int = 4000) -> str:
        self._log.flush()
        data = self.log_path.read_bytes()
        return data[-n:].decode(errors="replace")

    def _recv(self, deadline: Deadline) -> dict[str, Any]:
        assert self.conn is not None
        while True:
            left = deadline.left_s()
            if left <= 0 or (self.proc.poll() is not None and not self.conn.poll(0)):
                raise TimeoutError(
                    f"{self.spec.name}: no message (exit code {self.proc.poll()}); log:\n{self.tail_log()}"
                )
            if self.conn.poll(min(left, 0.5)):
                return self.conn.recv()

    def _pump(self, deadline: Deadline) -> None:
        msg = self._recv(deadline)
        if msg.get("op") == "result":
            self._pending[msg["rid"]] = msg
        else:
            self._replies.append(msg)

    def submit(
        self,
        rid: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> None:
        """Queue one greedy request (fixed length: EOS ignored)."""
        assert self.conn is not None
        self.conn.send(
            {
                "op": "generate",
                "rid": rid,
                "prompt_token_ids": list(prompt_token_ids),
                "max_tokens": max_tokens,
                "kv_transfer_params": kv_transfer_params,
            }
        )

    def result(self, rid: str, timeout: float = 60.0) -> dict[str, Any]:
        """The finished request: token_ids, finish_reason, kv_transfer_params, timings (engine clock)."""
        deadline = Deadline(timeout)
        while rid not in self._pending:
            self._pump(deadline)
        return self._pending.pop(rid)

    def generate(self, rid: str, prompt_token_ids: list[int], max_tokens: int, **kw: Any) -> dict[str, Any]:
        self.submit(rid, prompt_token_ids, max_tokens, **kw)
        return self.result(rid)

    def call(self, op: str, timeout: float = 30.0, **args: Any) -> dict[str, Any]:
        """A control command (state, corrupt_blocks, set_switch_interval); returns its reply."""
        assert self.conn is not None
        self.conn.send({"op": op, **args})
        deadline = Deadline(timeout)
        while not self._replies:
            self._pump(deadline)
        reply = self._replies.pop(0)
        if "error" in reply:
            raise RuntimeError(f"{self.spec.name} {op}: {reply['error']}")
        return reply

    def close(self) -> None:
        """Kill the child's whole process group and release the pipe."""
        with _suppress():
            kill_group_and_reap(self.proc, timeout=10)
        for closable in (self.conn, self._listener, self._log):
            if closable is not None:
                with _suppress():
                    closable.close()


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return True


def start_engines(specs: list[EngineSpec], log_dir: Path, timeout: float = 240.0) -> list[EngineProcess]:
    """Start the engines one after the other (two cores: parallel starts only thrash) and wait for each."""
    started: list[EngineProcess] = []
    try:
        for spec in specs:
            engine = EngineProcess(spec, log_dir)
            started.append(engine)
            engine.wait_ready(timeout)
    except BaseException:
        for engine in started:
            engine.close()
        raise
    return started


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads)."""
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def idle_cpu_cores(pids: list[int], seconds: float = 2.0) -> list[float]:
    """Average cores each process used over the same ``seconds`` window."""
    start = [process_cpu_seconds(pid) for pid in pids]
    t0 = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - t0
    return [(process_cpu_seconds(pid) - s) / elapsed for pid, s in zip(pids, start, strict=True)]


def wait_for_state(
    engine: EngineProcess, predicate: Callable[[dict[str, Any]], bool], timeout: float = 20.0
) -> dict[str, Any]:
    """Poll the engine's scheduler state until ``predicate`` holds; fail with the last state."""
    deadline = Deadline(timeout)
    while True:
        state = engine.call("state")
        if predicate(state):
            return state
        if deadline.expired():
            raise TimeoutError(f"{engine.spec.name}: state never matched; last: {state}")
        time.sleep(0.02)


def cpu_cores_against_a_spinner(pids: list[int], seconds: float = 2.0) -> tuple[list[float], float]:
    """Cores each process used over one window, and what a pure busy loop got in the same window.

    A busy-polling thread gets about what the spinner gets, however loaded the machine is; an idle
    process gets nearly nothing either way. Comparing with the spinner keeps assertions load-proof.
    """
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    try:
        time.sleep(0.2)
        *values, spun = idle_cpu_cores([*pids, spinner.pid], seconds)
    finally:
        spinner.kill()
        spinner.wait()
    return values, spun


def first_token_s(result: dict[str, Any]) -> float:
    """Seconds from the request's arrival in the engine to its first generated token."""
    return float(result["token_times"][0] - result["t_arrival"])


def prompt_ids(n: int, seed: int) -> list[int]:
    """A deterministic prompt of ``n`` ordinary token ids (specials 0-3 avoided)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


# ----------------------------------------------------------------------------------------------- child side


def _child_main(address: str) -> None:
    host, port = address.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["DISAGG_CHILD_AUTHKEY"]))
    try:
        _EngineChild(conn, json.loads(os.environ["DISAGG_CHILD_SPEC"])).run()
    except BaseException as exc:
        with _suppress():
            conn.send({"op": "crashed", "error": repr(exc)})
        raise


class _EngineChild:
    """The engine loop: take commands between steps, step while requests are unfinished."""

    def __init__(self, conn: Connection, spec: dict[str, Any]) -> None:
        self.conn = conn
        self.spec = spec
        self.affinity_before = sorted(os.sched_getaffinity(0))
        self.switch_before = sys.getswitchinterval()
        from vllm.config import KVTransferConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        kwargs: dict[str, Any] = {
            "model": spec["model"],
            "dtype": "float32",
            "enforce_eager": True,
            "max_model_len": MAX_MODEL_LEN,
            "block_size": BLOCK_SIZE,
            "max_num_seqs": spec["max_num_seqs"],
            "seed": 0,
        }
        if spec["kv_transfer_config"] is not None:
            kwargs["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer_config"])
        if spec["scheduler_cls"]:
            kwargs["scheduler_cls"] = spec["scheduler_cls"]
        t0 = time.monotonic()
        self.engine = LLMEngine.from_engine_args(EngineArgs(**kwargs))
        self.startup_s = time.monotonic() - t0
        self.core = self.engine.engine_core.engine_core  # InprocClient -> EngineCore
        self.ids: dict[str, str] = {}  # engine request id -> our id
        self.transfers: list[tuple[float, float, int]] = []
        self._hook_transfer_telemetry()
        self.live: dict[str, dict[str, Any]] = {}

    def _hook_transfer_telemetry(self) -> None:
        """Keep NIXL's per-transfer telemetry (finish time, duration, bytes) for the benchmark.

        vLLM hands its transfer stats to the engine's stats pipeline and resets them every step, so the
        records are copied as they are made.
        """
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group():
            return
        stats = getattr(get_kv_transfer_group().connector_worker, "xfer_stats", None)
        if stats is None:
            return
        record = stats.record_transfer

        def keep(res: Any) -> None:
            if res is not None:
                self.transfers.append((time.monotonic(), res.xferDuration / 1e6, int(res.totalBytes)))
            record(res)

        stats.record_transfer = keep

    def run(self) -> None:
        self.conn.send(
            {
                "op": "ready",
                "pid": os.getpid(),
                "startup_s": self.startup_s,
                "affinity_before": self.affinity_before,
                "affinity_after": sorted(os.sched_getaffinity(0)),
                "switch_interval_before": self.switch_before,
                "switch_interval_after": sys.getswitchinterval(),
                "num_free_blocks": self._free_blocks(),
            }
        )
        # Like ``LLM.generate``'s loop, a busy engine steps back to back without blocking calls (which
        # would release the GIL); the pipe is looked at only every POLL_EVERY_S while busy.
        next_poll = 0.0
        while True:
            busy = self.engine.has_unfinished_requests()
            now = time.monotonic()
            if not busy or now >= next_poll:
                timeout = 0.0 if busy else 0.05
                while self.conn.poll(timeout):
                    if not self._handle(self.conn.recv()):
                        return
                    timeout = 0.0
                next_poll = now + POLL_EVERY_S
            if self.engine.has_unfinished_requests():
                self._step()

    def _handle(self, msg: dict[str, Any]) -> bool:
        op = msg["op"]
        try:
            if op == "stop":
                return False
            if op == "generate":
                self._add(msg)
                return True
            if op == "state":
                self.conn.send({"op": "state", **self._state()})
            elif op == "corrupt_blocks":
                self.conn.send({"op": op, "layers": self._corrupt(msg["block_ids"])})
            elif op == "transfers":
                self.conn.send({"op": op, "transfers": self.transfers})
                self.transfers = []
            elif op == "set_switch_interval":
                sys.setswitchinterval(msg["value"])
                self.conn.send({"op": op, "value": sys.getswitchinterval()})
            else:
                self.conn.send({"op": op, "error": f"unknown op {op!r}"})
        except Exception as exc:
            self.conn.send({"op": op, "error": repr(exc)})
        return True

    def _add(self, msg: dict[str, Any]) -> None:
        from vllm import SamplingParams

        extra = {"kv_transfer_params": msg["kv_transfer_params"]} if msg["kv_transfer_params"] else None
        params = SamplingParams(
            temperature=0.0, max_tokens=msg["max_tokens"], ignore_eos=True, extra_args=extra
        )
        now = time.monotonic()
        engine_id = self.engine.add_request(msg["rid"], {"prompt_token_ids": msg["prompt_token_ids"]}, params)
        self.ids[engine_id] = msg["rid"]
        self.ids[msg["rid"]] = msg["rid"]
        self.live[msg["rid"]] = {"t_arrival": now, "token_times": [], "n": 0}

    def _step(self) -> None:
        outputs = self.engine.step()
        now = time.monotonic()
        for out in outputs:
            rid = self.ids.get(out.request_id, out.request_id)
            live = self.live.get(rid)
            if live is None:
                continue
            completion = out.outputs[0] if out.outputs else None
            n = len(completion.token_ids) if completion is not None else 0
            live["token_times"].extend([now] * max(0, n - live["n"]))
            live["n"] = n
            if out.finished:
                del self.live[rid]
                self.conn.send(
                    {
                        "op": "result",
                        "rid": rid,
                        "token_ids": list(completion.token_ids) if completion is not None else [],
                        "finish_reason": completion.finish_reason if completion is not None else None,
                        "kv_transfer_params": out.kv_transfer_params,
                        "num_cached_tokens": out.num_cached_tokens,
                        "t_arrival": live["t_arrival"],
                        "t_finished": now,
                        "token_times": live["token_times"],
                    }
                )

    def _free_blocks(self) -> int:
        return int(self.core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    def _state(self) -> dict[str, Any]:
        sched = self.core.scheduler
        waiting = [*getattr(sched, "kv_holding_waiting", []), *sched.waiting]
        return {
            "num_free_blocks": self._free_blocks(),
            "waiting": {self.ids.get(r.request_id, r.request_id): r.status.name for r in waiting},
            "running": [self.ids.get(r.request_id, r.request_id) for r in sched.running],
            "affinity": sorted(os.sched_getaffinity(0)),
            "switch_interval": sys.getswitchinterval(),
        }

    def _kv_caches(self) -> dict[str, Any]:
        """The KV tensors NIXL registered (on CPU: the engine's paged KV cache itself)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return get_kv_transfer_group().connector_worker.device_kv_caches

    def _corrupt(self, block_ids: list[int]) -> list[str]:
        """Overwrite the given KV blocks with noise in every layer (the block axis is found by size)."""
        import torch

        caches = self._kv_caches()
        num_blocks = self.core.scheduler.kv_cache_manager.block_pool.num_gpu_blocks
        gen = torch.Generator().manual_seed(1234)
        touched = []
        for name, cache in caches.items():
            axis = next(i for i, s in enumerate(cache.shape) if s == num_blocks)
            idx = torch.tensor(block_ids, dtype=torch.long)
            view = cache.index_select(axis, idx)
            noise = torch.randn(view.shape, generator=gen, dtype=view.dtype) * 3.0
            cache.index_copy_(axis, idx, noise)
            touched.append(f"{name}{tuple(cache.shape)}@{axis}")
        return touched


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--connect":
        _child_main(sys.argv[2])
    else:
        sys.exit("usage: python -m dynamo_fpm_testing.disagg_support --connect HOST:PORT")
