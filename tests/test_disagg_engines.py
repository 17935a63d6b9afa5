"""Prefill/decode disaggregation between two real CPU engines over vLLM's NixlConnector (about a minute).

The prefill engine runs each prompt with ``kv_transfer_params={"do_remote_decode": true}`` and
``max_tokens=1``; the decode engine gets the returned ``kv_transfer_params`` and pulls the prompt's KV
from the prefill engine's memory through NIXL (UCX). The aggregated reference runs on the prefill
engine as a plain request, so the decode engine never holds those prompts in its own prefix cache.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from disagg_support import (
    KV_LEASE_S,
    EngineProcess,
    EngineSpec,
    prompt_ids,
    start_engines,
    wait_for_state,
)
from dynamo.common.nats_server import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# Around every block boundary (block size 32) and up to 200 tokens.
PROMPT_LENGTHS = [6, 31, 32, 33, 64, 70, 96, 129, 200]
GEN_TOKENS = 16


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Prefill + decode engines; a test may replace the prefill engine (teardown closes what is there)."""
    log_dir = tmp_path_factory.mktemp("disagg-engines")
    prefill, decode = start_engines(
        [
            EngineSpec("prefill", tiny_model_dir, "kv_producer", free_port()),
            EngineSpec("decode", tiny_model_dir, "kv_consumer", free_port()),
        ],
        log_dir,
    )
    held: dict[str, Any] = {"prefill": prefill, "decode": decode, "log_dir": log_dir, "model": tiny_model_dir}
    try:
        yield held
    finally:
        for key in ("prefill", "decode"):
            held[key].close()


def _prefill(prefill: EngineProcess, rid: str, ids: list[int]) -> dict[str, Any]:
    out = prefill.generate(rid, ids, 1, kv_transfer_params={"do_remote_decode": True})
    assert out["finish_reason"] == "length", out
    params = out["kv_transfer_params"]
    assert params and params["do_remote_prefill"] and params["remote_num_tokens"] == len(ids), params
    return params


def test_disaggregated_greedy_output_equals_aggregated(engines: dict[str, Any]) -> None:
    prefill, decode = engines["prefill"], engines["decode"]
    prompts = {n: prompt_ids(n, seed=n) for n in PROMPT_LENGTHS}
    reference = {n: prefill.generate(f"agg-{n}", ids, GEN_TOKENS)["token_ids"] for n, ids in prompts.items()}
    params = {n: _prefill(prefill, f"pre-{n}", ids) for n, ids in prompts.items()}
    for n, ids in prompts.items():  # all decodes in flight together
        decode.submit(f"dec-{n}", ids, GEN_TOKENS, kv_transfer_params=params[n])
    for n in prompts:
        out = decode.result(f"dec-{n}")
        assert out["finish_reason"] == "length", (n, out)
        assert len(out["token_ids"]) == GEN_TOKENS
        assert out["token_ids"] == reference[n], f"{n}-token prompt: disaggregated output differs"
    # The decode engine gave every block back.
    assert decode.call("state")["num_free_blocks"] == decode.ready["num_free_blocks"]


def test_control_corrupted_kv_changes_the_output(engines: dict[str, Any]) -> None:
    """The comparison bites: the same flow with the prompt's KV overwritten on the prefill side differs.

    (Reordering whole blocks would not do: attention does not depend on the order of the KV pairs.)
    """
    prefill, decode = engines["prefill"], engines["decode"]
    for n in (6, 100):
        ids = prompt_ids(n, seed=1000 + n)
        reference = prefill.generate(f"ctl-agg-{n}", ids, GEN_TOKENS)["token_ids"]
        params = _prefill(prefill, f"ctl-pre-{n}", ids)
        (block_ids,) = params["remote_block_ids"]  # one KV cache group
        prefill.call("corrupt_blocks", block_ids=list(block_ids))
        out = decode.generate(f"ctl-dec-{n}", ids, GEN_TOKENS, kv_transfer_params=params)
        assert out["finish_reason"] == "length"
        assert out["token_ids"] != reference, f"{n}-token prompt: corrupted KV gave the reference output"


def test_prefill_killed_during_transfer_fails_the_request_and_decode_keeps_serving(
    engines: dict[str, Any],
) -> None:
    """Runs last: replaces the prefill engine with a new one and kills it while the decode side pulls.

    The new prefill engine is stopped (SIGSTOP) before the decode engine's first request to it, so the
    decode side's pull (handshake, then read) cannot finish; once the request is parked waiting for its
    KV, the prefill engine is killed.
    """
    decode = engines["decode"]
    engines["prefill"].close()
    (victim,) = start_engines(
        [EngineSpec("prefill-victim", engines["model"], "kv_producer", free_port())], engines["log_dir"]
    )
    engines["prefill"] = victim
    free_before = decode.call("state")["num_free_blocks"]
    ids = prompt_ids(150, seed=77)
    params = _prefill(victim, "kill-pre", ids)
    os.kill(victim.pid, signal.SIGSTOP)
    start = time.monotonic()
    decode.submit("kill-dec", ids, GEN_TOKENS, kv_transfer_params=params)
    state = wait_for_state(decode, lambda s: s["waiting"].get("kill-dec") == "WAITING_FOR_REMOTE_KVS")
    assert state["num_free_blocks"] < free_before  # blocks allocated for the incoming KV
    os.killpg(victim.pid, signal.SIGKILL)
    out = decode.result("kill-dec", timeout=KV_LEASE_S + 30)
    waited = time.monotonic() - start
    assert out["finish_reason"] == "error", out
    assert out["token_ids"] == []
    assert waited < KV_LEASE_S, f"the failed request took {waited:.1f}s to end"
    assert decode.call("state")["num_free_blocks"] == free_before
    # The decode engine keeps serving: an aggregated request on it runs to completion.
    other = decode.generate("after-kill", prompt_ids(50, seed=78), GEN_TOKENS)
    assert other["finish_reason"] == "length" and len(other["token_ids"]) == GEN_TOKENS
