"""Where kvtierd listens, and how a kvtierd address becomes a gRPC target.

Shared by the client and the daemon (the daemon takes its default socket path
from here), so this module depends on the standard library only.

Accepted address forms (``to_grpc_target``):

* ``unix:///abs/path`` and ``unix:/abs/path`` — a Unix domain socket;
* ``/abs/path`` — the same, without the scheme;
* ``host:port`` and ``[v6addr]:port`` — TCP;
* ``tls://host:port`` and ``tls://[v6addr]:port`` — TCP with TLS (``uses_tls``;
  the client's ``tls`` argument gives the CAs and a client certificate).
"""

from __future__ import annotations

import os
import re

ADDRESS_ENV = "KVTIERD_ADDRESS"
SOCKET_NAME = "kvtierd.sock"

ACCEPTED_FORMS = (
    "'unix:///abs/path', 'unix:/abs/path', '/abs/path', 'host:port', '[v6addr]:port' "
    "or 'tls://host:port'"
)
TLS_SCHEME = "tls://"

_HOST = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_V6 = r"\[[0-9A-Fa-f:.]+(?:%[A-Za-z0-9._-]+)?\]"
_HOST_PORT = re.compile(rf"^(?:{_HOST}|{_V6}):(?P<port>[0-9]{{1,5}})$")


def default_runtime_dir() -> str:
    """The directory holding the daemon's socket when none is configured.

    ``/run/kvtierd`` for root; else ``$XDG_RUNTIME_DIR/kvtierd`` when that
    variable is set; else ``/tmp/kvtierd-<uid>``.
    """
    uid = os.geteuid()
    if uid == 0:
        return "/run/kvtierd"
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    if xdg:
        return os.path.join(xdg, "kvtierd")
    return f"/tmp/kvtierd-{uid}"


def default_socket_path() -> str:
    """The daemon's default Unix socket: ``default_runtime_dir() + "/kvtierd.sock"``."""
    return os.path.join(default_runtime_dir(), SOCKET_NAME)


def default_address() -> str:
    """The address a client uses when given none.

    ``$KVTIERD_ADDRESS`` when set, else ``"unix://" + default_socket_path()``.
    """
    return os.environ.get(ADDRESS_ENV) or "unix://" + default_socket_path()


def to_grpc_target(address: str) -> str:
    """The gRPC channel target for a kvtierd ``address``.

    Unix sockets become ``unix:/abs/path``; TCP addresses are returned as given,
    without a ``tls://`` scheme. Raises ``ValueError`` naming the accepted forms
    for anything else.
    """
    if not isinstance(address, str):
        raise ValueError(_invalid(address, "not a string"))
    text = address.strip()
    if text.startswith(TLS_SCHEME):
        text = text[len(TLS_SCHEME) :]
        if not _HOST_PORT.match(text):
            raise ValueError(_invalid(address, "tls:// must be followed by host:port"))
    if text.startswith("/"):
        return "unix:" + _unix_path("unix:" + text, address)
    if text.startswith("unix:"):
        return "unix:" + _unix_path(text, address)
    if _HOST_PORT.match(text) and 0 < int(text.rsplit(":", 1)[1]) < 65536:
        return text
    raise ValueError(_invalid(address, "not a unix socket path or a host:port"))


def _unix_path(text: str, address: str) -> str:
    """The absolute socket path of a ``unix:`` address."""
    rest = text[len("unix:") :]
    if rest.startswith("//"):
        rest = rest[2:]  # unix://<authority>/path: only an empty authority is allowed
        if not rest.startswith("/"):
            raise ValueError(_invalid(address, "unix:// must be followed by an absolute path"))
    if not rest.startswith("/") or rest == "/":
        raise ValueError(_invalid(address, "the socket path must be absolute"))
    return rest


def _invalid(address: object, why: str) -> str:
    return f"invalid kvtierd address {address!r}: {why}; expected {ACCEPTED_FORMS}"


def uses_tls(address: str) -> bool:
    """Whether ``address`` asks for TLS by its form (``tls://host:port``)."""
    return isinstance(address, str) and address.strip().startswith(TLS_SCHEME)
