"""A streamed ``/v1/completions`` request read by a child process, for tests that act while it streams.

Why a process: the tests that use it must act on time while the answer streams (send SIGTERM mid-answer,
scale a pool down). A reader thread in the test process did a socket read and a JSON parse per chunk, and
competed with the test's own thread for its GIL the whole time. One fresh clone's failover test sent its
SIGTERM 36 ms after a 4,000-token answer had ended, 6.6 s after it began; the session's stall meter (a
separate process) reported a 6.4 s stall in that test, so the machine's ordinary processes were kept from
running too (docs/disaggregation.md, "Hosts that stall"): a reader process removes one competitor, not that.

Run as a module this file *is* the child: ``python -m dynamo_fpm_testing.stream_client URL BODY_JSON N``.
It prints ``started`` once N chunks have arrived (or the stream ended), then one JSON line: ``status``,
``chunks``, ``tokens`` (usage), ``finish``, ``errors`` (error chunks), ``words`` (of the text), ``error``
(a transport failure, else absent).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from typing import Any

from dynamo.common.process_group import kill_group_and_reap, start_in_own_session

STARTED = "started"


class StreamingCompletion:
    """Parent-side handle: start the child, wait until it streams, then collect its summary."""

    def __init__(self, base_url: str, body: dict[str, Any], started_after_chunks: int = 1) -> None:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        self.proc = start_in_own_session(
            [sys.executable, "-m", "dynamo_fpm_testing.stream_client", base_url, json.dumps(body),
             str(started_after_chunks)],
            stdout=subprocess.PIPE,
        )  # fmt: skip
        self._lines: list[str] = []
        self._buffer = b""

    def _read_lines(self, timeout: float) -> bool:
        """Read what the child wrote within ``timeout``; False once its output has ended."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], max(0.0, timeout))
        if not ready:
            return True
        data = os.read(fd, 65536)
        if not data:
            return False
        self._buffer += data
        *complete, self._buffer = self._buffer.split(b"\n")
        self._lines.extend(line.decode() for line in complete)
        return True

    def wait_started(self, timeout: float = 60.0) -> bool:
        """True once the child has read its first chunks (or the stream already ended)."""
        deadline = time.monotonic() + timeout
        while STARTED not in self._lines:
            left = deadline - time.monotonic()
            if left <= 0 or not self._read_lines(left):
                return STARTED in self._lines
        return True

    def result(self, timeout: float = 300.0) -> dict[str, Any]:
        """The child's summary (see the module docstring); raises TimeoutError if it never ends."""
        deadline = time.monotonic() + timeout
        while self._read_lines(max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                self.close()
                raise TimeoutError(f"the streaming request did not end in {timeout} s; got {self._lines}")
        self.proc.wait(timeout=10)
        summaries = [line for line in self._lines if line.startswith("{")]
        if not summaries:
            raise RuntimeError(f"the stream client ended without a summary (exit {self.proc.returncode})")
        result: dict[str, Any] = json.loads(summaries[-1])
        return result

    def close(self) -> None:
        kill_group_and_reap(self.proc)


def _stream(base_url: str, body: dict[str, Any], started_after: int) -> dict[str, Any]:
    import httpx

    from dynamo_fpm_testing.worker_support import sse_chunks

    out: dict[str, Any] = {"status": None, "chunks": 0, "tokens": 0, "finish": None, "errors": []}
    text: list[str] = []
    try:
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=300) as r:
            out["status"] = r.status_code
            for chunk in sse_chunks(r.iter_lines()):
                out["chunks"] += 1
                if "error" in chunk:
                    out["errors"].append(chunk["error"])
                for choice in chunk.get("choices", []):
                    text.append(choice.get("text") or "")
                    out["finish"] = choice.get("finish_reason") or out["finish"]
                if chunk.get("usage"):
                    out["tokens"] = chunk["usage"]["completion_tokens"]
                if out["chunks"] == started_after:
                    print(STARTED, flush=True)
    except httpx.HTTPError as exc:
        out["error"] = repr(exc)
    out["words"] = len("".join(text).split())
    return out


def main(argv: list[str]) -> int:
    base_url, body, started_after = argv[0], json.loads(argv[1]), int(argv[2])
    out = _stream(base_url, body, started_after)
    if out["chunks"] < started_after:
        print(STARTED, flush=True)  # ended (or failed) early: the parent stops waiting either way
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
