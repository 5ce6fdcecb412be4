"""The name a TLS client certificate gives its caller.

Only verified certificates carry a name here: the daemon asks TCP clients for
a certificate only when ``security.tls_client_ca_file`` is set, and then gRPC
refuses the handshake unless the certificate was signed by one of those CAs
(``tls.ServerTls``). Without mTLS, on plain TCP and on the Unix socket, the
auth context holds no certificate and every function here answers "none".

The names of a certificate are its subject's common name (CN) first, then its
DNS subject alternative names in their order; any of them may name a
principal. A connection's names are fixed at its handshake: a reload of the
CA or a principal's certificate changes nothing for connections already made.
"""

from __future__ import annotations

from typing import Any

TRANSPORT_TLS = b"ssl"  # gRPC's transport_security_type of a TLS connection


def tls_peer_names(context: Any) -> tuple[str, ...]:
    """Every name of the caller's verified client certificate (CN first, then
    DNS SANs; duplicates once), or () without one. ``context``: a
    ``grpc.aio.ServicerContext`` (anything with ``auth_context()``)."""
    auth = context.auth_context()
    if auth.get("transport_security_type") != [TRANSPORT_TLS]:
        return ()
    names: dict[str, None] = {}
    for raw in (*auth.get("x509_common_name", ()), *auth.get("peer_dns", ())):
        name = raw.decode("utf-8", "replace")
        if name:
            names[name] = None
    return tuple(names)


def tls_peer_name(context: Any) -> str | None:
    """The caller's certificate name: its CN, else its first DNS SAN; None when
    the caller presented no verified certificate (or one naming nothing)."""
    names = tls_peer_names(context)
    return names[0] if names else None
