"""Model registration with the Dynamo runtime: model card, capacity figures, worker type and peers.

The frontend pairs prefill and decode workers from ``worker_type`` and ``needs``; planners read the
capacity figures (context length, KV blocks, batch limits, data-parallel size) from the runtime config.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from dynamo.vllm.engine import EngineCapacity

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Role:
    """How a disaggregation mode registers: worker type, the peers it needs, and the model surfaces."""

    worker_type: str  # attribute name of dynamo.llm.WorkerType
    needs: tuple[tuple[str, ...], ...]
    model_types: tuple[str, ...]  # attribute names of dynamo.llm.ModelType, OR-ed together


# A decode worker that may serve alone: the needs are a DNF and the empty AND-set is always met, so the model
# stays available with no prefill worker (the frontend then routes decode-only, and the prompt is computed
# here); once one registers the frontend's prefill router takes over again.
DECODE_ALONE: tuple[str, ...] = ()


def needs_of(mode: str, local_prefill: bool = True) -> tuple[tuple[str, ...], ...]:
    """The peers a worker of this mode declares (``local_prefill``: a decode worker also serves alone)."""
    needs = ROLES[mode].needs
    return (*needs, DECODE_ALONE) if mode == "decode" and local_prefill else needs


ROLES: dict[str, Role] = {
    "agg": Role("Aggregated", (), ("Chat", "Completions")),
    "decode": Role("Decode", (("Prefill",),), ("Chat", "Completions")),
    # A prefill worker has no OpenAI surface; the legacy Prefill marker keeps older frontends pairing it.
    "prefill": Role("Prefill", (("Decode",),), ("Prefill",)),
}


def runtime_config(capacity: EngineCapacity, kv_events: bool = False) -> Any:
    """The runtime's ``ModelRuntimeConfig`` carrying this engine's capacity, and whether the worker publishes
    KV events and keeps a local index of its blocks (upstream's ``kv_event_publishing_enabled`` and
    ``enable_local_indexer``, which the KV router reads)."""
    from dynamo.llm import ModelRuntimeConfig

    cfg = ModelRuntimeConfig()
    cfg.context_length = capacity.context_length
    cfg.total_kv_blocks = capacity.total_kv_blocks
    cfg.max_num_seqs = capacity.max_num_seqs
    cfg.max_num_batched_tokens = capacity.max_num_batched_tokens
    cfg.data_parallel_size = capacity.data_parallel_size
    cfg.data_parallel_start_rank = capacity.data_parallel_start_rank
    cfg.set_engine_specific("block_size", str(capacity.block_size))
    cfg.kv_event_publishing_enabled = kv_events
    cfg.enable_local_indexer = kv_events  # the publisher keeps one (kv_events.start_publishers)
    return cfg


async def register(
    endpoint: Any,
    mode: str,
    model_path: str,
    served_name: str,
    capacity: EngineCapacity,
    custom_template_path: str | None = None,
    kv_events: bool = False,
    local_prefill: bool = True,
) -> None:
    """Publish the model card for this worker (token input; the frontend tokenizes)."""
    from dynamo.llm import ModelInput, ModelType, WorkerType, register_model

    role = ROLES[mode]
    model_type = getattr(ModelType, role.model_types[0])
    for name in role.model_types[1:]:
        model_type = model_type | getattr(ModelType, name)
    needs = [[getattr(WorkerType, w) for w in group] for group in needs_of(mode, local_prefill)]
    await register_model(
        ModelInput.Tokens,
        model_type,
        endpoint,
        model_path,
        served_name,
        worker_type=getattr(WorkerType, role.worker_type),
        kv_cache_block_size=capacity.block_size,
        runtime_config=runtime_config(capacity, kv_events),
        custom_template_path=custom_template_path,
        needs=needs or None,
    )
    log.info("registered %s as %s (%s)", served_name, role.worker_type, "|".join(role.model_types))


async def unregister(endpoint: Any) -> None:
    """Remove the model card and the endpoint instance: the frontend stops routing here in ~25 ms."""
    from dynamo.llm import unregister_model

    try:
        await unregister_model(endpoint)
    finally:
        await endpoint.unregister_endpoint_instance()
