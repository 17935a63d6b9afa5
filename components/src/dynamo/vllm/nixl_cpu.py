"""The CPU NIXL layer's old module path, kept so that configs written for earlier releases keep working.

``kv_connector_module_path: dynamo.vllm.nixl_cpu`` loads the same ``NixlConnector`` as the new path,
``dynamo.vllm.cpu_host.nixl_connector`` (docs/disaggregation.md); new configs should use that one.
"""

from dynamo.vllm.cpu_host.nixl_connector import NixlConnector

__all__ = ["NixlConnector"]
