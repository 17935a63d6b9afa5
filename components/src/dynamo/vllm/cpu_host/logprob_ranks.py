"""The sampled token's logprob rank computed eagerly on CPU, not through a first-use ``torch.compile``.

Why: on CPU that compile is a C++ build that stalled the first logprobs request for 26 s and every request in
flight with it (docs/workarounds.md#eager-logprob-ranks). Applied by :mod:`dynamo.vllm.engine_hooks` in a
worker's engine processes on vLLM's CPU platform only.
"""

from __future__ import annotations

from typing import Any


def _eager_count_greater_than(x: Any, values: Any) -> Any:
    return (x >= values).sum(-1)


def eager_logprob_ranks() -> bool:
    """Replace vLLM's compiled ``batched_count_greater_than`` (``(x >= values).sum(-1)``) by the same
    expression run eagerly; False when this vLLM has no such function."""
    try:
        from vllm.v1.sample import sampler
        from vllm.v1.sample.ops import logprobs
    except ImportError:  # pragma: no cover - another vLLM layout
        return False
    patched = False
    for module in (logprobs, sampler):
        if callable(getattr(module, "batched_count_greater_than", None)):
            module.batched_count_greater_than = _eager_count_greater_than
            patched = True
    return patched
