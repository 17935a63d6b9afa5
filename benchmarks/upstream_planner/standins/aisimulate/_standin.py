"""Shared helper of the ``aisimulate`` / ``aisimulate_core`` stand-ins (imports only, never used)."""

from typing import NoReturn


def unavailable(name: str) -> NoReturn:
    raise RuntimeError(
        f"{name} was called, but only an import stand-in is installed (benchmarks/upstream_planner/"
        "standins); the real aisimulate is not available here. Load-based scaling should never reach this."
    )
