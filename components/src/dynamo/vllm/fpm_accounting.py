"""Per-pass accounting: the scheduled side of one batch, and exact incremental queued totals.

Scheduled rule per request of a ``SchedulerOutput`` (``c`` = KV tokens before the pass, ``t`` = tokens
scheduled, ``s`` = speculative tokens scheduled for it):

- a request whose KV was loaded by an async KV connector (promoted from ``WAITING_FOR_REMOTE_KVS``) and
  that computes only its last prompt token (``t - s <= 1``) is a **decode** with KV ``c``: on a
  disaggregated decode engine that pass is the first decode step, not prefill work;
- a new request, or one resuming after preemption (recompute of its whole context), is **prefill**:
  tokens ``t``, KV read ``c`` (prefix-cache hits), length ``num_prompt_tokens`` (``num_tokens`` after a
  preemption: the context it rebuilds);
- a running request is **prefill** (chunked continuation or recompute) while
  ``c < max(num_prompt_tokens, num_tokens - 1)``, otherwise a **decode** with KV ``c``.

The queued side is kept per request id as ``(class, value, tokens)`` and re-classified only for the ids
the scheduler touched since the last reconcile, so a step costs O(touched), not O(queue).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from operator import mul
from typing import Any

from dynamo.common.forward_pass_metrics import QueuedRequestMetrics, ScheduledRequestMetrics
from dynamo.vllm.fpm_classifier import (
    Entry,
    Kind,
    PullPending,
    QueueTotals,
    ScanResult,
    classify,
    kind_of_status_name,
)

_EMPTY: tuple[str, ...] = ()
_NONE: set[str] = set()


def summarize_scheduled(
    output: Any,
    requests: Mapping[str, Any],
    kv_arrived: set[str],
    ever_preempted: set[str] = _NONE,
    *,
    fast_path: bool = True,
) -> ScheduledRequestMetrics:
    """Scheduled metrics of one batch, computed right after ``schedule()`` built it.

    Pops from ``kv_arrived`` the ids it consumes (their first scheduling). ``ever_preempted`` (ids
    preempted at some point) enables the fast path: a running request that has output tokens and was
    never preempted is decoding, so an all-decode running part is summed with C-level builtins.
    ``fast_path=False`` (a vLLM whose preemption cannot be hooked) applies the per-request rules to every
    batch.
    """
    nst = output.num_scheduled_tokens
    spec = output.scheduled_spec_decode_tokens
    p_n = p_tok = p_kv = p_s = p_sq = 0
    d_n = d_s = d_sq = 0

    for new in output.scheduled_new_reqs:
        rid = new.req_id
        t = nst[rid]
        c = new.num_computed_tokens
        if kv_arrived and rid in kv_arrived:
            kv_arrived.discard(rid)
            if t - len(spec.get(rid, _EMPTY)) <= 1:
                d_n += 1
                d_s += c
                d_sq += c * c
                continue
        req = requests[rid]
        length = req.num_tokens if req.num_preemptions else req.num_prompt_tokens
        p_n += 1
        p_tok += t
        p_kv += c
        p_s += length
        p_sq += length * length

    cached = output.scheduled_cached_reqs
    resumed, out_tokens_list = _cached_layout(cached, requests)
    if (
        fast_path
        and not resumed
        and 0 not in out_tokens_list
        and (not ever_preempted or ever_preempted.isdisjoint(cached.req_ids))
    ):
        computed = cached.num_computed_tokens
        d_n += len(computed)
        d_s += sum(computed)
        d_sq += sum(map(mul, computed, computed))
        return _metrics(p_n, p_tok, p_kv, p_s, p_sq, d_n, d_s, d_sq)

    for rid, c, out_tokens in zip(cached.req_ids, cached.num_computed_tokens, out_tokens_list, strict=True):
        req = requests[rid]
        prompt = req.num_prompt_tokens
        if resumed and rid in resumed:
            t = nst[rid]
            if kv_arrived and rid in kv_arrived:
                kv_arrived.discard(rid)
                if t - len(spec.get(rid, _EMPTY)) <= 1:
                    d_n += 1
                    d_s += c
                    d_sq += c * c
                    continue
            length = req.num_tokens
        elif c < prompt or c < prompt + out_tokens - 1:
            t = nst[rid]
            length = req.num_tokens if req.num_preemptions else prompt
        else:
            d_n += 1
            d_s += c
            d_sq += c * c
            continue
        p_n += 1
        p_tok += t
        p_kv += c
        p_s += length
        p_sq += length * length
    return _metrics(p_n, p_tok, p_kv, p_s, p_sq, d_n, d_s, d_sq)


def _cached_layout(cached: Any, requests: Mapping[str, Any]) -> tuple[Any, Any]:
    """(resumed ids, output-token counts) of a CachedRequestData, also for older vLLM layouts
    (``resumed_from_preemption`` flags, no ``num_output_tokens``)."""
    resumed = getattr(cached, "resumed_req_ids", None)
    if resumed is None:
        flags = getattr(cached, "resumed_from_preemption", ())
        resumed = {rid for rid, flag in zip(cached.req_ids, flags, strict=False) if flag}
    out_tokens = getattr(cached, "num_output_tokens", None)
    if out_tokens is None:
        out_tokens = [requests[rid].num_output_tokens for rid in cached.req_ids]
    return resumed, out_tokens


def _metrics(
    p_n: int, p_tok: int, p_kv: int, p_s: int, p_sq: int, d_n: int, d_s: int, d_sq: int
) -> ScheduledRequestMetrics:
    return ScheduledRequestMetrics(
        num_prefill_requests=p_n,
        sum_prefill_tokens=p_tok,
        var_prefill_length=(p_n * p_sq - p_s * p_s) / (p_n * p_n) if p_n else 0.0,
        sum_prefill_kv_tokens=p_kv,
        num_decode_requests=d_n,
        sum_decode_kv_tokens=d_s,
        var_decode_kv_tokens=(d_n * d_sq - d_s * d_s) / (d_n * d_n) if d_n else 0.0,
    )


class IncrementalQueue:
    """Exact queued totals maintained from the ids whose state may have changed ("touched").

    Membership is by status: a live request (in ``scheduler.requests``) with a queued status is queued.
    The scheduler touches every id whose status, ``num_computed_tokens``, ``num_tokens``, KV-ready or
    KV-arrived flag can have changed; ``reconcile`` re-classifies exactly those.
    """

    __slots__ = ("entries", "kinds", "on_unknown", "pull_pending", "totals", "touched")

    def __init__(
        self,
        kinds: Mapping[Any, Kind],
        on_unknown: Callable[[str], None] | None = None,
        pull_pending: PullPending = None,
    ) -> None:
        self.kinds = kinds
        self.on_unknown = on_unknown
        self.pull_pending = pull_pending
        self.totals = QueueTotals()
        self.entries: dict[str, Entry] = {}
        self.touched: set[str] = set()

    def reconcile(self, requests: Mapping[str, Any], ready_ids: Any, kv_arrived: Any) -> None:
        touched = self.touched
        if not touched:
            return
        entries = self.entries
        totals = self.totals
        kinds = self.kinds
        pull_pending = self.pull_pending
        for rid in touched:
            req = requests.get(rid)
            if req is None:
                new = None
            else:
                status = req.status
                kind = kinds.get(status)
                if kind is None:
                    kind = kind_of_status_name(getattr(status, "name", str(status)))
                if kind is Kind.NOT_QUEUED:
                    new = None
                else:
                    computed = req.num_computed_tokens
                    new = classify(
                        kind,
                        computed,
                        req.num_tokens,
                        rid in ready_ids,
                        rid in kv_arrived,
                        pull_pending is not None
                        and kind is Kind.PREFILL
                        and computed == 0
                        and pull_pending(req),
                    )
                    if kind is Kind.UNKNOWN and self.on_unknown is not None:
                        self.on_unknown(getattr(status, "name", str(status)))
            old = entries.get(rid)
            if old == new:
                continue
            if old is not None:
                totals.remove(old)
            if new is None:
                del entries[rid]
            else:
                entries[rid] = new
                totals.add(new)
        touched.clear()

    def metrics(self) -> QueuedRequestMetrics:
        return self.totals.metrics()

    def reset_from(self, scan: ScanResult) -> None:
        """Adopt a full scan (startup, audit repair, after events the hooks cannot follow)."""
        self.entries = dict(scan.entries)
        self.totals = QueueTotals()
        for entry in self.entries.values():
            self.totals.add(entry)
        self.touched.clear()
