"""Switches read from the environment by code that runs inside vLLM's processes (no vLLM import here).

A value that cannot be read raises ``ValueError`` naming the variable, so a typo never silently turns a fix
off.
"""

from __future__ import annotations

from collections.abc import Mapping


def flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    """An on/off switch: 1/0, true/false, yes/no, on/off (any case); unset or empty gives ``default``."""
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r}: expected 0/1, true/false, yes/no or on/off")


def number(
    env: Mapping[str, str], name: str, default: float, *, allow_zero: bool = True, what: str = "a number"
) -> float:
    """A number >= 0 (> 0 without ``allow_zero``); unset or empty gives ``default``. ``what`` names the unit
    in errors."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected {what}") from None
    if value != value or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name}={raw!r}: must be {'>= 0' if allow_zero else '> 0'}")
    return value
