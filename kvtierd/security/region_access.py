"""Region file descriptors handed to authorized peers only (issue #18, item 2).

A pool's bytes are reachable two ways: by the region file's path (for the
daemon's own uid, and today for its socket group: the file is 0660) and by a
file descriptor this module passes over a Unix socket with ``SCM_RIGHTS``.
The descriptor way is the one authorization can narrow to one pool: the
daemon learns the peer's uid/gid/groups from the kernel (``SO_PEERCRED``,
``SO_PEERGROUPS``: not forgeable), the session id proves which pool the peer
opened, and the map policy decides (:func:`map_policy`):

* no ``[[security.principals]]``: :func:`may_map` (the daemon's uid, root, or a
  member of the socket's group: whom the socket permissions let call at all);
* principals configured: the peer's principal must be the session's and may
  reach the pool, the same rule as every RPC on that session. Region files are
  then created 0600 (``kvtierd.ops.daemon``), so no other uid reaches them by path.

Protocol (one request per connection, stdlib-only on the client side):

    client -> daemon   b"MAP <session id hex>\\n"
    daemon -> client   b"OK\\n" with one descriptor in SCM_RIGHTS   (mapped O_RDWR)
                     | b"ERR <reason>\\n"                            (then closes)

Invariants:

* The descriptor sent is a *new* open file description of the region
  (``/proc/self/fd``), never the daemon's own: that one holds the region's
  liveness flock, which must not live on in a client's mapping.
* A session is looked up on the daemon's event loop (the session table is
  loop-only). The server's own thread runs its own event loop: it accepts,
  reads at most :data:`MAX_REQUEST_BYTES` per connection within
  :data:`REQUEST_TIMEOUT_S`, and answers, all connections concurrently, at
  most :data:`MAX_CONNECTIONS` open at once (a peer that connects and stays
  silent delays nobody; the oldest silent one of the uid with the most silent
  ones makes room for a new one: a flood drops its own connections).
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
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvtierd.errors import ConfigError, SessionNotFound
from kvtierd.security.access import AccessDenied
from kvtierd.security.identity import PeerCredentials, peer_credentials, peer_uid
from kvtierd.security.state import SecurityState
from kvtierd.util import filekind
from kvtierd.util.ratelimit import RateLimitedLog
from kvtierd.util.sockets import BoundSocket, SocketPlacement, unlink_if_own

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 128  # "MAP " + 32 hex + "\n", with room to spare
REQUEST_TIMEOUT_S = 2.0  # a peer that says nothing within this is dropped
MAX_CONNECTIONS = 64  # open at once; past that the oldest silent one is dropped
ACCEPT_BATCH = 64  # connections accepted per wake-up before the others run
SOCKET_SUFFIX = ".regions"  # <listen socket path> + this

# (session id) -> (pool name, region fd, owning principal) of a live session, or
# None: runs on the loop
SessionLookup = Callable[[str], "tuple[str, int, str] | None"]
# (peer, pool name, session's principal) -> None when the peer may map the pool's
# region, else the reason it may not; runs on the server's thread
MapPolicy = Callable[[PeerCredentials, str, str], "str | None"]


def may_map(
    peer_uid: int,
    peer_gid: int,
    pool_name: str,
    socket_gid: int | None = None,
    peer_groups: Sequence[int] = (),
) -> bool:
    """Whether a Unix peer may map ``pool_name``'s region. Default policy: the
    daemon's own uid, root, or a member of the socket's group (primary or
    supplementary), the same peers the socket permissions let call at all.
    With principals configured :func:`map_policy` uses them instead.

    ``peer_groups`` are the peer's supplementary groups as the kernel reports them
    (``SO_PEERGROUPS``): they decide. The group database is asked only where the
    kernel said nothing (``()``): in containers the peer's uid is usually unknown
    to the daemon's /etc/passwd (an engine container's user, given the group with
    ``--group-add`` or a pod's ``fsGroup`` / ``supplementalGroups``)."""
    if peer_uid in (os.geteuid(), 0):
        return True
    group = os.getegid() if socket_gid is None else socket_gid
    if peer_gid == group or group in peer_groups:
        return True
    if peer_groups:
        return False
    try:
        name = pwd.getpwuid(peer_uid).pw_name
        return group in os.getgrouplist(name, peer_gid)
    except KeyError:
        return False


def session_lookup(sessions: Any) -> SessionLookup:
    """A :data:`SessionLookup` over the daemon's ``SessionTable`` (on the loop)."""

    def lookup(session_id: str) -> tuple[str, int, str] | None:
        try:
            session = sessions.get(session_id)  # renews nothing: a map is no keepalive
        except SessionNotFound:
            return None
        if session.pool.region.closed:
            return None
        return session.pool.spec.name, session.pool.region.fileno(), session.principal

    return lookup


def map_policy(security: SecurityState, socket_gid: int | None) -> MapPolicy:
    """Who may map a session's region: see the module docstring. Reads
    ``security.authorizer`` per request, so a SIGHUP reload applies to the next."""

    def decide(peer: PeerCredentials, pool_name: str, owner: str) -> str | None:
        if not security.restricted:
            if may_map(peer.uid, peer.gid, pool_name, socket_gid, peer.groups):
                return None
            return _not_in_group(peer, pool_name)
        try:
            principal = security.authorizer.for_unix_peer(peer)
        except AccessDenied as exc:
            return str(exc)
        if principal.name != owner:
            return (
                f"the session belongs to principal {owner!r}, this peer is principal "
                f"{principal.name!r}"
            )
        if not principal.may_reach(pool_name):
            return f"principal {principal.name!r} may not reach pool {pool_name!r}"
        return None

    return decide


def serve_next_to(
    unix_sockets: list[str],
    sessions: Any,
    socket_gid: int | None,
    security: SecurityState,
    placement: SocketPlacement | None = None,
) -> RegionFdServer | None:
    """Starts a :class:`RegionFdServer` next to the first Unix listen socket (on
    the running loop; bound where ``placement`` says); None when the daemon
    listens on TCP only (no peer credentials there: regions are then reached by
    path only)."""
    if not unix_sockets:
        return None
    server = RegionFdServer(
        socket_path_for(unix_sockets[0]),
        session_lookup(sessions),
        asyncio.get_running_loop(),
        socket_gid,
        map_policy(security, socket_gid),
    )
    server.start(placement)
    log.info("region descriptors served on %s", server.path)
    return server


def socket_path_for(listen_path: str) -> str:
    """The region-descriptor socket next to the Unix listen socket ``listen_path``."""
    return listen_path + SOCKET_SUFFIX


class RegionFdServer:
    """Answers region-descriptor requests on one Unix socket, concurrently, on its
    own thread (its own event loop, non-blocking sockets).

    Lifecycle: :meth:`start` (binds; daemon's event loop) -> requests ->
    :meth:`close` (stops answering, removes the socket file). ``lookup`` runs on
    ``loop`` (the daemon's); nothing else of this server does.

    Bounds (a peer that stalls never delays another): each connection reads at
    most :data:`MAX_REQUEST_BYTES` within :data:`REQUEST_TIMEOUT_S` of its accept;
    at most :data:`MAX_CONNECTIONS` are open at once. Past that, a new connection
    drops the oldest one still reading its request (it gets an ``ERR`` line), or,
    when every open one is past its request (looked up, answered), is itself
    refused with an ``ERR`` line. Memory: a few hundred bytes per connection.
    A wake-up accepts up to :data:`ACCEPT_BATCH` waiting connections, so a flood
    moves through the listen backlog at about the kernel's pace; a dropped
    connection costs a few system calls (its socket is closed when its task is
    done, even one cancelled before it ran).
    """

    def __init__(
        self,
        path: str,
        lookup: SessionLookup,
        loop: asyncio.AbstractEventLoop,
        socket_gid: int | None,
        policy: MapPolicy | None = None,
    ) -> None:
        self.path = path
        self._lookup = lookup
        self._policy = policy or _default_policy(socket_gid)
        self._loop = loop
        self._gid = socket_gid
        self._sock: socket.socket | None = None
        self._bound: BoundSocket | None = None  # the socket file start() made
        self._thread: threading.Thread | None = None
        self._own_loop: asyncio.AbstractEventLoop | None = None  # the thread's
        self._accepting: asyncio.Task[None] | None = None  # on _own_loop
        # On _own_loop only. Invariant: _reading holds the tasks of _open still
        # reading their request, in accept order (oldest first).
        # _open maps each connection's task to its socket until the task is done
        # (then the socket is closed, even for a task dropped before it ran);
        # dropped tasks leave _open at once, so a flood never counts twice.
        self._open: dict[asyncio.Task[None], socket.socket] = {}
        self._reading: dict[asyncio.Task[Any], socket.socket] = {}
        self._uids: dict[asyncio.Task[Any], int] = {}  # the peer uid of each task in _reading
        self._dropped: dict[asyncio.Task[None], socket.socket] = {}  # cancelled, not yet done
        self._limited = RateLimitedLog(log)

    def start(self, placement: SocketPlacement | None = None) -> None:
        """Binds (where ``placement`` says: at the path by default) and starts
        answering. Raises ConfigError (exit 2) when something other than a socket
        sits at the path (never followed, left untouched)."""
        placement = placement if placement is not None else SocketPlacement()
        if not placement.takeover:
            _clear_stale_socket(self.path)
        at = placement.bind_name(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.bind(at)
        os.chmod(at, 0o660)
        if self._gid is not None:
            os.chown(at, -1, self._gid)
        self._bound = placement.record(self.path, at)
        sock.listen(64)
        sock.setblocking(False)
        self._sock = sock
        own_loop = asyncio.new_event_loop()
        self._own_loop = own_loop
        self._accepting = own_loop.create_task(self._accept_forever(sock))
        self._thread = threading.Thread(
            target=self._run, args=(own_loop,), name="kvtierd-region-fds", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stops accepting, drops the connections still open (a request being
        answered is cut) and removes the socket file. Idempotent."""
        own_loop, accepting = self._own_loop, self._accepting
        if own_loop is not None and accepting is not None:
            with contextlib.suppress(RuntimeError):  # the thread's loop already closed
                own_loop.call_soon_threadsafe(accepting.cancel)
        if self._thread is not None:
            self._thread.join(timeout=REQUEST_TIMEOUT_S)
            self._thread = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            unlink_if_own(self.path, self._bound)  # not a daemon's that took it over

    def _run(self, own_loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(own_loop)
        try:
            assert self._accepting is not None
            with contextlib.suppress(asyncio.CancelledError):
                own_loop.run_until_complete(self._accepting)
        except Exception:  # pragma: no cover - _accept_forever logs and goes on
            log.exception("region descriptor server stopped")
        finally:
            own_loop.close()

    async def _accept_forever(self, sock: socket.socket) -> None:
        own_loop = asyncio.get_running_loop()
        try:
            while True:
                await _readable(sock)
                # drain what the backlog holds (a bounded batch), so that a flood
                # of connections moves through the queue at the kernel's pace
                for _ in range(ACCEPT_BATCH):
                    try:
                        conn, _ = sock.accept()
                    except BlockingIOError:
                        break
                    except OSError as exc:  # EMFILE and the like: the backlog waits
                        self._limited.warning(
                            ("accept", exc.errno), "region descriptor socket: accept failed: %s",
                            exc,
                        )  # fmt: skip
                        await asyncio.sleep(0.05)
                        break
                    self._admit(own_loop, conn)
                await asyncio.sleep(0)  # let the connections accepted so far run
        finally:
            for task in list(self._open):
                task.cancel()
            if self._open:
                await asyncio.gather(*self._open, return_exceptions=True)

    def _admit(self, own_loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
        """Starts serving ``conn`` (just accepted; this server now owns it), making
        room first when :data:`MAX_CONNECTIONS` are open, or refuses it."""
        conn.setblocking(False)
        if len(self._open) >= MAX_CONNECTIONS and not self._make_room():
            _send_now(conn, b"ERR busy: too many region descriptor requests at once\n")
            conn.close()
            return
        task = own_loop.create_task(self._serve_connection(conn))
        self._open[task] = conn
        self._reading[task] = conn
        self._uids[task] = _peer_uid(conn)
        task.add_done_callback(self._forget)

    def _make_room(self) -> bool:
        """Drops the oldest connection still reading its request of the peer uid
        with the most of them; False if none is."""
        if not self._reading:
            return False
        # the oldest silent connection of the uid holding the most silent ones: a
        # peer flooding the socket drops its own connections, not another uid's
        counts: dict[int, int] = {}
        for uid in self._uids.values():
            counts[uid] = counts.get(uid, 0) + 1
        flooder = max(counts, key=counts.__getitem__)
        oldest = next(task for task, uid in self._uids.items() if uid == flooder)
        _send_now(
            self._reading.pop(oldest), b"ERR dropped: too many connections without a request\n"
        )
        self._uids.pop(oldest, None)
        oldest.cancel()  # its socket is closed when the task is done (_forget)
        self._dropped[oldest] = self._open.pop(oldest)
        self._limited.warning(
            "full",
            "region descriptor socket: %d connections open, dropped the oldest one still "
            "silent (a peer that connected and sent no request)",
            MAX_CONNECTIONS,
        )
        return True

    def _forget(self, task: asyncio.Task[None]) -> None:
        """Done callback of a connection's task: closes its socket (a task
        cancelled before its first step never ran its own ``finally``)."""
        conn = self._open.pop(task, None) or self._dropped.pop(task, None)
        self._reading.pop(task, None)
        self._uids.pop(task, None)
        if conn is not None:
            conn.close()

    async def _serve_connection(self, conn: socket.socket) -> None:
        task = asyncio.current_task()
        assert task is not None
        try:
            try:
                request = await asyncio.wait_for(_read_line(conn), REQUEST_TIMEOUT_S)
            except asyncio.TimeoutError:
                log.debug("region descriptor request: peer silent for %gs", REQUEST_TIMEOUT_S)
                return
            finally:
                self._reading.pop(task, None)
                self._uids.pop(task, None)
            if not request:
                return  # closed without a word: nobody to answer
            answer, fd = await self._answer(conn, request)
            try:
                await asyncio.wait_for(_send(conn, answer, fd), REQUEST_TIMEOUT_S)
            finally:
                if fd is not None:
                    os.close(fd)
        except Exception as exc:  # one peer's trouble never stops the server
            self._limited.warning(
                ("failed", type(exc)), "region descriptor request failed: %s",
                str(exc) or type(exc).__name__,
            )  # fmt: skip
        finally:
            conn.close()

    async def _answer(self, conn: socket.socket, request: bytes) -> tuple[bytes, int | None]:
        """The answer to ``request`` and the descriptor to pass with it (None: none)."""
        if b"\n" not in request:
            return f"ERR request longer than {MAX_REQUEST_BYTES} bytes\n".encode(), None
        if not request.startswith(b"MAP "):
            return b"ERR expected 'MAP <session id>'\n", None
        peer = peer_credentials(conn)
        session_id = request[4:].split(b"\n", 1)[0].decode("ascii", "replace").strip()
        future = asyncio.run_coroutine_threadsafe(_call(self._lookup, session_id), self._loop)
        try:
            found = await asyncio.wait_for(asyncio.wrap_future(future), REQUEST_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"the daemon's event loop did not look the session up within {REQUEST_TIMEOUT_S}s"
            ) from None
        if found is None:
            return b"ERR unknown, closed or expired session\n", None
        pool_name, region_fd, owner = found
        refusal = self._policy(peer, pool_name, owner)
        if refusal is not None:
            self._limited.warning(
                ("denied", peer.uid),
                "region of pool %r refused to %s: %s", pool_name, peer.describe(), refusal,
            )  # fmt: skip
            return f"ERR permission denied: {refusal}\n".encode(), None
        return b"OK\n", os.open(f"/proc/self/fd/{region_fd}", os.O_RDWR | os.O_CLOEXEC)


def _default_policy(socket_gid: int | None) -> MapPolicy:
    def decide(peer: PeerCredentials, pool_name: str, owner: str) -> str | None:
        if may_map(peer.uid, peer.gid, pool_name, socket_gid, peer.groups):
            return None
        return _not_in_group(peer, pool_name)

    return decide


def _not_in_group(peer: PeerCredentials, pool_name: str) -> str:
    """The default policy's refusal, naming what the daemon saw of the peer."""
    groups = list(peer.groups)
    return f"uid {peer.uid} gid {peer.gid} groups {groups} may not map pool {pool_name!r}"


async def _call(lookup: SessionLookup, session_id: str) -> tuple[str, int, str] | None:
    return lookup(session_id)


async def _read_line(conn: socket.socket) -> bytes:
    """The peer's bytes up to and with the first newline; at most
    :data:`MAX_REQUEST_BYTES` (then without a newline: the request is too long).
    A peer that closes early: its bytes so far plus a newline (b"" if none)."""
    own_loop = asyncio.get_running_loop()
    data = b""
    while b"\n" not in data and len(data) < MAX_REQUEST_BYTES:
        chunk = await own_loop.sock_recv(conn, MAX_REQUEST_BYTES - len(data))
        if not chunk:
            return data + b"\n" if data else b""
        data += chunk
    return data


async def _send(conn: socket.socket, answer: bytes, fd: int | None) -> None:
    """Sends ``answer`` (with ``fd`` in SCM_RIGHTS) on the non-blocking ``conn``."""
    if fd is None:
        await asyncio.get_running_loop().sock_sendall(conn, answer)
        return
    fds = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]).tobytes())]
    # a few bytes into a connection nothing was sent on yet: the buffer has room
    # (a peer whose queue is somehow full waits for writability, within the deadline)
    while True:
        try:
            sent = conn.sendmsg([answer], fds)
            break
        except BlockingIOError:
            await _writable(conn)
    if sent < len(answer):
        await asyncio.get_running_loop().sock_sendall(conn, answer[sent:])


async def _writable(conn: socket.socket) -> None:
    own_loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = own_loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    own_loop.add_writer(conn, wake)
    try:
        await ready
    finally:
        own_loop.remove_writer(conn)


def _peer_uid(conn: socket.socket) -> int:
    """The peer's uid (SO_PEERCRED), -1 when the kernel does not say."""
    try:
        return peer_uid(conn)
    except OSError:
        return -1


async def _readable(sock: socket.socket) -> None:
    """Returns once ``sock`` is readable (for a listen socket: a connection waits)."""
    own_loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = own_loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    own_loop.add_reader(sock, wake)
    try:
        await ready
    finally:
        own_loop.remove_reader(sock)


def _send_now(conn: socket.socket, line: bytes) -> None:
    """Best effort, never waits: a short ``ERR`` line to a peer being dropped."""
    with contextlib.suppress(OSError):
        conn.send(line)


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
