"""Stand-in for ``aisimulate_core._native``: re-exports the import-only stand-in (never used by load
scaling)."""

from aisimulate_core.sdk import RustForwardPassPerfModel

__all__ = ["RustForwardPassPerfModel"]
