"""Connectors against real counterparts: processes, Dynamo's virtual connector client over a real etcd,
and model cards registered through the real runtime (the kubernetes connector: test_planner_kubernetes.py)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dynamo.planner.connector_local import LocalConnector, render
from dynamo.planner.connector_virtual import VirtualConnector
from dynamo.planner.model_cards import capacities_from_cards, capacity_from_card
from dynamo_fpm_testing.planner_support import EmbeddedEtcd, serve_with_card

pytestmark = pytest.mark.timeout(90)

# --------------------------------------------------------------------------------------------------
# local

STAND_IN = textwrap.dedent(
    """
    import os, signal, sys, time
    stubborn = "--stubborn" in sys.argv
    pool, index = os.environ["DYN_PLANNER_POOL"], os.environ["DYN_PLANNER_INDEX"]
    print("started", pool, index, sys.argv[1:], flush=True)
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
    assert sorted((e[2] for e in c.exited), key=lambda rc: -1 if rc is None else rc) == [0, 0, 0, 0]


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
    with_default = capacity_from_card(no_block, default_block_size=32)
    assert with_default is not None and with_default.kv_tokens == 3200
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
