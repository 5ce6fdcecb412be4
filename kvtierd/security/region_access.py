"""Region file descriptors handed to authorized peers only (issue #18, item 2).

A pool's bytes are reachable two ways: by the region file's path (for the
daemon's own uid, and today for its socket group: the file is 0660) and by a
file descriptor this module passes over a Unix socket with ``SCM_RIGHTS``.
The descriptor way is the one authorization can narrow to one pool: the
daemon learns the peer's uid/gid from the kernel (``SO_PEERCRED``, not
forgeable), the session id proves which pool the peer opened, and
:func:`may_map` decides.

Protocol (one request per connection, stdlib-only on the client side):

    client -> daemon   b"MAP <session id hex>\\n"
    daemon -> client   b"OK\\n" with one descriptor in SCM_RIGHTS   (mapped O_RDWR)
                     | b"ERR <reason>\\n"                            (then closes)

Invariants:

* The descriptor sent is a *new* open file description of the region
  (``/proc/self/fd``), never the daemon's own: that one holds the region's
  liveness flock, which must not live on in a client's mapping.
* A session is looked up on the event loop (the session table is loop-only);
  this thread only accepts, reads at most :data:`MAX_REQUEST_BYTES` with a
  deadline and answers.
* The socket file is created 0660 with the listen socket's group, next to the
  first Unix listen socket; it is removed at :meth:`RegionFdServer.close`.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
import pwd
import socket
import stat
import struct
import threading
from collections.abc import Callable
from typing import Any

from kvtierd import filekind
from kvtierd.config import ConfigError
from kvtierd.errors import SessionNotFound

log = logging.getLogger("kvtierd.security.region_access")

MAX_REQUEST_BYTES = 128  # "MAP " + 32 hex + "\n", with room to spare
REQUEST_TIMEOUT_S = 2.0  # a peer that says nothing within this is dropped
SOCKET_SUFFIX = ".regions"  # <listen socket path> + this
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid

# (session id) -> (pool name, region fd) of a live session, or None: runs on the loop
SessionLookup = Callable[[str], "tuple[str, int] | None"]


def may_map(peer_uid: int, peer_gid: int, pool_name: str, socket_gid: int | None = None) -> bool:
    """Whether a Unix peer may map ``pool_name``'s region. Default policy: the
    daemon's own uid, root, or a member of the socket's group (primary or
    supplementary), the same peers the socket permissions let call at all.
    The principals of issue #18 item 1 replace this function."""
    if peer_uid in (os.geteuid(), 0):
        return True
    group = os.getegid() if socket_gid is None else socket_gid
    if peer_gid == group:
        return True
    try:
        name = pwd.getpwuid(peer_uid).pw_name
        return group in os.getgrouplist(name, peer_gid)
    except KeyError:
        return False


def session_lookup(sessions: Any) -> SessionLookup:
    """A :data:`SessionLookup` over the daemon's ``SessionTable`` (on the loop)."""

    def lookup(session_id: str) -> tuple[str, int] | None:
        try:
            session = sessions.get(session_id)  # a request is proof of life: renews
        except SessionNotFound:
            return None
        if session.pool.region.closed:
            return None
        return session.pool.spec.name, session.pool.region.fileno()

    return lookup


def serve_next_to(
    unix_sockets: list[str], sessions: Any, socket_gid: int | None
) -> RegionFdServer | None:
    """Starts a :class:`RegionFdServer` next to the first Unix listen socket (on
    the running loop); None when the daemon listens on TCP only (no peer
    credentials there: regions are then reached by path only)."""
    if not unix_sockets:
        return None
    server = RegionFdServer(
        socket_path_for(unix_sockets[0]),
        session_lookup(sessions),
        asyncio.get_running_loop(),
        socket_gid,
    )
    server.start()
    log.info("region descriptors served on %s", server.path)
    return server


def socket_path_for(listen_path: str) -> str:
    """The region-descriptor socket next to the Unix listen socket ``listen_path``."""
    return listen_path + SOCKET_SUFFIX


class RegionFdServer:
    """Answers region-descriptor requests on one Unix socket, on its own thread.

    Lifecycle: :meth:`start` (binds; event loop) -> requests -> :meth:`close`
    (stops accepting, removes the socket file). ``lookup`` runs on ``loop``.
    """

    def __init__(
        self,
        path: str,
        lookup: SessionLookup,
        loop: asyncio.AbstractEventLoop,
        socket_gid: int | None,
    ) -> None:
        self.path = path
        self._lookup = lookup
        self._loop = loop
        self._gid = socket_gid
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def start(self) -> None:
        """Binds and starts answering. Raises ConfigError (exit 2) when something
        other than a socket sits at the path (never followed, left untouched)."""
        _clear_stale_socket(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.bind(self.path)
        os.chmod(self.path, 0o660)
        if self._gid is not None:
            os.chown(self.path, -1, self._gid)
        sock.listen(64)
        # blocking accept, no polling: close() wakes it with shutdown(SHUT_RDWR)
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name="kvtierd-region-fds", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stops accepting (a request being answered may finish within
        :data:`REQUEST_TIMEOUT_S`) and removes the socket file. Idempotent."""
        self._stopping.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        if self._thread is not None:
            self._thread.join(timeout=REQUEST_TIMEOUT_S)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def _serve(self) -> None:
        assert self._sock is not None
        while not self._stopping.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._stopping.is_set():
                    return
                raise
            with conn:
                try:
                    self._answer(conn)
                except Exception as exc:  # one peer's trouble never stops the server
                    log.warning("region descriptor request failed: %s", exc)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(REQUEST_TIMEOUT_S)
        pid, uid, gid = _PEERCRED.unpack(
            conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        )
        request = _read_line(conn)
        if not request.startswith(b"MAP "):
            conn.sendall(b"ERR expected 'MAP <session id>'\n")
            return
        session_id = request[4:].decode("ascii", "replace").strip()
        future = asyncio.run_coroutine_threadsafe(_call(self._lookup, session_id), self._loop)
        found = future.result(timeout=REQUEST_TIMEOUT_S)
        if found is None:
            conn.sendall(b"ERR unknown, closed or expired session\n")
            return
        pool_name, region_fd = found
        if not may_map(uid, gid, pool_name, self._gid):
            log.warning("region of pool %r refused to pid %d uid %d gid %d: not allowed",
                        pool_name, pid, uid, gid)  # fmt: skip
            conn.sendall(
                f"ERR permission denied: uid {uid} gid {gid} may not map pool {pool_name!r}\n"
                .encode()
            )  # fmt: skip
            return
        fresh = os.open(f"/proc/self/fd/{region_fd}", os.O_RDWR | os.O_CLOEXEC)
        try:
            conn.sendmsg(
                [b"OK\n"],
                [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fresh]).tobytes())],
            )
        finally:
            os.close(fresh)


async def _call(lookup: SessionLookup, session_id: str) -> tuple[str, int] | None:
    return lookup(session_id)


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while b"\n" not in data and len(data) < MAX_REQUEST_BYTES:
        chunk = conn.recv(MAX_REQUEST_BYTES - len(data))
        if not chunk:
            break
        data += chunk
    return data.split(b"\n", 1)[0]


def _clear_stale_socket(path: str) -> None:
    """Removes a socket file at ``path`` (a crashed daemon's: the listen socket
    next to it was just bound by this daemon); refuses anything else."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(
            "server.listen",
            f"{path} (where the region descriptor socket of the first unix listen socket "
            f"goes) is {filekind.describe(path, st.st_mode)}, not a socket; remove it",
        )
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
