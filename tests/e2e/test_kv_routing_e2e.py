"""KV-aware routing end to end: our workers publish vLLM's KV cache events through the runtime's own
``KvEventPublisher``, and the runtime's own KV router (``python -m dynamo.frontend --router-mode kv``) sends
each turn of a conversation to the worker that holds its prefix.

nats-server, two aggregated ``python -m dynamo.vllm`` workers on the tiny model (each with its own
``--kv-events-config`` port) and two frontends over the same workers: one ``kv``, one ``round-robin``.
Every conversation's first turn goes through the round-robin frontend, so the conversations start on both
workers and the KV router never chose where a prefix lives: only the workers' events can tell it. Which
worker served a turn, and its prefix-cache hits, come from the workers' own vLLM counters.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from dynamo_fpm_testing.kv_routing import KvStack, conversation, kv_stack, router_events_applied, stickiness
from dynamo_fpm_testing.nats_server import EmbeddedNatsServer
from dynamo_fpm_testing.worker_support import wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.runtime, pytest.mark.slow]

# Odd, so that round-robin over two workers cannot keep a conversation on one worker by accident.
CONVERSATIONS = 3
TURNS = 5
BLOCK = 32  # the workers' --block-size (worker_support.ENGINE_FLAGS)


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, nats_server: EmbeddedNatsServer
) -> Iterator[KvStack]:
    with kv_stack(tmp_path_factory.mktemp("kv-routing"), tiny_model_dir, nats_server.url) as running:
        yield running


def test_turns_follow_their_prefix_with_kv_routing(stack: KvStack) -> None:
    conversations = {c: conversation(c, TURNS) for c in range(CONVERSATIONS)}
    placements: dict[int, list[int]] = {c: [] for c in conversations}
    hits_on_server: list[float] = []
    for c, prompts in conversations.items():  # first turns: round-robin puts them on both workers
        served, _, _ = stack.send("round-robin", prompts[0])
        placements[c].append(served)
    assert {p[0] for p in placements.values()} == {0, 1}, placements
    applied_before = router_events_applied(stack.frontends["kv"])
    for turn in range(1, TURNS):  # conversations interleaved, as concurrent users' turns are
        for c, prompts in conversations.items():
            served, deltas, _ = stack.send("kv", prompts[turn])
            placements[c].append(served)
            hits_on_server.append(deltas[served].prefix_hits)
    same, total = stickiness(placements)
    assert same >= 0.9 * total, placements
    # The turns reused the prefix for real: the serving engine found the previous turn's blocks in its cache.
    assert sum(h > 0 for h in hits_on_server) >= 0.9 * total, hits_on_server
    # The router applied events the workers published (the runtime's own counter of the frontend).
    assert router_events_applied(stack.frontends["kv"]) > applied_before
    for worker in stack.workers:
        relayed = r"KV events for dp_rank=0: tcp://127\.0\.0\.1:\d+ -> the event plane"
        assert re.search(relayed, worker.proc.log())
    per_worker = [sum(p.count(i) for p in placements.values()) for i in range(len(stack.workers))]
    print(f"kv routing: {same}/{total} turns on the previous turn's worker; requests per worker {per_worker}")


def test_round_robin_does_not_follow_the_prefix(stack: KvStack) -> None:
    """The control: the same measurement under round-robin stays well below the bar the KV router meets."""
    conversations = {c: conversation(100 + c, TURNS) for c in range(CONVERSATIONS)}
    placements: dict[int, list[int]] = {c: [] for c in conversations}
    for turn in range(TURNS):
        for c, prompts in conversations.items():
            served, _, _ = stack.send("round-robin", prompts[turn])
            placements[c].append(served)
    same, total = stickiness(placements)
    print(f"round-robin: {same}/{total} turns on the previous turn's worker")
    assert same < 0.9 * total, placements


async def test_events_of_a_worker_discovery_does_not_list_change_nothing(
    stack: KvStack, tiny_model_dir: Path, nats_server: EmbeddedNatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A publisher whose worker never registered (a stray process, a worker already gone) claims a whole
    conversation's prompt: the router still sends the turn to the registered worker that holds its prefix."""
    from dynamo.llm import KvEventPublisher
    from dynamo.runtime import DistributedRuntime
    from transformers import AutoTokenizer

    prompts = conversation(400, 2)
    first, _, _ = await asyncio.to_thread(stack.send, "round-robin", prompts[0])
    monkeypatch.setenv("DYN_FILE_KV", str(stack.file_kv))
    monkeypatch.setenv("NATS_SERVER", nats_server.url)
    runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp", event_plane="nats")
    try:
        stray = runtime.endpoint("dynamo.backend.generate")  # never served, never in discovery
        publisher = KvEventPublisher(stray, kv_block_size=BLOCK)
        token_ids = AutoTokenizer.from_pretrained(tiny_model_dir)(prompts[1])["input_ids"]
        blocks = len(token_ids) // BLOCK
        applied = router_events_applied(stack.frontends["kv"])
        publisher.publish_stored(
            token_ids[: blocks * BLOCK], [BLOCK] * blocks, list(range(7_000, 7_000 + blocks))
        )
        await asyncio.sleep(1.0)  # the event plane delivers in milliseconds
        served, _, _ = await asyncio.to_thread(stack.send, "kv", prompts[1])
        publisher.shutdown()
    finally:
        runtime.shutdown()
    assert served == first
    print(f"stray publisher: router applied {router_events_applied(stack.frontends['kv']) - applied} events")


def test_a_stopped_worker_leaves_the_router(stack: KvStack) -> None:
    """A worker that drains and stops is gone from the router: a conversation that lived on it goes on, on
    the other worker (and is cached there from then on)."""
    prompts = conversation(200, 3)
    first, _, _ = stack.send("kv", prompts[0])
    second, _, _ = stack.send("kv", prompts[1])
    assert second == first
    gone = stack.workers[first]
    gone.proc.signal(15)
    assert gone.proc.wait(timeout=60) == 0, gone.proc.log()[-3000:]
    stack.procs.remove(gone.proc)
    stack.workers.remove(gone)
    wait_until(lambda: "drained:" in gone.proc.log(), timeout=10)
    served, _, _ = stack.send("kv", prompts[2])
    assert served == 0 and len(stack.workers) == 1
