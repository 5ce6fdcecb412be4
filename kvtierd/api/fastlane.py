"""The fast lane: a session's hot calls as framed protobuf on a Unix socket.

Why: a gRPC call costs ~300 µs of daemon CPU in Python; the work of a 32-key
Lookup costs ~10 µs. The lane carries the same protobuf messages in
length-prefixed frames (``kvtierd_client.wire.lane_frames``) on a stream socket
``<listen socket>.lane`` (mode 0660 and the group of the gRPC socket), parsed
by an ``asyncio.BufferedProtocol`` on the daemon's loop that calls the request
handlers the gRPC servicer calls (``RequestHandlers.run``): same validation, same
service functions, same status codes and messages, same metrics and audit.
Answers leave in the order of their requests: a call whose answer waits (a
``Pending``: a Lookup waiting for its remote tiers, at most
``limits.remote_lookup_wait``) stops the connection's reading and frame handling
until that answer is written; other connections go on meanwhile.

Binding. ``OpenSession`` over a Unix socket offers the session a lane
(``offer``): the socket path and a fresh 256-bit token, which only the
opener's answer carries. A connection's first frame is ``BIND`` with that
token; the token is used up by it (one lane per session, for the session's
life: a second connection with it is refused). The caller of every call on
the lane is fixed at ``BIND`` from the connection's kernel credentials
(SO_PEERCRED): with ``[[security.principals]]``, the principal listing its
uid or groups, which must be the principal that opened the session (else
PERMISSION_DENIED, audited); without principals, the local caller, as on the
Unix gRPC socket.

Lifetime. A lane lives as long as its session, no longer. A session that ends
(CloseSession, its lease, the daemon's stop: ``FastLane.session_ended``) ends
its lane: the answers already due are written, then a NOT_FOUND frame saying
why, and the connection is closed (aborted if its client does not read them
within ``write_timeout``); nothing of it is held any more. When a bound
connection ends first (the client closed it or died: EOF; or the daemon cut it
for a bad frame or a stalled reader) its session is left to its lease
(``FastLane.lane_ended``), as a gRPC client that went away is: copiers of the
client may still trust that lease, so its pins and reservations hold until it
runs out. Leases renew on lane calls exactly as on gRPC calls (the same
``_live_session``).

Bounds. A frame is at most ``max_frame_bytes`` (the gRPC receive limit) once
bound, and at most :data:`MAX_BIND_FRAME_BYTES` before (the only frame an
unbound peer may send is ``BIND``: a peer that proved nothing yet must not
make the daemon hold a 35 MiB frame per connection); a longer one, a length of
0, an unknown kind or a request before ``BIND`` is answered with an error
frame and the connection is cut. Reads land in one buffer shared by every
connection (:data:`READ_BYTES`; the loop runs one protocol at a time), whose
whole frames are handled in place. A frame that did not arrive whole is held in
one buffer allocated at its header to the size it announces, and must arrive
whole within ``frame_timeout``; while a client leaves its answers unread, the
rest of its last read waits in one copy, and the daemon stops reading it and
cuts it after ``write_timeout``. Both kinds of buffer are reserved from
``LaneBuffers`` (``kvtierd.api.lanebuffers``): at most ``per_owner`` bytes per
principal (per uid without principals) and ``total`` in all; a frame that
would pass either bound is refused (RESOURCE_EXHAUSTED, connection cut). A
connection that has not bound within ``bind_timeout`` is cut; at most
``max_connections`` connections are open (a new one past that drops the oldest
connection that has not bound yet, as the region socket does, so idle
connections cannot keep sessions off their lanes; bound connections are at
most one per live session).

The connections themselves (framing, bounds, binding, answers in order):
:class:`~kvtierd.api.laneconn.LaneConnection`. Event-loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
from typing import Any

import grpc

from kvtierd.api.handlers import RequestHandlers
from kvtierd.api.lanebuffers import LaneBuffers
from kvtierd.api.laneconn import MAX_BIND_FRAME_BYTES, TOKEN_BYTES, LaneConnection
from kvtierd.core.sessions import Session, SessionTable
from kvtierd.errors import KvtierdError, Unauthenticated
from kvtierd.security.access import AccessDenied
from kvtierd.security.identity import LOCAL_CALLER, Caller, PeerCredentials
from kvtierd.security.state import SecurityState
from kvtierd_client.wire.lane_frames import HEADER, VERSION

log = logging.getLogger(__name__)

LANE_SOCKET_SUFFIX = ".lane"
DEFAULT_WRITE_TIMEOUT = 10.0  # seconds a peer may leave the daemon's answers unread
DEFAULT_BIND_TIMEOUT = 5.0  # seconds a new connection may take to send BIND
READ_BYTES = 64 << 10  # the shared read buffer: frames that arrive whole are handled in it
# What LaneBuffers allows by default, in frames of max_frame_bytes (and a read's
# worth each): a principal may have two frames in flight at once, all of them eight.
FRAMES_PER_OWNER = 2
FRAMES_IN_ALL = 8
LANE_ENDED = "its client's fast lane connection ended"


def lane_socket_path(listen_path: str) -> str:
    """The lane socket next to the gRPC Unix socket ``listen_path``."""
    return listen_path + LANE_SOCKET_SUFFIX


def first_unix_path(listen: tuple[str, ...] | list[str]) -> str | None:
    """The path of the first ``unix://`` address of ``listen``, or None."""
    for address in listen:
        if address.startswith("unix://"):
            return address[len("unix://") :]
    return None


def default_buffers(max_frame_bytes: int) -> LaneBuffers:
    """The bounds of a lane whose frames are at most ``max_frame_bytes``."""
    slot = HEADER.size + max_frame_bytes + READ_BYTES
    return LaneBuffers(total=FRAMES_IN_ALL * slot, per_owner=FRAMES_PER_OWNER * slot)


class FastLane:
    """The lane socket, its tokens and its connections.

    ``_tokens``: token -> session id, for sessions offered a lane and not bound
    yet; ``_token_of`` is its inverse. Both lose an entry when the token is used
    (``bind``) or its session ends (``session_ended``), so they hold at most one
    entry per open session. ``_connections``: every open connection that is not
    being closed; ``_bound``: session id -> its connection, for live sessions
    only (an entry leaves with its session or its connection); ``_closing``: the
    connections cut or ended whose last frames are still being written.
    """

    def __init__(
        self,
        path: str,
        sessions: SessionTable,
        security: SecurityState,
        *,
        max_frame_bytes: int,
        max_connections: int,
        write_timeout: float = DEFAULT_WRITE_TIMEOUT,
        bind_timeout: float = DEFAULT_BIND_TIMEOUT,
        frame_timeout: float | None = None,
        buffers: LaneBuffers | None = None,
    ) -> None:
        """``frame_timeout``: seconds a frame begun may take to arrive whole (default
        ``write_timeout``); ``buffers``: the byte bounds (``default_buffers``)."""
        self.path = path
        self.sessions = sessions
        self.security = security
        self.max_frame_bytes = max_frame_bytes
        self.max_connections = max_connections
        self.write_timeout = write_timeout
        self.bind_timeout = bind_timeout
        self.frame_timeout = write_timeout if frame_timeout is None else frame_timeout
        self.buffers = buffers if buffers is not None else default_buffers(max_frame_bytes)
        self.read_buffer = memoryview(bytearray(READ_BYTES))
        self._tokens: dict[bytes, str] = {}
        self._token_of: dict[str, bytes] = {}
        self._connections: set[LaneConnection] = set()
        # the connections that have not bound yet, oldest first (a subset of
        # _connections): a full lane drops the oldest of them for a new one
        self._unbound: dict[LaneConnection, None] = {}
        self._bound: dict[str, LaneConnection] = {}
        self._closing: set[LaneConnection] = set()
        self._server: asyncio.AbstractServer | None = None
        self.handlers: RequestHandlers | None = None  # set by serve: the lane's calls

    async def serve(self, listener: socket.socket, handlers: RequestHandlers) -> None:
        """Accepts lane connections on ``listener`` (bound, listening) until ``close``;
        their calls run through ``handlers`` (the gRPC servicer's too)."""
        self.handlers = handlers
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: LaneConnection(self), sock=listener)

    def close(self) -> None:
        """Stops accepting and cuts every connection (their sessions close with them).
        The socket file is the daemon's to remove (its ``SocketPlacement``: not if a
        daemon that took over has put its own there)."""
        if self._server is not None:
            self._server.close()
        for connection in [*self._connections, *self._closing]:
            connection.cut()

    def __len__(self) -> int:
        return len(self._connections)

    def owner_of(self, peer: PeerCredentials) -> str:
        """Whose byte bound a connection of ``peer`` draws on: with principals the
        one listing it (the one BIND will find), else (or for a peer none lists)
        its uid."""
        if self.security.restricted:
            with contextlib.suppress(AccessDenied):
                return self.security.authorizer.for_unix_peer(peer).name
        return f"uid {peer.uid}"

    # -- sessions ------------------------------------------------------------------------

    def offer(self, session: Session, peer: str) -> dict[str, Any] | None:
        """The OpenSessionResponse fields offering ``session`` its lane, or None for a
        session opened over TCP (the lane is a local transport)."""
        if not peer.startswith("unix:"):
            return None
        token = secrets.token_bytes(TOKEN_BYTES)
        self._tokens[token] = session.id
        self._token_of[session.id] = token
        return {
            "fast_lane_path": self.path,
            "fast_lane_token": token,
            "fast_lane_max_frame_bytes": min(self.max_frame_bytes, 0xFFFFFFFF),
            "fast_lane_version": VERSION,
        }

    def session_ended(self, event: str, session: Session, reason: str) -> None:
        """``SessionTable``'s hook: a closed or expired session's token is dropped
        and its lane ended (``LaneConnection.end_with_session``)."""
        if event == "opened":
            return
        token = self._token_of.pop(session.id, None)
        if token is not None:
            self._tokens.pop(token, None)
        connection = self._bound.pop(session.id, None)
        if connection is not None:
            connection.end_with_session(
                f"session {session.id!r} {event} ({reason}); its fast lane is closed with "
                "it: open a new session"
            )

    def bind(self, token: bytes, peer: PeerCredentials) -> tuple[str, Caller]:
        """The session ``token`` names and the caller the connection of ``peer``
        speaks for; uses the token up. Raises ``KvtierdError``: an unknown or used
        token (UNAUTHENTICATED), a peer of another principal than the session's
        (PERMISSION_DENIED), a session that ended (NOT_FOUND)."""
        session_id = self._tokens.get(token)
        if session_id is None:
            raise Unauthenticated(
                "fast lane BIND: the token is unknown or already used (a session has one lane, "
                "bound by its first connection); open a session and bind with its token"
            )
        if self.security.restricted:
            principal = self.security.authorizer.for_unix_peer(peer)  # AccessDenied
            caller = Caller(principal, peer.describe(), "socket credentials")
        else:
            caller = Caller(LOCAL_CALLER.principal, peer.describe(), LOCAL_CALLER.via)
        self.sessions.get(session_id, caller.name)  # SessionNotFound, AccessDenied
        del self._tokens[token]
        del self._token_of[session_id]
        return session_id, caller

    def lane_ended(self, session_id: str) -> None:
        """A bound connection ended. Its session is left to its lease, as a gRPC
        client that went away is: the processes that copy its rows (vLLM's workers,
        through its lease beacon) may go on trusting that lease, so its pins and
        reservations must hold until it runs out (an attack test read another key's
        bytes through a pin released at the lane's end). Nothing renews it from the
        lane any more; a KeepAlive over gRPC still may (a worker proving the lease)."""
        log.debug("session %s: %s; it ends with its lease", session_id, LANE_ENDED)

    def refused(self, caller: Caller | None, peer: str, exc: KvtierdError) -> None:
        if exc.code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
            self.security.call_denied("FastLaneBind", caller, peer, exc)


__all__ = [
    "MAX_BIND_FRAME_BYTES",
    "TOKEN_BYTES",
    "FastLane",
    "LaneConnection",
    "default_buffers",
    "first_unix_path",
    "lane_socket_path",
]
