"""The Dynamo runtime's NATS variable names (``NATS_AUTH_*``, ``NATS_TLS_*``) and our aliases.

One rule: the runtime's name wins when both are set, and a conflicting pair logs one warning.
Checked as units and against real nats-servers configured for user/password and for token auth,
with our publisher and our tracker (what the planner and the watch CLI connect with).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from pathlib import Path

import pytest
from dynamo.common import nats_options
from dynamo.common.fpm_publisher import FpmDirectPublisher
from dynamo.common.fpm_tracker import FpmTracker
from dynamo.common.nats_options import NAMES, nats_connect_options_from_env, read_var, tls_context_from_env
from dynamo_fpm_testing.fpm_support import CustomNatsServer, full_record, self_signed_cert, wait_until

NS = "names"
ALL_VARS = [n for pair in NAMES for n in pair if n]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ALL_VARS:
        monkeypatch.delenv(var, raising=False)
    nats_options._warned.clear()


def test_runtime_name_wins_and_a_conflict_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "dynamo.common.nats_options")
    assert read_var({"NATS_USER": "ours"}, nats_options.USERNAME) == ("ours", "NATS_USER")
    assert read_var({"NATS_AUTH_USERNAME": "rt"}, nats_options.USERNAME) == ("rt", "NATS_AUTH_USERNAME")
    same = {"NATS_AUTH_TOKEN": "t", "NATS_TOKEN": "t"}
    assert nats_connect_options_from_env(same) == {"token": "t"}
    assert not caplog.records  # equal values: nothing to warn about
    env = {"NATS_AUTH_TOKEN": "runtime", "NATS_TOKEN": "ours", "NATS_AUTH_NKEY": ""}
    for _ in range(3):
        assert nats_connect_options_from_env(env) == {"token": "runtime"}
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "NATS_AUTH_TOKEN" in warnings[0] and "NATS_TOKEN" in warnings[0]
    assert "runtime" not in warnings[0].replace("runtime's", "")  # values (secrets) are never logged


def test_every_runtime_name_is_read(tmp_path: Path) -> None:
    creds = tmp_path / "x.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----\n")
    assert nats_connect_options_from_env({"NATS_AUTH_USERNAME": "u", "NATS_AUTH_PASSWORD": "p"}) == {
        "user": "u",
        "password": "p",
    }
    assert nats_connect_options_from_env({"NATS_AUTH_TOKEN": "t"}) == {"token": "t"}
    assert nats_connect_options_from_env({"NATS_AUTH_CREDENTIALS_FILE": str(creds)}) == {
        "user_credentials": str(creds)
    }
    try:
        import nkeys  # noqa: F401

        assert nats_connect_options_from_env({"NATS_AUTH_NKEY": "SUABC"}) == {"nkeys_seed_str": "SUABC"}
    except ImportError:
        with pytest.raises(ValueError, match="NATS_AUTH_NKEY needs the 'nkeys' package"):
            nats_connect_options_from_env({"NATS_AUTH_NKEY": "SUABC"})
    with pytest.raises(ValueError, match="NATS_AUTH_CREDENTIALS_FILE"):
        nats_connect_options_from_env({"NATS_AUTH_CREDENTIALS_FILE": str(tmp_path / "missing")})
    with pytest.raises(ValueError, match="NATS_AUTH_PASSWORD is set without"):
        nats_connect_options_from_env({"NATS_AUTH_PASSWORD": "p"})
    cert, key = self_signed_cert(tmp_path)
    ctx = tls_context_from_env(
        {
            "NATS_TLS_CA_CERT_PATH": str(cert),
            "NATS_TLS_CLIENT_CERT_PATH": str(cert),
            "NATS_TLS_CLIENT_KEY_PATH": str(key),
        }
    )
    assert isinstance(ctx, ssl.SSLContext) and ctx.verify_mode == ssl.CERT_REQUIRED
    with pytest.raises(ValueError, match="NATS_TLS_CLIENT_CERT_PATH and NATS_TLS_CLIENT_KEY_PATH"):
        tls_context_from_env({"NATS_TLS_CLIENT_CERT_PATH": str(cert)})
    insecure = tls_context_from_env({"NATS_TLS_INSECURE": "true"})
    assert insecure is not None and insecure.verify_mode == ssl.CERT_NONE and not insecure.check_hostname
    assert tls_context_from_env({"NATS_TLS_INSECURE": "0"}) is None
    with pytest.raises(ValueError, match="NATS_TLS_INSECURE='maybe'"):
        tls_context_from_env({"NATS_TLS_INSECURE": "maybe"})


def test_one_auth_method_in_the_runtimes_order(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "dynamo.common.nats_options")
    env = {"NATS_AUTH_USERNAME": "u", "NATS_AUTH_PASSWORD": "p", "NATS_AUTH_TOKEN": "t"}
    assert nats_connect_options_from_env(env) == {"user": "u", "password": "p"}
    assert nats_connect_options_from_env(env) == {"user": "u", "password": "p"}
    assert [r.getMessage() for r in caplog.records] == [
        "NATS authentication: using NATS_AUTH_USERNAME/NATS_AUTH_PASSWORD; "
        "also set and ignored (the runtime's order): NATS_AUTH_TOKEN"
    ]


async def test_insecure_tls_against_a_self_signed_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = self_signed_cert(tmp_path)
    with CustomNatsServer("--tls", "--tlscert", str(cert), "--tlskey", str(key)) as server:
        monkeypatch.setenv("NATS_TLS_INSECURE", "1")  # no CA given: only the runtime's insecure flag connects
        tracker = FpmTracker(NS, nats_url=f"tls://127.0.0.1:{server.port}")
        await tracker.start()
        await tracker.stop()


@pytest.mark.parametrize(
    ("flags", "runtime_env", "alias_env"),
    [
        (
            ("--user", "fpm", "--pass", "s3cret"),
            {"NATS_AUTH_USERNAME": "fpm", "NATS_AUTH_PASSWORD": "s3cret"},
            {"NATS_USER": "fpm", "NATS_PASSWORD": "wrong"},
        ),
        (("--auth", "tok3n"), {"NATS_AUTH_TOKEN": "tok3n"}, {"NATS_TOKEN": "wrong"}),
    ],
    ids=["user-password", "token"],
)
async def test_runtime_names_against_a_real_server(
    flags: tuple[str, ...],
    runtime_env: dict[str, str],
    alias_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Publisher and tracker authenticate with the runtime's names, and win over a wrong alias."""
    caplog.set_level(logging.WARNING, "dynamo.common.nats_options")
    with CustomNatsServer(*flags) as server:
        url = f"nats://127.0.0.1:{server.port}"
        for k, v in alias_env.items():  # our names alone, with a wrong secret: refused
            monkeypatch.setenv(k, v)
        with pytest.raises(ConnectionError, match="cannot reach NATS"):
            await FpmTracker(NS, nats_url=url).start(timeout=2)
        for k, v in runtime_env.items():  # the runtime's names beside them: they win
            monkeypatch.setenv(k, v)
        tracker = FpmTracker(NS, nats_url=url)
        await tracker.start()
        pub = FpmDirectPublisher(namespace=NS, component="backend", worker_id="w", nats_url=url)
        try:
            pub.publish(full_record("names-w"))
            assert await wait_until(lambda: tracker.stats().accepted >= 1, timeout=10)
            assert tracker.workers()[0].key.worker_id == "names-w"
            assert pub.stats().connected
        finally:
            pub.close()
            await tracker.stop()
        conflicts = [r.getMessage() for r in caplog.records if "different values" in r.getMessage()]
        assert len(conflicts) == 1  # one warning per pair and process, however many connections
        await asyncio.sleep(0)
