"""Who is calling: a Unix-socket peer's kernel credentials, and the ``Caller``
every handled RPC runs on behalf of.

``PeerCredentials`` are read from a connected Unix socket with SO_PEERCRED
(pid, uid, gid at the peer's ``connect()``) and SO_PEERGROUPS (its
supplementary groups then; Linux >= 4.13). Both come from the kernel: a peer
cannot choose them.
"""

from __future__ import annotations

import errno
import socket
import struct
from dataclasses import dataclass

from kvtierd.security.principals import UNRESTRICTED, Principal

_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux; Python may not name it
_UCRED = struct.Struct("iII")  # pid_t pid; uid_t uid; gid_t gid
_GID = struct.Struct("I")
_GROUPS_FIRST_TRY = 256  # gids read in one call; NGROUPS_MAX (65536) when it is not enough


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
