"""NATS server URL and connection options (auth, TLS) from environment variables.

Every FPM component connects the same way, so the variables are read in one place:

====================  ==========================================================  ===================
variable              meaning                                                     default
====================  ==========================================================  ===================
``NATS_SERVER``       server URL(s), comma separated; ``user:pass@`` allowed      nats://localhost:4222
``NATS_USER``         user name (with ``NATS_PASSWORD``)                          unset
``NATS_PASSWORD``     password                                                    unset
``NATS_TOKEN``        authentication token                                        unset
``NATS_CREDS``        path of a ``.creds`` file (JWT + NKey seed)                 unset
``NATS_TLS_CA``       CA bundle to verify the server (turns TLS on)               unset
``NATS_TLS_CERT``     client certificate (mutual TLS; with ``NATS_TLS_KEY``)      unset
``NATS_TLS_KEY``      client private key                                          unset
====================  ==========================================================  ===================

A ``tls://`` URL also turns TLS on with the system's CA store. Credentials in the URL
(``nats://user:pass@host:4222``) are honoured by nats-py itself.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from typing import Any

DEFAULT_NATS_URL = "nats://localhost:4222"


def nats_url_from_env(env: Mapping[str, str] | None = None) -> str:
    """``NATS_SERVER`` or the local default."""
    env = os.environ if env is None else env
    return env.get("NATS_SERVER", "").strip() or DEFAULT_NATS_URL


def nats_servers(url: str) -> list[str]:
    """Split a comma-separated server list (nats-py takes a list)."""
    return [u.strip() for u in url.split(",") if u.strip()]


def tls_context_from_env(env: Mapping[str, str] | None = None) -> ssl.SSLContext | None:
    """An SSL context when any ``NATS_TLS_*`` variable is set, else ``None``."""
    env = os.environ if env is None else env
    ca, cert, key = (env.get(f"NATS_TLS_{k}", "").strip() for k in ("CA", "CERT", "KEY"))
    if not (ca or cert or key):
        return None
    if bool(cert) != bool(key):
        raise ValueError("NATS_TLS_CERT and NATS_TLS_KEY must be set together")
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca or None)
    if cert:
        ctx.load_cert_chain(certfile=cert, keyfile=key)
    return ctx


def nats_connect_options_from_env(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Keyword arguments for ``nats.connect`` (auth and TLS only; the caller adds the URL)."""
    env = os.environ if env is None else env
    opts: dict[str, Any] = {}
    user, password = env.get("NATS_USER", ""), env.get("NATS_PASSWORD", "")
    if user:
        opts["user"] = user
        opts["password"] = password
    elif password:
        raise ValueError("NATS_PASSWORD is set without NATS_USER")
    token = env.get("NATS_TOKEN", "")
    if token:
        opts["token"] = token
    creds = env.get("NATS_CREDS", "").strip()
    if creds:
        if not os.path.isfile(creds):
            raise ValueError(f"NATS_CREDS={creds!r} is not a readable file")
        opts["user_credentials"] = creds
    tls = tls_context_from_env(env)
    if tls is not None:
        opts["tls"] = tls
    return opts


def redact_url(url: str) -> str:
    """The URL list for messages and logs, with any ``user:password@`` replaced by ``***@``."""
    out = []
    for u in nats_servers(url):
        scheme, sep, rest = u.rpartition("://")
        if "@" in rest:
            rest = "***@" + rest.rsplit("@", 1)[1]
        out.append(f"{scheme}{sep}{rest}")
    return ",".join(out)
