"""The planner's observation layer reads the held-KV fields of FPM records (KV a prefill engine holds for
a decode worker that has not read it): per engine and summed per pool, 0 where a producer does not report
them."""

from __future__ import annotations

from dynamo.common.forward_pass_metrics import ForwardPassMetrics
from dynamo.common.fpm_validate import record_problem
from dynamo.planner.config import config_from_mapping
from dynamo.planner.observations import WorkerBook


def held(worker_id: str, requests: int | None, tokens: int | None, age: float | None) -> ForwardPassMetrics:
    return ForwardPassMetrics(
        worker_id=worker_id, num_held_kv_requests=requests, sum_held_kv_tokens=tokens, max_held_kv_age=age
    )


def test_held_kv_per_engine_and_per_pool() -> None:
    book = WorkerBook(config_from_mapping({}))
    # A record holding KV is a snapshot (load), never an idle heartbeat.
    assert book.ingest("prefill", held("p1", 3, 210, 12.5), 0.0) == "snapshot"
    assert book.ingest("prefill", held("p2", 1, 64, 2.0), 0.0) == "snapshot"
    assert book.ingest("prefill", held("p3", None, None, None), 0.0) == "heartbeat"  # upstream's records
    assert book.ingest("prefill", held("p4", 0, 0, 0.0), 0.0) == "heartbeat"  # ours, nothing held
    pool = book.observe(0.5).prefill
    by_id = {e.worker_id: e for e in pool.engines}
    p1, p3 = by_id["p1"], by_id["p3"]
    assert (p1.held_kv_requests, p1.held_kv_tokens, p1.held_kv_age_s) == (3, 210, 12.5)
    assert (p3.held_kv_requests, p3.held_kv_tokens, p3.held_kv_age_s) == (0, 0, 0.0)
    assert (pool.held_kv_requests, pool.held_kv_tokens, pool.max_held_kv_age_s) == (4, 274, 12.5)
    assert book.observe(0.5).decode.held_kv_tokens == 0


def test_held_kv_bounds() -> None:
    assert record_problem(held("p", 2, 64, 1.5)) is None
    assert record_problem(held("p", -1, 64, 1.5)) == "negative num_held_kv_requests"
    assert record_problem(held("p", 1, 2**41, 1.5)) == "over 2^40 sum_held_kv_tokens"
    bad_age = "max_held_kv_age not a finite non-negative number"
    assert record_problem(held("p", 1, 64, float("nan"))) == bad_age
    assert record_problem(held("p", 1, 64, -0.5)) == bad_age
