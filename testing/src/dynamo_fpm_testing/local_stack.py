"""The local stack's recipe, written once: the environment every process of a one-host stack shares and the
KV-transfer config of its CPU engines. Used by tests/conftest.py (the test process), ``worker_support``
(worker and frontend processes), ``disagg_support`` (in-process engines) and the demo (``demo_lib.stack``).

Pure data, no I/O: importing it changes nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Offline (the tiny model is built on the spot, nothing is downloaded), no usage reports, vLLM's CPU KV cache
# at its smallest (1 GiB): several engines share one host.
OFFLINE_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}

# The Dynamo runtime's request plane, response streams and event plane stay on loopback.
LOOPBACK_ENV: dict[str, str] = {
    "DYN_TCP_RPC_HOST": "127.0.0.1",
    "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
    "DYN_EVENT_PLANE_HOST": "127.0.0.1",
}

# vLLM's NixlConnector through the project's CPU compatibility layer.
CPU_KV_CONNECTOR_MODULE = "dynamo.vllm.cpu_host.nixl_connector"


def file_discovery_env(file_kv: Path) -> dict[str, str]:
    """The runtime's file discovery in ``file_kv``: no etcd on one host."""
    return {"DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(file_kv)}


def kv_transfer_config(role: str, *, lease_s: int, use_layer: bool = True) -> dict[str, Any]:
    """One engine's ``--kv-transfer-config``: vLLM's NixlConnector with a CPU KV buffer, our CPU layer unless
    ``use_layer`` is False, and a KV lease of ``lease_s`` (how long a prefill engine keeps a prompt's KV for
    the decode engine to read)."""
    cfg: dict[str, Any] = {"kv_connector": "NixlConnector"}
    if use_layer:
        cfg["kv_connector_module_path"] = CPU_KV_CONNECTOR_MODULE
    cfg.update(
        {
            "kv_role": role,
            "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {"kv_lease_duration": lease_s},
        }
    )
    return cfg
