"""Engine capacity from Dynamo model deployment cards (what each worker registers).

The card's ``runtime_config`` carries ``context_length``, ``total_kv_blocks``, ``max_num_seqs`` and
``max_num_batched_tokens``; KV tokens = blocks x ``kv_cache_block_size`` (card, else configuration).
Cards are read through the runtime's ``FpmEventSubscriber.get_model_cards()`` (keyed by worker id,
the same id the FPM records carry), polled by the loop; parsing is a pure function.
"""

from __future__ import annotations

import json
import logging
from typing import Any, NamedTuple

from .observations import Capacity

logger = logging.getLogger(__name__)


def _pos_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def capacity_from_card(card: dict[str, Any], default_block_size: int | None = None) -> Capacity | None:
    """The capacity a card states, or None when it states none of it."""
    raw = card.get("runtime_config")
    rc: dict[str, Any] = raw if isinstance(raw, dict) else {}
    ctx = _pos_int(rc.get("context_length")) or _pos_int(card.get("context_length"))
    blocks = _pos_int(rc.get("total_kv_blocks"))
    block = (
        _pos_int(card.get("kv_cache_block_size"))
        or _pos_int(rc.get("kv_cache_block_size"))
        or default_block_size
    )
    kv = blocks * block if blocks and block else None
    seqs = _pos_int(rc.get("max_num_seqs"))
    batched = _pos_int(rc.get("max_num_batched_tokens"))
    if not any((ctx, kv, seqs, batched)):
        return None
    return Capacity(ctx, kv, batched, seqs, "card")


def capacities_from_cards(
    cards: dict[str, str], default_block_size: int | None = None
) -> dict[str, Capacity]:
    out: dict[str, Capacity] = {}
    for worker_id, raw in cards.items():
        try:
            card = json.loads(raw)
        except (TypeError, ValueError):
            logger.warning("model card of worker %s is not JSON; ignored", worker_id)
            continue
        if isinstance(card, dict) and (cap := capacity_from_card(card, default_block_size)) is not None:
            out[str(worker_id)] = cap
    return out


class CardListing(NamedTuple):
    """What discovery lists for one component: every worker id with a card, and the capacities stated."""

    worker_ids: frozenset[str]
    capacities: dict[str, Capacity]


def listing_from_cards(cards: dict[str, str], default_block_size: int | None = None) -> CardListing:
    return CardListing(frozenset(str(w) for w in cards), capacities_from_cards(cards, default_block_size))


class ModelCardSource:
    """Polls the model cards of one component through the Dynamo runtime's discovery."""

    def __init__(self, runtime: Any, namespace: str, component: str, endpoint: str) -> None:
        from dynamo.llm import FpmEventSubscriber

        self._sub = FpmEventSubscriber(runtime.endpoint(f"{namespace}.{component}.{endpoint}"))
        self._sub.start_tracking()

    def listing(self, default_block_size: int | None = None) -> CardListing | None:
        """Every worker id discovery lists (the planner trusts only these), or None while discovery
        cannot be read (the planner keeps what it knew)."""
        try:
            return listing_from_cards(self._sub.get_model_cards(), default_block_size)
        except RuntimeError as exc:
            logger.debug("model cards unavailable: %s", exc)
            return None

    def poll(self, default_block_size: int | None = None) -> dict[str, Capacity]:
        try:
            return capacities_from_cards(self._sub.get_model_cards(), default_block_size)
        except RuntimeError as exc:
            logger.debug("model cards unavailable: %s", exc)
            return {}

    def close(self) -> None:
        try:
            self._sub.shutdown()
        except Exception:
            logger.debug("closing the model card subscriber", exc_info=True)
