"""KV-aware routing on the real CPU stack: workers that publish KV events, frontends per router mode,
multi-turn conversations, and which worker served each turn, read from the workers' own vLLM counters.

Shared by ``tests/e2e/test_kv_routing_e2e.py`` and ``benchmarks/bench_kv_routing.py``. A turn's prompt is the
previous turn's prompt plus new words, so consecutive turns share a growing prefix of whole KV blocks; every
conversation opens with words of its own, so two conversations share no block.
"""

from __future__ import annotations

import itertools
import json
import random
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynamo.common.ports import free_port, stable_free_port

from dynamo_fpm_testing.worker_support import (
    Proc,
    base_env,
    complete,
    kv_transfer_config_json,
    model_ready,
    scrape,
    start_frontend,
    start_worker,
    wait_until,
)

MODEL = "tiny"
# The tiny model's tokenizer knows a few real words and w0, w1, ...: one token each, none unknown.
WORDS = tuple(f"w{i}" for i in range(800))


def kv_events_config_json(port: int) -> str:
    """A worker's ``--kv-events-config``: vLLM's ZMQ publisher bound on ``port`` (each worker its own)."""
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"})


def conversation(conv_id: int, turns: int, opening_words: int = 90, words_per_turn: int = 40) -> list[str]:
    """The prompts of one conversation: each turn is the previous prompt plus ``words_per_turn`` words."""
    rng = random.Random(conv_id)
    text = " ".join(rng.choice(WORDS) for _ in range(opening_words))
    prompts = [text]
    for _ in range(1, turns):
        text = f"{text} user: " + " ".join(rng.choice(WORDS) for _ in range(words_per_turn))
        prompts.append(text)
    return prompts


@dataclass(frozen=True)
class Counters:
    """One worker's vLLM counters at one moment (its own Prometheus series)."""

    requests: float
    prompt_tokens: float
    prefix_queries: float
    prefix_hits: float

    def minus(self, other: Counters) -> Counters:
        return Counters(
            self.requests - other.requests,
            self.prompt_tokens - other.prompt_tokens,
            self.prefix_queries - other.prefix_queries,
            self.prefix_hits - other.prefix_hits,
        )


def _total(values: dict[str, float], name: str) -> float:
    """The sum over every label set of series ``name``."""
    return sum(v for k, v in values.items() if k.split("{", 1)[0] == name)


@dataclass
class KvWorker:
    """One worker process of the stack and its metrics port."""

    proc: Proc
    metrics_url: str
    name: str
    worker_id: str = ""

    def counters(self) -> Counters:
        values = scrape(self.metrics_url)
        return Counters(
            _total(values, "vllm:request_success_total"),
            _total(values, "vllm:prompt_tokens_total"),
            _total(values, "vllm:prefix_cache_queries_total"),
            _total(values, "vllm:prefix_cache_hits_total"),
        )

    def read_worker_id(self) -> str:
        key = next(k for k in scrape(self.metrics_url) if k.startswith("dynamo_worker_ready{"))
        self.worker_id = key.split('worker_id="')[1].split('"')[0]
        return self.worker_id


@dataclass
class KvStack:
    """Frontends by router mode over the same workers, all on one discovery folder and event plane."""

    frontends: dict[str, str]  # router mode -> base URL
    workers: list[KvWorker]
    file_kv: Path
    procs: list[Proc] = field(default_factory=list)
    decode: Proc | None = None  # disaggregated: the decode worker

    def snapshot(self) -> list[Counters]:
        return [w.counters() for w in self.workers]

    def send(self, mode: str, prompt: str, max_tokens: int = 8) -> tuple[int, list[Counters], float]:
        """One completion through the ``mode`` frontend: (index of the worker that served it, every worker's
        counter deltas, seconds to the answer). Sequential use only: the deltas are this request's."""
        before = self.snapshot()
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        started = time.monotonic()
        complete(self.frontends[mode], body, self.file_kv, self.procs)
        took = time.monotonic() - started
        # vLLM records its counters just after the answer leaves: wait for this request to be counted.
        deltas = wait_until(
            lambda: _counted([now.minus(then) for now, then in zip(self.snapshot(), before, strict=True)]),
            timeout=30,
            procs=self.procs,
        )
        served = [i for i, d in enumerate(deltas) if d.requests > 0]
        assert len(served) == 1, deltas
        return served[0], deltas, took


def _counted(deltas: list[Counters]) -> list[Counters] | None:
    return deltas if sum(d.requests for d in deltas) >= 1 else None


@contextmanager
def kv_stack(
    work: Path,
    model_dir: Path,
    nats_url: str | None,
    modes: Sequence[str] = ("kv", "round-robin"),
    workers: int = 2,
    event_plane: str = "nats",
    disaggregated: bool = False,
    decode_args: Sequence[str] = (),
) -> Iterator[KvStack]:
    """``workers`` workers publishing KV events (aggregated, or prefill workers with one decode worker that
    publishes none, as upstream recommends, with ``decode_args`` added), one frontend per router mode; all
    stopped after."""
    file_kv = work / "discovery"
    file_kv.mkdir()
    env = base_env(file_kv, nats_url, DYN_EVENT_PLANE=event_plane)
    role: list[str] = []
    if disaggregated:
        role = ["--kv-transfer-config", kv_transfer_config_json("kv_both"), "--disaggregation-mode"]
    with ExitStack() as stack:
        procs: list[Proc] = []
        kv_workers: list[KvWorker] = []
        for i in range(workers):
            metrics_port = free_port()
            proc = start_worker(
                model_dir,
                env,
                work / f"worker{i}.log",
                "--served-model-name",
                MODEL,
                "--metrics-port",
                str(metrics_port),
                "--kv-events-config",
                kv_events_config_json(stable_free_port()),
                *([*role, "prefill"] if role else []),
            )
            stack.callback(proc.stop)
            procs.append(proc)
            kv_workers.append(KvWorker(proc, f"http://127.0.0.1:{metrics_port}/metrics", f"worker{i}"))
        if role:
            decode = start_worker(
                model_dir,
                env,
                work / "decode.log",
                "--served-model-name",
                MODEL,
                *role,
                "decode",
                *decode_args,
            )
            stack.callback(decode.stop)
            procs.append(decode)
        frontends: dict[str, str] = {}
        for mode in modes:
            port = free_port()
            proc = start_frontend(port, env, work / f"frontend-{mode}.log", "--router-mode", mode)
            stack.callback(proc.stop)
            procs.append(proc)
            frontends[mode] = f"http://127.0.0.1:{port}"
        for url in frontends.values():
            wait_until(lambda url=url: model_ready(url, MODEL), timeout=300, procs=procs)
        # Every worker registered (the model is ready with one): all serve before the first turn.
        for proc in procs[: workers + (1 if role else 0)]:
            wait_until(lambda p=proc: "ready: " in p.log(), timeout=300, procs=procs)
        for worker in kv_workers:
            worker.read_worker_id()
        yield KvStack(frontends, kv_workers, file_kv, procs, procs[workers] if role else None)


def stickiness(placements: dict[int, list[int]]) -> tuple[int, int]:
    """(turns after a conversation's first that went to the worker of its previous turn, such turns)."""
    same = total = 0
    for served in placements.values():
        for previous, current in itertools.pairwise(served):
            total += 1
            same += previous == current
    return same, total


def router_events_applied(frontend_url: str) -> float:
    """KV events the frontend's router applied to its index so far (the runtime's own counter)."""
    values: dict[str, Any] = scrape(f"{frontend_url}/metrics")
    return sum(
        v
        for k, v in values.items()
        if k.split("{", 1)[0] == "dynamo_component_kv_cache_events_applied" and 'status="ok"' in k
    )
