"""Stand-in for ``aisimulate_core.sdk``: names to satisfy imports only (load-based scaling never uses
them)."""

from typing import Any

from aisimulate._standin import unavailable


class ForwardPassPerfModelConfig:
    """Import stand-in; constructing one raises."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        unavailable("aisimulate_core.sdk.ForwardPassPerfModelConfig")

    @classmethod
    def from_legacy_engine_config(cls, *args: Any, **kwargs: Any) -> "ForwardPassPerfModelConfig":
        unavailable("aisimulate_core.sdk.ForwardPassPerfModelConfig.from_legacy_engine_config")


class RustForwardPassPerfModel:
    """Import stand-in; every entry point raises."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        unavailable("aisimulate_core.sdk.RustForwardPassPerfModel")

    @classmethod
    def best_available(cls, *args: Any, **kwargs: Any) -> "RustForwardPassPerfModel":
        unavailable("aisimulate_core.sdk.RustForwardPassPerfModel.best_available")

    @staticmethod
    def normalize_config(*args: Any, **kwargs: Any) -> str:
        unavailable("aisimulate_core.sdk.RustForwardPassPerfModel.normalize_config")
