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

Event-loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from typing import Any

import grpc

from kvtierd.api import guards
from kvtierd.api.handlers import Pending, RequestHandlers
from kvtierd.api.lanebuffers import LaneBuffers, frame_buffer
from kvtierd.core.sessions import Session, SessionTable
from kvtierd.errors import InvalidArgument, KvtierdError, Unauthenticated
from kvtierd.security.access import AccessDenied
from kvtierd.security.identity import LOCAL_CALLER, Caller, PeerCredentials, peer_credentials
from kvtierd.security.state import SecurityState
from kvtierd.util.ratelimit import RateLimitedLog
from kvtierd_client.wire.lane_frames import BIND, HEADER, METHODS, OK, VERSION, frame
from kvtierd_client.wire.proto import pb2

log = logging.getLogger("kvtierd.fastlane")
_faults = RateLimitedLog(log)

LANE_SOCKET_SUFFIX = ".lane"
TOKEN_BYTES = 32
# the longest frame an unbound connection may send: BIND's kind byte and a token
# (with room for a longer token in a later version); longer is cut at its header
MAX_BIND_FRAME_BYTES = 1 + 4 * TOKEN_BYTES
DEFAULT_WRITE_TIMEOUT = 10.0  # seconds a peer may leave the daemon's answers unread
DEFAULT_BIND_TIMEOUT = 5.0  # seconds a new connection may take to send BIND
WRITE_HIGH_WATER = 1 << 20  # answer bytes queued before the daemon stops reading
READ_BYTES = 64 << 10  # the shared read buffer: frames that arrive whole are handled in it
# What LaneBuffers allows by default, in frames of max_frame_bytes (and a read's
# worth each): a principal may have two frames in flight at once, all of them eight.
FRAMES_PER_OWNER = 2
FRAMES_IN_ALL = 8
_SERVICE = pb2.DESCRIPTOR.services_by_name["KVTier"].full_name
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


class _Method:
    """One lane method: its RPC name and a lenient parser (``guards.lenient``: bytes
    that do not parse become a marker the RPC body answers INVALID_ARGUMENT for,
    with the gRPC path's message)."""

    __slots__ = ("name", "parse")

    def __init__(self, name: str, request_type: Any) -> None:
        self.name = name
        self.parse = guards.lenient(request_type.FromString, f"/{_SERVICE}/{name}")


_BY_KIND: dict[int, _Method] = {
    kind: _Method(name, request_type) for name, (kind, request_type, _) in METHODS.items()
}


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
        """Stops accepting and cuts every connection (their sessions close with them)."""
        if self._server is not None:
            self._server.close()
        for connection in [*self._connections, *self._closing]:
            connection.cut()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

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


class LaneConnection(asyncio.BufferedProtocol):
    """One lane connection (see the module doc). The transport reads into
    ``get_buffer``'s answer: the lane's shared read buffer, whose whole frames are
    handled at once (``_consume``); the rest of a frame's header (``_head``);
    or, once a header announced a frame that did not arrive whole, that frame's
    own buffer (``_body``, allocated to its size, reserved from the lane's
    ``LaneBuffers``), read into up to its last byte and no further.

    State: unbound -> bound (``_session_id`` set once) -> ended (``_cut``);
    ``_caller`` is fixed at bind. ``_body`` and ``_backlog`` are reserved under
    ``_owner`` while they exist and released as they are dropped (at the latest
    when the connection ends: ``_forget``). ``_paused``: the transport's write buffer is over its
    high water; no frame is handled and nothing is read until it drains, the
    rest of the last read waiting in ``_backlog``. ``_waiting``: the answer of the
    last call handled waits (``_answer_when_ready``); likewise nothing is handled
    or read until it is written."""

    def __init__(self, lane: FastLane) -> None:
        self._lane = lane
        self._transport: asyncio.Transport | None = None
        self._peer: PeerCredentials | None = None
        self._describe = "unix"
        self._owner = ""
        self._session_id: str | None = None
        self._caller: Caller | None = None
        self._head = memoryview(bytearray(HEADER.size))
        self._head_filled = 0  # > 0: a frame's header is partly in _head
        self._body: memoryview | None = None  # the body of the frame being read
        self._body_filled = 0
        self._kind = 0  # the kind of the frame in _body
        self._backlog = b""  # unhandled bytes of the last read, while paused
        self._paused = False
        self._waiting = False
        self._answer_task: asyncio.Task[None] | None = None  # while _waiting
        self._cut = False
        self._timer: asyncio.TimerHandle | None = None  # bind, write stall, or abort
        self._frame_timer: asyncio.TimerHandle | None = None  # the frame in _body

    # -- transport callbacks ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        own: asyncio.Transport = transport  # type: ignore[assignment]  # uvloop's: no subclass
        self._transport = own
        lane = self._lane
        lane._connections.add(self)
        lane._unbound[self] = None
        own.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        try:
            self._peer = peer_credentials(transport.get_extra_info("socket"))
            self._describe = self._peer.describe()
        except OSError as exc:
            self._fail(grpc.StatusCode.INTERNAL, f"cannot read the peer's credentials: {exc}")
            return
        self._owner = lane.owner_of(self._peer)
        if len(lane._connections) > lane.max_connections:
            # the oldest connection still silent makes room (as on the region socket):
            # otherwise idle connections, re-opened as they are cut, would keep every
            # session's lane refused (its client falling back to gRPC)
            oldest = next(iter(lane._unbound))
            if oldest is self:
                self._fail(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{lane.max_connections} fast lane connections are open (one per "
                    "session); close sessions you no longer use",
                )
                return
            oldest._fail(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"fast lane full ({lane.max_connections} connections): the oldest "
                "connection that had not sent BIND was dropped for a new one",
            )
        self._timer = asyncio.get_running_loop().call_later(lane.bind_timeout, self._bind_late)

    def connection_lost(self, exc: Exception | None) -> None:
        lane = self._lane
        self._cut = True
        self._forget()
        lane._closing.discard(self)
        if self._timer is not None:
            self._timer.cancel()
        if self._session_id is not None and lane._bound.get(self._session_id) is self:
            del lane._bound[self._session_id]
            lane.lane_ended(self._session_id)

    def pause_writing(self) -> None:
        self._paused = True
        if self._cut or self._transport is None:
            return  # closing: its abort timer stands
        self._transport.pause_reading()
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(self._lane.write_timeout, self._stalled)

    def resume_writing(self) -> None:
        self._paused = False
        if self._cut or self._transport is None:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._waiting:  # else the waiting answer, once written, goes on
            self._go_on()

    def _go_on(self) -> None:
        """Reads again and handles what waited in ``_backlog``."""
        assert self._transport is not None
        self._transport.resume_reading()
        if self._backlog:
            backlog, self._backlog = self._backlog, b""
            self._release(len(backlog))
            self._consume(memoryview(backlog))

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._body is not None:
            return self._body[self._body_filled :]
        if self._head_filled:
            return self._head[self._head_filled :]
        return self._lane.read_buffer

    def buffer_updated(self, nbytes: int) -> None:
        if self._cut:
            return
        if self._body is not None:
            self._body_filled += nbytes
            if self._body_filled == len(self._body):
                self._finish_body()
        elif self._head_filled:
            self._head_filled += nbytes
            if self._head_filled == HEADER.size:
                self._head_filled = 0
                self._header_read()
        else:
            self._consume(self._lane.read_buffer[:nbytes])

    # -- frames --------------------------------------------------------------------------

    def _consume(self, data: memoryview) -> None:
        """Handles every whole frame of ``data`` (which the next read may overwrite);
        keeps the rest: a frame begun, or while paused everything left."""
        end = len(data)
        pos = 0
        header = HEADER.size
        while end - pos >= header and not self._paused and not self._waiting and not self._cut:
            length, kind = HEADER.unpack_from(data, pos)
            if not self._length_ok(length):
                return
            stop = pos + 4 + length
            if stop > end:
                break
            self._frame(kind, data[pos + header : stop])
            pos = stop
        if self._cut or pos == end:
            return
        if self._paused or self._waiting:
            self._keep_backlog(data[pos:])
        elif end - pos < header:
            self._head[: end - pos] = data[pos:]
            self._head_filled = end - pos
        else:
            length, kind = HEADER.unpack_from(data, pos)
            self._begin_body(kind, length - 1, data[pos + header :])

    def _header_read(self) -> None:
        """``_head`` holds a whole header: the frame's body is read into its own buffer."""
        length, kind = HEADER.unpack_from(self._head)
        if not self._length_ok(length):
            return
        if length == 1:  # an empty body: the frame is whole
            self._frame(kind, self._head[HEADER.size :])
        else:
            self._begin_body(kind, length - 1, self._head[HEADER.size :])

    def _length_ok(self, length: int) -> bool:
        """Whether a frame of ``length`` may be read; else the connection is cut."""
        bound = self._session_id is not None
        limit = self._lane.max_frame_bytes if bound else MAX_BIND_FRAME_BYTES
        if 0 < length <= limit:
            return True
        self._fail(
            grpc.StatusCode.RESOURCE_EXHAUSTED if length else grpc.StatusCode.INVALID_ARGUMENT,
            f"fast lane frame of {length} bytes; a frame is 1 to {limit} bytes "
            + (
                "(server.limits: the gRPC message limit)"
                if bound
                else "before BIND (the first frame: BIND with the session's fast_lane_token)"
            ),
        )
        return False

    def _begin_body(self, kind: int, size: int, first: memoryview) -> None:
        """A frame of ``kind`` whose ``size`` body bytes did not all arrive (``first``
        did): its buffer is reserved and allocated, and must fill within the
        lane's ``frame_timeout``."""
        if not self._reserve(size, f"a fast lane frame of {size + 1} bytes"):
            return
        body = memoryview(frame_buffer(size))
        body[: len(first)] = first
        self._body, self._body_filled, self._kind = body, len(first), kind
        loop = asyncio.get_running_loop()
        self._frame_timer = loop.call_later(self._lane.frame_timeout, self._frame_late)

    def _finish_body(self) -> None:
        body, kind = self._body, self._kind
        assert body is not None
        self._drop_body()
        self._frame(kind, body)

    def _drop_body(self) -> None:
        if self._body is not None:
            self._release(len(self._body))
            self._body = None  # the buffer goes with its last view
        if self._frame_timer is not None:
            self._frame_timer.cancel()
            self._frame_timer = None

    def _keep_backlog(self, rest: memoryview) -> None:
        if self._reserve(len(rest), "the unread rest of a fast lane read"):
            self._backlog = bytes(rest)

    def _reserve(self, nbytes: int, what: str) -> bool:
        """Reserves ``nbytes`` from the lane's bounds; refused: the connection is cut."""
        refusal = self._lane.buffers.reserve(self._owner, nbytes)
        if refusal is not None:
            self._fail(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{what} refused: {refusal}")
            return False
        return True

    def _release(self, nbytes: int) -> None:
        self._lane.buffers.release(self._owner, nbytes)

    def _frame(self, kind: int, body: memoryview) -> None:
        if self._session_id is None:
            self._bind(kind, body)
            return
        method = _BY_KIND.get(kind)
        if method is None:
            self._fail(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"fast lane frame of unknown kind {kind}; kinds are "
                f"{sorted(_BY_KIND)} (kvtierd_client.wire.lane_frames.METHODS)",
            )
            return
        request = method.parse(body)  # type: ignore[arg-type]  # protobuf takes any buffer
        assert self._transport is not None and self._caller is not None
        try:
            if (
                not isinstance(request, guards.UnparsableRequest)
                and request.session_id != self._session_id
            ):
                raise InvalidArgument(
                    f"session_id: {request.session_id[:64]!r} is not the session this "
                    f"fast lane is bound to ({self._session_id!r}); use gRPC for other sessions"
                )
            response = self._lane.handlers.run(  # type: ignore[union-attr]  # set by serve
                method.name, request, self._describe, self._identify
            )
        except KvtierdError as exc:
            self._transport.write(frame(exc.code.value[0], str(exc).encode()))
            return
        if response.__class__ is Pending:
            self._wait_for(response)
            return
        self._transport.write(frame(OK, response.SerializeToString()))

    def _wait_for(self, pending: Pending) -> None:
        """The call's answer waits: nothing more is read or handled on this
        connection until it is written (answers leave in order)."""
        assert self._transport is not None
        self._waiting = True
        self._transport.pause_reading()
        loop = asyncio.get_running_loop()
        self._answer_task = loop.create_task(self._answer_when_ready(pending))

    async def _answer_when_ready(self, pending: Pending) -> None:
        try:
            response = await pending
            answer = frame(OK, response.SerializeToString())
        except KvtierdError as exc:
            answer = frame(exc.code.value[0], str(exc).encode())
        self._waiting = False
        self._answer_task = None
        if self._cut or self._transport is None:
            return  # the connection ended meanwhile: nobody reads the answer
        self._transport.write(answer)
        if not self._paused:  # else resume_writing goes on once the answers drained
            self._go_on()

    def _identify(self) -> Caller:
        """The caller of every call on this lane: fixed at BIND."""
        assert self._caller is not None  # a call frame is handled only once bound
        return self._caller

    def _bind(self, kind: int, body: memoryview) -> None:
        assert self._transport is not None and self._peer is not None
        if kind != BIND:
            self._fail(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"fast lane: the first frame must be BIND (kind {BIND}) with the session's "
                f"fast_lane_token, not kind {kind}",
            )
            return
        try:
            self._session_id, self._caller = self._lane.bind(bytes(body), self._peer)
        except KvtierdError as exc:
            self._lane.refused(None, self._describe, exc)
            self._fail(exc.code, str(exc))
            return
        self._lane._unbound.pop(self, None)
        self._lane._bound[self._session_id] = self
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._transport.write(frame(OK, b""))

    # -- ending ------------------------------------------------------------------------

    def end_with_session(self, message: str) -> None:
        """The session ended: the answers due, then a NOT_FOUND frame with
        ``message``, and the connection is closed; it holds nothing from now."""
        log.debug("fast lane %s: %s", self._describe, message)
        self._close(frame(grpc.StatusCode.NOT_FOUND.value[0], message.encode()))

    def _fail(self, code: grpc.StatusCode, message: str) -> None:
        """Answers an error frame and cuts the connection (the frame is written first)."""
        _faults.warning(
            ("fast-lane", code.name), "fast lane %s: %s; connection cut", self._describe, message
        )
        self._close(frame(code.value[0], message.encode()))

    def _close(self, last: bytes) -> None:
        """Writes ``last`` after the answers due and closes; aborts after the lane's
        ``write_timeout`` a peer that does not read them."""
        if self._transport is None or self._cut:
            return
        self._transport.write(last)
        self._cut = True
        self._forget()
        self._lane._closing.add(self)
        self._transport.close()  # flushes what is queued, then closes
        if self._timer is not None:
            self._timer.cancel()
        # a peer that does not read the last frames either is dropped all the same
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._lane.write_timeout, self._transport.abort)

    def _forget(self) -> None:
        """Leaves the lane's open connections and gives back every byte held."""
        lane = self._lane
        lane._connections.discard(self)
        lane._unbound.pop(self, None)  # never the one dropped for a newcomer again
        self._drop_body()
        self._head_filled = 0
        if self._backlog:
            self._release(len(self._backlog))
            self._backlog = b""

    def _bind_late(self) -> None:
        self._timer = None
        self._fail(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"fast lane: no BIND within {self._lane.bind_timeout:g}s of connecting",
        )

    def _frame_late(self) -> None:
        self._frame_timer = None
        size = 0 if self._body is None else len(self._body) + 1
        self._fail(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"fast lane: a frame of {size} bytes did not arrive whole within "
            f"{self._lane.frame_timeout:g}s of its header; send each frame at once",
        )

    def _stalled(self) -> None:
        self._timer = None
        _faults.warning(
            ("fast-lane", "stalled"),
            "fast lane %s: answers unread for %gs; connection cut",
            self._describe,
            self._lane.write_timeout,
        )
        self.cut()

    def cut(self) -> None:
        """Drops the connection now, unwritten answers included."""
        self._cut = True
        self._forget()
        if self._transport is not None:
            self._transport.abort()
