"""The kubernetes connector against an HTTP-level double of the Kubernetes API and Dynamo 1.6's operator.

The real ``kubernetes`` client talks HTTP to the double, so paths, verbs, content types and bodies are
the ones a cluster sees. The double behaves as the operator does where it matters: each service with a
DynamoGraphDeploymentScalingAdapter (``<dgd>-<service>``) takes its replicas from the adapter, and an
edit of the DGD's replicas for such a service is put back on the next sync.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from dynamo.planner.config import ConfigError, KubernetesConfig
from dynamo.planner.connector_kubernetes import KubernetesConnector, adapter_name, resolve_target

pytestmark = pytest.mark.timeout(60)

ADAPTERS = "dynamographdeploymentscalingadapters"


class FakeApi:
    """Serves one DGD and its adapters; records PATCH requests and applies them; status follows spec."""

    def __init__(self, dgd: dict[str, Any], adapters: dict[str, int] | None = None) -> None:
        self.dgd = dgd
        self.adapters = dict(adapters or {})  # adapter name -> spec.replicas
        self.forbidden_adapters = False
        self.patches: list[tuple[str, str, Any]] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def _send(self, code: int, obj: Any) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _route(self) -> tuple[str, str | None]:
                meta = api.dgd["metadata"]
                version = api.dgd["apiVersion"].split("/")[1]
                base = f"/apis/nvidia.com/{version}/namespaces/{meta['namespace']}"
                if self.path == f"{base}/dynamographdeployments/{meta['name']}":
                    return "dgd", None
                prefix = f"{base}/{ADAPTERS}/"
                if self.path.startswith(prefix) and self.path.endswith("/scale"):
                    return "scale", self.path[len(prefix) : -len("/scale")]
                return "none", None

            def _missing(self) -> None:
                self._send(404, {"kind": "Status", "code": 404, "reason": "NotFound"})

            def do_GET(self) -> None:
                kind, name = self._route()
                if kind == "dgd":
                    return self._send(200, api.dgd)
                if kind == "scale" and api.forbidden_adapters:
                    return self._send(403, {"kind": "Status", "code": 403, "reason": "Forbidden"})
                if kind == "scale" and name in api.adapters:
                    return self._send(200, api.scale(name))
                self._missing()

            def do_PATCH(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                ctype = self.headers["Content-Type"]
                api.patches.append((self.path, ctype, body))
                kind, name = self._route()
                if kind == "dgd":
                    api.apply(ctype, body)
                    return self._send(200, api.dgd)
                if kind == "scale" and name in api.adapters:
                    assert ctype == "application/merge-patch+json", ctype
                    api.adapters[name] = int(body["spec"]["replicas"])
                    api.sync()
                    return self._send(200, api.scale(name))
                self._missing()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def scale(self, name: str) -> dict[str, Any]:
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {"name": name, "namespace": self.dgd["metadata"]["namespace"]},
            "spec": {"replicas": self.adapters[name]},
            "status": {"replicas": self.adapters[name]},
        }

    def apply(self, ctype: str, body: Any) -> None:
        spec = self.dgd["spec"]
        if ctype == "application/json-patch+json":
            for op in body:
                _, _, _, idx, key = op["path"].split("/")
                comp = spec["components"][int(idx)]
                if op["op"] == "test":
                    assert comp[key] == op["value"]
                else:
                    comp[key] = op["value"]
        else:
            for name, svc in body["spec"]["services"].items():
                spec["services"][name].update(svc)
        self.sync()

    def sync(self) -> None:
        """The operator's reconcile: a service with an adapter takes the adapter's replicas."""
        for comp in self.dgd["spec"].get("components", []):
            name = adapter_name(self.dgd["metadata"]["name"], comp["name"])
            if name in self.adapters:
                comp["replicas"] = self.adapters[name]

    def replicas(self, service: str) -> int:
        return next(int(c["replicas"]) for c in self.dgd["spec"]["components"] if c["name"] == service)

    def set_ready(self, name: str, ready: int, updated: int | None = None) -> None:
        st = self.dgd.setdefault("status", {}).setdefault("components", {})
        st[name] = {"readyReplicas": ready, "updatedReplicas": ready if updated is None else updated}

    def __enter__(self) -> FakeApi:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def _client(url: str) -> Any:
    from kubernetes import client

    return client.ApiClient(client.Configuration(host=url))


def _dgd_v1beta1(namespace: str = "team") -> dict[str, Any]:
    return {
        "apiVersion": "nvidia.com/v1beta1",
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": "llm", "namespace": namespace},
        "spec": {
            "components": [
                {"name": "frontend", "replicas": 1},
                {"name": "prefill", "replicas": 1},
                {"name": "decode", "replicas": 2},
            ]
        },
    }


NO_ENV: dict[str, str] = {}


async def _started(api: FakeApi, **cfg: Any) -> KubernetesConnector:
    """A started connector on ``llm`` in ``team`` whose services serve what the DGD asks (1 + 2)."""
    api.set_ready("prefill", 1)
    api.set_ready("decode", 2)
    c = KubernetesConnector(
        KubernetesConfig(deployment="llm", k8s_namespace="team", **cfg), _client(api.url), NO_ENV
    )
    await c.start()
    return c


async def test_scales_through_the_scaling_adapters_as_the_16_operator_expects() -> None:
    """With an adapter per service, the scale subresource is patched and the DGD is never edited."""
    with FakeApi(_dgd_v1beta1(), adapters={"llm-prefill": 1, "llm-decode": 2}) as api:
        c = await _started(api)
        assert c.adapters == {"prefill": "llm-prefill", "decode": "llm-decode"}
        st = await c.status()
        assert (st.prefill, st.decode, st.settled) == (1, 2, True)
        await c.apply(None, 4)
        path, ctype, body = api.patches[-1]
        assert path == f"/apis/nvidia.com/v1beta1/namespaces/team/{ADAPTERS}/llm-decode/scale"
        assert (ctype, body) == ("application/merge-patch+json", {"spec": {"replicas": 4}})
        assert len(api.patches) == 1 and api.replicas("decode") == 4
        st = await c.status()  # asked for 4, 2 serve: the other 2 are capacity to come
        assert (st.decode, st.settled) == (4, False)
        assert st.decode_pool is not None and (st.decode_pool.starting, st.decode_pool.draining) == (2, 0)
        api.set_ready("decode", 4)
        assert (await c.status()).settled
        await c.apply(None, 4)  # already there: nothing sent
        assert len(api.patches) == 1
        await c.apply(None, 1)
        st = await c.status()  # 4 still serve while 3 terminate
        assert st.decode == 1 and st.decode_pool is not None and st.decode_pool.draining == 3
        await c.close()


async def test_an_adapters_target_wins_over_a_dgd_not_yet_synced() -> None:
    """The target is read from the adapter, so a write the operator has not reconciled is not asked twice."""
    with FakeApi(_dgd_v1beta1(), adapters={"llm-prefill": 1, "llm-decode": 2}) as api:
        c = await _started(api)
        api.adapters["llm-decode"] = 3  # e.g. written by the previous planner; the DGD still says 2
        assert (await c.status()).decode == 3
        await c.apply(None, 3)
        assert api.patches == []
        await c.close()


async def test_patches_the_dgd_with_a_guarded_json_patch_where_no_adapter_exists() -> None:
    with FakeApi(_dgd_v1beta1(), adapters={"llm-decode": 2}) as api:  # prefill has none
        c = await _started(api)
        assert c.adapters == {"decode": "llm-decode"}
        await c.apply(2, 2)  # decode unchanged: only prefill, through the DGD
        assert len(api.patches) == 1
        path, ctype, body = api.patches[0]
        assert path == "/apis/nvidia.com/v1beta1/namespaces/team/dynamographdeployments/llm"
        assert ctype == "application/json-patch+json"
        assert body == [
            {"op": "test", "path": "/spec/components/1/name", "value": "prefill"},
            {"op": "add", "path": "/spec/components/1/replicas", "value": 2},
        ]
        st = await c.status()  # the operator has not caught up: 1 ready of 2 wanted
        assert (st.prefill, st.settled) == (2, False)
        assert st.prefill_pool is not None and st.prefill_pool.starting == 1
        api.set_ready("prefill", 2)
        assert (await c.status()).settled
        await c.close()


async def test_scale_via_dgd_edits_are_put_back_by_an_adapter() -> None:
    """Why adapters come first: with one present, a DGD edit does not hold (the double's operator)."""
    with FakeApi(_dgd_v1beta1(), adapters={"llm-prefill": 1, "llm-decode": 2}) as api:
        cfg = KubernetesConfig(deployment="llm", k8s_namespace="team", scale_via="dgd")
        c = KubernetesConnector(cfg, _client(api.url), NO_ENV)
        await c.start()
        assert c.adapters == {}
        await c.apply(None, 5)
        assert api.patches[-1][1] == "application/json-patch+json" and api.replicas("decode") == 2
        await c.close()


async def test_a_deleted_adapter_falls_back_to_the_dgd_and_strict_mode_refuses() -> None:
    with FakeApi(_dgd_v1beta1(), adapters={"llm-prefill": 1, "llm-decode": 2}) as api:
        c = KubernetesConnector(
            KubernetesConfig(deployment="llm", k8s_namespace="team"), _client(api.url), NO_ENV
        )
        await c.start()
        del api.adapters["llm-decode"]
        assert (await c.status()).decode == 2  # read from the DGD now
        assert c.adapters == {"prefill": "llm-prefill"}
        await c.apply(None, 3)
        assert api.patches[-1][1] == "application/json-patch+json" and api.replicas("decode") == 3
        assert c.adapters == {"prefill": "llm-prefill"}
        await c.close()
    with FakeApi(_dgd_v1beta1(), adapters={"llm-prefill": 1}) as api:
        cfg = KubernetesConfig(deployment="llm", k8s_namespace="team", scale_via="adapter")
        c = KubernetesConnector(cfg, _client(api.url), NO_ENV)
        with pytest.raises(
            ValueError, match=r"no DynamoGraphDeploymentScalingAdapter 'llm-decode' in 'team'"
        ):
            await c.start()


async def test_a_role_without_adapter_rights_is_named() -> None:
    with FakeApi(_dgd_v1beta1(), adapters={"llm-prefill": 1, "llm-decode": 2}) as api:
        api.forbidden_adapters = True
        c = KubernetesConnector(
            KubernetesConfig(deployment="llm", k8s_namespace="team"), _client(api.url), NO_ENV
        )
        with pytest.raises(PermissionError, match=rf"needs get/patch on {ADAPTERS}/scale"):
            await c.start()


async def test_v1alpha1_merge_patch_and_errors() -> None:
    dgd: dict[str, Any] = {
        "apiVersion": "nvidia.com/v1alpha1",
        "metadata": {"name": "llm", "namespace": "default"},
        "spec": {"services": {"VllmPrefillWorker": {"replicas": 1}, "VllmDecodeWorker": {"replicas": 1}}},
        "status": {
            "services": {
                "VllmPrefillWorker": {"availableReplicas": 1},
                "VllmDecodeWorker": {"readyReplicas": 1},
            }
        },
    }
    with FakeApi(dgd) as api:
        cfg = KubernetesConfig(
            deployment="llm",
            api_version="v1alpha1",
            prefill_service="VllmPrefillWorker",
            decode_service="VllmDecodeWorker",
        )
        c = KubernetesConnector(cfg, _client(api.url), NO_ENV, service_account_namespace=Path("/nonexistent"))
        await c.start()
        assert c.namespace == "default" and c.adapters == {}
        await c.apply(1, 3)
        assert api.patches[-1][1:] == (
            "application/merge-patch+json",
            {"spec": {"services": {"VllmDecodeWorker": {"replicas": 3}}}},
        )
        assert dgd["spec"]["services"]["VllmDecodeWorker"]["replicas"] == 3
        bad = KubernetesConnector(
            KubernetesConfig(
                deployment="llm",
                k8s_namespace="default",
                api_version="v1alpha1",
                decode_service="nope",
                prefill_service="VllmPrefillWorker",
            ),
            _client(api.url),
            NO_ENV,
        )
        with pytest.raises(
            ValueError, match=r"kubernetes\.decode_service: service 'nope' not in spec\.services"
        ):
            await bad.start()
        missing = KubernetesConnector(
            KubernetesConfig(deployment="other", k8s_namespace="default", api_version="v1alpha1"),
            _client(api.url),
            NO_ENV,
        )
        with pytest.raises(Exception, match=r"404|Not Found"):
            await missing.start()


def test_target_from_the_operators_pod_environment(tmp_path: Path) -> None:
    sa = tmp_path / "namespace"
    sa.write_text("from-sa\n")
    env = {"DYN_PARENT_DGD_K8S_NAME": "graph", "POD_NAMESPACE": "from-env"}
    t = resolve_target(KubernetesConfig(), env, sa)
    assert (t.deployment, t.namespace, t.deployment_from, t.namespace_from) == (
        "graph",
        "from-env",
        "DYN_PARENT_DGD_K8S_NAME",
        "POD_NAMESPACE",
    )
    assert resolve_target(KubernetesConfig(), {"DYN_PARENT_DGD_K8S_NAME": "graph"}, sa).namespace == "from-sa"
    t = resolve_target(KubernetesConfig(), {"DYN_PARENT_DGD_K8S_NAME": "g"}, tmp_path / "absent")
    assert (t.namespace, t.namespace_from) == ("default", "default")
    t = resolve_target(KubernetesConfig(deployment="mine", k8s_namespace="ns"), env, sa)
    assert (t.deployment, t.namespace) == ("mine", "ns")
    with pytest.raises(ConfigError, match=r"kubernetes\.deployment: .*DYN_PARENT_DGD_K8S_NAME"):
        resolve_target(KubernetesConfig(), {"POD_NAMESPACE": "x"}, sa)


def test_the_planner_names_a_missing_dgd_before_connecting_to_anything() -> None:
    env = {k: v for k, v in os.environ.items() if k != "DYN_PARENT_DGD_K8S_NAME"}
    r = subprocess.run(
        [sys.executable, "-m", "dynamo.planner", "--connector", "kubernetes"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 2, r.stderr
    assert "kubernetes.deployment: the DynamoGraphDeployment name is required" in r.stderr
    assert "DYN_PARENT_DGD_K8S_NAME" in r.stderr
