"""Drive a real vLLM scheduler without a model: configs, requests, fake model-runner outputs, NATS reader.

The recipe is the one in the shared notes (a config.json-only model dir, KVCacheConfig with one full
attention group, ``Request`` objects with a block hasher). Used by the scheduler tests and the benchmark.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynamo_fpm_testing.stall_meter import Deadline

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

BLOCK_SIZE = 16
EOS = 2
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 4096,
    "torch_dtype": "float32",
    "eos_token_id": EOS,
    "bos_token_id": 1,
}

_hash_ready = False


def write_model_config(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(MODEL_CONFIG))
    return directory


def _init_hashing() -> None:
    global _hash_ready
    if not _hash_ready:
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import init_none_hash

        init_none_hash(sha256)
        _hash_ready = True


@dataclass
class SchedSpec:
    """Knobs of one real scheduler."""

    model_dir: Path
    num_blocks: int = 4096
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    kv_connector: str | None = None  # class name
    kv_connector_module_path: str | None = None
    kv_role: str = "kv_consumer"
    enable_chunked_prefill: bool = True
    structured_output: bool = False
    max_num_inflight_kv_loads: int | None = None  # vLLM >= 0.34 (``--max-num-inflight-kv-loads``)


def make_scheduler(cls: type, spec: SchedSpec) -> Any:
    """A real vLLM scheduler of class ``cls`` (Scheduler, AsyncScheduler, InstrumentedScheduler...)."""
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    _init_hashing()
    model_config = ModelConfig(
        model=str(spec.model_dir),
        dtype="float32",
        max_model_len=spec.max_model_len,
        skip_tokenizer_init=not spec.structured_output,
        tokenizer=str(spec.model_dir) if spec.structured_output else None,
    )
    kv_transfer = None
    if spec.kv_connector:
        kv_transfer = KVTransferConfig(
            kv_connector=spec.kv_connector,
            kv_connector_module_path=spec.kv_connector_module_path,
            kv_role=spec.kv_role,
        )
    extra: dict[str, Any] = {}
    if spec.max_num_inflight_kv_loads is not None:
        extra["max_num_inflight_kv_loads"] = spec.max_num_inflight_kv_loads
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=spec.max_num_seqs,
            max_num_batched_tokens=spec.max_num_batched_tokens,
            max_model_len=spec.max_model_len,
            is_encoder_decoder=False,
            enable_chunked_prefill=spec.enable_chunked_prefill,
            **extra,
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        kv_transfer_config=kv_transfer,
        device_config=DeviceConfig("cpu"),
    )
    vllm_config.cache_config.num_gpu_blocks = spec.num_blocks
    kv_cache_config = KVCacheConfig(
        num_blocks=spec.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32),
            )
        ],
    )
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        log_stats=True,
    )


_counter = iter(range(10**9))


def make_request(
    prompt_len: int,
    max_tokens: int = 16,
    *,
    request_id: str | None = None,
    remote_prefill: bool = False,
    seed_token: int | None = None,
    sampling_params: Any = None,
) -> Any:
    """A real vLLM ``Request``; ``remote_prefill`` marks it for an async KV load (decode side)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    _init_hashing()
    n = next(_counter)
    rid = request_id or f"req-{n}"
    base = (seed_token if seed_token is not None else n * 7) % 900 + 10
    prompt = [(base + i) % 990 + 5 for i in range(prompt_len)]
    params = sampling_params or SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    params.update_from_generation_config({}, EOS)
    if remote_prefill:
        params.extra_args = {
            "kv_transfer_params": {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": [1, 2, 3],
                "remote_engine_id": "prefill-engine",
                "remote_request_id": f"prefill-{rid}",
                "remote_host": "127.0.0.1",
                "remote_port": 1,
                "tp_size": 1,
            }
        }
    return Request(rid, prompt, params, None, block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))


def runner_output(
    req_ids: list[str], sampled_token_ids: list[list[int]], kv_connector_output: Any = None
) -> Any:
    """A ``ModelRunnerOutput`` for the installed vLLM: up to 0.33 it also carries ``req_id_to_index``; 0.34
    removed it (the scheduler indexes outputs by the order of ``req_ids``)."""
    from vllm.v1.outputs import ModelRunnerOutput

    extra: dict[str, Any] = {}
    if _has_req_id_to_index():
        extra["req_id_to_index"] = {rid: i for i, rid in enumerate(req_ids)}
    return ModelRunnerOutput(
        req_ids=req_ids, sampled_token_ids=sampled_token_ids, kv_connector_output=kv_connector_output, **extra
    )


def has_inflight_kv_loads() -> bool:
    """Whether this vLLM has ``--max-num-inflight-kv-loads`` and ``Scheduler.async_kv_waiting`` (0.34)."""
    from vllm.config import SchedulerConfig

    return "max_num_inflight_kv_loads" in SchedulerConfig.__dataclass_fields__


@functools.cache
def _has_req_id_to_index() -> bool:
    from vllm.v1.outputs import ModelRunnerOutput

    return "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}


def model_output(sched_out: Any, *, finished_recving: Iterable[str] = (), token: int = 7) -> Any:
    """A ModelRunnerOutput for every request of ``sched_out`` (one sampled token each, none mid-prefill)."""
    from vllm.v1.outputs import KVConnectorOutput

    req_ids = list(sched_out.num_scheduled_tokens)
    sampled = []
    for _rid in req_ids:
        sampled.append([token])
    kv_out = None
    recv = set(finished_recving)
    if recv:
        kv_out = KVConnectorOutput(finished_recving=recv)
    return runner_output(req_ids, sampled, kv_out)


def prefill_done_output(sched: Any, sched_out: Any, **kwargs: Any) -> Any:
    """Like ``model_output`` but with no token for requests still mid-prefill (as the model runner does)."""
    out = model_output(sched_out, **kwargs)
    for i, rid in enumerate(out.req_ids):
        req = sched.requests.get(rid)
        if req is not None and req.num_computed_tokens < req.num_tokens:
            out.sampled_token_ids[i] = []
    return out


def step(sched: Any, **kwargs: Any) -> tuple[Any, Any]:
    """One synchronous engine step: schedule, fake execution, update."""
    out = sched.schedule()
    mro = prefill_done_output(sched, out, **kwargs)
    sched.update_from_output(out, mro)
    return out, mro


# ------------------------------------------------------------------ records on NATS
@dataclass
class NatsRecords:
    """Collects decoded FPM records from a real NATS subscription in a background thread."""

    url: str
    subject: str
    records: list[Any] = field(default_factory=list)
    payloads: list[bytes] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    _thread: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _ready: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> NatsRecords:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("NATS subscriber did not start")
        return self

    async def _run(self) -> None:
        import nats
        from dynamo.common.forward_pass_metrics import decode
        from dynamo.common.fpm_subjects import decode_envelope

        nc = await nats.connect(self.url)

        async def on_msg(msg: Any) -> None:
            env = decode_envelope(msg.data)
            rec = decode(env.payload)
            with self._lock:
                self.records.append(rec)
                self.payloads.append(bytes(env.payload))
                self.arrivals.append(time.monotonic())

        await nc.subscribe(self.subject, cb=on_msg)
        await nc.flush()
        self._ready.set()
        while not self._stop.is_set():
            await asyncio.sleep(0.01)
        await nc.drain()

    def snapshot(self) -> list[Any]:
        with self._lock:
            return list(self.records)

    def latest(self) -> Any:
        with self._lock:
            return self.records[-1] if self.records else None

    def wait_for(self, predicate: Any, timeout: float = 5.0) -> Any:
        deadline = Deadline(timeout)
        while not deadline.expired():
            for rec in reversed(self.snapshot()):
                if predicate(rec):
                    return rec
            time.sleep(0.01)
        return None

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)


@contextlib.contextmanager
def fpm_env(**values: str | None) -> Iterator[None]:
    """Set (or unset with None) environment variables for the duration."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class ListPublisher:
    """In-memory publisher with FpmDirectPublisher's interface (for the hot-path-only unit tests)."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.records: list[Any] = []
        self.idle_record: Any = "initial"
        self.idle_changes: list[Any] = []
        self.handovers: list[int] = []  # len(records) at each wait_sent()
        self.closed = False

    def publish(self, record: Any) -> None:
        self.records.append(record)

    def wait_sent(self, timeout: float) -> bool:
        self.handovers.append(len(self.records))
        return True

    def set_idle_record(self, record: Any) -> None:
        self.idle_record = record
        self.idle_changes.append(record)

    def close(self, timeout: float = 2.0) -> None:
        self.closed = True


def capturing_scheduler_cls() -> type:
    """InstrumentedScheduler whose publisher is a ListPublisher (records in ``sched._fpm_pub.records``)."""
    from dynamo.vllm.instrumented_scheduler import InstrumentedScheduler

    class CapturingScheduler(InstrumentedScheduler):
        def _fpm_make_publisher(self, settings: Any, worker_id: str, dp_rank: int) -> Any:
            return ListPublisher(settings=settings, worker_id=worker_id, dp_rank=dp_rank)

    return CapturingScheduler


# ------------------------------------------------------------------ a real engine (end-to-end tests)
E2E_PROMPT_LENS = (23, 41, 57, 12, 88, 30)
E2E_MAX_TOKENS = (9, 14, 5, 20, 7, 11)


def e2e_prompts() -> list[list[int]]:
    return [[(7 * i + 3 * j) % 900 + 20 for j in range(n)] for i, n in enumerate(E2E_PROMPT_LENS)]


def run_llm(model_dir: str) -> dict[str, Any]:
    """Serve the e2e prompts concurrently on a real vLLM engine with the InstrumentedScheduler.

    Returns what was processed: prompt and generated token counts per request.
    """
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model_dir,
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        block_size=32,
        enable_prefix_caching=False,
        max_num_seqs=8,
        scheduler_cls="dynamo.vllm.instrumented_scheduler.InstrumentedScheduler",
    )
    try:
        params = [SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0) for m in E2E_MAX_TOKENS]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in e2e_prompts()], params)
        return {
            "prompt_tokens": [len(o.prompt_token_ids) for o in outs],
            "generated_tokens": [len(o.outputs[0].token_ids) for o in outs],
        }
    finally:
        llm.llm_engine.engine_core.shutdown()


if (
    __name__ == "__main__"
):  # the multiprocess e2e child: python -m dynamo_fpm_testing.scheduler_support MODEL_DIR OUT_JSON
    import sys

    result = run_llm(sys.argv[1])
    Path(sys.argv[2]).write_text(json.dumps(result))
