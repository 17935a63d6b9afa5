"""Stand-in for ``aisimulate.runner``: satisfies an import only (load-based scaling never calls it)."""

from typing import Any

from aisimulate._standin import unavailable


def canonical_performance_config(config: Any, *, worker_type: str) -> dict[str, Any]:
    unavailable("aisimulate.runner.canonical_performance_config")
