"""The ``kubernetes`` connector: scales a DynamoGraphDeployment's prefill and decode services.

Dynamo's 1.6 operator creates one DynamoGraphDeploymentScalingAdapter (DGDSA) per service, named
``<dgd>-<service, lower case>``, and the adapter owns that service's replica count: an edit of the DGD
itself is put back by the adapter. So each service is scaled through its adapter's ``scale``
subresource (as upstream's planner, KEDA and the HPA do); only a service without an adapter (404, or
``kubernetes.scale_via: dgd``) is scaled by patching the DGD: v1beta1 DGDs list services in
``spec.components`` and get an RFC 6902 JSON patch that first *tests* the component's name at its
index (a concurrent reorder fails instead of scaling the wrong service); v1alpha1 DGDs keep a
``spec.services`` map and get a merge patch.

The DGD name comes from ``kubernetes.deployment``, else ``DYN_PARENT_DGD_K8S_NAME`` (which the
operator sets in its pods); the namespace from ``kubernetes.k8s_namespace``, else ``POD_NAMESPACE``,
else the pod's service account, else ``default``. Replicas serving come from the DGD's status
(``availableReplicas``, else ``readyReplicas``); a service is settled when its target equals its
updated and ready counts.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import ConfigError, KubernetesConfig
from .connector_base import ConnectorStatus, PoolStatus

logger = logging.getLogger(__name__)

PLURAL = "dynamographdeployments"
ADAPTER_PLURAL = "dynamographdeploymentscalingadapters"
DGD_NAME_ENV = "DYN_PARENT_DGD_K8S_NAME"
NAMESPACE_ENV = "POD_NAMESPACE"
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
POOLS = ("prefill", "decode")


def load_api_client(kubeconfig: str | None = None) -> Any:
    """In-cluster service account first, else the kubeconfig file."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config(config_file=kubeconfig)
    return client.ApiClient()


@dataclass(frozen=True, slots=True)
class Target:
    """Which DGD the connector scales, and where each setting came from (for the start-up log)."""

    deployment: str
    namespace: str
    deployment_from: str
    namespace_from: str


def resolve_target(
    cfg: KubernetesConfig,
    env: Mapping[str, str],
    service_account_namespace: Path = SERVICE_ACCOUNT_NAMESPACE,
) -> Target:
    """The configured DGD and namespace, else the ones the operator gives its pods."""
    if cfg.deployment:
        deployment, deployment_from = cfg.deployment, "kubernetes.deployment"
    elif env.get(DGD_NAME_ENV):
        deployment, deployment_from = env[DGD_NAME_ENV], DGD_NAME_ENV
    else:
        raise ConfigError(
            f"kubernetes.deployment: the DynamoGraphDeployment name is required "
            f"(--k8s-deployment, or {DGD_NAME_ENV} as the Dynamo operator sets it in its pods)"
        )
    if cfg.k8s_namespace:
        return Target(deployment, cfg.k8s_namespace, deployment_from, "kubernetes.k8s_namespace")
    if env.get(NAMESPACE_ENV):
        return Target(deployment, env[NAMESPACE_ENV], deployment_from, NAMESPACE_ENV)
    try:
        namespace = service_account_namespace.read_text().strip()
    except OSError:
        namespace = ""
    if namespace:
        return Target(deployment, namespace, deployment_from, str(service_account_namespace))
    return Target(deployment, "default", deployment_from, "default")


def adapter_name(deployment: str, service: str) -> str:
    """The operator's naming of a service's scaling adapter."""
    return f"{deployment}-{service.lower()}"


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


def pool_status(dgd: dict[str, Any], service: str, want: int) -> tuple[PoolStatus, bool]:
    """(breakdown, stable) of one service whose replica target is ``want``."""
    status = dgd.get("status") or {}
    st = (status.get("components") or status.get("services") or {}).get(service) or {}
    ready = st.get("availableReplicas", st.get("readyReplicas"))
    if ready is None:
        return PoolStatus(starting=want), False  # the operator has not reported yet
    ready = int(ready)
    updated = int(st.get("updatedReplicas", ready))
    breakdown = PoolStatus(starting=max(want - ready, 0), draining=max(ready - want, 0))
    return breakdown, want == updated == ready


def replica_patch(dgd: dict[str, Any], service: str, replicas: int) -> tuple[Any, str]:
    """(patch body, content type) that sets one service's replicas in the DGD."""
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


def _api_status(exc: BaseException) -> int | None:
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) else None


class KubernetesConnector:
    name = "kubernetes"

    def __init__(
        self,
        cfg: KubernetesConfig,
        api_client: Any | None = None,
        env: Mapping[str, str] | None = None,
        service_account_namespace: Path = SERVICE_ACCOUNT_NAMESPACE,
    ) -> None:
        self.cfg = cfg
        self._api_client = api_client
        self._api: Any = None
        self._env = os.environ if env is None else env
        self._sa_namespace = service_account_namespace
        self.services = {"prefill": cfg.prefill_service, "decode": cfg.decode_service}
        self.target: Target | None = None
        # pool -> adapter name, for the pools scaled through their DGDSA.
        self.adapters: dict[str, str] = {}

    @property
    def deployment(self) -> str:
        assert self.target is not None, "start() first"
        return self.target.deployment

    @property
    def namespace(self) -> str:
        assert self.target is not None, "start() first"
        return self.target.namespace

    async def start(self) -> None:
        from kubernetes import client

        self.target = resolve_target(self.cfg, self._env, self._sa_namespace)
        if self._api_client is None:
            self._api_client = load_api_client(self.cfg.kubeconfig)
        self._api = client.CustomObjectsApi(self._api_client)
        dgd = await asyncio.to_thread(self._get)
        for pool, svc in self.services.items():
            try:
                desired_replicas(dgd, svc)
            except KeyError as exc:
                raise ValueError(f"kubernetes.{pool}_service: {exc.args[0]} of {self.deployment!r}") from exc
        for pool in POOLS:
            if await self._probe_adapter(pool):
                self.adapters[pool] = adapter_name(self.deployment, self.services[pool])
        how = ", ".join(
            f"{pool} via DGDSA {self.adapters[pool]}" if pool in self.adapters else f"{pool} via the DGD"
            for pool in POOLS
        )
        logger.info(
            "kubernetes: scaling %s/%s (name from %s, namespace from %s): %s",
            self.namespace,
            self.deployment,
            self.target.deployment_from,
            self.target.namespace_from,
            how,
        )

    async def _probe_adapter(self, pool: str) -> bool:
        """Whether this pool has a scaling adapter to go through (``scale_via`` decides when to look)."""
        if self.cfg.scale_via == "dgd":
            return False
        name = adapter_name(self.deployment, self.services[pool])
        try:
            await asyncio.to_thread(self._get_scale, name)
        except Exception as exc:
            status = _api_status(exc)
            if status == 404 and self.cfg.scale_via == "auto":
                return False
            if status == 404:
                raise ValueError(
                    f"kubernetes.scale_via: adapter: no DynamoGraphDeploymentScalingAdapter {name!r} in "
                    f"{self.namespace!r} (the operator names them <dgd>-<service>)"
                ) from exc
            if status == 403:
                raise PermissionError(
                    f"kubernetes: not allowed to read {ADAPTER_PLURAL}/scale {name!r} in {self.namespace!r}: "
                    f"the planner's Role needs get/patch on {ADAPTER_PLURAL}/scale "
                    "(container/k8s/dgd-disagg-planner.yaml), or set kubernetes.scale_via: dgd"
                ) from exc
            raise
        return True

    def _get(self) -> dict[str, Any]:
        return self._api.get_namespaced_custom_object(
            self.cfg.api_group, self.cfg.api_version, self.namespace, PLURAL, self.deployment
        )

    def _patch(self, body: Any, content_type: str) -> None:
        self._api.patch_namespaced_custom_object(
            self.cfg.api_group,
            self.cfg.api_version,
            self.namespace,
            PLURAL,
            self.deployment,
            body,
            _content_type=content_type,
        )

    def _get_scale(self, name: str) -> dict[str, Any]:
        return self._api.get_namespaced_custom_object_scale(
            self.cfg.api_group, self.cfg.api_version, self.namespace, ADAPTER_PLURAL, name
        )

    def _patch_scale(self, name: str, replicas: int) -> None:
        self._api.patch_namespaced_custom_object_scale(
            self.cfg.api_group,
            self.cfg.api_version,
            self.namespace,
            ADAPTER_PLURAL,
            name,
            {"spec": {"replicas": replicas}},
            _content_type="application/merge-patch+json",
        )

    async def _target_replicas(self, dgd: dict[str, Any], pool: str) -> int:
        """The authoritative target: the adapter's, which the DGD follows once the operator syncs it."""
        name = self.adapters.get(pool)
        if name is not None:
            try:
                scale = await asyncio.to_thread(self._get_scale, name)
            except Exception as exc:
                self._drop_adapter_or_raise(pool, exc)
            else:
                return int((scale.get("spec") or {}).get("replicas", 0))
        return desired_replicas(dgd, self.services[pool])

    def _drop_adapter_or_raise(self, pool: str, exc: BaseException) -> None:
        """An adapter deleted while we run: go through the DGD from now on (``auto`` only)."""
        if _api_status(exc) != 404 or self.cfg.scale_via == "adapter":
            raise exc
        logger.warning(
            "kubernetes: DGDSA %s is gone; scaling %s through the DGD",
            self.adapters[pool],
            self.services[pool],
        )
        del self.adapters[pool]

    async def status(self) -> ConnectorStatus:
        dgd = await asyncio.to_thread(self._get)
        wants: dict[str, int] = {}
        pools: dict[str, PoolStatus] = {}
        stable: dict[str, bool] = {}
        for pool in POOLS:
            wants[pool] = await self._target_replicas(dgd, pool)
            pools[pool], stable[pool] = pool_status(dgd, self.services[pool], wants[pool])
        settled = all(stable.values())
        detail = "" if settled else "rollout in progress: " + ", ".join(p for p in POOLS if not stable[p])
        return ConnectorStatus(
            wants["prefill"],
            wants["decode"],
            settled,
            detail,
            prefill_pool=pools["prefill"],
            decode_pool=pools["decode"],
        )

    async def apply(self, prefill: int | None, decode: int | None) -> None:
        dgd = await asyncio.to_thread(self._get)
        for pool, want in (("prefill", prefill), ("decode", decode)):
            if want is None or await self._target_replicas(dgd, pool) == want:
                continue
            svc = self.services[pool]
            name = self.adapters.get(pool)
            if name is not None:
                try:
                    await asyncio.to_thread(self._patch_scale, name, want)
                except Exception as exc:
                    self._drop_adapter_or_raise(pool, exc)
                else:
                    logger.info("scaled DGDSA %s/%s to %d replicas", self.namespace, name, want)
                    continue
            body, ctype = replica_patch(dgd, svc, want)
            await asyncio.to_thread(self._patch, body, ctype)
            logger.info("patched %s/%s service %s to %d replicas", self.namespace, self.deployment, svc, want)

    async def close(self) -> None:
        if self._api_client is not None:
            try:
                self._api_client.close()
            except Exception:
                logger.debug("closing the kubernetes client", exc_info=True)
