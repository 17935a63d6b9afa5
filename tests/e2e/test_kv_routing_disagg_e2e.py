"""KV-aware routing with disaggregated serving: two prefill workers publish vLLM's KV cache events, one
decode worker publishes none (upstream's guidance: prefill workers are routed by their cache, decode workers
by load), and the runtime's KV router (``python -m dynamo.frontend --router-mode kv``) sends each turn's
prefill to the prefill worker that holds the conversation's prefix.

On the ZMQ event plane with no NATS server at all (``test_kv_routing_e2e.py`` runs on NATS): between the
two files the KV events travel on both of the runtime's planes. As there: first turns through a round-robin
frontend (the conversations start on both prefill workers), the rest through the ``kv`` one; which prefill
worker served a turn, and its prefix-cache hits, come from that worker's own vLLM counters.

The decode worker is given a KV event endpoint where nothing listens (``tcp://127.0.0.1:PORT``: vLLM connects
to it rather than binding it): one WARNING line says so, and the worker serves every turn anyway.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dynamo.common.ports import stable_free_port
from dynamo_fpm_testing.kv_routing import conversation, kv_stack, router_events_applied, stickiness

pytest.importorskip("nixl")
pytestmark = [pytest.mark.vllm, pytest.mark.runtime, pytest.mark.slow]

CONVERSATIONS = 3
TURNS = 4


def test_prefill_turns_follow_their_prefix(tmp_path: Path, tiny_model_dir: Path) -> None:
    unbound = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{stable_free_port()}"}
    decode_args = ["--kv-events-config", json.dumps(unbound)]
    with kv_stack(
        tmp_path, tiny_model_dir, None, event_plane="zmq", disaggregated=True, decode_args=decode_args
    ) as stack:
        conversations = {c: conversation(300 + c, TURNS) for c in range(CONVERSATIONS)}
        placements: dict[int, list[int]] = {c: [] for c in conversations}
        hits_on_server: list[float] = []
        for c, prompts in conversations.items():
            served, _, _ = stack.send("round-robin", prompts[0])
            placements[c].append(served)
        assert {p[0] for p in placements.values()} == {0, 1}, placements
        applied_before = router_events_applied(stack.frontends["kv"])
        for turn in range(1, TURNS):
            for c, prompts in conversations.items():
                served, deltas, _ = stack.send("kv", prompts[turn])
                placements[c].append(served)
                hits_on_server.append(deltas[served].prefix_hits)
        same, total = stickiness(placements)
        per_worker = [sum(p.count(i) for p in placements.values()) for i in range(len(stack.workers))]
        print(f"kv routing, prefill: {same}/{total} on the previous turn's worker; per worker {per_worker}")
        assert same >= 0.9 * total, placements
        assert sum(h > 0 for h in hits_on_server) >= 0.9 * total, hits_on_server
        assert router_events_applied(stack.frontends["kv"]) > applied_before
        assert stack.decode is not None
        decode_log = stack.decode.log()
        assert decode_log.count("KV events: nothing listens at vLLM's KV event socket (dp_rank=0") == 1
        assert "KV events for dp_rank" not in decode_log
