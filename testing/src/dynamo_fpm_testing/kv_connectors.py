"""A minimal asynchronous KV connector for tests: parks requests in ``WAITING_FOR_REMOTE_KVS``.

Load it with ``KVTransferConfig(kv_connector="AsyncLoadTestConnector",
kv_connector_module_path="dynamo_fpm_testing.kv_connectors", kv_role="kv_consumer")``.

Scheduler side: a request whose ``kv_transfer_params`` carry ``do_remote_prefill`` gets its whole prompt
but one token "loaded" asynchronously, exactly how a disaggregated decode engine parks requests while
their KV comes from a prefill engine. Nothing is transferred; the test (acting as the worker side)
reports completion through ``KVConnectorOutput(finished_recving=...)``. Worker side: no-ops (the data
"arrives" whenever the test says so), so it also runs inside a real engine.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)


class AsyncLoadTestConnector(KVConnectorBase_V1):
    """Scheduler-side async load of remote-prefill requests; worker side does nothing."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.parked: dict[str, int] = {}  # request id -> tokens being "loaded"

    # ---------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            count = len(request.prompt_token_ids or ()) - 1 - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self.parked[request.request_id] = num_external_tokens
            params = request.kv_transfer_params
            if params is not None:
                params["do_remote_prefill"] = False  # load once, like NixlConnector

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        self.parked.pop(request.request_id, None)
        return False, None

    # ---------------------------------------------------------------- worker side (no data moves)
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
