"""Shared fixtures: a real nats-server on a free loopback port, the tiny model, upstream's schema module.

Environment defaults for vLLM on CPU are set here so every test process (and the engine processes
they spawn) runs offline with a small KV cache.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
from dynamo_fpm_testing.local_stack import LOOPBACK_ENV, OFFLINE_ENV

# Before anything imports vLLM or the runtime: offline, small KV cache, the runtime on loopback.
for _name, _value in {**OFFLINE_ENV, **LOOPBACK_ENV}.items():
    os.environ.setdefault(_name, _value)

from dynamo_fpm_testing import REPO  # noqa: E402
from dynamo_fpm_testing.nats_server import EmbeddedNatsServer  # noqa: E402
from dynamo_fpm_testing.stall_meter import MACHINE  # noqa: E402

UPSTREAM_DIR = REPO / ".cache" / "upstream" / "ai-dynamo-1.6.1"

# A shell without job control starts background commands (`make test &`, `nohup ... &`) with SIGINT ignored,
# and an ignored signal stays ignored through exec: every process the Ctrl-C tests start would ignore the
# SIGINT they send (three tests failed so). A handled signal is reset to its default at exec: handle it here.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session", autouse=True)
def machine_stall_meter() -> Iterator[None]:
    """Measure the machine's stalls for the whole session: timing bounds subtract them (``stall_meter``)."""
    MACHINE.start()
    yield
    MACHINE.stop()


# Each folder of tests/ is a kind of test and a marker of the same name (registered in pyproject.toml,
# docs/testing.md): `pytest -m unit` runs the folder's tests wherever they are named on the command line.
FOLDER_MARKERS = ("unit", "integration", "e2e", "compat")
TESTS_DIR = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test with its folder's kind, so the marker can never disagree with where the test is."""
    for item in items:
        kind = item.path.resolve().relative_to(TESTS_DIR).parts[0]
        if kind in FOLDER_MARKERS:
            item.add_marker(getattr(pytest.mark, kind))


# (nodeid, start, end) in time.monotonic() seconds, setup and teardown included: where each stall happened.
_TEST_SPANS: list[tuple[str, float, float]] = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    started = time.monotonic()
    try:
        return (yield)
    finally:
        _TEST_SPANS.append((item.nodeid, started, time.monotonic()))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say how much the machine stalled during the run, and in which tests: the context of any timing
    failure."""
    stalls = MACHINE.stalls()
    if not stalls:
        return
    total = sum(end - start for start, end in stalls)
    terminalreporter.write_line(
        f"machine stalls measured: {len(stalls)}, {total:.1f} s in all "
        "(timing bounds in the tests left them out); the longest:"
    )
    for start, end in sorted(stalls, key=lambda s: s[0] - s[1])[:3]:
        during = [nodeid for nodeid, t0, t1 in _TEST_SPANS if t0 <= end and start <= t1] or [
            "(between tests)"
        ]
        terminalreporter.write_line(f"  {end - start:5.1f} s during {', '.join(during)}")


@pytest.fixture(scope="session")
def nats_server() -> Iterator[EmbeddedNatsServer]:
    """One real nats-server for the session. Tests that stop it must use ``fresh_nats_server``."""
    with EmbeddedNatsServer() as server:
        yield server


@pytest.fixture()
def fresh_nats_server() -> Iterator[EmbeddedNatsServer]:
    """A nats-server of this test's own, free to stop and restart."""
    with EmbeddedNatsServer() as server:
        yield server


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama model and tokenizer, built on the spot (about 4 s)."""
    from dynamo_fpm_testing.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def upstream_dir() -> Path:
    """The unpacked upstream ai-dynamo 1.6.1 wheel (fetched by `make setup`; tests never download)."""
    if not (UPSTREAM_DIR / "dynamo" / "common" / "forward_pass_metrics.py").is_file():
        pytest.fail(f"{UPSTREAM_DIR} is missing: run `make setup` (it fetches the upstream wheel once)")
    return UPSTREAM_DIR
