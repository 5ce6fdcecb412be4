"""Who is calling: a Unix-socket peer's kernel credentials, the names of a TLS
client certificate, and the ``Caller`` every handled RPC runs on behalf of.

``PeerCredentials`` are read from a connected Unix socket with SO_PEERCRED
(pid, uid, gid at the peer's ``connect()``) and SO_PEERGROUPS (its
supplementary groups then; Linux >= 4.13). Both come from the kernel: a peer
cannot choose them.

Certificate names: only verified certificates carry a name here. The daemon
asks TCP clients for a certificate only when ``security.tls_client_ca_file`` is
set, and then gRPC refuses the handshake unless the certificate was signed by
one of those CAs (``tls.ServerTls``). Without mTLS, on plain TCP and on the
Unix socket, the auth context holds no certificate and ``tls_peer_names``
answers "none". The names of a certificate are its subject's common name (CN)
first, then its DNS subject alternative names in their order; any of them may
name a principal (``authorizer.Authorizer.for_certificate``). A connection's
names are fixed at its handshake: a reload of the CA or a principal's
certificate changes nothing for connections already made.
"""

from __future__ import annotations

import errno
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtierd.security.principals import UNRESTRICTED, Principal

_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux; Python may not name it
_UCRED = struct.Struct("iII")  # pid_t pid; uid_t uid; gid_t gid
_GID = struct.Struct("I")
_GROUPS_FIRST_TRY = 256  # gids read in one call; NGROUPS_MAX (65536) when it is not enough

TRANSPORT_TLS = b"ssl"  # gRPC's transport_security_type of a TLS connection
# gRPC's auth-context properties of a verified peer certificate
_CN_PROPERTY = "x509_common_name"
_DNS_PROPERTY = "peer_dns"  # the certificate's DNS SANs


@dataclass(frozen=True, slots=True)
class PeerCredentials:
    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...]  # supplementary groups; () where the kernel does not say

    def describe(self) -> str:
        return f"unix uid={self.uid} gid={self.gid} pid={self.pid}"

    def all_groups(self) -> tuple[int, ...]:
        return (self.gid, *(g for g in self.groups if g != self.gid))


def peer_credentials(connection: socket.socket) -> PeerCredentials:
    """The kernel's credentials of the process at the other end of ``connection``."""
    raw = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return PeerCredentials(pid=pid, uid=uid, gid=gid, groups=_peer_groups(connection))


def peer_uid(connection: socket.socket) -> int:
    """The uid of the process at the other end of ``connection`` (SO_PEERCRED
    alone: one system call, no group list)."""
    raw = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return int(_UCRED.unpack(raw)[1])


def _peer_groups(connection: socket.socket) -> tuple[int, ...]:
    for count in (_GROUPS_FIRST_TRY, 65536):
        try:
            raw = connection.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, count * _GID.size)
        except OSError as exc:
            if exc.errno == errno.ERANGE:
                continue
            if exc.errno in (errno.ENOPROTOOPT, errno.EINVAL):
                return ()
            raise
        return tuple(g for (g,) in _GID.iter_unpack(raw[: len(raw) - len(raw) % _GID.size]))
    return ()


def certificate_names(auth: Mapping[str, Any]) -> tuple[str, ...]:
    """The names of the peer certificate in the auth context ``auth``: its CN
    first, then its DNS SANs (duplicates once, empty names dropped); () without
    a certificate. Does not look at the transport: see ``tls_peer_names``."""
    names: dict[str, None] = {}
    for raw in (*(auth.get(_CN_PROPERTY) or ()), *(auth.get(_DNS_PROPERTY) or ())):
        name = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        if name:
            names[name] = None
    return tuple(names)


def tls_peer_names(context: Any) -> tuple[str, ...]:
    """Every name of the caller's verified client certificate (CN first, then
    DNS SANs; duplicates once), or () without one (or not over TLS).
    ``context``: a ``grpc.aio.ServicerContext`` (anything with ``auth_context()``)."""
    auth = context.auth_context()
    if auth.get("transport_security_type") != [TRANSPORT_TLS]:
        return ()
    return certificate_names(auth)


def tls_peer_name(context: Any) -> str | None:
    """The caller's certificate name: its CN, else its first DNS SAN; None when
    the caller presented no verified certificate (or one naming nothing)."""
    names = tls_peer_names(context)
    return names[0] if names else None


@dataclass(frozen=True, slots=True)
class Caller:
    """The principal a call runs as, and how it was recognized.

    ``peer`` describes the other end for log lines and messages (``unix uid=1001
    gid=1001 pid=42``, ``ipv4:10.0.0.7:51234``); ``via`` says what proved the
    identity: ``"socket permissions"``, ``"peer ticket"``, ``"token"`` or
    ``"certificate"``.
    """

    principal: Principal
    peer: str
    via: str

    @property
    def name(self) -> str:
        return self.principal.name


# A Unix-socket caller when no principals are configured: the socket's file
# permissions decided who may connect, and every pool is reachable (as before).
LOCAL_CALLER = Caller(UNRESTRICTED, "unix", "socket permissions")
