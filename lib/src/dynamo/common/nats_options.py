"""NATS server URL and connection options (auth, TLS) from environment variables.

Every FPM component (publisher, tracker, planner, watch CLI) connects the same way, so the
variables are read in one place. The Dynamo runtime's names are read first; the names this
project used before stay as aliases:

==============================  ======================  =====================================================
runtime name (wins)             alias                   meaning
==============================  ======================  =====================================================
``NATS_SERVER``                 -                       server URL(s), comma separated; ``user:pass@`` allowed
``NATS_AUTH_USERNAME``          ``NATS_USER``           user name (with the password)
``NATS_AUTH_PASSWORD``          ``NATS_PASSWORD``       password
``NATS_AUTH_TOKEN``             ``NATS_TOKEN``          authentication token
``NATS_AUTH_NKEY``              -                       NKey seed (``SU...``); needs the ``nkeys`` package
``NATS_AUTH_CREDENTIALS_FILE``  ``NATS_CREDS``          path of a ``.creds`` file (JWT + NKey seed)
``NATS_TLS_CA_CERT_PATH``       ``NATS_TLS_CA``         CA bundle to verify the server (turns TLS on)
``NATS_TLS_CLIENT_CERT_PATH``   ``NATS_TLS_CERT``       client certificate (mutual TLS; with the key)
``NATS_TLS_CLIENT_KEY_PATH``    ``NATS_TLS_KEY``        client private key
``NATS_TLS_INSECURE``           -                       ``1``/``true``/``yes``/``on``: no server check
==============================  ======================  =====================================================

Precedence, one rule: **when a runtime name and its alias are both set, the runtime's value is
used**; if the two values differ, one warning per variable pair and process says so. An empty value
counts as unset. Like the runtime, one authentication method is used, the first set in this order:
user/password, token, NKey, credentials file (one warning names the methods ignored).

A ``tls://`` URL also turns TLS on with the system's CA store. Credentials in the URL
(``nats://user:pass@host:4222``) are honoured by nats-py itself.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_NATS_URL = "nats://localhost:4222"

# (runtime name, our alias or None), in the order the table above lists them.
USERNAME = ("NATS_AUTH_USERNAME", "NATS_USER")
PASSWORD = ("NATS_AUTH_PASSWORD", "NATS_PASSWORD")
TOKEN = ("NATS_AUTH_TOKEN", "NATS_TOKEN")
NKEY = ("NATS_AUTH_NKEY", None)
CREDENTIALS = ("NATS_AUTH_CREDENTIALS_FILE", "NATS_CREDS")
TLS_CA = ("NATS_TLS_CA_CERT_PATH", "NATS_TLS_CA")
TLS_CERT = ("NATS_TLS_CLIENT_CERT_PATH", "NATS_TLS_CERT")
TLS_KEY = ("NATS_TLS_CLIENT_KEY_PATH", "NATS_TLS_KEY")
TLS_INSECURE = ("NATS_TLS_INSECURE", None)
NAMES: tuple[tuple[str, str | None], ...] = (
    USERNAME,
    PASSWORD,
    TOKEN,
    NKEY,
    CREDENTIALS,
    TLS_CA,
    TLS_CERT,
    TLS_KEY,
    TLS_INSECURE,
)
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")

_warned: set[str] = set()  # one warning per conflicting pair (or ignored auth set) per process


def _warn_once(key: str, message: str, *args: object) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message, *args)


def read_var(env: Mapping[str, str], names: tuple[str, str | None]) -> tuple[str, str]:
    """``(value, name it came from)`` for one setting; the runtime's name wins (see the module doc)."""
    primary, alias = names
    value = env.get(primary, "").strip()
    other = env.get(alias, "").strip() if alias else ""
    if value:
        if other and other != value:
            # Never log the values: they may be secrets.
            _warn_once(
                primary,
                "both %s and %s are set, to different values: using %s (the Dynamo runtime's name)",
                primary,
                alias,
                primary,
            )
        return value, primary
    if other:
        return other, str(alias)
    return "", primary


def nats_url_from_env(env: Mapping[str, str] | None = None) -> str:
    """``NATS_SERVER`` or the local default."""
    env = os.environ if env is None else env
    return env.get("NATS_SERVER", "").strip() or DEFAULT_NATS_URL


def nats_servers(url: str) -> list[str]:
    """Split a comma-separated server list (nats-py takes a list)."""
    return [u.strip() for u in url.split(",") if u.strip()]


def _insecure(env: Mapping[str, str]) -> bool:
    raw, name = read_var(env, TLS_INSECURE)
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: expected one of 1/true/yes/on or 0/false/no/off")


def tls_context_from_env(env: Mapping[str, str] | None = None) -> ssl.SSLContext | None:
    """An SSL context when any TLS variable is set, else ``None``."""
    env = os.environ if env is None else env
    (ca, _), (cert, cert_name), (key, key_name) = (read_var(env, n) for n in (TLS_CA, TLS_CERT, TLS_KEY))
    insecure = _insecure(env)
    if not (ca or cert or key or insecure):
        return None
    if bool(cert) != bool(key):
        raise ValueError(f"{cert_name} and {key_name} must be set together")
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca or None)
    if insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if cert:
        ctx.load_cert_chain(certfile=cert, keyfile=key)
    return ctx


def _auth_options(env: Mapping[str, str]) -> dict[str, Any]:
    (user, user_name), (password, password_name) = read_var(env, USERNAME), read_var(env, PASSWORD)
    if password and not user:
        raise ValueError(f"{password_name} is set without {USERNAME[0]} (or {USERNAME[1]})")
    token, token_name = read_var(env, TOKEN)
    nkey, nkey_name = read_var(env, NKEY)
    creds, creds_name = read_var(env, CREDENTIALS)
    methods: list[tuple[str, dict[str, Any]]] = []
    if user:
        methods.append((f"{user_name}/{password_name}", {"user": user, "password": password}))
    if token:
        methods.append((token_name, {"token": token}))
    if nkey:
        methods.append((nkey_name, {"nkeys_seed_str": nkey}))
    if creds:
        if not os.path.isfile(creds):
            raise ValueError(f"{creds_name}={creds!r} is not a readable file")
        methods.append((creds_name, {"user_credentials": creds}))
    if not methods:
        return {}
    if len(methods) > 1:
        _warn_once(
            "auth:" + ",".join(m for m, _ in methods),
            "NATS authentication: using %s; also set and ignored (the runtime's order): %s",
            methods[0][0],
            ", ".join(m for m, _ in methods[1:]),
        )
    chosen = methods[0][1]
    if "nkeys_seed_str" in chosen:
        try:
            import nkeys  # noqa: F401  (nats-py signs the server's nonce with it)
        except ImportError as exc:
            raise ValueError(f"{nkey_name} needs the 'nkeys' package (pip install nkeys)") from exc
    return dict(chosen)


def nats_connect_options_from_env(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Keyword arguments for ``nats.connect`` (auth and TLS only; the caller adds the URL).

    Raises ``ValueError`` naming the variable on an unusable setting.
    """
    env = os.environ if env is None else env
    opts = _auth_options(env)
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
