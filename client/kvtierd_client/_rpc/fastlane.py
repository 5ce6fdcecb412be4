"""The client end of a session's fast lane (docs/design/protocol.md, "The fast lane").

``OpenSession`` over a Unix socket may offer the session a lane: a Unix stream
socket and a token (``OpenSessionResponse.fast_lane_*``). The session then
sends its hot calls (``lane_frames.LANE_METHODS``) as frames on one connection
bound with that token; every other call, and every call of a session not
offered a lane (TCP, TLS, ``server.fast_lane = false``) or whose lane could not
be connected, goes through gRPC. Answers and errors are the same as gRPC's:
the same response messages, the same ``KvtierError`` subclasses and messages.

A lane lives as long as its session, no longer: when the session ends
(``CloseSession``, from this client or another; its lease running out) the
daemon writes the answers due, then a NOT_FOUND frame saying why, and closes
the connection. A lane that ends is therefore taken as its session's end
(``NotFound``). The client closes its lane after ``CloseSession`` (or when the
session is gone or collected); a lane's end alone leaves the session to its
lease on the daemon's side.

:class:`FastLane` (blocking, thread-safe: one call at a time under ``_lock``)
serves ``Client``; :class:`AsyncFastLane` (one event loop; calls may overlap,
answered in order by one reader task) serves ``AsyncClient``. Both belong to
the process that connected them: in a forked child ``usable`` is False and the
session's calls go through gRPC (two processes writing one stream would mix
their frames).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

import grpc

from kvtierd_client.errors import KvtierError, NotFound, Unavailable, UntrustedAddress, from_status
from kvtierd_client.wire import trust
from kvtierd_client.wire.lane_frames import BIND, HEADER, METHODS, OK, VERSION, frame
from kvtierd_client.wire.proto import pb2

__all__ = ["AsyncFastLane", "FastLane", "offered"]

_CODES = {code.value[0]: code for code in grpc.StatusCode}
_RECV_BYTES = 1 << 16

# The number of forks this process descends from, counted by a fork hook: a lane
# connected in an ancestor is not this process's (``usable``). Cheaper per call
# than ``os.getpid()``, a system call.
_forks = [0]


def _forked() -> None:
    _forks[0] += 1


os.register_at_fork(after_in_child=_forked)
MIN_MAX_ANSWER_BYTES = 64 << 20  # the gRPC channel's receive limit (DEFAULT_CHANNEL_OPTIONS)


def offered(response: pb2.OpenSessionResponse) -> bool:
    """Whether ``response`` offers a lane this client speaks."""
    return bool(response.fast_lane_path) and response.fast_lane_version == VERSION


def _max_answer_bytes(response: pb2.OpenSessionResponse) -> int:
    # a daemon's answer is at most about twice its largest request (server.max_send_bytes)
    return max(MIN_MAX_ANSWER_BYTES, 2 * int(response.fast_lane_max_frame_bytes) + (1 << 20))


def _lane_error(kind: int, body: bytes, address: str) -> KvtierError:
    code = _CODES.get(kind, grpc.StatusCode.UNKNOWN)
    return from_status(code, body.decode("utf-8", "replace"), address)


def _check_server(sock: Any, path: str, address: str, daemon_uid: int | None) -> None:
    """Raises ``UntrustedAddress`` unless the daemon's uid serves the lane (``SO_PEERCRED``):
    the lane's token is the session's, never sent to another user's process."""
    if daemon_uid is None:
        return
    try:
        trust.require_peer(sock, daemon_uid, path, "the fast lane socket")
    except trust.UntrustedDaemon as exc:
        raise UntrustedAddress(str(exc), address=address) from None


def _unreachable(path: str, address: str, why: str) -> Unavailable:
    """A lane that could not be connected and bound: the session lives on (gRPC)."""
    return Unavailable(
        f"cannot reach kvtierd at {address}: its fast lane {path} {why}", address=address
    )


def _lost(path: str, address: str, why: str) -> NotFound:
    """A bound lane that ended: the daemon ends a lane when its session ends (or it
    stopped, and a restarted daemon never knew the session), so the session is taken
    as gone, as a daemon answering NOT_FOUND would say. A caller reopens at once instead of
    waiting out a daemon it believes down (a restart is seen as one lost call)."""
    return NotFound(
        f"the session ended: its fast lane {path} to kvtierd at {address} {why} "
        "(the session was closed or its lease ran out, the daemon stopped or restarted, "
        "or it cut the connection)",
        address=address,
    )


class FastLane:
    """A blocking lane connection (see the module doc).

    ``_buffer`` holds answer bytes received and not yet taken; ``_owed`` counts
    answers of calls that gave up waiting (deadline), discarded before the next
    call's answer is read, so answers always match their calls. A failed send
    or an end of stream marks the lane ``broken`` for good. Under ``_lock``."""

    def __init__(
        self,
        response: pb2.OpenSessionResponse,
        address: str,
        timeout: float,
        daemon_uid: int | None = None,
    ) -> None:
        """Connects and binds; raises ``KvtierError`` (``Unavailable`` when the socket
        cannot be reached, ``UntrustedAddress`` when another uid than ``daemon_uid``
        serves it, the daemon's refusal otherwise)."""
        self.path: str = response.fast_lane_path
        self.address = address
        self._max_answer = _max_answer_bytes(response)
        self._pid = os.getpid()
        self._forks = _forks[0]
        self._lock = threading.Lock()
        self._buffer = bytearray()  # answer bytes received, not taken yet
        self._scratch = bytearray(_RECV_BYTES)  # recv_into target: no allocation per read
        self._timeout = -1.0  # the kernel's SO_RCVTIMEO / SO_SNDTIMEO now (seconds)
        self._owed = 0
        self.broken = False
        self.on_close: Callable[[], None] | None = None  # set by the owning client
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(timeout)
            self._sock.connect(self.path)
            _check_server(self._sock, self.path, address, daemon_uid)
            # blocking from here, with kernel timeouts: a read costs one system call
            # (Python's own timeouts poll() before each recv)
            self._sock.settimeout(None)
            self._set_timeout(timeout)
            self._sock.sendall(frame(BIND, response.fast_lane_token))
            kind, body = self._read()
        except OSError as err:
            self._sock.close()
            raise _unreachable(self.path, address, f"cannot be connected ({err})") from None
        except KvtierError:
            self._sock.close()
            raise
        if kind != OK:
            self._sock.close()
            raise _lane_error(kind, body, address)

    @property
    def usable(self) -> bool:
        """Not broken, and this is the process that connected it (no fork since)."""
        return not self.broken and _forks[0] == self._forks

    def call(self, rpc: str, request: Any, timeout: float) -> Any:
        """Sends ``request`` of RPC ``rpc`` and returns its response message; raises
        the ``KvtierError`` the daemon answered, ``DeadlineExceeded`` after
        ``timeout`` seconds, ``Unavailable`` once the lane is broken."""
        kind, _, response_type = METHODS[rpc]
        data = frame(kind, request.SerializeToString())
        with self._lock:
            if self.broken:
                raise _lost(self.path, self.address, "is closed")
            sock = self._sock
            try:
                if timeout != self._timeout:
                    self._set_timeout(timeout)
                sock.sendall(data)
            except OSError as err:
                self._break()
                raise _lost(self.path, self.address, f"failed ({err})") from None
            self._owed += 1
            try:
                while True:
                    answer_kind, body = self._read()
                    self._owed -= 1
                    if self._owed == 0:
                        break
            except (TimeoutError, BlockingIOError):  # SO_RCVTIMEO ran out: EAGAIN
                raise from_status(
                    grpc.StatusCode.DEADLINE_EXCEEDED, f"fast lane, {timeout:g}s", self.address
                ) from None
            except OSError as err:
                self._break()
                raise _lost(self.path, self.address, f"failed ({err})") from None
        if answer_kind != OK:
            raise _lane_error(answer_kind, body, self.address)
        return response_type.FromString(body)

    def _set_timeout(self, timeout: float) -> None:
        seconds = int(timeout)
        value = struct.pack("ll", seconds, int((timeout - seconds) * 1e6))
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
        self._timeout = timeout

    def _read(self) -> tuple[int, bytes]:
        """The next answer frame; partial frames stay in ``_buffer`` across timeouts."""
        buffer = self._buffer
        if not buffer:  # the usual case: the whole answer in one read
            received = self._sock.recv_into(self._scratch)
            if received >= HEADER.size:
                length, kind = HEADER.unpack_from(self._scratch)
                if 4 + length == received:
                    return kind, bytes(self._scratch[HEADER.size : received])
            if not received:
                self._break()
                raise _lost(self.path, self.address, "was closed by the daemon")
            buffer += self._scratch[:received]
        while True:
            if len(buffer) >= HEADER.size:
                length, kind = HEADER.unpack_from(buffer)
                if length == 0 or length > self._max_answer:
                    self._break()
                    raise _lost(self.path, self.address, f"sent a frame of {length} bytes")
                end = 4 + length
                if len(buffer) >= end:
                    body = bytes(buffer[HEADER.size : end])
                    del buffer[:end]
                    return kind, body
            chunk = self._sock.recv(_RECV_BYTES)
            if not chunk:
                self._break()
                raise _lost(self.path, self.address, "was closed by the daemon")
            buffer += chunk

    def _break(self) -> None:
        self.broken = True
        with contextlib.suppress(OSError):
            self._sock.close()

    def close(self) -> None:
        """Closes the connection (the daemon then closes the session if still open)."""
        self.broken = True
        if self.on_close is not None:
            self.on_close()
        if os.getpid() == self._pid:
            with contextlib.suppress(OSError):
                self._sock.close()


class AsyncFastLane:
    """An asyncio lane connection (see the module doc): calls are written in the
    order they are made and their futures wait in ``_waiting`` in that order; one
    reader task resolves them as answers arrive. A call that gives up (deadline,
    cancellation) leaves its future cancelled and its answer is dropped.
    Event-loop only."""

    def __init__(
        self, response: pb2.OpenSessionResponse, address: str, daemon_uid: int | None = None
    ) -> None:
        self.path: str = response.fast_lane_path
        self.address = address
        self._daemon_uid = daemon_uid
        self._token: bytes = response.fast_lane_token
        self._max_answer = _max_answer_bytes(response)
        self._pid = os.getpid()
        self._forks = _forks[0]
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._waiting: collections.deque[asyncio.Future[tuple[int, bytes]]] = collections.deque()
        self._task: asyncio.Task[None] | None = None
        self.broken = False
        self.on_close: Callable[[], None] | None = None  # set by the owning client

    async def connect(self, timeout: float) -> None:
        """Connects and binds; raises as ``FastLane()`` does."""
        try:
            self._reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(self.path), timeout
            )
            self._writer = writer
            served = writer.get_extra_info("socket")
            _check_server(served, self.path, self.address, self._daemon_uid)
            writer.write(frame(BIND, self._token))
            kind, body = await asyncio.wait_for(self._read(), timeout)
        except (OSError, asyncio.IncompleteReadError, TimeoutError) as err:
            self.close()
            raise _unreachable(self.path, self.address, f"cannot be connected ({err!r})") from None
        except KvtierError:
            self.close()
            raise
        if kind != OK:
            self.close()
            raise _lane_error(kind, body, self.address)
        self._task = asyncio.get_running_loop().create_task(self._read_answers())

    @property
    def usable(self) -> bool:
        return not self.broken and _forks[0] == self._forks

    async def call(self, rpc: str, request: Any, timeout: float) -> Any:
        """As ``FastLane.call``, awaited."""
        if self.broken or self._writer is None:
            raise _lost(self.path, self.address, "is closed")
        kind, _, response_type = METHODS[rpc]
        answer: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
        self._waiting.append(answer)
        self._writer.write(frame(kind, request.SerializeToString()))
        try:
            # bounded: waits while the socket's buffer is over its high water mark
            await asyncio.wait_for(self._writer.drain(), timeout)
            answer_kind, body = await asyncio.wait_for(answer, timeout)
        except TimeoutError:
            raise from_status(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"fast lane, {timeout:g}s", self.address
            ) from None
        except ConnectionError as err:  # drain: the daemon closed the connection
            self.broken = True
            raise _lost(self.path, self.address, f"failed ({err})") from None
        if answer_kind != OK:
            raise _lane_error(answer_kind, body, self.address)
        return response_type.FromString(body)

    async def _read(self) -> tuple[int, bytes]:
        assert self._reader is not None
        header = await self._reader.readexactly(HEADER.size)
        length, kind = HEADER.unpack(header)
        if length == 0 or length > self._max_answer:
            raise OSError(f"the daemon sent a frame of {length} bytes")
        return kind, await self._reader.readexactly(length - 1)

    async def _read_answers(self) -> None:
        error: KvtierError
        try:
            while True:
                kind, body = await self._read()
                if not self._waiting:
                    raise OSError("the daemon sent an answer nobody asked for")
                waiter = self._waiting.popleft()
                if not waiter.done():
                    waiter.set_result((kind, body))
        except asyncio.IncompleteReadError:
            error = _lost(self.path, self.address, "was closed by the daemon")
        except OSError as err:
            error = _lost(self.path, self.address, f"failed ({err})")
        self.broken = True
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_exception(error)
        self.close()

    def close(self) -> None:
        """Closes the connection (the daemon then closes the session if still open)."""
        self.broken = True
        if self.on_close is not None:
            self.on_close()
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
        if self._writer is not None and os.getpid() == self._pid:
            self._writer.close()
