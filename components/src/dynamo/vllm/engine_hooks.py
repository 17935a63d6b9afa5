"""Hooks for the vLLM engine processes a ``python -m dynamo.vllm`` worker starts (a vLLM general plugin).

vLLM loads general plugins in each of its processes: the worker's own, its EngineCore child and EngineCore's
model-runner (executor worker) children. Before it starts the engine, the worker exports its pid as
:data:`WORKER_PID_ENV`; in every *other* process that inherits the variable the plugin

- on vLLM's CPU platform, computes the sampled token's logprob rank eagerly (:func:`eager_logprob_ranks`).

Without the variable (vLLM run by anything else) the plugin does nothing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

WORKER_PID_ENV = "DYN_VLLM_WORKER_PID"


def worker_pid(environ: Mapping[str, str]) -> int | None:
    """The pid of the Dynamo worker that started this engine, or None (not one of its engines)."""
    value = environ.get(WORKER_PID_ENV, "").strip()
    return int(value) if value.isdigit() else None


def is_engine_process(environ: Mapping[str, str], pid: int) -> bool:
    """True in a process the worker started (directly or not), False in the worker itself or elsewhere."""
    owner = worker_pid(environ)
    return owner is not None and owner != pid


def _eager_count_greater_than(x: Any, values: Any) -> Any:
    return (x >= values).sum(-1)


def eager_logprob_ranks() -> bool:
    """Replace vLLM's ``torch.compile``-d rank count of the sampled token by the same expression run eagerly.

    vLLM compiles ``batched_count_greater_than`` (``(x >= values).sum(-1)``) with inductor the first time a
    request asks for logprobs. On CPU that compile is a C++ build in the model-runner process, and the engine
    does nothing else meanwhile: the first logprobs request took 26 s here with an empty inductor cache (4 s
    with a warm one) and stalled every request in flight. Eager, the expression costs microseconds for the
    vocabularies a CPU host serves. Returns False when this vLLM has no such function.
    """
    try:
        from vllm.v1.sample import sampler
        from vllm.v1.sample.ops import logprobs
    except ImportError:  # pragma: no cover - another vLLM layout
        return False
    patched = False
    for module in (logprobs, sampler):
        if callable(getattr(module, "batched_count_greater_than", None)):
            module.batched_count_greater_than = _eager_count_greater_than  # type: ignore[attr-defined]
            patched = True
    return patched


def _cpu_platform() -> bool:
    try:
        from vllm.platforms import current_platform
    except ImportError:  # pragma: no cover
        return False
    return bool(current_platform.is_cpu())


def register() -> None:
    """vLLM general-plugin entry point (``dynamo_engine_hooks``); inert outside a Dynamo worker's engine."""
    if not is_engine_process(os.environ, os.getpid()):
        return
    if _cpu_platform() and not eager_logprob_ranks():
        log.warning("this vLLM has no batched_count_greater_than: the first logprobs request may compile")
