"""Connectors against real counterparts: processes, an HTTP-level Kubernetes API double, Dynamo's
virtual connector client over a real etcd, and model cards registered through the real runtime."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from dynamo.planner.config import KubernetesConfig
from dynamo.planner.connector_kubernetes import KubernetesConnector
from dynamo.planner.connector_local import LocalConnector, render
from dynamo.planner.connector_virtual import VirtualConnector
from dynamo.planner.model_cards import capacities_from_cards, capacity_from_card

from tests.planner_support import EmbeddedEtcd, serve_with_card

pytestmark = pytest.mark.timeout(90)

# --------------------------------------------------------------------------------------------------
# local

STAND_IN = textwrap.dedent(
    """
    import os, signal, sys, time
    stubborn = "--stubborn" in sys.argv
    print("started", os.environ["DYN_PLANNER_POOL"], os.environ["DYN_PLANNER_INDEX"], sys.argv[1:], flush=True)
    def term(*_):
        if stubborn:
            print("ignoring SIGTERM", flush=True)
            return
        print("draining", flush=True)
        time.sleep(0.3)  # finish in-flight work
        print("drained", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, term)
    while True:
        time.sleep(0.05)
    """
)


@pytest.fixture()
def stand_in(tmp_path: Path) -> Path:
    script = tmp_path / "worker.py"
    script.write_text(STAND_IN)
    return script


async def _until(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


def test_render_fills_placeholders_and_uses_our_interpreter() -> None:
    argv = render(
        "python -m dynamo.vllm --mode {pool} --port {port} --ns {namespace}",
        pool="decode",
        port=7,
        namespace="n",
    )
    assert argv == [sys.executable, "-m", "dynamo.vllm", "--mode", "decode", "--port", "7", "--ns", "n"]
    with pytest.raises(ValueError, match="unknown placeholder 'gpu'"):
        render("x {gpu}", pool="p")


async def test_local_connector_starts_and_drains_processes(tmp_path: Path, stand_in: Path) -> None:
    c = LocalConnector(
        prefill_command=f"python {stand_in} --role {{pool}} --index {{index}} --port {{port}}",
        decode_command=f"python {stand_in} --role {{pool}} --index {{index}}",
        log_dir=tmp_path / "logs",
        stop_timeout_s=5.0,
    )
    await c.start()
    try:
        await c.apply(2, 1)
        st = await c.status()
        assert (st.prefill, st.decode, st.settled) == (2, 1, True)
        pids = [wp.pid for wp in c.procs["prefill"]]
        assert all(os.getpgid(p) == p for p in pids)  # each in its own process group
        log1 = tmp_path / "logs" / "prefill-1.log"
        await _until(lambda: "started prefill 1" in log1.read_text(errors="replace"))
        assert "--port" in log1.read_text()
        await c.apply(1, None)  # the newest prefill worker gets SIGTERM and drains
        st = await c.status()
        assert (st.prefill, st.decode, st.settled) == (1, 1, False)
        await _until(lambda: c.draining() == 0)
        assert "drained" in log1.read_text()
        assert ("prefill", 1, 0) in c.exited
        assert (await c.status()).settled
        await c.apply(None, 2)
        assert (await c.status()).decode == 2
        await _until(lambda: "started decode 1" in (tmp_path / "logs" / "decode-1.log").read_text())
    finally:
        await c.close()
    assert all(not wp.alive for procs in c.procs.values() for wp in procs)
    assert sorted(e[2] for e in c.exited) == [0, 0, 0, 0]


async def test_local_connector_kills_a_worker_that_does_not_drain(tmp_path: Path, stand_in: Path) -> None:
    c = LocalConnector(
        prefill_command=f"python {stand_in} --stubborn",
        decode_command=f"python {stand_in}",
        log_dir=tmp_path,
        stop_timeout_s=0.5,
    )
    await c.start()
    try:
        await c.apply(1, 0)
        await _until(lambda: "started" in (tmp_path / "prefill-0.log").read_text())
        await c.apply(0, 0)
        await _until(lambda: c.draining() == 0, timeout=10)
        assert c.exited[-1][2] == -9
        assert "ignoring SIGTERM" in (tmp_path / "prefill-0.log").read_text()
    finally:
        await c.close()


async def test_local_connector_reports_a_crashed_worker(tmp_path: Path) -> None:
    c = LocalConnector(
        prefill_command="python -c 'import sys; sys.exit(3)'",
        decode_command="python -c pass",
        log_dir=tmp_path,
    )
    await c.start()
    await c.apply(1, 0)
    await _until(lambda: c.running("prefill") == [])
    assert (await c.status()).prefill == 0 and c.exited == [("prefill", 0, 3)]
    await c.close()


# --------------------------------------------------------------------------------------------------
# kubernetes: an API double at the HTTP level


class FakeApi:
    """Serves one DynamoGraphDeployment; records PATCH requests and applies them; status follows spec."""

    def __init__(self, dgd: dict[str, Any]) -> None:
        self.dgd = dgd
        self.patches: list[tuple[str, str, Any]] = []
        self.gets = 0
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

            def _ours(self) -> bool:
                meta = api.dgd["metadata"]
                version = api.dgd["apiVersion"].split("/")[1]
                want = f"/apis/nvidia.com/{version}/namespaces/{meta['namespace']}/dynamographdeployments/{meta['name']}"
                return self.path == want

            def do_GET(self) -> None:
                if not self._ours():
                    return self._send(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
                api.gets += 1
                self._send(200, api.dgd)

            def do_PATCH(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                ctype = self.headers["Content-Type"]
                api.patches.append((self.path, ctype, body))
                if not self._ours():
                    return self._send(404, {"kind": "Status", "code": 404})
                api.apply(ctype, body)
                self._send(200, api.dgd)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

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

    conf = client.Configuration(host=url)
    return client.ApiClient(conf)


def _dgd_v1beta1() -> dict[str, Any]:
    return {
        "apiVersion": "nvidia.com/v1beta1",
        "kind": "DynamoGraphDeployment",
        "metadata": {"name": "llm", "namespace": "team"},
        "spec": {
            "components": [
                {"name": "frontend", "replicas": 1},
                {"name": "prefill", "replicas": 1},
                {"name": "decode", "replicas": 2},
            ]
        },
    }


async def test_kubernetes_connector_patches_replicas_with_a_guarded_json_patch() -> None:
    with FakeApi(_dgd_v1beta1()) as api:
        api.set_ready("prefill", 1)
        api.set_ready("decode", 2)
        cfg = KubernetesConfig(deployment="llm", k8s_namespace="team")
        c = KubernetesConnector(cfg, _client(api.url))
        await c.start()
        st = await c.status()
        assert (st.prefill, st.decode, st.settled) == (1, 2, True)
        await c.apply(2, 2)  # decode unchanged: only prefill is patched
        assert len(api.patches) == 1
        path, ctype, body = api.patches[0]
        assert path == "/apis/nvidia.com/v1beta1/namespaces/team/dynamographdeployments/llm"
        assert ctype == "application/json-patch+json"
        assert body == [
            {"op": "test", "path": "/spec/components/1/name", "value": "prefill"},
            {"op": "add", "path": "/spec/components/1/replicas", "value": 2},
        ]
        st = await c.status()  # operator has not caught up: 1 ready of 2 wanted
        assert (st.prefill, st.settled) == (1, False)
        api.set_ready("prefill", 2)
        assert (await c.status()).settled
        await c.apply(None, 1)
        assert api.patches[-1][2][1] == {"op": "add", "path": "/spec/components/2/replicas", "value": 1}
        await c.close()


async def test_kubernetes_connector_v1alpha1_merge_patch_and_errors() -> None:
    dgd = {
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
        c = KubernetesConnector(cfg, _client(api.url))
        await c.start()
        await c.apply(1, 3)
        assert api.patches[-1][1:] == (
            "application/merge-patch+json",
            {"spec": {"services": {"VllmDecodeWorker": {"replicas": 3}}}},
        )
        assert dgd["spec"]["services"]["VllmDecodeWorker"]["replicas"] == 3
        bad = KubernetesConnector(
            KubernetesConfig(
                deployment="llm",
                api_version="v1alpha1",
                decode_service="nope",
                prefill_service="VllmPrefillWorker",
            ),
            _client(api.url),
        )
        with pytest.raises(
            ValueError, match=r"kubernetes\.decode_service: service 'nope' not in spec\.services"
        ):
            await bad.start()
        missing = KubernetesConnector(
            KubernetesConfig(deployment="other", api_version="v1alpha1"), _client(api.url)
        )
        with pytest.raises(Exception, match=r"404|Not Found"):
            await missing.start()


# --------------------------------------------------------------------------------------------------
# virtual: a real VirtualConnectorClient over a real etcd


@pytest.fixture(scope="module")
def etcd() -> Iterator[EmbeddedEtcd]:
    server = EmbeddedEtcd().start()
    try:
        yield server
    finally:
        server.stop()


async def test_virtual_connector_round_trip(monkeypatch: pytest.MonkeyPatch, etcd: EmbeddedEtcd) -> None:
    from dynamo._core import VirtualConnectorClient
    from dynamo.runtime import DistributedRuntime

    monkeypatch.setenv("ETCD_ENDPOINTS", etcd.url)
    loop = asyncio.get_running_loop()
    rt_planner = DistributedRuntime(loop, "etcd", "tcp", event_plane="zmq")
    rt_client = DistributedRuntime(loop, "etcd", "tcp", event_plane="zmq")
    try:
        c = VirtualConnector(rt_planner, "vround")
        await c.start()
        assert c.targets() == (-1, -1, -1)
        assert (await c.status()).settled
        client = VirtualConnectorClient(rt_client, "vround")
        await c.apply(2, 3)
        st = await c.status()
        assert not st.settled and "prefill 2, decode 3" in st.detail
        await asyncio.wait_for(client.wait(), 10)
        d = await client.get()
        assert (d.num_prefill_workers, d.num_decode_workers) == (2, 3)
        await client.complete(d)
        deadline = time.monotonic() + 10
        while not (await c.status()).settled:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        st = await c.status()
        assert (st.prefill, st.decode) == (2, 3)  # acknowledged targets count as replicas
        await c.apply(None, 4)
        assert (await c.status()).decode is None  # pending: unknown until acknowledged
        await asyncio.wait_for(client.wait(), 10)
        d = await client.get()
        assert (d.num_prefill_workers, d.num_decode_workers) == (2, 4)
    finally:
        rt_client.shutdown()
        rt_planner.shutdown()


# --------------------------------------------------------------------------------------------------
# model cards


def test_capacity_from_card() -> None:
    card = {
        "kv_cache_block_size": 16,
        "context_length": 2048,
        "runtime_config": {
            "total_kv_blocks": 100,
            "max_num_seqs": 8,
            "max_num_batched_tokens": 512,
            "context_length": 1024,
        },
    }
    cap = capacity_from_card(card)
    assert cap is not None
    assert (cap.context_length, cap.kv_tokens, cap.max_num_seqs, cap.max_num_batched_tokens) == (
        1024,
        1600,
        8,
        512,
    )
    no_block = {"kv_cache_block_size": 0, "runtime_config": {"total_kv_blocks": 100}}
    assert capacity_from_card(no_block) is None
    assert capacity_from_card(no_block, default_block_size=32).kv_tokens == 3200  # type: ignore[union-attr]
    assert capacities_from_cards({"7": "not json", "8": json.dumps(card)}) == {"8": cap}


async def test_model_card_registered_through_the_runtime_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dynamo.planner.model_cards import ModelCardSource
    from dynamo.runtime import DistributedRuntime

    monkeypatch.setenv("DYN_FILE_KV", str(tmp_path))
    loop = asyncio.get_running_loop()
    rt = DistributedRuntime(loop, "file", "tcp", event_plane="zmq")
    rt2 = DistributedRuntime(loop, "file", "tcp", event_plane="zmq")
    try:
        ep, serving = await serve_with_card(
            rt,
            "cards.backend.generate",
            kv_blocks=100,
            max_num_seqs=8,
            context_length=1024,
            max_num_batched_tokens=256,
        )
        source = ModelCardSource(rt2, "cards", "backend", "generate")
        deadline = time.monotonic() + 10
        caps: dict[str, Any] = {}
        while not caps:
            assert time.monotonic() < deadline, "model card never seen"
            await asyncio.sleep(0.1)
            caps = source.poll(default_block_size=32)
        ((worker_id, cap),) = caps.items()
        assert worker_id == str(ep.connection_id())
        assert (cap.context_length, cap.kv_tokens, cap.max_num_seqs, cap.source) == (1024, 3200, 8, "card")
        source.close()
        serving.cancel()
    finally:
        rt2.shutdown()
        rt.shutdown()
