"""How a redis tier reaches its server: TLS, and what a refusal of the server means.

* :func:`tls_options`: redis-py's ``ssl_*`` arguments of a ``rediss://`` tier
  (the CA that signs the servers' certificates, a client certificate). The
  server's certificate is verified and must name the host the tier connects to
  (redis-py's ``ssl_check_hostname``, on): for a Cluster, the addresses its
  nodes announce.
* :func:`check_tls`: at daemon start, the TLS files are loaded once into a TLS
  context, so a missing, unreadable or mismatched file (or a private key others
  may read) stops the start with one line naming the option (exit code 2)
  instead of failing every connection later.
* :func:`explain`: one line for the fault log that says what the server refused
  and which option fixes it: credentials (``WRONGPASS``, ``NOAUTH``: ``username``,
  ``password_file``), the server's ACL (``NOPERM``: the user's commands and key
  pattern, docs/guides/fleet.md#a-restricted-acl-user), TLS (certificate, CA,
  scheme). Such faults degrade the tier (its jobs fail, counted; lookups answer
  from what it knows), never the daemon.

Pure functions of the settings and an exception; no I/O but :func:`check_tls`'s
reads of its files (at start, before the loop serves).
"""

from __future__ import annotations

import os
import ssl
import stat
from typing import Any

from redis.exceptions import AuthenticationError, NoPermissionError

from kvtierd.tiers.configured import TierCheckError
from kvtierd.tiers.redis.settings import RedisTierSettings

ACL_DOC = "docs/guides/fleet.md#a-restricted-acl-user"
# Every command the tier (and redis-py under it) sends: a user allowed these on the keys
# ``<key_prefix>:*`` and nothing else runs the tier whole, standalone or Cluster (tested
# against real servers' ACLs: tests/integration/tiers/redis/test_redis_tls_acl.py).
# (On Redis 7.2+ redis-py also names each connection, CLIENT SETINFO; refused, it is
# ignored, so it is left out; the docs say to add +client|setinfo to keep ACL LOG quiet.)
ACL_COMMANDS = (
    "set", "getrange", "exists", "del",  # stores, loads, probes, deletes
    "watch", "multi", "exec", "unwatch", "discard",  # deleting a bad value unless replaced
    "ping", "info",  # health (INFO memory, stats; INFO cluster with cluster = "auto")
    "cluster|slots", "cluster|shards", "command", "asking",  # a Cluster's slot map, redirects
    "eval", "zadd", "zcard", "zpopmin", "zremrangebyscore",  # fleet_capacity's index (fleetlru)
)  # fmt: skip


def uses_tls(settings: RedisTierSettings) -> bool:
    return settings.urls[0].startswith("rediss://")


def tls_options(settings: RedisTierSettings) -> dict[str, Any]:
    """redis-py's TLS arguments for ``settings`` ({} for redis://)."""
    if not uses_tls(settings):
        return {}
    options: dict[str, Any] = {"ssl_cert_reqs": "required", "ssl_check_hostname": True}
    if settings.tls_ca_file:
        options["ssl_ca_certs"] = settings.tls_ca_file
    if settings.tls_cert_file:
        options["ssl_certfile"] = settings.tls_cert_file
        options["ssl_keyfile"] = settings.tls_key_file
    return options


def check_tls(settings: RedisTierSettings) -> None:
    """Loads the tier's TLS files as a connection will; TierCheckError naming the
    option of the file at fault (the private key also when others may read it)."""
    if not uses_tls(settings):
        return
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    if settings.tls_ca_file:
        try:
            context.load_verify_locations(cafile=settings.tls_ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise TierCheckError(
                "tls_ca_file", f"cannot load CA certificates {settings.tls_ca_file}: {_why(exc)}"
            ) from None
    if not settings.tls_cert_file:
        return
    _check_private(settings.tls_key_file)
    try:
        context.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
    except FileNotFoundError as exc:
        option = "tls_cert_file" if exc.filename == settings.tls_cert_file else "tls_key_file"
        raise TierCheckError(option, f"cannot read {exc.filename}: {_why(exc)}") from None
    except (OSError, ssl.SSLError) as exc:
        raise TierCheckError(
            "tls_cert_file",
            f"cannot load the client certificate {settings.tls_cert_file} with its key "
            f"{settings.tls_key_file}: {_why(exc)} (both PEM, and the key the certificate's)",
        ) from None


def _check_private(path: str) -> None:
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise TierCheckError("tls_key_file", f"cannot read {path}: {_why(exc)}") from None
    if mode & (stat.S_IRGRP | stat.S_IROTH | stat.S_IWGRP | stat.S_IWOTH):
        raise TierCheckError(
            "tls_key_file", f"private key {path} is open to others: chmod 600 {path}"
        )


def _why(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        return exc.reason or str(exc)
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return str(exc)


def explain(error: BaseException, settings: RedisTierSettings) -> str:
    """One line on a Redis fault: what the server refused and what to change, or
    the error as it is (type and message) when it is no refusal."""
    text = " ".join(str(error).split())
    user = settings.username or "default"
    for cause in _chain(error):
        if isinstance(cause, AuthenticationError) or _says(cause, "WRONGPASS", "NOAUTH"):
            return (
                f"the server refused the credentials of user {user!r}: {text} (check "
                "username and password_file)"
            )
        if isinstance(cause, NoPermissionError) or _says(cause, "NOPERM"):
            return (
                f"the server's ACL refused user {user!r}: {text} (the user needs the tier's "
                f"commands and the key pattern {settings.key_prefix}:*, see {ACL_DOC})"
            )
        if isinstance(cause, ssl.SSLError) or _says(cause, "SSL", "_ssl.c", "certificate"):
            return (
                f"TLS with the server failed: {text} (check tls_ca_file: the CA that signed "
                "the server's certificate, which must name the URL's host; tls_cert_file and "
                "tls_key_file if the server asks for a client certificate)"
            )
    if not uses_tls(settings) and _says(error, "Connection closed by server", "reset by peer"):
        return f"{type(error).__name__}: {text} (a TLS port? then use rediss:// URLs)"
    return f"{type(error).__name__}: {text}"


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and its causes (``raise ... from``), the first 8."""
    chain: list[BaseException] = []
    cause: BaseException | None = error
    while cause is not None and len(chain) < 8:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    return chain


def _says(error: BaseException, *words: str) -> bool:
    text = str(error)
    return any(word in text for word in words)
