"""The ``kubernetes`` connector: patches a DynamoGraphDeployment's prefill and decode replica counts.

Uses the official ``kubernetes`` client. v1beta1 DGDs list services in ``spec.components`` (name,
replicas): the patch is an RFC 6902 JSON patch that first *tests* the component's name at its index,
so a concurrent edit that reorders components fails instead of scaling the wrong service. v1alpha1
DGDs keep a ``spec.services`` map: a merge patch of ``replicas``. Replicas read from
``status.components|services.<name>`` (``availableReplicas``, else ``readyReplicas``); settled when
desired == updated == ready for both services.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from .config import KubernetesConfig
from .connector_base import ConnectorStatus

logger = logging.getLogger(__name__)

PLURAL = "dynamographdeployments"


def load_api_client(kubeconfig: str | None = None) -> Any:
    """In-cluster service account first, else the kubeconfig file."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config(config_file=kubeconfig)
    return client.ApiClient()


def _services(dgd: dict[str, Any]) -> tuple[str, Any]:
    spec = dgd.get("spec") or {}
    if isinstance(spec.get("components"), list):
        return "components", spec["components"]
    if isinstance(spec.get("services"), dict):
        return "services", spec["services"]
    raise KeyError("DynamoGraphDeployment has neither spec.components (list) nor spec.services (map)")


def desired_replicas(dgd: dict[str, Any], service: str) -> int:
    kind, services = _services(dgd)
    if kind == "components":
        for c in services:
            if c.get("name") == service:
                return int(c.get("replicas", 1))
        raise KeyError(f"service {service!r} not in spec.components")
    if service not in services:
        raise KeyError(f"service {service!r} not in spec.services")
    return int((services[service] or {}).get("replicas", 1))


def service_status(dgd: dict[str, Any], service: str) -> tuple[int, bool]:
    """(replicas serving traffic, stable) of one service."""
    want = desired_replicas(dgd, service)
    status = dgd.get("status") or {}
    st = (status.get("components") or status.get("services") or {}).get(service) or {}
    ready = st.get("availableReplicas", st.get("readyReplicas"))
    if ready is None:
        return want, False  # the operator has not reported yet
    updated = st.get("updatedReplicas", ready)
    return int(ready), want == int(updated) == int(ready)


def replica_patch(dgd: dict[str, Any], service: str, replicas: int) -> tuple[Any, str]:
    """(patch body, content type) that sets one service's replicas."""
    kind, services = _services(dgd)
    if kind == "components":
        for i, c in enumerate(services):
            if c.get("name") == service:
                return [
                    {"op": "test", "path": f"/spec/components/{i}/name", "value": service},
                    {"op": "add", "path": f"/spec/components/{i}/replicas", "value": replicas},
                ], "application/json-patch+json"
        raise KeyError(f"service {service!r} not in spec.components")
    return {"spec": {"services": {service: {"replicas": replicas}}}}, "application/merge-patch+json"


class KubernetesConnector:
    name = "kubernetes"

    def __init__(self, cfg: KubernetesConfig, api_client: Any | None = None) -> None:
        self.cfg = cfg
        self._api_client = api_client
        self._api: Any = None
        self.services = {"prefill": cfg.prefill_service, "decode": cfg.decode_service}

    async def start(self) -> None:
        from kubernetes import client

        if self._api_client is None:
            self._api_client = load_api_client(self.cfg.kubeconfig)
        self._api = client.CustomObjectsApi(self._api_client)
        dgd = await asyncio.to_thread(self._get)
        for pool, svc in self.services.items():
            try:
                desired_replicas(dgd, svc)
            except KeyError as exc:
                raise ValueError(
                    f"kubernetes.{pool}_service: {exc.args[0]} of {self.cfg.deployment!r}"
                ) from exc

    def _get(self) -> dict[str, Any]:
        return self._api.get_namespaced_custom_object(
            self.cfg.api_group, self.cfg.api_version, self.cfg.k8s_namespace, PLURAL, self.cfg.deployment
        )

    def _patch(self, body: Any, content_type: str) -> None:
        self._api.patch_namespaced_custom_object(
            self.cfg.api_group,
            self.cfg.api_version,
            self.cfg.k8s_namespace,
            PLURAL,
            self.cfg.deployment,
            body,
            _content_type=content_type,
        )

    async def status(self) -> ConnectorStatus:
        dgd = await asyncio.to_thread(self._get)
        p, p_ok = service_status(dgd, self.services["prefill"])
        d, d_ok = service_status(dgd, self.services["decode"])
        return ConnectorStatus(p, d, p_ok and d_ok, "" if p_ok and d_ok else "rollout in progress")

    async def apply(self, prefill: int | None, decode: int | None) -> None:
        dgd = await asyncio.to_thread(self._get)
        for pool, want in (("prefill", prefill), ("decode", decode)):
            if want is None:
                continue
            svc = self.services[pool]
            if desired_replicas(dgd, svc) == want:
                continue
            body, ctype = replica_patch(dgd, svc, want)
            await asyncio.to_thread(self._patch, body, ctype)
            logger.info(
                "patched %s/%s service %s to %d replicas",
                self.cfg.k8s_namespace,
                self.cfg.deployment,
                svc,
                want,
            )

    async def close(self) -> None:
        if self._api_client is not None:
            try:
                self._api_client.close()
            except Exception:
                logger.debug("closing the kubernetes client", exc_info=True)
