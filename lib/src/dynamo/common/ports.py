"""Free TCP ports that stay free until a process binds them much later.

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


def stable_free_port(
    host: str = "127.0.0.1", *, attempts: int = 200, rng: random.Random | None = None
) -> int:
    """A port that is free now and outside the kernel's ephemeral range (see the module docstring)."""
    low, high = ephemeral_range()
    candidates = (
        (LOWEST_PORT, low - HEADROOM) if low - HEADROOM > LOWEST_PORT else (high + 1, 65535 - HEADROOM)
    )
    if candidates[0] > candidates[1]:
        raise RuntimeError(f"no port range outside the ephemeral range {low}-{high}")
    pick = rng or random.SystemRandom()
    for _ in range(attempts):
        port = pick.randint(*candidates)
        if _bindable(host, port):
            return port
    raise RuntimeError(f"no free port in {candidates[0]}-{candidates[1]} after {attempts} attempts")
