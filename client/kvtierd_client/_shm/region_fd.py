"""Asking the daemon for a region's file descriptor (``SCM_RIGHTS``), the way to
map a pool's bytes that does not depend on reaching the region file by path.

The daemon (``kvtierd.security.region_access``) announces its descriptor socket
in OpenSession's ``Region.fd_socket`` and answers one request per connection:
``MAP <session id>`` -> ``OK`` plus one descriptor, or ``ERR <reason>``. It
checks the caller's uid/gid (``SO_PEERCRED``) against the session's pool.
Standard library only.
"""

from __future__ import annotations

import array
import os
import socket
import struct
import time

REQUEST_TIMEOUT_S = 5.0
_FD_SIZE = array.array("i").itemsize


class RegionAccessDenied(PermissionError):
    """The daemon refused this process the region's descriptor (the reason says why)."""


class RegionSocketImpostor(PermissionError):
    """The process answering on the descriptor socket is not the daemon."""


_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _check_server(sock: socket.socket, socket_path: str, server_uid: int) -> None:
    _pid, uid, _gid = _PEERCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    )
    if uid != server_uid:
        raise RegionSocketImpostor(
            f"{socket_path} is served by uid {uid}, not by the daemon's uid {server_uid}: "
            "not sending it the session id"
        )


def request_region_fd(
    socket_path: str,
    session_id: str,
    timeout: float = REQUEST_TIMEOUT_S,
    *,
    server_uid: int | None = None,
) -> int:
    """A new descriptor (O_RDWR, close-on-exec) of ``session_id``'s region; the
    caller owns it. Raises RegionAccessDenied when refused, OSError otherwise.

    ``server_uid``: the uid the answering process must run as (the daemon's:
    ``SO_PEERCRED`` of this connection, which nobody can forge); a process of
    another uid serving a socket planted at ``socket_path`` is refused with
    ``RegionSocketImpostor`` before it learns the session id."""
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout)
        while True:
            try:
                sock.connect(socket_path)
                break
            except BlockingIOError:  # the listen backlog is full for now (a burst)
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.005)
        if server_uid is not None:
            _check_server(sock, socket_path, server_uid)
        sock.sendall(f"MAP {session_id}\n".encode("ascii"))
        message, ancillary, _flags, _addr = sock.recvmsg(
            256, socket.CMSG_SPACE(_FD_SIZE), socket.MSG_CMSG_CLOEXEC
        )
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % _FD_SIZE])
    if message.startswith(b"OK") and len(fds) == 1:
        return fds[0]
    for fd in fds:  # never leak a descriptor we will not use
        os.close(fd)
    reason = message.decode("utf-8", "replace").strip().removeprefix("ERR ").strip()
    raise RegionAccessDenied(
        f"kvtierd refused the region of session {session_id[:64]!r} over {socket_path}: "
        f"{reason or 'no answer'}"
    )
