"""One engine's record read as work: idle or not, and its decode demand in KV tokens and running slots."""

from __future__ import annotations

from typing import NamedTuple

from ..observations import EngineObs


def engine_idle(e: EngineObs) -> bool:
    r = e.record
    s, q = r.scheduled_requests, r.queued_requests
    return (
        s.num_prefill_requests == 0
        and s.num_decode_requests == 0
        and q.num_prefill_requests == 0
        and q.num_decode_requests == 0
    )


class DecodeDemand(NamedTuple):
    tokens: float  # KV tokens the engine must hold
    requests: float  # requests that need a running slot (max_num_seqs)
    transfer_tokens: int
    waiting_tokens: int  # queued decode KV waiting for a slot (ready or preempted)
    transfer_bound: bool


def decode_demand(e: EngineObs, up: float) -> DecodeDemand:
    """Decode work that counts as demand, in KV tokens and in running slots, with the split rule.

    Without the transfer/ready split (upstream records) every queued decode request and token counts,
    as upstream does. With it: requests whose KV arrived (ready) and preempted ones wait for a decode
    slot, so they always count; requests still in transfer count too, unless the engine is
    *transfer-bound* -- nothing waits for a slot and what it holds is at or below the scale-up
    threshold in KV and in slots -- then the transfer backlog is a link problem, not missing decode
    capacity, and does not count.
    """
    s, q = e.record.scheduled_requests, e.record.queued_requests
    # An aggregated engine (in the decode pool) also queues prompts: they will need KV and slots.
    prompts_kv, prompts = q.sum_prefill_tokens + s.sum_prefill_tokens, q.num_prefill_requests
    if q.sum_decode_kv_transfer_tokens is None:
        return DecodeDemand(
            float(s.sum_decode_kv_tokens + q.sum_decode_kv_tokens + prompts_kv),
            float(s.num_decode_requests + q.num_decode_requests + prompts + s.num_prefill_requests),
            0,
            q.sum_decode_kv_tokens,
            False,
        )
    kv = e.capacity.kv_tokens or 1
    seqs = e.capacity.max_num_seqs
    transfer = q.sum_decode_kv_transfer_tokens
    transfer_reqs = q.num_decode_kv_transfer_requests or 0
    waiting = max(q.sum_decode_kv_tokens - transfer, 0)
    waiting_reqs = q.num_decode_requests - transfer_reqs
    held = s.sum_decode_kv_tokens + waiting + prompts_kv
    held_reqs = s.num_decode_requests + max(waiting_reqs, 0) + prompts + s.num_prefill_requests
    bound = transfer > 0 and waiting_reqs <= 0 and held / kv <= up and (not seqs or held_reqs / seqs <= up)
    if bound:
        return DecodeDemand(float(held), float(held_reqs), transfer, waiting, True)
    return DecodeDemand(float(held + transfer), float(held_reqs + transfer_reqs), transfer, waiting, False)


def decode_load(e: EngineObs, dd: DecodeDemand) -> float:
    """KV demand / KV capacity, or running-slot demand / ``max_num_seqs`` when known: the higher."""
    kv = e.capacity.kv_tokens or 1
    load = dd.tokens / kv
    seqs = e.capacity.max_num_seqs
    if seqs:
        load = max(load, dd.requests / seqs)
    return load
