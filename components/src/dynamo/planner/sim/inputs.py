"""Checked inputs of ``simulate``: Mooncake traces, mocker engine args, ``P,D`` fleet sizes.

Every problem raises :class:`SimInputError` with one line naming the file, line or key, so the command
exits 2 before the simulator starts (the simulator's own errors are longer and later).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .prefixes import BLOCK_TOKENS

# The engine pair of docs/planner-evaluation.md: 8192 blocks of 64 tokens, 64 sequences, 16k context.
DEFAULT_ENGINE: dict[str, Any] = {"num_gpu_blocks": 8192, "max_num_seqs": 64, "max_model_len": 16384}
DEFAULT_STARTUP_S = 60.0


# Per-run noise: Dynamo's KV router logs one INFO line per routed request and pool (about 40,000 for an hour
# of the conversation trace) and a WARN per worker a scale-down removes, the mocker one INFO line per engine
# it starts. The runtime reads DYN_LOG once, when ``dynamo._core`` is first imported.
SIMULATOR_LOG_DIRECTIVES = (
    "dynamo_kv_router::scheduling::selector=warn,dynamo_kv_router::sequences::multi_worker=error,"
    "aisimulate_core::engine::kv_manager=warn"
)


def quiet_simulator_logs() -> None:
    """Before the runtime's first import: those per-request and per-engine lines at warn (a DYN_LOG with
    directives of its own is left as it is)."""
    level = os.environ.get("DYN_LOG") or "info"
    if "dynamo._core" not in sys.modules and "=" not in level:
        os.environ["DYN_LOG"] = f"{level},{SIMULATOR_LOG_DIRECTIVES}"


class SimInputError(ValueError):
    """Bad input for ``simulate``; the message names the problem in one line."""


def check_trace(path: str, block_size: int = BLOCK_TOKENS) -> float:
    """Validate a Mooncake JSON-lines trace whose hash ids stand for ``block_size`` prompt tokens each (64 in
    the traces this package writes); returns its last arrival time in seconds."""
    if block_size < 1:
        raise SimInputError(f"trace block size: must be >= 1, got {block_size}")
    p = Path(path)
    if not p.is_file():
        raise SimInputError(f"trace {path}: no such file")
    last_ms = 0.0
    count = 0
    try:
        with p.open(encoding="utf-8") as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise SimInputError(f"trace {path} line {n}: not JSON ({exc.msg})") from None
                _check_request(obj, f"trace {path} line {n}", block_size)
                last_ms = max(last_ms, float(obj["timestamp"]))
                count += 1
    except UnicodeDecodeError as exc:
        raise SimInputError(f"trace {path}: not UTF-8 text ({exc.reason})") from None
    if count == 0:
        raise SimInputError(f"trace {path}: no requests")
    return last_ms / 1000.0


def prompts_over(path: str, limit: int) -> tuple[int, int]:
    """(requests whose prompt is longer than ``limit`` tokens, the longest prompt) of a checked trace."""
    over = longest = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                isl = int(json.loads(line)["input_length"])
                over += isl > limit
                longest = max(longest, isl)
    return over, longest


def _check_request(obj: Any, where: str, block_size: int) -> None:
    if not isinstance(obj, dict):
        raise SimInputError(f"{where}: expected a JSON object")
    ts = obj.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts) or ts < 0:
        raise SimInputError(f"{where}: timestamp must be a non-negative number of milliseconds")
    for key in ("input_length", "output_length"):
        v = obj.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise SimInputError(f"{where}: {key} must be a positive integer")
    ids = obj.get("hash_ids")
    if ids is not None and (
        not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    ):
        raise SimInputError(f"{where}: hash_ids must be a list of integers")
    if ids and len(ids) * block_size < obj["input_length"]:
        raise SimInputError(
            f"{where}: {len(ids)} hash_ids of {block_size} tokens cannot hold input_length "
            f"{obj['input_length']} (the trace's block size: --trace-block-size)"
        )


def merge_traces(paths: list[str], out: Path) -> Path:
    """Several traces as one (the simulator replays one Mooncake file): merged by time stamp.

    Each file's block hashes are shifted past the previous files' so independent traces do not
    read as sharing prefixes.
    """
    rows: list[tuple[float, int, str]] = []
    offset = 0
    for i, path in enumerate(paths):
        top = -1
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                obj = json.loads(line)
                ids = obj.get("hash_ids")
                if ids:
                    top = max(top, max(ids))
                    obj["hash_ids"] = [h + offset for h in ids]
                rows.append((float(obj["timestamp"]), i, json.dumps(obj, separators=(",", ":"))))
        offset += top + 1
    rows.sort(key=lambda r: (r[0], r[1]))
    with out.open("w", encoding="utf-8") as f:
        f.writelines(r[2] + "\n" for r in rows)
    return out


def parse_json_arg(text: str | None, what: str) -> dict[str, Any]:
    """Inline JSON, or the path of a JSON file."""
    if text is None:
        return {}
    raw = text
    if not text.lstrip().startswith("{"):
        p = Path(text)
        if not p.is_file():
            raise SimInputError(f"{what}: neither inline JSON nor a readable file: {text!r}")
        raw = p.read_text(encoding="utf-8")
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        raise SimInputError(f"{what}: not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise SimInputError(f"{what}: expected a JSON object")
    return obj


def engine_args(given: Mapping[str, Any], pool: str, startup_s: float | None) -> dict[str, Any]:
    """The mocker's normalized config for one pool (unknown keys rejected by the mocker itself)."""
    quiet_simulator_logs()
    from dynamo._core import _normalize_mocker_config

    what = f"{pool}-engine-args"
    args = json.loads(json.dumps(given))  # a deep copy
    engine = args.setdefault("engine", {})
    if not isinstance(engine, dict):
        raise SimInputError(f"{what}: engine must be a JSON object")
    for k, v in DEFAULT_ENGINE.items():
        engine.setdefault(k, v)
    kind = engine.setdefault("worker_type", pool)
    if kind != pool:
        raise SimInputError(f"{what}: engine.worker_type is {kind!r}, this pool is {pool!r}")
    if startup_s is not None:
        args["startup_time"] = startup_s
    args.setdefault("startup_time", DEFAULT_STARTUP_S)
    try:
        return dict(_normalize_mocker_config(args))
    except ValueError as exc:
        raise SimInputError(f"{what}: {str(exc).splitlines()[0]}") from None


def parse_fleet(text: str, what: str) -> tuple[int, int]:
    """``P,D`` -> (P, D), both whole numbers >= 0 and not both 0."""
    parts = text.split(",")
    try:
        if len(parts) != 2:
            raise ValueError
        p, d = int(parts[0]), int(parts[1])
    except ValueError:
        raise SimInputError(f"{what}: expected P,D (two whole numbers), got {text!r}") from None
    if p < 1 or d < 1:
        raise SimInputError(f"{what}: a disaggregated fleet needs at least one worker per pool, got {text!r}")
    return p, d
