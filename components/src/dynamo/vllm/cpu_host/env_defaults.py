"""The environment a prefill or decode worker gives vLLM on its CPU platform (a value the user set wins).

Why each default exists: docs/workarounds.md. The worker applies them before it starts the engine, whose
processes inherit them.
"""

from __future__ import annotations

from collections.abc import Mapping

from dynamo.vllm.cpu_host import shm_wait

OMP_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
OMP_BIND_DEFAULT = "nobind"

# The INFO line the worker logs for each default it sets (one line of why; the measurements are in the docs).
REASONS = {
    OMP_BIND_ENV: "NIXL's threads must not share the model thread's single core on CPU "
    "(set it yourself to override)",
    shm_wait.ENV: "vLLM's engine processes sleep instead of yielding in their waits on CPU "
    "(set it yourself to override, 0 for vLLM's sched_yield)",
}


def cpu_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The CPU defaults not already set in ``environ``: OpenMP threads unbound, engine waits that sleep."""
    env: dict[str, str] = {}
    if not environ.get(OMP_BIND_ENV):
        env[OMP_BIND_ENV] = OMP_BIND_DEFAULT
    if not environ.get(shm_wait.ENV):
        env[shm_wait.ENV] = str(shm_wait.DEFAULT_SLEEP_US)
    return env
