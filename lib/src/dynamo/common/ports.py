"""Free TCP ports: the one module that picks them (the product, the demo, the benchmarks and the tests).

- :func:`stable_free_port`: for a port that is chosen now and bound much later by another process;
- :func:`low_free_port`: the same, below 32768, for the Dynamo 1.6.1 runtime's ``DYN_SYSTEM_PORT``;
- :func:`free_port`: the kernel's choice, for a port bound at once (a server started right away).

Why the first two avoid the kernel's ephemeral range:

A port taken from the kernel with ``bind(("", 0))`` lies in the ephemeral range, which the kernel keeps
handing out to every socket that binds or connects without a port. Where the port is chosen now but bound
tens of seconds later by another process (vLLM's NIXL side channel: the worker picks it, EngineCore binds
it after the model is loaded), UCX's own listeners in the meantime took that very port and the engine
failed with ``Address already in use``. Ports below the ephemeral range are never handed out implicitly.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL_RANGE = (32768, 60999)
LOWEST_PORT = 10000
HEADROOM = 64  # consecutive ports above the chosen one a caller may add (vLLM adds the data-parallel rank)
# The Dynamo 1.6.1 runtime parses DYN_SYSTEM_PORT as a signed 16-bit integer.
SIGNED_16_BIT_MAX = 32767


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux), or the usual default where it cannot be read."""
    try:
        low, high = (int(part) for part in path.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL_RANGE
    return (low, high) if 0 < low <= high <= 65535 else DEFAULT_EPHEMERAL_RANGE


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago, chosen by the kernel (ephemeral range: bind it right away)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def stable_free_port(
    host: str = "127.0.0.1",
    *,
    attempts: int = 200,
    rng: random.Random | None = None,
    highest: int = 65535,
) -> int:
    """A port that is free now and outside the kernel's ephemeral range (see the module docstring).

    ``highest`` caps the choice (plus :data:`HEADROOM`), e.g. for consumers that cannot read large ports."""
    low, high = ephemeral_range()
    below = (LOWEST_PORT, min(low, highest + 1) - HEADROOM)
    above = (high + 1, highest - HEADROOM)
    candidates = below if below[1] > below[0] else above
    if candidates[0] > candidates[1]:
        raise RuntimeError(f"no port range below {highest + 1} outside the ephemeral range {low}-{high}")
    pick = rng or random.SystemRandom()
    for _ in range(attempts):
        port = pick.randint(*candidates)
        if _bindable(host, port):
            return port
    raise RuntimeError(f"no free port in {candidates[0]}-{candidates[1]} after {attempts} attempts")


def low_free_port(host: str = "127.0.0.1") -> int:
    """A stable free port the Dynamo 1.6.1 runtime accepts as ``DYN_SYSTEM_PORT`` (below 32768)."""
    return stable_free_port(host, highest=SIGNED_16_BIT_MAX)
