"""What the sync and the asyncio client share: one channel to one daemon.

:class:`Connection` holds the daemon address, the stub over a channel it opened
(or one a test injected), the call deadline, the credentials every call carries
(a bearer token; over a Unix socket of a daemon with principals, a peer ticket:
``kvtierd_client._rpc.credentials``) and the sessions opened through it. It prepares
every call (request, deadline, closed check) and turns gRPC failures into
``KvtierError``; sending the call (blocking, or awaited) is all that
``kvtierd_client.client.Client`` and ``kvtierd_client.aio.AsyncClient`` add.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar, NoReturn

import grpc

from kvtierd_client._rpc.codec import WATCH_EVENTS, Op, client_closed_error
from kvtierd_client._rpc.credentials import CallCredentials
from kvtierd_client._rpc.session_state import SessionState
from kvtierd_client._rpc.trusted_daemon import DaemonCheck, socket_path_of
from kvtierd_client.errors import KvtierError, from_rpc_error
from kvtierd_client.tls import TlsOptions, resolve_tls
from kvtierd_client.wire.address import default_address, to_grpc_target
from kvtierd_client.wire.proto import pb2_grpc

__all__ = ["DEFAULT_CHANNEL_OPTIONS", "DEFAULT_TIMEOUT", "Connection", "WatchStream"]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 5.0
# OpenSession creates a pool's region the first time (allocation and pre-faulting:
# seconds per GiB), so its deadline is at least this, whatever the client's timeout
OPEN_SESSION_TIMEOUT = 120.0
"""Seconds each call may take before it fails with ``DeadlineExceeded``."""

MIN_CONNECT_TIMEOUT_MS = 20_000  # gRPC's default; see DEFAULT_CHANNEL_OPTIONS

DEFAULT_CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.enable_http_proxy", 0),  # a local daemon is never behind $http_proxy
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.initial_reconnect_backoff_ms", 100),  # reconnect quickly after a daemon restart
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Not a backoff: gRPC's time limit for one connection attempt (connect, TLS and
    # HTTP/2 handshakes). At 100 ms a daemon descheduled that long on a loaded host
    # failed a new connection's first call with UNAVAILABLE; the call's deadline
    # bounds the wait anyway.
    ("grpc.min_reconnect_backoff_ms", MIN_CONNECT_TIMEOUT_MS),
)
"""gRPC channel arguments used when ``channel_options`` is not given (it replaces them)."""


class Connection:
    """One channel to kvtierd and the sessions opened over it (base of both clients).

    ``address``: ``unix:///abs/path``, ``/abs/path``, ``host:port``, ... (see
    ``kvtierd_client.wire.address``); default ``$KVTIERD_ADDRESS`` or the default socket.
    ``timeout``: the deadline in seconds of every call. ``channel_options``
    replaces ``DEFAULT_CHANNEL_OPTIONS``. ``token``: sent as
    ``authorization: Bearer <token>`` on every call. ``tls``: TLS (and mTLS)
    options for a TCP address (``kvtierd_client.tls``; a ``tls://host:port``
    address uses TLS even without them). ``stub``: use this object
    instead of a ``KVTierStub`` over a new channel (tests inject fakes here).
    Over a Unix socket of a daemon with principals, the client proves its
    process's uid with a peer ticket (``kvtierd_client._rpc.credentials``; not with
    an injected ``stub``). ``fast_lane``: a session the daemon offers a fast lane
    sends its hot calls over it (``kvtierd_client._rpc.fastlane``); False: always gRPC.
    ``daemon_user``: user names or uids trusted to run the daemon besides root,
    this process's user and ``$KVTIERD_DAEMON_USER``: over a Unix socket, no session
    is opened unless the socket's path shows it is the daemon of a trusted user's,
    and nothing it announces is used unless that user's (``kvtierd_client.wire.trust``;
    ``UntrustedAddress`` otherwise).

    Raises ``ValueError`` for a malformed address, an unknown ``daemon_user``, or
    TLS asked for on a Unix socket. Connecting is lazy: an unreachable daemon (or a failed TLS
    handshake) shows up as ``Unavailable`` on the first call.

    ``_sessions`` (weak: a session nobody references expires with its lease) is
    guarded by ``_lock``; ``_closed`` only goes False -> True, in ``close()``.
    """

    _open_channel: ClassVar[Callable[..., Any]]
    """``(target, options, tls) -> channel``: ``kvtierd_client.tls.sync_channel`` or
    ``aio_channel`` (set by the subclass)."""
    _closed_channel_error: ClassVar[type[Exception]]
    """What gRPC raises for a call on a closed channel (set by the subclass)."""

    def __init__(
        self,
        address: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        channel_options: Sequence[tuple[str, Any]] = DEFAULT_CHANNEL_OPTIONS,
        token: str | None = None,
        tls: TlsOptions | None = None,
        stub: Any = None,
        fast_lane: bool = True,
        daemon_user: Iterable[int | str] | int | str | None = None,
    ) -> None:
        self.address: str = address or default_address()
        self.target: str = to_grpc_target(self.address)
        tls = resolve_tls(self.address, self.target, tls)
        self._daemon = DaemonCheck(
            self.address, socket_path_of(self.target, stub is not None), daemon_user
        )
        self.timeout = timeout
        self._credentials = CallCredentials(
            self.address, token, timeout, tickets=stub is None, server_uid=self._daemon.daemon_uid
        )
        self._channel: Any = None
        if stub is None:
            self._channel = type(self)._open_channel(self.target, channel_options, tls)
            stub = pb2_grpc.KVTierStub(self._channel)
        self._stub = stub
        self._closed = False
        self._lock = threading.Lock()
        self._sessions: weakref.WeakSet[SessionState] = weakref.WeakSet()
        self.fast_lane = fast_lane
        # the fast lanes of this client's sessions, until each session is closed or
        # gone: a session nobody references keeps its lane open (the daemon would
        # close the session with it) and expires with its lease, as over gRPC
        self._lanes: set[Any] = set()

    def verify_daemon(self) -> int | None:
        """The uid of the daemon behind this client's Unix socket, once the socket's
        path shows it is the daemon of a trusted user (``kvtierd_client.wire.trust``;
        ``open_session`` checks this itself); None over TCP. Blocking (a few ``lstat``).

        Raises ``UntrustedAddress`` when the socket could be another user's,
        ``Unavailable`` when there is no socket."""
        return self._daemon.daemon_uid()

    # -- calls -----------------------------------------------------------------------

    def _prepare(
        self, op: Op[Any], args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float | None
    ) -> tuple[Callable[..., Any], Any, float]:
        """The stub method, the request and the deadline of one call of ``op``.

        Raises ``InvalidArgument`` for malformed arguments, ``KvtierError``
        (CANCELLED) once the client is closed."""
        request = op.request(*args, **kwargs)
        if self._closed:
            raise client_closed_error(self.address)
        deadline = self.timeout if timeout is None else timeout
        return getattr(self._stub, op.rpc), request, deadline

    def _lane_request(
        self, op: Op[Any], args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float | None
    ) -> tuple[Any, float]:
        """The request and deadline of one call of ``op`` over a fast lane (checks as
        ``_prepare``)."""
        request = op.request(*args, **kwargs)
        if self._closed:
            raise client_closed_error(self.address)
        return request, self.timeout if timeout is None else timeout

    def _keep_lane(self, lane: Any) -> None:
        """Holds ``lane`` until it is closed (its ``on_close`` forgets it)."""
        with self._lock:
            self._lanes.add(lane)

        def forget() -> None:
            with self._lock:
                self._lanes.discard(lane)

        lane.on_close = forget

    def _open_session_timeout(self, timeout: float | None) -> float:
        """The deadline of one ``OpenSession``: ``timeout`` when given, else the
        client's timeout raised to :data:`OPEN_SESSION_TIMEOUT` (the first session of
        a big pool waits for its region to be created)."""
        if timeout is not None:
            return timeout
        return max(self.timeout, OPEN_SESSION_TIMEOUT)

    def _lanes_to_close(self) -> list[Any]:
        """The lanes still open, for ``close()`` (their sessions are closed first)."""
        with self._lock:
            lanes = list(self._lanes)
            self._lanes.clear()
        return lanes

    def _raise_call_error(self, err: Exception) -> NoReturn:
        """Raises what a failed send stands for: a ``grpc.RpcError`` its ``KvtierError``;
        the error gRPC raises for a call on a closed channel (``_closed_channel_error``)
        the closed client's error once the client is closed; anything else as it is.

        Call it from ``except (grpc.RpcError, self._closed_channel_error)``: an except
        clause costs nothing on the path where the call succeeds."""
        if isinstance(err, grpc.RpcError):
            raise from_rpc_error(err, self.address) from None  # says it all; __context__ keeps it
        if isinstance(err, self._closed_channel_error) and self._closed:
            raise client_closed_error(self.address) from None
        raise err

    def _watch(self, pool: str, after_seq: int, timeout: float | None) -> Any:
        """The ``WatchEvents`` call object (a stream; not awaited, not iterated yet)."""
        if self._closed:
            raise client_closed_error(self.address)
        request = WATCH_EVENTS.request(pool, after_seq)
        metadata = self._credentials.metadata
        return self._stub.WatchEvents(request, timeout=timeout, metadata=metadata)

    # -- sessions --------------------------------------------------------------------

    def _register(self, session: SessionState) -> None:
        with self._lock:
            self._sessions.add(session)

    def _forget(self, session: SessionState) -> None:
        with self._lock:
            self._sessions.discard(session)

    def _sessions_to_close(self) -> list[Any]:
        """The open sessions, for ``close()`` (empty once the client is closed)."""
        if self._closed:
            return []
        with self._lock:
            return list(self._sessions)

    @staticmethod
    @contextmanager
    def _closing(session: SessionState) -> Iterator[None]:
        """Wraps closing one session at client close: its errors are logged, not raised."""
        try:
            yield
        except KvtierError as err:
            log.debug("closing kvtierd session %s: %s", session.session_id, err)

    def _finish_close(self) -> Any:
        """Marks the client closed; returns the channel to close (None: it was closed
        already, or the stub was injected). Call ``_credentials.close()`` after
        closing it (the peer ticket is given up)."""
        channel = None if self._closed else self._channel
        self._closed = True
        return channel

    @property
    def closed(self) -> bool:
        """True once ``close()`` was called."""
        return self._closed

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.address}{' closed' if self._closed else ''}>"


class WatchStream:
    """What the sync and async ``WatchEvents`` streams share: the call, who ends it.

    ``_cancelled`` only goes False -> True (``cancel()``, from any thread)."""

    def __init__(self, call: Any, client: Connection) -> None:
        self._call = call
        self._client = client
        self._cancelled = False

    def cancel(self) -> None:
        """Stops the stream; a waiting ``next`` ends the iteration."""
        self._cancelled = True
        cancel = getattr(self._call, "cancel", None)
        if cancel is not None:
            cancel()

    def _error_of(self, err: grpc.RpcError) -> KvtierError | None:
        """What a failed read of the stream raises; None: the iteration just ends
        (the stream was cancelled, or its client closed)."""
        if self._cancelled or self._client.closed:
            return None
        return from_rpc_error(err, self._client.address)
