"""One fast lane connection: its frames, its bounds, its binding and its answers, in order.

The lane as a whole -- its socket, tokens, bounds and the rules every connection
follows -- is described in :mod:`kvtierd.api.fastlane`, which owns the
:class:`~kvtierd.api.fastlane.FastLane` its connections belong to; this module is
the protocol object the loop runs per connection. Event-loop only.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

import grpc

from kvtierd.api import guards
from kvtierd.api.handlers import Pending, RequestHandlers
from kvtierd.api.lanebuffers import LaneBuffers, frame_buffer
from kvtierd.errors import InvalidArgument, KvtierdError
from kvtierd.security.identity import Caller, PeerCredentials, peer_credentials
from kvtierd.util.ratelimit import RateLimitedLog
from kvtierd_client.wire.lane_frames import BIND, HEADER, METHODS, OK, frame
from kvtierd_client.wire.proto import pb2

log = logging.getLogger(__name__)
_faults = RateLimitedLog(log)

TOKEN_BYTES = 32
# the longest frame an unbound connection may send: BIND's kind byte and a token
# (with room for a longer token in a later version); longer is cut at its header
MAX_BIND_FRAME_BYTES = 1 + 4 * TOKEN_BYTES
WRITE_HIGH_WATER = 1 << 20  # answer bytes queued before the daemon stops reading
_SERVICE = pb2.DESCRIPTOR.services_by_name["KVTier"].full_name


class Lane(Protocol):
    """What a connection uses of its lane (:class:`kvtierd.api.fastlane.FastLane`): its
    bounds and buffers, its tables of connections (kept by the connections
    themselves, as the lane's module doc says) and its session calls."""

    read_buffer: memoryview
    max_frame_bytes: int
    max_connections: int
    write_timeout: float
    bind_timeout: float
    frame_timeout: float
    buffers: LaneBuffers
    handlers: RequestHandlers | None
    _connections: set[Any]
    _unbound: dict[Any, None]
    _bound: dict[str, Any]
    _closing: set[Any]

    def owner_of(self, peer: PeerCredentials) -> str: ...

    def bind(self, token: bytes, peer: PeerCredentials) -> tuple[str, Caller]: ...

    def refused(self, caller: Caller | None, peer: str, exc: KvtierdError) -> None: ...

    def lane_ended(self, session_id: str) -> None: ...


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

    def __init__(self, lane: Lane) -> None:
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
